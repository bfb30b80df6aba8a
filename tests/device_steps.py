"""The Python half of tests/device_check.sh's steps, each writing JSON into a folder:

    python tests/device_steps.py preflight OUT     CuPy imports and sees a device: device.json
    python tests/device_steps.py compile OUT       every cuda/*.cu module built (NVRTC) and loaded: compile.json
    python tests/device_steps.py tests OUT NAME    tests_NAME.json from pytest's NAME.xml (junit)

Each exits non-zero, with one `error: ...` line, when its step failed: CuPy missing, no device,
a test failed, or no test passed (all skipped: a GPU test suite that ran nothing)."""
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(3)


def preflight(out: Path) -> None:
    try:
        import cupy
    except Exception as e:  # ImportError, or CuPy failing to load its libraries
        fail(f"CuPy cannot be imported ({type(e).__name__}: {e}): every GPU test would be skipped")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver
        fail(f"CuPy sees no CUDA device ({type(e).__name__}: {e})")
    if count < 1:
        fail("CuPy sees no CUDA device")
    props = cupy.cuda.runtime.getDeviceProperties(0)
    free, total = cupy.cuda.runtime.memGetInfo()
    info = {"device": props["name"].decode(), "count": count, "sms": props["multiProcessorCount"],
            "memory_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1),
            "cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(), "python": sys.version.split()[0]}
    (out / "device.json").write_text(json.dumps(info, indent=1) + "\n")
    print(info)


def compile_kernels(out: Path) -> None:
    """Each module's first kernel fetched, a module per source and element type: NVRTC
    compiles the module (CuPy caches it on disk for the steps after this one) and it is loaded
    onto the device. The modules build on threads, as many as cores (NVRTC runs without the
    GIL): one after the other, float16's alone took 48-62 s of the step's 75 on an H200
    (docs/h200_figures.md), and bfloat16 doubles the attention modules, the longest."""
    from nano import kernels
    jobs = [(source, instance) for source in kernels._TEMPLATES
            for instance in {kernels._type_of(e): e for e in kernels._TEMPLATES[source]}.values()]

    def build(job) -> float:
        start = time.perf_counter()
        kernels.kernel(*job)
        seconds = round(time.perf_counter() - start, 2)
        print(f"{job[0]} {job[1]}: {seconds} s", flush=True)
        return seconds

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        seconds = dict(zip((instance for _, instance in jobs), pool.map(build, jobs)))
    (out / "compile.json").write_text(json.dumps(seconds, indent=1) + "\n")


def tests(out: Path, name: str) -> None:
    """junit XML -> JSON: counts, and each test's outcome and seconds."""
    if not (out / f"{name}.xml").exists():
        fail(f"{name}: pytest wrote no report (stopped at its time limit?)")
    suite = ET.parse(out / f"{name}.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0))})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    (out / f"tests_{name}.json").write_text(json.dumps({"counts": counts, "cases": cases}, indent=1) + "\n")
    print(f"{name}: {counts}")
    if counts["failure"] or counts["error"]:
        fail(f"{name}: {counts['failure']} failed, {counts['error']} errors")
    if not counts["passed"]:
        fail(f"{name}: no test passed ({counts['skipped']} skipped): the GPU tests did not run")


if __name__ == "__main__":
    step, out = sys.argv[1], Path(sys.argv[2])
    {"preflight": preflight, "compile": compile_kernels, "tests": lambda o: tests(o, sys.argv[3])}[step](out)
