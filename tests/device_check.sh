#!/usr/bin/env bash
# The one script to run on the GPU machine, from anywhere: lists the GPU, runs every GPU
# test (kernels against their NumPy references, CUDA graphs against eager, the whole engine
# against the CPU path), then the kernel benchmark, whose markdown table is printed last.
# A failing test does not hide the benchmark; the exit code is the tests'. Each part has a
# time limit so that a hang costs that part, not the call. Budget: under 6 minutes (the limits
# sum to 9.5; the kernel tests and the benchmark cover float16 and int8 caches, and the first
# NVRTC build of cuda/ takes ~20 s, cached after).
# Where $OUT is set (the device tool), the full pytest log is written there too.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGS=${OUT:-$(mktemp -d)}
nvidia-smi -L
# pytest-timeout, where installed, bounds each test so one hang costs one test
per_test=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=100")
status=0
for part in "150 kernels tests/test_kernels.py" "60 graphs tests/test_graphs_gpu.py" \
            "150 engine tests/test_engine_gpu.py" "60 disagg tests/test_disagg.py"; do
  set -- $part
  timeout "$1" $PY -m pytest -q -rfE --durations=8 -p no:cacheprovider -m gpu $per_test "$3" \
    > "$LOGS/check_$2.log" 2>&1 || status=1
  echo "== $2 tests (limit $1 s):"
  grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|error)|Timeout" "$LOGS/check_$2.log" | cut -c1-240 | tail -25
done
timeout 150 $PY tests/bench_kernels.py
exit $status
