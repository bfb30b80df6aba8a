"""The shared libraries nano's GPU path loads are installed by requirements.txt and export what
it calls, checked on a machine without a GPU (loading a library needs no device): cuBLAS as
nano/cublas.py finds it (libcublas.so.13, which needs libcublasLt.so.13), and NVRTC and cuBLAS
as CuPy loads them (through cuda.pathfinder; cupy.matmul's cuBLAS bindings, used by the GPU
tests). The CUDA driver, libcuda.so.1, comes with the GPU's driver, not from pip."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEEDED = {  # library -> the functions called from it
    "cublas": ["cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"],
    "cublasLt": ["cublasLtCreate", "cublasLtMatmul"],
    "nvrtc": ["nvrtcVersion", "nvrtcCreateProgram", "nvrtcAddNameExpression", "nvrtcCompileProgram",
              "nvrtcGetLoweredName", "nvrtcGetCUBIN", "nvrtcGetProgramLog", "nvrtcDestroyProgram"],
}
# In a process of its own: the tests' own process must load the emulator's stand-in cuBLAS.
SCRIPT = """
import ctypes, sys
from cuda import pathfinder
from nano import cublas
from cupy_backends.cuda.libs import cublas as cupy_cublas  # raises ImportError if CuPy cannot load it
lib = cublas._library()  # sets the prototypes of what it calls: a missing function raises
print("nano/cublas.py loaded", lib._name)
for name, symbols in {needed}.items():
    loaded = ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib(name).abs_path)
    missing = [s for s in symbols if not hasattr(loaded, s)]
    assert not missing, f"lib{{name}} lacks {{missing}}"
print("all found")
"""


def test_the_gpu_libraries_are_installed_and_export_what_is_called():
    pytest.importorskip("cupy")
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(needed=NEEDED)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "all found" in done.stdout and "libcublas.so.13" in done.stdout


NOT_FOUND = """
import sys
import cuda
from nano import cublas
cuda.pathfinder = None             # no cuda.pathfinder,
sys.modules["nvidia"] = None       # no nvidia wheels,
try:                               # CUDA_PATH's copy damaged, and none on the loader's path
    cublas._library()
except RuntimeError as e:
    print(e)
"""


def test_cublas_not_found_is_one_clear_error(tmp_path):
    """Every place nano/cublas.py looks, in order, failing: one RuntimeError naming them."""
    pytest.importorskip("cupy")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libcublas.so.13").write_text("not a library")
    env = {**os.environ, "CUDA_PATH": str(tmp_path), "PYTHONPATH": str(ROOT), "LD_LIBRARY_PATH": ""}
    done = subprocess.run([sys.executable, "-c", NOT_FOUND], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env=env)
    assert "libcublas.so.13 not found (looked in CUDA_PATH" in done.stdout, done.stdout + done.stderr
