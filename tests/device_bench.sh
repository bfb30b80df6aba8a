#!/usr/bin/env bash
# One device call, under 10 minutes on one H200 (limits sum to 9.2 with NANO_SKIP_TESTS):
# the GPU tests of CUDA graphs, fused kernels and device sampling, then `run.py --bench` on
# random-weight models in two real shapes (SmolLM2-135M and Llama-3.2-1B; the device has no
# network and no weights), one sequence decoding and the 256-sequence bench workload, each
# eager (--enforce-eager) and with graphs, and the 256-sequence workload on an int8 KV pool.
# The markdown table of results is the last thing printed.
# Every step has its own time limit, so a hang costs its row, not the table.
# NANO_SKIP_TESTS=1 skips the tests (when device_check.sh ran them in the same call); where
# $OUT is set (the device tool), every run's full log is appended to $OUT/bench_runs.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi -L
if [ -z "${NANO_SKIP_TESTS:-}" ]; then
  timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs_gpu.py tests/test_kernels.py
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ALL=${OUT:-$WORK}/bench_runs.log
timeout 150 $PY - "$WORK" <<'PY'
import sys
sys.path.insert(0, "tests")
from reference import LLAMA_32_1B, SMOLLM2_135M, make_random_model
root = sys.argv[1]
# max_pos 2048: the bench's longest request (1024 + 1024 tokens) fits; graphs' block
# tables are 2048 / 16 = 128 blocks wide.
make_random_model(f"{root}/smollm2-135m", max_pos=2048, dtype="float16", seed=1, **SMOLLM2_135M)
make_random_model(f"{root}/llama-3.2-1b", max_pos=2048, dtype="float16", seed=1, **LLAMA_32_1B)
PY

ROWS="$WORK/rows.txt"
for model in smollm2-135m llama-3.2-1b; do
  for run in "graphs 45 1 128 1024" "eager 45 1 128 1024" "graphs 55 256 100:1024 100:1024" \
             "int8 55 256 100:1024 100:1024"; do
    set -- $run
    case "$1" in
      eager) flag=--enforce-eager ;;
      int8) flag="--kv-cache-dtype int8" ;;  # graphs, int8 KV pool (rotate keys)
      *) flag= ;;
    esac
    log="$WORK/$model-$1-$3.log"
    timeout "$2" $PY run.py --bench --model "$WORK/$model" --device gpu $flag \
      --num-seqs "$3" --input-len "$4" --output-len "$5" > "$log" 2>&1
    echo "$model|$1|$3 seqs, in $4, out $5|$?|$log" >> "$ROWS"
    { echo "=== $model $run"; cat "$log"; } >> "$ALL"
  done
done

$PY - "$ROWS" <<'PY'
import re, sys
print("\n| model | mode | workload | output tok/s | total tok/s | mean decode step | floor | fraction of floor |")
print("|---|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    model, mode, workload, rc, log = line.rstrip("\n").split("|")
    text = open(log).read()
    bench = re.search(r"bench: ([\d.]+) output tokens/s, ([\d.]+) total tokens/s", text)
    step = re.search(r"decode step: mean ([\d.]+) ms, floor ([\d.]+) ms \(weights \+ KV read at ([\d.]+) GB/s\), ([\d.]+)% of floor", text)
    if not bench:
        tail = text.strip().splitlines()[-1:] or ["no output"]
        print(f"| {model} | {mode} | {workload} | failed (rc {rc}): {tail[0][:80]} | | | | |")
        continue
    out, total = bench.groups()
    mean, floor, bw, frac = step.groups() if step else ("n/a",) * 4
    print(f"| {model} | {mode} | {workload} | {out} | {total} | {mean} ms | {floor} ms at {bw} GB/s | {frac}% |")
PY
