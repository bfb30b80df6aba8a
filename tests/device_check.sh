#!/usr/bin/env bash
# The one command for a GPU machine, from anywhere: every GPU test and both benchmarks in one
# call that ends within 9 minutes on a fresh H200 (16 cores), NVRTC's first build of cuda/
# included. Each step has a time limit (they sum to 510 s, 530 s with each one's 2 s to die
# after its limit; the budget of each, its CPU half and its time on an H200: docs/h200_figures.md),
# so a hang costs its step, not the call.
#   preflight      CuPy imports and sees a device (else it stops here, non-zero)
#   compile        every cuda/*.cu module built by NVRTC and loaded (CuPy caches the builds),
#                  one per source and element type (float16, bfloat16)
#   kernels, graphs, engine_*, disagg   the GPU tests (-m gpu), one limit per test as well;
#                  kernels: every kernel test in float16 and bfloat16, LoRA's too
#   bench_kernels  the attention kernel benchmark (tests/bench_kernels.py)
#   bench_engine   run.py --bench on random models in real shapes (tests/device_bench.sh)
# Every figure is written as JSON under $OUT (a temporary folder without it): device.json,
# compile.json, tests_<step>.json, bench_kernels.json, bench_engine.json, and steps.json with
# each step's status, seconds and limit; logs beside them. The exit code is non-zero if any
# step failed, timed out, or (a test step) passed no test.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
: > "$OUT/steps.jsonl"
status=0

# step NAME LIMIT COMMAND...: COMMAND under LIMIT seconds, its output in $OUT/NAME.log.
step() {
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout -k 2 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' "$name" "$rc" $((SECONDS - start)) "$limit" \
    >> "$OUT/steps.jsonl"
  echo "== $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc$([ $rc -eq 124 ] && echo ', time limit'))") in $((SECONDS - start)) s of $limit"
  grep -E "^error: |^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/$name.log" | cut -c1-200 | tail -8
  [ $rc -eq 0 ] || status=1
  return $rc
}

# tests NAME LIMIT PER_TEST FILE... [-k EXPR]: the GPU tests of FILE, each under PER_TEST seconds.
tests() {
  local name=$1 limit=$2 per_test=$3
  shift 3
  step "$name" "$limit" $PY -m pytest -q -rfE --durations=5 -p no:cacheprovider -p tests.per_test_timeout \
    --test-timeout "$per_test" -m gpu --junitxml="$OUT/$name.xml" "$@"
  $PY tests/device_steps.py tests "$OUT" "$name" || status=1
}

nvidia-smi -L
step preflight 15 $PY tests/device_steps.py preflight "$OUT" || exit 3
step compile 75 $PY tests/device_steps.py compile "$OUT"
tests kernels 50 20 tests/test_kernels.py tests/test_lora_kernels.py
tests graphs 70 25 tests/test_graphs_gpu.py
tests engine_smollm2 45 20 tests/test_engine_gpu.py -k smollm2
tests engine_llama 80 40 tests/test_engine_gpu.py -k llama
tests engine_gemma3 30 15 tests/test_engine_gpu.py -k gemma3
tests disagg 15 10 tests/test_disagg.py
step bench_kernels 20 $PY tests/bench_kernels.py --json "$OUT/bench_kernels.json"
step bench_engine 110 env NANO_SKIP_TESTS=1 bash tests/device_bench.sh
$PY -c "import json, sys; steps = [json.loads(l) for l in open(sys.argv[1])]
json.dump({'steps': steps, 'seconds': sum(s['seconds'] for s in steps), 'ok': all(s['rc'] == 0 for s in steps)},
          open(sys.argv[2], 'w'), indent=1)" "$OUT/steps.jsonl" "$OUT/steps.json"
tail -n 30 "$OUT/bench_kernels.log" "$OUT/bench_engine.log" 2>/dev/null
exit $status
