#!/usr/bin/env bash
# The one script to run on the GPU machine, from anywhere: lists the GPU, runs every
# gpu-marked test under tests/ (kernel tests now, engine-level GPU tests as they are
# added), then the kernel benchmark, whose markdown table is the last thing printed.
# Budget: well under 5 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
python -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_graphs_gpu.py tests/test_engine_gpu.py
python tests/bench_kernels.py
