"""Where arrays live: the CPU (NumPy, float32) or a GPU (CuPy, bfloat16 or float16: --dtype),
and how much memory each has free."""
import os

import numpy as np

from nano.errors import NanoError

# bfloat16 on the GPU: its bits in uint16 arrays, the top half of a float32 (CuPy has no
# bfloat16 dtype); the kernels round to it to nearest even (cuda/common.cuh), as from_float32.
BFLOAT16 = np.dtype(np.uint16)


def to_float32(x):
    """A NumPy or CuPy array of float values as float32: bfloat16 bits widened, exactly."""
    if x.dtype == BFLOAT16:
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32, copy=False)


def from_float32(x: np.ndarray, dtype) -> np.ndarray:
    """Float values rounded to dtype, to nearest even: bfloat16 by adding 0x7FFF plus the
    lowest bit kept, then dropping the low 16 bits, as the kernels round (infinities and the
    canonical NaN stay what they are)."""
    if dtype != BFLOAT16:
        return np.ascontiguousarray(x, dtype=dtype)
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def select_device(name: str) -> str:
    """'auto' takes the GPU when CuPy sees one."""
    if name == "cpu":
        return "cpu"
    try:
        import cupy
        found = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean the same here
        found = False
    if name == "gpu" and not found:
        raise NanoError("--device gpu: no CUDA device visible to CuPy")
    return "gpu" if found else "cpu"


def gpu_count() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def gpu_of(rank: int) -> int:
    """TP ranks take the visible GPUs round-robin; several may share one."""
    return rank % gpu_count()


def ranks_on_gpu(rank: int, world: int) -> range:
    """The ranks of `world` that run on rank's GPU, rank included."""
    return range(gpu_of(rank), world, gpu_count())


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory. Available is Linux's MemAvailable (free
    memory plus the page cache it can reclaim); elsewhere, what sysconf calls free."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, total
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * page, total


class Device:
    def __init__(self, kind: str, index: int = 0, dtype: str = "float32"):
        """dtype: what its float arrays hold (EngineConfig.element_dtype's choice)."""
        self.kind, self.dtype = kind, BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
        self.xp = np
        if kind == "gpu":
            import cupy
            cupy.cuda.Device(index).use()
            self.xp = cupy

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def put(self, host: np.ndarray, keep_float32: bool = False, cpu_column_major: bool = False):
        """cpu_column_major: a (N, K) weight that ops.linear multiplies by, stored column-major
        on the CPU so that x @ w.T is one plain GEMM with no transposed operand (faster, and no
        copy of the product; docs/perf_notes.md). cuBLAS reads the row-major original."""
        dtype = np.float32 if keep_float32 else self.dtype
        if cpu_column_major and self.kind == "cpu":
            return np.asfortranarray(host, dtype=dtype)
        return self.xp.asarray(from_float32(host, dtype))

    def free_memory(self) -> int:
        """Bytes that can still be allocated on this device."""
        if self.kind == "gpu":
            return self.xp.cuda.runtime.memGetInfo()[0]
        return host_memory()[0]

    def to_host(self, arr) -> np.ndarray:
        return arr.get() if self.kind == "gpu" else arr

    def synchronize(self) -> None:
        if self.kind == "gpu":
            self.xp.cuda.get_current_stream().synchronize()
