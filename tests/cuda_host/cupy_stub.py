"""A stand-in for the part of CuPy that nano's GPU path and its tests use, so that they run
unchanged on the emulator: `install()` makes it `cupy` for a whole process (the emulated
engine's subprocesses), `emulating(kernels)` swaps it in for nano/kernels.py and nano/cublas.py
(the in-process kernel tests). What works here must work with CuPy, so it is stricter where
CuPy is strict:

- Device arrays (`ndarray`) are not NumPy arrays: each holds a NumPy view of emulated device
  memory. Converting one to NumPy implicitly (np.asarray, np.array, a NumPy array's slot)
  raises TypeError as CuPy does; `.get()` and `asnumpy` are the explicit ways. NumPy's ufuncs
  and functions on device arrays run "on the device" and return device arrays (CuPy's
  __array_ufunc__ / __array_function__ dispatch), and a NumPy array among their operands
  raises TypeError (host/device mixing); `a[...] = host_array` raises ValueError (CuPy
  fills from scalars only there).
- Memory: each allocation is an anonymous mapping whose buffer ends as close to an
  inaccessible guard page as 16-byte alignment allows. A kernel that reads or writes past the
  end of an argument faults there and the emulator names the argument; the < 16 bytes of slack
  before the guard are filled with a canary that must survive the launch. Accesses before the
  start are caught in sanitizer runs (see Allocation). Mappings are reserved lazily, so a pool
  past 2^31 elements costs only the pages a test touches.
- Streams and CUDA graphs: between `stream.begin_capture()` and `end_capture()`, kernel
  launches, cuBLAS GEMMs and array operations issued on the capturing stream are recorded, not
  run; `Graph.launch()` replays them with the captured pointers, and a replay that reaches
  memory freed since the capture (a stale pointer) raises EmulatorError. While capturing, a
  host synchronisation (`.get()`, `.set()`, `synchronize()`, a host-to-device copy) raises
  as CUDA does, and so does an allocation outside the allocator in use (`using_allocator`, the
  graph's memory pool): memory the default pool could hand to someone else while the graph
  still writes it on every replay.
- cuBLAS: nano/cublas.py loads the stand-in libcublas.so.13 (cublas.cpp, built by
  emulator.py) through its own ctypes code; `_gemm_hook` sees each GEMM first (operands inside
  device allocations, recorded under capture). Refused GEMMs return
  CUBLAS_STATUS_EXECUTION_FAILED, and the reason is in `gemm_errors`.
- RawModule compiles with the emulator, with the -ftz=true that CuPy adds to every module.
  The device is described as an H200: 132 SMs, which sets nano/kernels.py's split-KV choice.
"""
import bisect
import contextlib
import ctypes
import itertools
import mmap
import sys
import weakref
from types import SimpleNamespace

import numpy as np

from . import emulator
from .emulator import EmulatorError

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64

ALIGN = 16  # what the kernels' 16-byte loads need (CuPy gives 256)
SLACK_BYTE = 0xCD
MAP_NORESERVE = 0x4000  # Linux: no swap reserved; pages exist once touched
IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")  # CuPy's words
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
if emulator.SANITIZE:  # libasan is preloaded, so its interface is in the global namespace
    _poison, _unpoison = (getattr(_libc, f"__asan_{verb}_memory_region") for verb in ("poison", "unpoison"))
    _poison.argtypes = _unpoison.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class CUDARuntimeError(RuntimeError):
    """What CuPy raises for a failed CUDA runtime call (here: one refused during a capture)."""


# ------------------------------------------------------------------ memory

_starts: list[int] = []  # start addresses of the live allocations, sorted (cuBLAS operand lookup)
_live: dict[int, weakref.ref] = {}


class Allocation(mmap.mmap):
    """Memory for one device array: an anonymous mapping, [lead][buffer][slack][guard page].
    The guard page is PROT_NONE. Under AddressSanitizer (sanitizer runs) the lead (a page)
    and the slack are also poisoned, so that an access on either side is reported with the
    kernel's source line. Arrays hold their views of the mapping, so it lives as long as they do;
    `cupy.cuda.Memory(n)` (a raw allocation) is one too."""

    def __new__(cls, nbytes: int):
        padded = -(-max(nbytes, 1) // ALIGN) * ALIGN
        pages = -(-padded // mmap.PAGESIZE)
        lead = mmap.PAGESIZE if emulator.SANITIZE else 0
        self = super().__new__(cls, -1, lead + (pages + 1) * mmap.PAGESIZE,
                               flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
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
        bisect.insort(_starts, self.start)
        _live[self.start] = weakref.ref(self)
        weakref.finalize(self, _forget, self.start)
        return self

    def __del__(self):
        if emulator.SANITIZE:  # the address range may be mapped again for something else
            _unpoison(self.base, self.guard_end - mmap.PAGESIZE - self.base)

    @property
    def ptr(self) -> int:
        return self.start

    @property
    def allocation(self) -> "Allocation":
        return self

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


def _forget(start: int) -> None:
    _starts.pop(bisect.bisect_left(_starts, start))
    del _live[start]


def _allocation_at(address: int, nbytes: int) -> Allocation | None:
    """The live allocation holding [address, address + nbytes), or None."""
    i = bisect.bisect_right(_starts, address) - 1
    a = _live[_starts[i]]() if i >= 0 else None
    return a if a is not None and address + nbytes <= a.start + a.nbytes else None


class PooledMemory:
    """Memory a MemoryPool handed out: back to the pool when the last array on it is freed."""

    def __init__(self, allocation: Allocation):
        self.allocation, self.ptr = allocation, allocation.start


class MemoryPool:
    """cupy.cuda.MemoryPool: freed memory is handed out again (here to a request of the same
    size, so that the guard page stays right after each buffer); the pool keeps every mapping
    it made, as a graph's pool must: replays write them."""

    def __init__(self):
        self._free: dict[int, list] = {}
        self._mappings: list[Allocation] = []

    def malloc(self, nbytes: int) -> PooledMemory:
        free = self._free.setdefault(nbytes, [])
        if not free:
            self._mappings.append(Allocation(nbytes))
            free.append(self._mappings[-1])
        memory = PooledMemory(free.pop())
        weakref.finalize(memory, free.append, memory.allocation)
        return memory


@contextlib.contextmanager
def using_allocator(allocator=None):
    saved, _state.allocator = _state.allocator, allocator
    try:
        yield
    finally:
        _state.allocator = saved


def _malloc(nbytes: int):
    """Memory for a new array, from the allocator in use (using_allocator) or a fresh mapping."""
    if _state.allocator is not None:
        memory = _state.allocator(nbytes)
        if not isinstance(memory, PooledMemory):
            raise TypeError(f"the allocator in use returned {type(memory).__name__}, not pool memory")
        return memory
    if _capturing() is not None:
        _refuse("an allocation outside the graph's memory pool (the default pool could hand it to "
                "someone else while every replay writes it)")
    return Allocation(nbytes)


def allocation_of(array: "ndarray") -> Allocation:
    return array._memory.allocation


# ------------------------------------------------------------------ streams and graphs

_stream_ids = itertools.count(0x5100)
# The current streams (innermost last), the allocator in use, every stream by its pointer.
_state = SimpleNamespace(streams=[], allocator=None, streams_by_ptr=weakref.WeakValueDictionary())


class Graph:
    """cupy.cuda.Graph: what a capture recorded, replayed in order by launch()."""

    def __init__(self):
        self.ops, self.invalid = [], None

    def launch(self, stream=None):
        if _capturing() is not None:
            raise EmulatorError("a graph launched inside a capture (child graphs are not emulated)")
        for op in self.ops:
            op()


class Stream:
    """cupy.cuda.Stream: `with stream:` makes it current; begin_capture / end_capture."""

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else next(_stream_ids)
        self.graph = None  # the graph being captured
        _state.streams_by_ptr[self.ptr] = self

    def __enter__(self):
        _state.streams.append(self)
        return self

    def __exit__(self, *exc):
        _state.streams.pop()

    def synchronize(self):
        if self.graph is not None:
            _refuse("stream.synchronize()", self)

    def begin_capture(self, mode=None):
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self.graph is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: the stream is already capturing")
        self.graph = Graph()

    def end_capture(self) -> Graph:
        if self.graph is None:
            raise CUDARuntimeError("cudaErrorIllegalState: the stream is not capturing")
        graph, self.graph = self.graph, None
        if graph.invalid:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureInvalidated: {graph.invalid} during the capture")
        return graph

    def is_capturing(self) -> bool:
        return self.graph is not None


Stream.null = Stream(null=True)


def get_current_stream() -> Stream:
    return _state.streams[-1] if _state.streams else Stream.null


def _capturing(stream: Stream | None = None) -> Graph | None:
    """The graph that work issued on `stream` (default: the current one) goes into, if any."""
    return (stream or get_current_stream()).graph


def _refuse(what: str, stream: Stream | None = None):
    """`what` is not allowed while the stream is capturing: CUDA refuses it and invalidates
    the capture (end_capture raises too)."""
    stream = stream or get_current_stream()
    stream.graph.invalid = stream.graph.invalid or what
    raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} while stream {stream.ptr:#x} "
                           "is capturing")


def _sync(what: str) -> None:
    """A host synchronisation (a device-to-host copy, a host-to-device copy, ...)."""
    if _capturing() is not None:
        _refuse(what)


def submit(run, named: list, stream: Stream | None = None) -> None:
    """Device work on its arguments' allocations ((name, Allocation) pairs): run(allocations)
    now, or, while the stream captures, a graph node that runs it on replay if every
    allocation is still alive."""
    graph = _capturing(stream)
    if graph is None:
        run([a for _, a in named])
        return
    refs = [(name, weakref.ref(a)) for name, a in named]

    def replay():
        allocations = [ref() for _, ref in refs]
        for (name, _), a in zip(refs, allocations):
            if a is None:
                raise EmulatorError(f"a replayed graph reaches {name!r}, whose memory was freed after the "
                                    "capture (a stale pointer)")
        run(allocations)
    graph.ops.append(replay)


# ------------------------------------------------------------------ device arrays

class _Slot:
    """Where a device array sat in a call's arguments."""

    def __init__(self, i):
        self.i = i


def _split(tree, host_ok=False):
    """Arguments -> (the same with each device array replaced by a _Slot, the device arrays)."""
    arrays = []

    def walk(x):
        if isinstance(x, ndarray):
            arrays.append(x)
            return _Slot(len(arrays) - 1)
        if isinstance(x, np.ndarray) and not host_ok:
            raise TypeError(f"Unsupported type {type(x)}: a NumPy array among device arrays")
        if isinstance(x, list | tuple):
            return type(x)(walk(y) for y in x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x
    return walk(tree), arrays


def _fill(template, views):
    if isinstance(template, _Slot):
        return views[template.i]
    if isinstance(template, list | tuple):
        return type(template)(_fill(y, views) for y in template)
    if isinstance(template, dict):
        return {k: _fill(v, views) for k, v in template.items()}
    return template


def _geometry(array: "ndarray"):
    """How to rebuild a view of `array` from its allocation (a recorded op's pointer)."""
    a = allocation_of(array)
    return array.shape, array.dtype, array.data.ptr - a.base, array._host.strides


def _views(geometries, allocations):
    return [np.ndarray(shape, dtype, a, offset, strides)
            for (shape, dtype, offset, strides), a in zip(geometries, allocations)]


def _on_device(fn, template, arrays):
    """fn(*args, **kwargs) filled with device views, as a device operation: now, or recorded."""
    geometries = [_geometry(a) for a in arrays]

    def run(allocations):
        args, kwargs = _fill(template, _views(geometries, allocations))
        fn(*args, **kwargs)
    submit(run, [(f"operand {i}", allocation_of(a)) for i, a in enumerate(arrays)])


def _compute(fn, args=(), kwargs=None, host_ok=False):
    """A NumPy function with no side effects, on device arrays: its result, a view of an
    operand (a reshape, a basic index) or a new device array. The function runs now even while
    capturing (for the result's shape and dtype; it only reads); a new result is then poisoned
    and recomputed on every replay."""
    template, arrays = _split((args, kwargs or {}), host_ok)
    views = [a._host for a in arrays]
    call_args, call_kwargs = _fill(template, views)
    result = fn(*call_args, **call_kwargs)
    if isinstance(result, tuple):  # np.nonzero and the like: CuPy synchronises for these too
        _sync(f"{getattr(fn, '__name__', 'a function')} with several results")
        return tuple(_to_device(r) for r in result)
    if not isinstance(result, np.ndarray | np.generic):
        return result
    for view, array in zip(views, arrays):
        if isinstance(result, np.ndarray) and np.may_share_memory(result, view):
            return ndarray(result, array._memory)
    out = empty(np.shape(result), np.result_type(result))
    if _capturing() is None:
        out._host[...] = result
        return out
    out._host.reshape(-1).view(np.uint8)[...] = 0xFF

    def again(out_view, *operand_views):
        args2, kwargs2 = _fill(template, operand_views)
        out_view[...] = fn(*args2, **kwargs2)
    _on_device(again, ([_Slot(i) for i in range(len(arrays) + 1)], {}), [out, *arrays])
    return out


def _mutate(fn, args=(), kwargs=None, host_ok=False):
    """A NumPy operation that writes device arrays (out=, setitem, fill): now, or recorded."""
    template, arrays = _split((args, kwargs or {}), host_ok)
    _on_device(fn, template, arrays)


# CuPy ndarray methods the stand-in has (others raise AttributeError, as missing ones would).
_METHODS = {"reshape", "view", "transpose", "swapaxes", "squeeze", "ravel", "flatten", "astype", "copy",
            "sum", "prod", "max", "min", "argmax", "argmin", "mean", "any", "all", "cumsum", "clip",
            "take", "repeat", "argsort", "argpartition", "dot", "round", "nonzero"}


class ndarray:
    """An emulated device array: a NumPy view of emulated device memory, behind CuPy's rules
    (the module docstring)."""

    __slots__ = ("_host", "_memory", "__weakref__")
    __hash__ = None

    def __init__(self, host: np.ndarray, memory):
        self._host, self._memory = host, memory  # memory: the Allocation or PooledMemory it views

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    ndim = property(lambda self: self._host.ndim)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    itemsize = property(lambda self: self._host.itemsize)
    strides = property(lambda self: self._host.strides)
    T = property(lambda self: self.transpose())

    @property
    def flags(self):
        f = self._host.flags
        return SimpleNamespace(c_contiguous=f.c_contiguous, f_contiguous=f.f_contiguous, owndata=False)

    @property
    def data(self):
        return SimpleNamespace(ptr=self._host.ctypes.data)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.data.ptr, False),
                "strides": None if self.flags.c_contiguous else self.strides, "version": 3}

    # ---- CuPy's rules at the boundary with NumPy
    def __array__(self, dtype=None, copy=None):
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        fn = ufunc if method == "__call__" else getattr(ufunc, method)
        if out is None:
            return _compute(fn, inputs, kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(o, ndarray) for o in outs):
            raise TypeError("out= must be device arrays")
        _mutate(fn, inputs, {**kwargs, "out": outs})
        return outs[0] if len(outs) == 1 else outs

    def __array_function__(self, func, types, args, kwargs):
        if func is np.copyto:
            return _mutate(func, args, kwargs)
        return _compute(func, args, kwargs)

    # ---- explicit transfers and host synchronisation
    def get(self, stream=None, out=None) -> np.ndarray:
        _sync("a device-to-host copy")
        return self._host.copy()

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr).__name__}")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"Shape or dtype mismatch: {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
        _sync("a host-to-device copy")
        self._host[...] = arr

    def tolist(self):
        return self.get().tolist()

    def item(self):
        return self.get().item()

    def __bool__(self):
        return bool(self.get())

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __len__(self):
        return len(self._host)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return f"{self.get()!r} (on the emulated device)"

    # ---- operations
    def __getattr__(self, name):
        if name not in _METHODS:
            raise AttributeError(f"the emulated device array has no attribute {name!r}")
        return lambda *args, **kwargs: _compute(
            lambda host, *a, **k: getattr(host, name)(*a, **k), (self, *args), kwargs)

    def fill(self, value):
        if isinstance(value, np.ndarray) and value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        _mutate(np.ndarray.fill, (self, value))

    def sort(self, axis=-1):
        _mutate(np.ndarray.sort, (self, axis))

    def __getitem__(self, key):
        return _compute(lambda host, k: host[k], (self, key), host_ok=True)

    def __setitem__(self, key, value):
        keys = key if isinstance(key, tuple) else (key,)
        advanced = any(isinstance(k, np.ndarray | ndarray | list) for k in keys)
        if isinstance(value, np.ndarray):
            if not advanced and value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            _sync("a host-to-device copy")
        _mutate(_setitem, (self, key, value), host_ok=True)


def _setitem(host, key, value):
    host[key] = value


def _operator(ufunc, reflected=False, inplace=False):
    if inplace:
        return lambda self, other: ufunc(self, other, out=self)
    return (lambda self, other: ufunc(other, self)) if reflected else (lambda self, other: ufunc(self, other))


for _name, _ufunc in [("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("truediv", np.true_divide),
                      ("floordiv", np.floor_divide), ("mod", np.remainder), ("pow", np.power),
                      ("matmul", np.matmul), ("and", np.bitwise_and), ("or", np.bitwise_or),
                      ("xor", np.bitwise_xor), ("lshift", np.left_shift), ("rshift", np.right_shift)]:
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
    setattr(ndarray, f"__r{_name}__", _operator(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _operator(_ufunc, inplace=True))
for _name, _ufunc in [("lt", np.less), ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal),
                      ("eq", np.equal), ("ne", np.not_equal)]:
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
for _name, _ufunc in [("neg", np.negative), ("pos", np.positive), ("abs", np.absolute), ("invert", np.invert)]:
    setattr(ndarray, f"__{_name}__", lambda self, f=_ufunc: f(self))


# ------------------------------------------------------------------ module functions

def empty(shape, dtype=float32, order="C"):
    if order != "C":
        raise ValueError("the emulated device allocates C order only")
    shape = tuple(shape) if isinstance(shape, tuple | list) else (int(shape),)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = _malloc(count * dtype.itemsize)
    a = memory.allocation
    return ndarray(np.frombuffer(a, dtype, count, a.offset).reshape(shape), memory)


def empty_like(a, dtype=None):
    return empty(a.shape, dtype or a.dtype)


def zeros(shape, dtype=float32):
    out = empty(shape, dtype)
    out.fill(0)
    return out


def _to_device(host) -> ndarray:
    host = np.asarray(host)
    out = empty(host.shape, host.dtype)
    out._host[...] = host
    return out


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    _sync("a host-to-device copy")
    return _to_device(np.asarray(a, dtype))


def array(obj, dtype=None, copy=True):
    return asarray(obj, dtype).copy() if isinstance(obj, ndarray) else asarray(obj, dtype)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        return asarray(np.ascontiguousarray(a, dtype))
    return _compute(np.ascontiguousarray, (a,), {"dtype": dtype})


def asnumpy(a, stream=None) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def matmul(a, b):
    """float32 sums, one rounding to the operands' type: cupy.matmul on float16 (cuBLAS)."""
    return _compute(lambda x, y: np.matmul(x.astype(np.float32), y.astype(np.float32)).astype(
        np.result_type(x, y)), (a, b))


def __getattr__(name):
    """Every other NumPy name: types and constants as they are, functions and ufuncs run on
    device arrays (a NumPy array among their operands raises TypeError)."""
    value = getattr(np, name)
    if isinstance(value, type) or not callable(value):
        return value
    return lambda *args, **kwargs: _compute(value, args, kwargs)


# ------------------------------------------------------------------ the device, modules

_source_dir = None  # where the sources of the modules being built live (nano/kernels.py's CUDA_DIR)


def RawModule(code, options=(), backend="nvrtc", name_expressions=None):
    return emulator.Module(code, (*options, "-ftz=true"), name_expressions, _source_dir)


class _Device:
    id = 0
    attributes = {"MultiProcessorCount": 132}

    def __init__(self, index: int = 0):
        self.id = index

    def use(self):
        pass

    def synchronize(self):
        capturing = [s for s in _state.streams_by_ptr.values() if s.graph is not None]
        if capturing:
            _refuse("cudaDeviceSynchronize", capturing[0])


def _memory_info() -> tuple[int, int]:
    """(free, total) of the emulated device: the host's (launches run synchronously on it)."""
    from nano.device import host_memory
    return host_memory()


cuda = SimpleNamespace(
    get_cuda_path=lambda: None, Device=_Device, Stream=Stream, Graph=Graph, MemoryPool=MemoryPool,
    Memory=Allocation, using_allocator=using_allocator, get_current_stream=get_current_stream,
    runtime=SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=_memory_info, CUDARuntimeError=CUDARuntimeError))


# ------------------------------------------------------------------ cuBLAS

class _GemmCall(ctypes.Structure):  # cublas.cpp's GemmCall
    _fields_ = [("stream", ctypes.c_void_p), ("workspace", ctypes.c_void_p), ("transa", ctypes.c_int),
                ("transb", ctypes.c_int), ("m", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int),
                ("alpha", ctypes.c_float), ("beta", ctypes.c_float), ("a", ctypes.c_void_p), ("lda", ctypes.c_int),
                ("b", ctypes.c_void_p), ("ldb", ctypes.c_int), ("c", ctypes.c_void_p), ("ldc", ctypes.c_int),
                ("a_bytes", ctypes.c_size_t), ("b_bytes", ctypes.c_size_t), ("c_bytes", ctypes.c_size_t),
                ("type", ctypes.c_int)]


gemm_errors: list[str] = []  # why GEMMs were refused, in order


def _gemm(pointer) -> int:
    """cublas.cpp's hook: 0 run it now, 1 recorded for a graph, 2 refused (see gemm_errors)."""
    try:
        call = _GemmCall.from_buffer_copy(pointer.contents)
        named = []
        for name, address, nbytes in (("A", call.a, call.a_bytes), ("B", call.b, call.b_bytes),
                                      ("C", call.c, call.c_bytes)):
            allocation = _allocation_at(address or 0, nbytes)
            if allocation is None:
                raise EmulatorError(f"cublasGemmEx: operand {name} ({nbytes} bytes at {address or 0:#x}) is not "
                                    "inside one device allocation: a wrong shape, leading dimension or transpose?")
            named.append((name, allocation))
        stream = _state.streams_by_ptr.get(call.stream or 0, Stream.null)
        if stream.graph is None:
            return 0
        if not call.workspace:
            raise EmulatorError("cublasGemmEx captured with cuBLAS's own workspace, which it would cudaMalloc "
                                "during the capture: set one (cublasSetWorkspace_v2) after cublasSetStream_v2")
        submit(lambda _: _replay_gemm(call), named, stream)
        return 1
    except Exception as e:  # a ctypes callback cannot raise into its C caller
        gemm_errors.append(str(e))
        print(f"cuda_host cuBLAS: {e}", file=sys.stderr)
        return 2


def _replay_gemm(call: _GemmCall) -> None:
    if not _cublas().cuda_host_gemm(ctypes.byref(call)):
        raise EmulatorError("a replayed cublasGemmEx reads past an operand (cublas.cpp's cuda_host_gemm)")


_GEMM_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_GemmCall))(_gemm)
_cublas_lib = None


def _cublas() -> ctypes.CDLL:
    """The stand-in libcublas.so.13 (the same handle nano/cublas.py's CDLL gets), hooked."""
    global _cublas_lib
    if _cublas_lib is None:
        _cublas_lib = ctypes.CDLL(str(emulator.cublas_library()))
        _cublas_lib.cuda_host_gemm_hook(_GEMM_HOOK)
        _cublas_lib.cuda_host_gemm.restype = ctypes.c_bool
    return _cublas_lib


def _use_standin_cublas(cublas) -> None:
    """nano/cublas.py loads the stand-in (its search list, not its calls, is replaced)."""
    cublas._library.cache_clear()
    cublas.handle.cache_clear()
    cublas._candidates = lambda: [_cublas()._name]


# ------------------------------------------------------------------ installing it

def install() -> None:
    """Make this module `cupy` for the rest of the process, before nano imports it."""
    sys.modules["cupy"] = sys.modules[__name__]
    from nano import cublas
    _use_standin_cublas(cublas)


@contextlib.contextmanager
def emulating(kernels):
    """Run nano/kernels.py (and the nano/cublas.py it calls) against this module instead of
    CuPy; the caches of compiled modules, device facts and the cuBLAS library are cleared on
    the way in and out."""
    global _source_dir
    cublas = kernels.cublas
    caches = [getattr(kernels, name) for name in ("_module", "kernel", "_num_sms", "_options")]
    real, candidates = kernels.cupy, cublas._candidates
    _source_dir = kernels.CUDA_DIR
    for c in caches:
        c.cache_clear()
    kernels.cupy = cublas.cupy = sys.modules[__name__]
    _use_standin_cublas(cublas)
    try:
        yield kernels.cupy
    finally:
        kernels.cupy = cublas.cupy = real
        cublas._candidates = candidates
        cublas._library.cache_clear()
        cublas.handle.cache_clear()
        _source_dir = None
        for c in caches:
            c.cache_clear()
