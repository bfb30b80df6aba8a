"""Every cuda/*.cu compiled for sm_90 by NVRTC with nano/kernels.py's sources, templates and
options (no GPU needed; CI runs it): the registers, local memory and shared memory of every
kernel instance as ptxas reports them (docs/perf_notes.md keeps the table), and the SASS of
the cubin as cuobjdump (the nvidia-cuda-cuobjdump wheel) disassembles it.

    python tests/kernel_resources.py
"""
import ctypes
import ctypes.util
import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from cupy_backends.cuda.libs import nvrtc

from nano import kernels

# Itanium ABI codes of the template arguments the kernels use: ints (Li64E), the builtin
# signed char (a: int8_t), unsigned short (t), named types (6__half, 5uint4), and a named type
# met before (S0_: the substitution table holds the template's name, then each named type).
_TEMPLATE_ARG = re.compile(r"Li(-?\d+)E|(a)|(t)|(\d+)|S(\d?)_")
_BUILTINS = {"a": "int8_t", "t": "unsigned short"}


@dataclasses.dataclass
class Build:
    log: str      # NVRTC's log: ptxas's report where the options ask for it
    cubin: bytes  # the sm_* machine code


@functools.cache
def _libnvrtc() -> ctypes.CDLL:
    """NVRTC itself, for the cubin: CuPy's getCUBIN returns it one byte short, the last byte
    of the ELF's program headers, which cuobjdump and nvdisasm then call an invalid file."""
    import nvidia
    found = [p for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.*"))]
    return ctypes.CDLL(found[0] if found else ctypes.util.find_library("nvrtc"))


def _cubin(prog) -> bytes:
    lib, size = _libnvrtc(), ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(ctypes.c_void_p(prog), ctypes.byref(size)):
        raise RuntimeError("nvrtcGetCUBINSize failed")
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetCUBIN(ctypes.c_void_p(prog), buf):
        raise RuntimeError("nvrtcGetCUBIN failed")
    return buf.raw


def compile_all(arch: str = "sm_90", extra_options: tuple = ()) -> dict[str, Build]:
    """Compile every cuda/*.cu for `arch` with NVRTC directly, without a GPU, using the
    options the RawModules use (CuPy adds its own -arch, -ftz=true and
    --device-as-default-execution-space at load time) and `extra_options` (e.g. ptxas's
    resource report, see main). Returns {file name: Build}; raises RuntimeError with the log
    if a file does not compile."""
    def compile_one(name: str) -> Build:
        prog = nvrtc.createProgram((kernels.CUDA_DIR / name).read_text(), name, (), ())
        try:
            for expression in kernels._TEMPLATES.get(name, ()):
                nvrtc.addNameExpression(prog, expression)
            try:
                nvrtc.compileProgram(prog, kernels._options() + (f"-arch={arch}",) + tuple(extra_options))
            except nvrtc.NVRTCError as e:
                raise RuntimeError(f"{name} does not compile:\n{nvrtc.getProgramLog(prog)}") from e
            return Build(nvrtc.getProgramLog(prog), _cubin(prog))
        finally:
            nvrtc.destroyProgram(prog)

    # The longest first, on as many threads as cores (NVRTC compiles without holding the GIL).
    names = sorted(kernels._TEMPLATES, key=lambda n: (kernels.CUDA_DIR / n).stat().st_size, reverse=True)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(compile_one, names)))


@dataclasses.dataclass
class Resources:
    registers: int
    local_bytes: int   # the stack frame: local memory, for local arrays and spilled registers
    shared_bytes: int  # static shared memory


def resources(log: str) -> dict[str, Resources]:
    """{kernel instance: Resources} from a log compiled with --ptxas-options=-v."""
    out, kernel, local = {}, None, 0
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            kernel = demangle(m.group(1))
        elif m := re.search(r"(\d+) bytes stack frame", line):
            local = int(m.group(1))
        elif m := re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line):
            out[kernel] = Resources(int(m.group(1)), local, int(m.group(2) or 0))
    return out


def cuobjdump() -> str | None:
    """The cuobjdump of the nvidia-cuda-cuobjdump wheel (requirements.txt), else on PATH; its
    -sass needs nvdisasm (the nvidia-cuda-nvdisasm wheel) in the same folder or on PATH."""
    import nvidia
    found = [p for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "*", "bin", "cuobjdump"))]
    return found[0] if found else shutil.which("cuobjdump")


def sass(cubin: bytes) -> dict[str, str]:
    """{kernel instance: its SASS text} of a cubin, through cuobjdump -sass."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        # cuobjdump runs nvdisasm for -sass: the nvidia-cuda-nvdisasm wheel puts it beside
        # cuobjdump, in a folder that is on no PATH.
        tool = cuobjdump()
        env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True,
                              env=env).stdout
    parts = re.split(r"^\s*Function : (\S+)\s*$", text, flags=re.M)
    return {demangle(name): body for name, body in zip(parts[1::2], parts[2::2])}


def demangle(name: str) -> str:
    """_Z22paged_attention_kernelILi64ELi3E6__halfEv... -> paged_attention_kernel<64, 3, __half>;
    _Z22paged_attention_kernelILi64ELi3EaEv... -> paged_attention_kernel<64, 3, int8_t>;
    _Z13gather_blocksI5uint4Ev... -> gather_blocks<uint4>;
    _Z18rope_store_kvcacheI6__halfS0_Ev... -> rope_store_kvcache<__half, __half>; a plain C
    name stays as it is."""
    m = re.match(r"_Z(\d+)", name)
    if not m or name[m.end() + int(m.group(1)):][:1] != "I":
        return name
    base = name[m.end():m.end() + int(m.group(1))]
    rest, args, named = name[m.end() + int(m.group(1)) + 1:], [], [base]
    while rest and rest[0] != "E":
        a = _TEMPLATE_ARG.match(rest)
        if not a:
            return name
        if a.group(1) is not None:
            args.append(a.group(1))
        elif a.group(2) or a.group(3):
            args.append(_BUILTINS[a.group(2) or a.group(3)])
        elif a.group(5) is not None:  # S_ is entry 0, S0_ entry 1, ...
            args.append(named[int(a.group(5)) + 1 if a.group(5) else 0])
        else:  # a named type: its length, then its name
            length = int(a.group(4))
            named.append(rest[a.end():a.end() + length])
            args.append(named[-1])
            rest = rest[a.end() + length:]
            continue
        rest = rest[a.end():]
    return f"{base}<{', '.join(args)}>"


def main():
    builds = compile_all("sm_90", ("-ftz=true", "--ptxas-options=-v"))
    print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, sm_90, -ftz=true (as CuPy compiles)\n")
    print(f"| {'file':20} | {'kernel':42} | regs | local B | shared B |")
    print(f"|{'-' * 22}|{'-' * 44}|------|---------|----------|")
    for source, build in builds.items():
        for kernel, r in resources(build.log).items():
            print(f"| {source:20} | {kernel:42} | {r.registers:>4} | {r.local_bytes:>7} | {r.shared_bytes:>8} |")


if __name__ == "__main__":
    main()
