"""A stand-in for the part of CuPy that nano/kernels.py and the kernel tests use, so that they
run unchanged on the emulator: `emulating(kernels)` swaps it in for `cupy` inside
nano/kernels.py.

Device arrays are NumPy arrays (a subclass carrying `data.ptr` and the CUDA array interface,
so nano/ops.py dispatches them to nano/kernels.py) whose memory comes from `Allocation`: an
anonymous mapping whose buffer ends as close to an inaccessible guard page as 16-byte
alignment allows. A kernel that reads or writes past the end of an argument faults there,
and the emulator names the argument; the < 16 bytes of slack before the guard are filled with
a canary that must survive the launch. Accesses before the start are caught in sanitizer
runs (see Allocation). RawModule compiles with the emulator. The device is
described as an H200: 132 SMs, which sets nano/kernels.py's split-KV choice.
"""
import contextlib
import ctypes
import mmap
import sys
from types import SimpleNamespace

import numpy as np

from . import emulator

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64

ALIGN = 16  # what the kernels' 16-byte loads need (CuPy gives 256)
SLACK_BYTE = 0xCD
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
if emulator.SANITIZE:  # libasan is preloaded, so its interface is in the global namespace
    _poison, _unpoison = (getattr(_libc, f"__asan_{verb}_memory_region") for verb in ("poison", "unpoison"))
    _poison.argtypes = _unpoison.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Allocation(mmap.mmap):
    """Memory for one device array: an anonymous mapping, [lead][buffer][slack][guard page].
    The guard page is PROT_NONE. Under AddressSanitizer (sanitizer runs) the lead (a page)
    and the slack are also poisoned, so that an access on either side is reported with the
    kernel's source line. NumPy arrays hold the mapping itself, so it lives as long as they do."""

    def __new__(cls, nbytes: int):
        padded = -(-max(nbytes, 1) // ALIGN) * ALIGN
        pages = -(-padded // mmap.PAGESIZE)
        lead = mmap.PAGESIZE if emulator.SANITIZE else 0
        self = super().__new__(cls, -1, lead + (pages + 1) * mmap.PAGESIZE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self))
        guard = base + lead + pages * mmap.PAGESIZE
        if _libc.mprotect(guard, mmap.PAGESIZE, 0):  # PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect failed for a guard page")
        self.nbytes, self.padded = nbytes, padded
        self.offset = lead + pages * mmap.PAGESIZE - padded
        self.base, self.start, self.guard_end = base, base + self.offset, guard + mmap.PAGESIZE
        if emulator.SANITIZE:
            _poison(base, self.offset)
            _poison(self.start + nbytes, padded - nbytes)
        return self

    def __del__(self):
        if emulator.SANITIZE:  # the address range may be mapped again for something else
            _unpoison(self.base, self.guard_end - mmap.PAGESIZE - self.base)

    def snapshot(self) -> bytes:
        return self[self.offset:self.offset + self.nbytes]

    def restore(self, data: bytes):
        self[self.offset:self.offset + self.nbytes] = data

    def _slack(self) -> slice:
        return slice(self.offset + self.nbytes, self.offset + self.padded)

    def fill_slack(self):
        if not emulator.SANITIZE:  # there it is poisoned: ASan reports any access
            self[self._slack()] = bytes([SLACK_BYTE]) * (self.padded - self.nbytes)

    def slack_intact(self) -> bool:
        return emulator.SANITIZE or self[self._slack()] == bytes([SLACK_BYTE]) * (self.padded - self.nbytes)


class ndarray(np.ndarray):
    """An emulated device array. Views keep their allocation; arrays that NumPy arithmetic
    makes from them live in ordinary host memory, which allocation_of() tells apart."""

    def __array_finalize__(self, obj):
        self._allocation = getattr(obj, "_allocation", None)

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False),
                "strides": None if self.flags.c_contiguous else self.strides, "version": 3}

    def get(self) -> np.ndarray:
        return np.array(self)

    def copy(self, order="C"):
        out = empty(self.shape, self.dtype)
        out[...] = self
        return out


def allocation_of(array) -> Allocation | None:
    """The allocation holding `array`'s memory, or None if it is not emulated device memory."""
    a = getattr(array, "_allocation", None)
    if a is None:
        return None
    lo = array.ctypes.data
    extent = sum((n - 1) * abs(s) for n, s in zip(array.shape, array.strides)) + array.itemsize
    return a if a.start <= lo and lo + extent <= a.start + a.nbytes else None


def empty(shape, dtype=float32, order="C"):
    if order != "C":
        raise ValueError("the emulated device allocates C order only")
    shape = tuple(shape) if isinstance(shape, tuple | list) else (int(shape),)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    a = Allocation(count * dtype.itemsize)
    out = np.frombuffer(a, dtype, count, a.offset).reshape(shape).view(ndarray)
    out._allocation = a
    return out


def empty_like(a, dtype=None):
    return empty(a.shape, dtype or a.dtype)


def zeros(shape, dtype=float32):
    out = empty(shape, dtype)
    out.fill(0)
    return out


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and allocation_of(a) is not None and (dtype is None or a.dtype == dtype):
        return a
    a = np.asarray(a, dtype)
    out = empty(a.shape, a.dtype)
    out[...] = a
    return out


def ascontiguousarray(a):
    a = asarray(a)
    return a if a.flags.c_contiguous else a.copy()


def concatenate(arrays, axis=0):
    joined = np.concatenate([np.asarray(a) for a in arrays], axis)
    out = empty(joined.shape, joined.dtype)
    out[...] = joined
    return out


def asnumpy(a) -> np.ndarray:
    return np.array(a)


def array_equal(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


_source_dir = None  # where the sources of the modules being built live (nano/kernels.py's CUDA_DIR)


def RawModule(code, options=(), backend="nvrtc", name_expressions=None):
    return emulator.Module(code, options, name_expressions, _source_dir)


class _Device:
    id = 0
    attributes = {"MultiProcessorCount": 132}

    def __init__(self, index: int = 0):
        self.id = index

    def use(self):
        pass

    def synchronize(self):
        pass


def _memory_info() -> tuple[int, int]:
    """(free, total) of the emulated device: the host's (launches run synchronously on it)."""
    from nano.device import host_memory
    return host_memory()


_stream = SimpleNamespace(synchronize=lambda: None)
cuda = SimpleNamespace(get_cuda_path=lambda: None, Device=_Device, get_current_stream=lambda: _stream,
                       runtime=SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=_memory_info))


@contextlib.contextmanager
def emulating(kernels):
    """Run nano/kernels.py against this module instead of CuPy; its caches of compiled
    modules and device facts are cleared on the way in and out."""
    global _source_dir
    caches = [getattr(kernels, name) for name in ("_module", "_kernel", "_num_sms", "_options")]
    real = kernels.cupy
    _source_dir = kernels.CUDA_DIR
    for c in caches:
        c.cache_clear()
    kernels.cupy = sys.modules[__name__]
    try:
        yield kernels.cupy
    finally:
        kernels.cupy = real
        _source_dir = None
        for c in caches:
            c.cache_clear()
