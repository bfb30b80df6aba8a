"""Registers, spills and shared memory of every kernel instance, as ptxas reports them when
NVRTC compiles cuda/*.cu for sm_90 (no GPU needed). The `.cu` headers quote this table.

    python tests/kernel_resources.py
"""
import re

from cupy_backends.cuda.libs import nvrtc

from nano import kernels


def demangle(name: str) -> str:
    """_Z22paged_attention_kernelILi64ELi3EEv... -> paged_attention_kernel<64, 3>"""
    m = re.match(r"_Z\d+(\w+?)ILi(\d+)ELi(\d+)E", name)
    return f"{m.group(1)}<{m.group(2)}, {m.group(3)}>" if m else name


def main():
    logs = kernels.compile_all("sm_90", ("-ftz=true", "--ptxas-options=-v"))
    print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, sm_90, -ftz=true (as CuPy compiles)\n")
    print(f"| {'file':20} | {'kernel':34} | regs | spill B | shared B |")
    print(f"|{'-' * 22}|{'-' * 36}|------|---------|----------|")
    for source, log in logs.items():
        kernel = None
        for line in log.splitlines():
            if m := re.search(r"Compiling entry function '(\w+)'", line):
                kernel = demangle(m.group(1))
            elif m := re.search(r"(\d+) bytes spill stores", line):
                spill = int(m.group(1))
            elif m := re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line):
                print(f"| {source:20} | {kernel:34} | {m.group(1):>4} | {spill:>7} | {m.group(2) or 0:>8} |")


if __name__ == "__main__":
    main()
