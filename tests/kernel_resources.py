"""Every cuda/*.cu compiled for sm_90 by NVRTC with nano/kernels.py's sources, templates and
options (no GPU needed; CI runs it), and the registers, spills and shared memory of every
kernel instance as ptxas reports them (docs/perf_notes.md keeps the table).

    python tests/kernel_resources.py
"""
import os
import re
from concurrent.futures import ThreadPoolExecutor

from cupy_backends.cuda.libs import nvrtc

from nano import kernels

# Itanium ABI codes of the template arguments the kernels use: ints (Li64E), the builtin
# signed char (a: int8_t), unsigned short (t), and named types (6__half, 5uint4).
_TEMPLATE_ARG = re.compile(r"Li(-?\d+)E|(a)|(t)|(\d+)")
_BUILTINS = {"a": "int8_t", "t": "unsigned short"}


def compile_all(arch: str = "sm_90", extra_options: tuple = ()) -> dict:
    """Compile every cuda/*.cu for `arch` with NVRTC directly, without a GPU, using the
    options the RawModules use (CuPy adds its own -arch, -ftz=true and
    --device-as-default-execution-space at load time) and `extra_options` (e.g. ptxas's
    resource report, see tests/kernel_resources.py). Returns {file name: compile log};
    raises RuntimeError with the log if a file does not compile."""
    def compile_one(name: str) -> str:
        prog = nvrtc.createProgram((kernels.CUDA_DIR / name).read_text(), name, (), ())
        try:
            for expression in kernels._TEMPLATES.get(name, ()):
                nvrtc.addNameExpression(prog, expression)
            try:
                nvrtc.compileProgram(prog, kernels._options() + (f"-arch={arch}",) + tuple(extra_options))
            except nvrtc.NVRTCError as e:
                raise RuntimeError(f"{name} does not compile:\n{nvrtc.getProgramLog(prog)}") from e
            return nvrtc.getProgramLog(prog)
        finally:
            nvrtc.destroyProgram(prog)

    # The longest first, on as many threads as cores (NVRTC compiles without holding the GIL).
    names = sorted(kernels.SOURCES, key=lambda n: (kernels.CUDA_DIR / n).stat().st_size, reverse=True)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(names, pool.map(compile_one, names)))


def demangle(name: str) -> str:
    """_Z22paged_attention_kernelILi64ELi3E6__halfEv... -> paged_attention_kernel<64, 3, __half>;
    _Z22paged_attention_kernelILi64ELi3EaEv... -> paged_attention_kernel<64, 3, int8_t>;
    _Z13gather_blocksI5uint4Ev... -> gather_blocks<uint4>; a plain C name stays as it is."""
    m = re.match(r"_Z(\d+)", name)
    if not m or name[m.end() + int(m.group(1)):][:1] != "I":
        return name
    base = name[m.end():m.end() + int(m.group(1))]
    rest, args = name[m.end() + int(m.group(1)) + 1:], []
    while rest and rest[0] != "E":
        a = _TEMPLATE_ARG.match(rest)
        if not a:
            return name
        if a.group(1) is not None:
            args.append(a.group(1))
        elif a.group(2) or a.group(3):
            args.append(_BUILTINS[a.group(2) or a.group(3)])
        else:  # a named type: its length, then its name
            length = int(a.group(4))
            args.append(rest[a.end():a.end() + length])
            rest = rest[a.end() + length:]
            continue
        rest = rest[a.end():]
    return f"{base}<{', '.join(args)}>"


def main():
    logs = compile_all("sm_90", ("-ftz=true", "--ptxas-options=-v"))
    print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, sm_90, -ftz=true (as CuPy compiles)\n")
    print(f"| {'file':20} | {'kernel':42} | regs | spill B | shared B |")
    print(f"|{'-' * 22}|{'-' * 44}|------|---------|----------|")
    for source, log in logs.items():
        kernel = None
        for line in log.splitlines():
            if m := re.search(r"Compiling entry function '(\w+)'", line):
                kernel = demangle(m.group(1))
            elif m := re.search(r"(\d+) bytes spill stores", line):
                spill = int(m.group(1))
            elif m := re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line):
                print(f"| {source:20} | {kernel:42} | {m.group(1):>4} | {spill:>7} | {m.group(2) or 0:>8} |")


if __name__ == "__main__":
    main()
