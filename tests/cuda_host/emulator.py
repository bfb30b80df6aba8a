"""Build cuda/*.cu for the host and launch kernels there (see shim.h for what is emulated).

`Module(code, options, name_expressions)` compiles one unchanged CUDA source with g++, with
shim.h force-included, into a shared library whose calls into the runtime (runtime.cpp,
loaded once per process) bind at load time; a generated table lists its kernels: the `extern "C"` ones found in the source and the
template instantiations nano/kernels.py asks for (its `name_expressions`), each with its C
parameter types and its __launch_bounds__. `Module.get_function(name)` returns a `Function`
that launches like a CuPy RawKernel: `f(grid, block, args, shared_mem=0)`.

Every launch is checked before it runs (argument count, each argument's C type against the
NumPy scalar or array dtype passed, grid and block limits, __launch_bounds__) and then runs
once per thread order in ORDERS, each time from the same inputs with a different poison byte
in shared memory. The outputs of all runs must be bit-identical: a difference means a race
between threads or a read of shared memory nobody wrote. A fault at a guard page after an
argument's buffer (see cupy_stub.py) is reported with the argument's name. A launch while the
current stream is being captured is recorded instead, and runs when the graph is replayed
(cupy_stub.py).

Floating point as NVRTC compiles it: multiply-adds contracted into FMAs (NVRTC's default
--fmad=true; g++ -mfma -ffp-contract=fast, though g++ may not fuse exactly the products NVRTC
fuses), and float32 subnormals flushed to zero where the module asks for -ftz=true, as CuPy
does for every module (the runtime sets the CPU's FTZ and DAZ bits for the launch).

Variants: plain (-O2, used in the normal test run) and sanitize (-fsanitize=address,undefined
and float-cast-overflow, which g++'s "undefined" leaves out: inf, NaN or a float out of
an int's range converted to int; set NANO_CUDA_HOST_SANITIZE=1 and preload libasan; tests/test_cuda_host.py does this in a
subprocess).
"""
import ctypes
import fcntl
import functools
import hashlib
import importlib.machinery
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / ".build"
SANITIZE = os.environ.get("NANO_CUDA_HOST_SANITIZE") == "1"
# Thread orders every launch runs under: 0 in order, 1 reversed, 2 shuffled (seeded).
ORDERS = tuple(int(o) for o in os.environ.get("NANO_CUDA_HOST_ORDERS", "0,1,2").split(","))
POISON = {0: 0xFF, 1: 0x7F, 2: 0xA5}  # NaN / -1 as float / int; huge; garbage
WORKERS = int(os.environ.get("NANO_CUDA_HOST_WORKERS", os.cpu_count() or 1))
SNAPSHOT_LIMIT = 2**30  # bytes: larger arguments are not compared between thread orders (Function._run)
# The sanitizers' reports need line tables only (-g1): with full debug information (-g) ASan took
# half again as long to build, for variables nobody inspects.
FLAGS = (["-O1", "-g1", "-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all",
          "-fno-omit-frame-pointer"] if SANITIZE else ["-O2"])

# What this process compiled (kernel names) and launched ({name: launches}), for the test summary.
compiled: set[str] = set()
launches: dict[str, int] = {}


class EmulatorError(RuntimeError):
    """A kernel did something a GPU would get wrong or fault on, or a launch was invalid."""


def unavailable() -> str | None:
    """Why the emulator cannot run here, or None."""
    import platform
    if platform.machine() != "x86_64":
        return f"the CUDA host emulator switches fibers with x86-64 code; this is {platform.machine()}"
    flags = Path("/proc/cpuinfo").read_text().split()
    if "f16c" not in flags or "fma" not in flags:
        return "the CUDA host emulator needs the CPU's F16C and FMA instructions, which this CPU lacks"
    if not shutil.which("g++"):
        return "no g++: install a C++ compiler (Debian: apt-get install g++) to run kernels on the CPU"
    return None


def _cccl_include() -> str:
    """<nv/target>, which cuda_fp16.h includes, comes with CuPy's copy of libcudacxx."""
    spec = importlib.machinery.PathFinder.find_spec("cupy")  # the package, even where a stub stands in
    for root in spec.submodule_search_locations:
        path = Path(root) / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx"
        if (path / "nv" / "target").exists():
            return str(path)
    raise EmulatorError("CuPy's libcudacxx headers (nv/target) not found")


def host_includes() -> list[str]:
    """g++ flags for the toolkit's headers on the host: our crt/host_defines.h, and CuPy's
    libcudacxx for the <nv/target> that cuda_fp16.h includes."""
    return [f"-I{HERE / 'include'}", f"-I{_cccl_include()}"]


def _compile(source: str, out_name: str, extra: list[str], inputs: str = "", kernels: bool = True,
             source_dir: Path | None = None) -> Path:
    """g++ `source` into BUILD_DIR/out_name-<hash>.so; reused while nothing that goes into it
    changes: the source, the flags, the shim, and `inputs` (the text of the files it includes).
    kernels: a kernel module (shim.h force-included, the runtime's symbols left undefined).
    source_dir: the folder of the files whose text is in `inputs`; its path stays out of the
    key, so that a copy of cuda/ (the injected bugs' tests) reuses what the same text built
    (a sanitizer's report then names the folder of the copy that built it)."""
    flags = ["-std=c++17", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-mf16c",
             "-fno-extern-tls-init", "-Wno-unknown-pragmas", *FLAGS,
             f"-I{HERE / 'include'}", f"-I{HERE}", *extra, f"-I{_cccl_include()}"]
    if kernels:
        flags.append("-fvisibility=hidden")
    text = "\0".join([source, inputs, *flags, *_stand_ins()])
    if source_dir:
        text = text.replace(str(source_dir), "<source_dir>")
    target = BUILD_DIR / f"{out_name}-{_ASAN}{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
    if kernels:  # shim.h includes nothing of the source's folder
        shim = _precompiled_shim([f for f in flags if f != f"-I{source_dir}"])
        flags[:0] = ["-include", str(shim), "-Werror=invalid-pch"]  # not parsed again unnoticed
    return _once(target, lambda tmp: _run_gxx([*flags, _write(tmp / f"{out_name}.cpp", source)],
                                               tmp / target.name, out_name))


_ASAN = "asan-" if SANITIZE else ""


def _stand_ins() -> list[str]:
    """The text of the shim and of the headers that stand in for the toolkit's."""
    return [p.read_text() for p in [HERE / "shim.h", *sorted((HERE / "include").rglob("*.h"))]]


def _precompiled_shim(flags: list[str]) -> Path:
    """A copy of shim.h with, beside it, the header precompiled for these flags, where g++'s
    `-include` finds it: parsing shim.h and the toolkit headers it includes took 0.8 s of the
    1 s a small kernel module took to build. Every flag goes into the key: g++ quietly parses
    the header instead where a precompiled one was made with other target options."""
    key = hashlib.sha256("\0".join([*flags, *_stand_ins()]).encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:
        shutil.copy(HERE / "shim.h", tmp / "shim.h")
        _run_gxx(["-x", "c++-header", *flags, f"-fdebug-prefix-map={tmp}={target}", str(tmp / "shim.h")],
                 tmp / "shim.h.gch", "shim.h")
    target = BUILD_DIR / f"shim-{_ASAN}{key}"
    return _once(target, build, whole_folder=True) / "shim.h"


def _once(target: Path, build, whole_folder: bool = False) -> Path:
    """Makes `target` with build(tmp), in a temporary folder moved into place when done (the
    folder itself, or the one file of its name), unless it exists. One process builds a key
    while the others (xdist workers, the engine tests' subprocesses) wait on its lock and then
    use what it built, instead of each running the same g++."""
    if target.exists():
        return target
    BUILD_DIR.mkdir(exist_ok=True)
    with open(BUILD_DIR / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            # A folder moved into place is no longer there to clean up.
            with tempfile.TemporaryDirectory(dir=BUILD_DIR, ignore_cleanup_errors=whole_folder) as tmp:
                build(Path(tmp))
                # atomic: a reader never sees a half-written library
                os.replace(tmp if whole_folder else Path(tmp) / target.name, target)
    return target


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _run_gxx(args: list[str], out: Path, what: str) -> None:
    done = subprocess.run(["g++", *args, "-o", str(out)], capture_output=True, text=True)
    if done.returncode:
        raise EmulatorError(f"g++ failed for {what}:\n{done.stderr[-6000:]}")


def cublas_header() -> Path:
    """cuBLAS's published declarations, cublas_api.h, as the nvidia-cublas wheel of
    requirements.txt installs them (next to the cuda_fp16.h they include)."""
    spec = importlib.machinery.PathFinder.find_spec("nvidia")
    headers = [h for root in (spec.submodule_search_locations if spec else ())
               for h in sorted(Path(root).glob("*/include/cublas_api.h"))]
    if not headers:
        raise EmulatorError("cublas_api.h not found: install nvidia-cublas (requirements.txt)")
    return headers[0]


@functools.cache
def cublas_library() -> Path:
    """The stand-in libcublas.so.13 (cublas.cpp), built against cuBLAS's own header."""
    header = cublas_header()
    return _compile((HERE / "cublas.cpp").read_text(), "libcublas",
                    [f"-I{header.parent}", "-Wl,-soname,libcublas.so.13"], header.read_text(), kernels=False)


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_ulonglong), ("order", ctypes.c_int),
                ("seed", ctypes.c_ulonglong), ("poison", ctypes.c_int), ("workers", ctypes.c_int),
                ("ftz", ctypes.c_int)]


class _LaunchResult(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int), ("fault_addr", ctypes.c_ulonglong),
                ("fault_write", ctypes.c_int), ("message", ctypes.c_char * 2048)]


class _Kernel(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("signature", ctypes.c_char_p),
                ("max_threads", ctypes.c_int), ("invoke", ctypes.c_void_p), ("fn", ctypes.c_void_p)]


class _Module(ctypes.Structure):
    _fields_ = [("kernels", ctypes.POINTER(_Kernel)), ("num_kernels", ctypes.c_int),
                ("tls_anchor", ctypes.c_void_p), ("num_dynamic", ctypes.c_int),
                ("dynamic_shared", ctypes.c_void_p)]


_runtime_lib = None


def _runtime(options: list[str]) -> ctypes.CDLL:
    """The one runtime of this process, loaded with RTLD_GLOBAL before any kernel module: the
    modules leave its symbols undefined, so they all bind to it (two copies would each have
    their own `current` fiber). Built with the first module's flags."""
    global _runtime_lib
    if _runtime_lib is None:
        path = _compile((HERE / "runtime.cpp").read_text(), "libcuda_host", options, kernels=False)
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        lib.cuda_host_launch.argtypes = [ctypes.POINTER(_Module), ctypes.POINTER(_Kernel),
                                         ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(_LaunchResult)]
        lib.cuda_host_launch.restype = None
        _runtime_lib = lib
    return _runtime_lib


# ------------------------------------------------------------------ reading the source

_EXTERN_C = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+'
                       r'(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')
_BOUNDS = re.compile(r"__launch_bounds__\(\s*([^,)]+)[^)]*\)\s+(\w+)\s*\(")
_DYNAMIC = re.compile(r"extern\s+__shared__\s+([^;\[]*?)\s*\b(\w+)\s*\[\s*\]\s*;")


def _parameter_names(code: str, kernel: str) -> list[str]:
    """Names of a __global__ function's parameters, for messages ('k_cache', not 'argument 5')."""
    match = re.search(rf"__global__[^;{{]*?\b{kernel}\s*\(", code)
    if not match:
        return []
    depth, i = 1, match.end()
    while depth and i < len(code):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
    params = code[match.end():i - 1]
    return [re.findall(r"\w+", p)[-1] for p in params.split(",") if p.strip()]


def _registry(cu_path: Path, code: str, name_expressions) -> str:
    """C++ that includes the source and exports its kernel table (a cuda_host::Module)."""
    names = _EXTERN_C.findall(code) + list(name_expressions or ())
    bounds = {name: expr for expr, name in _BOUNDS.findall(code)}
    dynamic = _DYNAMIC.findall(code)
    lines = [f'#include "{cu_path}"']
    for type_, name in dynamic:
        element = re.sub(r"__align__\(\s*\d+\s*\)", "", type_)
        lines.append(f"__shared__ {type_} {name}[CUDA_HOST_DYNAMIC_SHARED / sizeof({element})];")
    entries = ",\n    ".join(
        f'cuda_host::kernel(&{name}, "{name}", {bounds.get(name.split("<")[0], "0")})' for name in names)
    cases = "".join(f"        case {i}: return {name};\n" for i, (_, name) in enumerate(dynamic))
    lines.append(f"""
static thread_local char cuda_host_anchor;
static void* cuda_host_tls_anchor() {{ return &cuda_host_anchor; }}
static void* cuda_host_dynamic_shared(int i) {{
    switch (i) {{
{cases}    }}
    return nullptr;
}}
static const cuda_host::Kernel cuda_host_kernels[] = {{
    {entries}
}};
extern "C" __attribute__((visibility("default"))) const cuda_host::Module* cuda_host_module() {{
    static const cuda_host::Module module{{cuda_host_kernels, {len(names)}, cuda_host_tls_anchor,
                                          {len(dynamic)}, cuda_host_dynamic_shared}};
    return &module;
}}""")
    return "\n".join(lines) + "\n"


def _compile_options(options) -> tuple[list[str], bool]:
    """NVRTC options -> (g++ flags, flush-to-zero). -std, -I and -D mean the same to g++;
    --fmad (default true) and -ftz (default false) set how float32 arithmetic rounds (the
    module docstring). Others are refused, not ignored."""
    out, fmad, ftz = [], True, False
    for opt in options:
        name, _, value = opt.lstrip("-").partition("=")
        if opt.startswith(("-std=", "-I", "-D")):
            out.append(opt)
        elif name in ("ftz", "fmad") and value in ("true", "false"):
            fmad, ftz = (value == "true", ftz) if name == "fmad" else (fmad, value == "true")
        elif opt.startswith(("-arch", "--gpu-architecture", "-lineinfo")):
            continue  # device code generation only
        else:
            raise EmulatorError(f"the emulator does not know the NVRTC option {opt!r}")
    return out + (["-mfma", "-ffp-contract=fast"] if fmad else ["-ffp-contract=off"]), ftz


# ------------------------------------------------------------------ modules and launches

class Module:
    """One compiled source, like cupy.RawModule(code=..., options=..., name_expressions=...)."""

    def __init__(self, code: str, options=(), name_expressions=None, source_dir: Path | None = None):
        self.code = code
        self.path = _source_path(code, source_dir)
        options, self.ftz = _compile_options(options)
        # The registry #includes the source by path: its text and its neighbour headers go in the key.
        headers = [p for p in sorted(self.path.parent.iterdir()) if p.suffix in (".cuh", ".h")]
        inputs = "\0".join([code, *(p.read_text() for p in headers)])
        # Of the include folders the runtime needs only the toolkit's (shim.h includes its
        # cuda_fp16.h), so that its build is the same for a copy of cuda/.
        self._runtime = _runtime([o for o in options if not o.startswith("-I")
                                  or (Path(o[2:]) / "cuda_fp16.h").exists()])
        library = _compile(_registry(self.path, code, name_expressions), self.path.stem, options, inputs,
                           source_dir=self.path.parent)
        self._lib = ctypes.CDLL(str(library))
        self._lib.cuda_host_module.restype = ctypes.POINTER(_Module)
        self._module = self._lib.cuda_host_module()
        self._kernels = {}
        m = self._module.contents
        for i in range(m.num_kernels):
            k = m.kernels[i]
            self._kernels[k.name.decode()] = ctypes.pointer(k)
        compiled.update(self._kernels)

    def get_function(self, name: str) -> "Function":
        if name not in self._kernels:
            raise EmulatorError(f"no kernel {name!r} in {self.path.name} (have {sorted(self._kernels)})")
        return Function(self, name, self._kernels[name])


def _source_path(code: str, source_dir: Path | None) -> Path:
    """RawModule gets the code, not a file name: find the file it came from (in source_dir,
    else the repository's cuda/), so that g++ messages and emulator reports name lines of
    the real source; else a copy."""
    for path in sorted(Path(source_dir or HERE.parent.parent / "cuda").glob("*.cu")):
        if path.read_text() == code:
            return path
    digest = hashlib.sha256(code.encode()).hexdigest()[:16]
    path = BUILD_DIR / "sources" / f"{digest}.cu"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    return path


_DTYPE_CODES = {np.dtype(t): c for t, c in [
    (np.float16, "f2"), (np.float32, "f4"), (np.float64, "f8"), (np.int8, "i1"), (np.uint8, "u1"),
    (np.int16, "i2"), (np.uint16, "u2"), (np.int32, "i4"), (np.uint32, "u4"), (np.int64, "i8"),
    (np.uint64, "u8"), (np.bool_, "b1")]}


class Function:
    """A kernel, launched like a CuPy RawKernel."""

    def __init__(self, module: Module, name: str, kernel):
        self.module, self.name, self._kernel = module, name, kernel
        self.signature = kernel.contents.signature.decode().split()
        params = _parameter_names(module.code, name.split("<")[0])
        self.params = params if len(params) == len(self.signature) else [
            f"#{i}" for i in range(len(self.signature))]

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        from . import cupy_stub  # its arrays carry their guarded allocation
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        cells, bound = self._marshal(args, cupy_stub)
        names = [name for name, _ in bound]
        cupy_stub.submit(lambda allocations: self._run(grid, block, shared_mem, cells,
                                                       list(zip(names, allocations))), bound)

    def _run(self, grid, block, shared_mem, cells, bound):
        """The launch, once per thread order from the same inputs. Buffers over SNAPSHOT_LIMIT
        (the cases past 2^31 elements, a sparse mapping of which only a few pages are ever
        touched) are neither restored nor compared: copying them would touch every page."""
        argv = (ctypes.c_void_p * len(cells))(*[c.ctypes.data for c in cells])
        allocations = [a for a in {id(a): a for _, a in bound}.values() if a.nbytes <= SNAPSHOT_LIMIT]
        before = [a.snapshot() for a in allocations]
        results = None
        for run, order in enumerate(ORDERS):
            if run:
                for a, saved in zip(allocations, before):
                    a.restore(saved)
            self._launch(grid, block, shared_mem, order, argv, bound)
            after = [a.snapshot() for a in allocations]
            if results is None:
                results = after
            else:
                self._compare(results, after, allocations, bound, ORDERS[0], order)
        launches[self.name] = launches.get(self.name, 0) + 1

    def _marshal(self, args, cupy_stub):
        """One cell of bytes per argument (a pointer or a scalar), type-checked against the C
        parameter; returns the cells and (parameter name, allocation) of each array argument."""
        if len(args) != len(self.signature):
            raise EmulatorError(f"{self.name} takes {len(self.signature)} arguments, got {len(args)}")
        cells, arrays = [], []
        for value, code, param in zip(args, self.signature, self.params):
            where = f"{self.name} argument {param!r}"
            if isinstance(value, np.ndarray):
                raise EmulatorError(f"{where}: a NumPy (host) array; kernels take device arrays")
            if isinstance(value, cupy_stub.ndarray) and value.ndim >= 1:
                if not code.startswith("p"):
                    raise EmulatorError(f"{where} is a {code} scalar in C, got an array")
                got = _DTYPE_CODES.get(value.dtype)
                if code[1:] != got:
                    raise EmulatorError(f"{where} points to {code[1:]} in C, got a {value.dtype} array")
                if value.data.ptr % value.dtype.itemsize:  # a GPU faults: "misaligned address"
                    raise EmulatorError(f"{where}: a {value.dtype} array at an address not a multiple of "
                                        f"{value.dtype.itemsize} bytes (misaligned)")
                arrays.append((param, cupy_stub.allocation_of(value)))
                cells.append(np.array([value.data.ptr], np.uint64))
            elif isinstance(value, np.generic):
                got = _DTYPE_CODES.get(value.dtype)
                if code != got:
                    raise EmulatorError(f"{where} is {code} in C, got {value.dtype}")
                cells.append(np.array(value))
            else:
                raise EmulatorError(f"{where}: pass arrays or NumPy scalars (the C type must be "
                                    f"explicit), got {type(value).__name__}")
        return cells, arrays

    def _launch(self, grid, block, shared_mem, order, argv, bound):
        cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                            order, 0x5EED + order, POISON[order], WORKERS, self.module.ftz)
        result = _LaunchResult()
        for _, a in bound:
            a.fill_slack()
        self.module._runtime.cuda_host_launch(self.module._module, self._kernel, ctypes.byref(cfg), argv,
                                    ctypes.byref(result))
        message = result.message.decode(errors="replace")
        if result.status == 2:
            message += ": " + _describe_fault(result.fault_addr, bool(result.fault_write), bound)
        if result.status:
            raise EmulatorError(f"{self.name} grid {grid} block {block}: {message}")
        for name, a in bound:
            if not a.slack_intact():
                raise EmulatorError(f"{self.name}: wrote past the end of argument {name!r} "
                                    f"({a.nbytes} bytes)")

    def _compare(self, first, other, allocations, bound, order_a, order_b):
        for a, x, y in zip(allocations, first, other):
            if x != y:
                names = ", ".join(repr(name) for name, b in bound if b is a)
                diff = np.flatnonzero(np.frombuffer(x, np.uint8) != np.frombuffer(y, np.uint8))
                raise EmulatorError(
                    f"{self.name}: argument {names} differs between thread orders {order_a} and "
                    f"{order_b} in {diff.size} bytes (first at byte {diff[0]} of {a.nbytes}): a race "
                    "between threads, or a read of shared memory that no thread wrote")


def _dim3(value, what) -> tuple:
    dims = tuple(value) if isinstance(value, tuple | list) else (value,)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int | np.integer) for d in dims):
        raise EmulatorError(f"{what} must be 1 to 3 integers, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def _describe_fault(address: int, write: bool, bound) -> str:
    verb = "write" if write else "read"
    for name, a in bound:
        start, end = a.start, a.start + a.nbytes
        if end <= address < a.guard_end:
            return f"{verb} {address - end} bytes past the end of argument {name!r} ({a.nbytes} bytes)"
        if start <= address < end:
            return f"{verb} inside argument {name!r} at byte {address - start}"
    if address == 0:  # x86-64 reports no address for a non-canonical one
        return f"wild {verb}, far outside every argument (an index read from uninitialised memory?)"
    return f"{verb} at 0x{address:x}, not in or next to any argument"
