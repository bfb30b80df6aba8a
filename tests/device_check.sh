#!/usr/bin/env bash
# The one script to run on the GPU machine, from anywhere: lists the GPU, runs every GPU
# test (kernels against their NumPy references, CUDA graphs against eager, the whole engine
# against the CPU path), then the kernel benchmark, whose markdown table is printed last.
# A failing test does not hide the benchmark; the exit code is the tests'. Each part has a
# time limit so that a hang costs that part, not the call. Budget: under 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L
timeout 200 python -m pytest -q --durations=10 -m gpu \
  tests/test_kernels_gpu.py tests/test_graphs_gpu.py tests/test_engine_gpu.py
status=$?
timeout 80 python tests/bench_kernels.py
exit $status
