"""cuBLAS called through ctypes: the GEMM behind ops.linear on the GPU, eager and captured.

Row-major y (T, N) = x (T, K) @ w (N, K)^T is the column-major GEMM y^T = w x^T: m = N, n = T, k =
K;  A = w read as (K, N) with lda = K, transposed (OP_T) -> (N, K); B = x read as (K, T) with ldb =
x's row stride, not transposed;  C = y with ldc = N. Why ctypes (CuPy refuses cuBLAS during a
capture), and the layout derived: docs/gpu-path.md#cublas-through-ctypes.
"""
import ctypes
import functools
import glob
import os

import cupy

from nano.device import BFLOAT16

OP_N, OP_T = 0, 1       # cublasOperation_t
R_16F, R_16BF = 2, 14   # cudaDataType CUDA_R_16F, CUDA_R_16BF
DATA_TYPES = {"float16": R_16F, BFLOAT16.name: R_16BF}  # element dtype's name -> cudaDataType
COMPUTE_32F = 68        # cublasComputeType_t CUBLAS_COMPUTE_32F: float32 accumulation
GEMM_DEFAULT = -1       # cublasGemmAlgo_t CUBLAS_GEMM_DEFAULT: cuBLAS's heuristics choose
# cuBLAS's own workspace pool would be allocated with cudaMalloc on first use, which is not
# captured into a graph; we hand it a buffer instead. 32 MiB is NVIDIA's advice for Hopper.
WORKSPACE_BYTES = 32 * 2**20


def wheel_files(*pattern: str) -> list[str]:
    """The files a glob pattern, its parts joined, matches in the nvidia-* wheels (pip's CUDA
    libraries and headers), in order; none without them."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(f for root in nvidia.__path__
                  for f in glob.glob(os.path.join(root, *pattern), recursive=True))


def _candidates() -> list[str]:
    """Where libcublas.so.13 may be: where CuPy's cuda.pathfinder finds it, the CUDA toolkit,
    the nvidia cuBLAS wheel (pip installs), and last the dynamic loader's own search path."""
    paths = []
    try:  # first the copy CuPy's own cuBLAS bindings use (CuPy 14 loads it with cuda.pathfinder,
        # libcublasLt first, RTLD_GLOBAL): one libcublas per process, its libcublasLt resolved
        from cuda import pathfinder
        loaded = pathfinder.load_nvidia_dynamic_lib("cublas").abs_path
        if loaded:
            paths.append(loaded)
    except Exception:  # no pathfinder, or it found no cuBLAS: the places below
        pass
    for root in (os.environ.get("CUDA_PATH"), cupy.cuda.get_cuda_path(), "/usr/local/cuda"):
        if root:
            paths.append(os.path.join(root, "lib64", "libcublas.so.13"))
    return paths + wheel_files("**", "lib", "libcublas.so*") + ["libcublas.so.13"]


@functools.cache
def _library() -> ctypes.CDLL:
    for path in _candidates():
        try:  # a path that is not there fails as a library that does not load
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
        lib.cublasSetStream_v2.argtypes = [p, p]
        lib.cublasSetWorkspace_v2.argtypes = [p, p, size]
        lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        return lib
    raise RuntimeError("libcublas.so.13 not found (looked in CUDA_PATH, the CUDA toolkit, the "
                       "nvidia wheels and the loader's path): install the CUDA toolkit or "
                       "nvidia-cublas")


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed: cuBLAS status {status}")


class Handle:
    """One cuBLAS handle with its own workspace, for one device."""

    def __init__(self):
        self.lib = _library()
        self.ptr = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(self.ptr)), "cublasCreate_v2")
        # A raw allocation this handle owns, in no memory pool: the handle is cached for the
        # process, so its workspace must outlive whatever allocator is current when it is created
        # (inside DecodeGraphs' warm-up that is a graph pool, freed with its engine).
        self.workspace = cupy.cuda.Memory(WORKSPACE_BYTES)
        self.stream = None  # the stream the handle was last set to
        # alpha, beta (float32 compute)
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _use_current_stream(self) -> None:
        """Enqueue on CuPy's current stream: the legacy default stream when eager, the
        capturing stream inside a graph capture."""
        stream = cupy.cuda.get_current_stream().ptr
        if stream == self.stream:
            return
        _check(self.lib.cublasSetStream_v2(self.ptr, stream), "cublasSetStream_v2")
        # cublasSetStream resets the workspace to cuBLAS's default pool: set ours again.
        _check(self.lib.cublasSetWorkspace_v2(self.ptr, self.workspace.ptr, WORKSPACE_BYTES),
               "cublasSetWorkspace_v2")
        self.stream = stream

    def linear(self, x, weight, out, accumulate: bool = False) -> None:
        """out (T, N) = x (T, K) @ weight (N, K)^T (+ out when accumulating, beta 1) in float16
        or bfloat16, all three alike, with float32 accumulation and one rounding. weight and
        out are C-contiguous; x's rows may be strided (elements contiguous)."""
        tokens, k = x.shape
        n = weight.shape[0]
        kind = DATA_TYPES[x.dtype.name]  # of all three operands
        self._use_current_stream()
        _check(self.lib.cublasGemmEx(
            self.ptr, OP_T, OP_N, n, tokens, k, ctypes.byref(self.one),
            weight.data.ptr, kind, k, x.data.ptr, kind, x.strides[0] // x.itemsize,
            ctypes.byref(self.one if accumulate else self.zero), out.data.ptr, kind, n,
            COMPUTE_32F, GEMM_DEFAULT), "cublasGemmEx")


@functools.cache
def handle(device_id: int) -> Handle:
    """The handle of a device, created on first use (outside any graph capture: the first
    GEMM of a process is an eager prefill, and every capture is preceded by a warm-up run)."""
    return Handle()
