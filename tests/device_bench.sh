#!/usr/bin/env bash
# The engine benchmark on a GPU: `run.py --bench` on random-weight models in two real shapes
# (SmolLM2-135M and Llama-3.2-1B; the GPU machine has no network and no weights): one
# sequence decoding with CUDA graphs and eagerly (--enforce-eager), 64 sequences of mixed
# lengths with graphs, and (SmolLM2) the same on an int8 KV pool. tests/device_check.sh runs it
# as its last step; alone: `bash tests/device_bench.sh`, about 65 s (the limits below sum to 105 s;
# docs/h200_figures.md). NANO_SKIP_TESTS=1 skips the GPU tests of CUDA graphs and kernels run
# first otherwise. Every run has its own time limit, so a hang costs its row, not the table.
# Writes $OUT/bench_engine.json (one record per run) and every run's log to $OUT/bench_runs.log
# (a temporary folder without $OUT); the markdown table is the last thing printed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -z "${NANO_SKIP_TESTS:-}" ]; then
  timeout 120 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs_gpu.py tests/test_kernels.py
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
OUT=${OUT:-$WORK}
ALL=$OUT/bench_runs.log
timeout 18 $PY - "$WORK" <<'PY'
import sys
sys.path.insert(0, "tests")
from reference import LLAMA_32_1B, SMOLLM2_135M, make_random_model
root = sys.argv[1]
# max_pos 1024: the longest request (512 + 512 tokens) fits; graphs' block tables are
# 1024 / 16 = 64 blocks wide. Uniform draws: the weights' values do not change the speed.
make_random_model(f"{root}/smollm2-135m", max_pos=1024, dtype="float16", seed=1, uniform=True, **SMOLLM2_135M)
make_random_model(f"{root}/llama-3.2-1b", max_pos=1024, dtype="float16", seed=1, uniform=True, **LLAMA_32_1B)
PY

ROWS="$WORK/rows.txt"
for run in "smollm2-135m graphs 10 1 128 512" "smollm2-135m eager 15 1 128 512" \
           "smollm2-135m graphs 12 64 100:512 100:512" "smollm2-135m int8 12 64 100:512 100:512" \
           "llama-3.2-1b graphs 16 1 128 512" "llama-3.2-1b graphs 22 64 100:512 100:512"; do
  set -- $run
  case "$2" in
    eager) flag=--enforce-eager ;;
    int8) flag="--kv-cache-dtype int8" ;;  # graphs, int8 KV pool (rotate keys)
    *) flag= ;;
  esac
  log="$WORK/$1-$2-$4.log"
  timeout "$3" $PY run.py --bench --model "$WORK/$1" --device gpu $flag \
    --num-seqs "$4" --input-len "$5" --output-len "$6" > "$log" 2>&1
  echo "$1|$2|$4 seqs, in $5, out $6|$?|$log" >> "$ROWS"
  { echo "=== $run"; cat "$log"; } >> "$ALL"
done

$PY - "$ROWS" "$OUT/bench_engine.json" <<'PY'
import json, re, sys
print("\n| model | mode | workload | output tok/s | total tok/s | mean decode step | floor | fraction of floor |")
print("|---|---|---|---|---|---|---|---|")
records = []
for line in open(sys.argv[1]):
    model, mode, workload, rc, log = line.rstrip("\n").split("|")
    text = open(log).read()
    bench = re.search(r"bench: ([\d.]+) output tokens/s, ([\d.]+) total tokens/s", text)
    step = re.search(r"decode step: mean ([\d.]+) ms, floor ([\d.]+) ms \(weights \+ KV read at ([\d.]+) GB/s\), ([\d.]+)% of floor", text)
    record = dict(model=model, mode=mode, workload=workload, rc=int(rc))
    if not bench:
        tail = text.strip().splitlines()[-1:] or ["no output"]
        records.append({**record, "error": tail[0][:200]})
        print(f"| {model} | {mode} | {workload} | failed (rc {rc}): {tail[0][:80]} | | | | |")
        continue
    out, total = bench.groups()
    mean, floor, bw, frac = step.groups() if step else ("n/a",) * 4
    records.append({**record, "output_tok_s": float(out), "total_tok_s": float(total),
                    **({"decode_step_ms": float(mean), "floor_ms": float(floor), "floor_gbs": float(bw),
                        "percent_of_floor": float(frac)} if step else {})})
    print(f"| {model} | {mode} | {workload} | {out} | {total} | {mean} ms | {floor} ms at {bw} GB/s | {frac}% |")
json.dump(records, open(sys.argv[2], "w"), indent=1)
sys.exit(any(r["rc"] for r in records))
PY
