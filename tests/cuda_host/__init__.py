"""Runs cuda/*.cu on the CPU: g++ builds the unchanged sources with shim.h force-included,
runtime.cpp runs each CUDA thread as a fiber, emulator.py launches kernels, and cupy_stub.py
stands in for CuPy so that nano/kernels.py and the kernel tests run unchanged."""
