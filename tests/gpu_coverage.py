"""How much of nano's GPU-only code CI executes, on the CPU emulator (docs/cuda-emulator.md):
runs the tests that create device arrays under coverage (subprocesses and mpirun ranks
included) and reports, of the statements only a GPU run reaches, how many ran and which did not.

    .venv/bin/pip install coverage   # not in requirements.txt: only this measurement uses it
    .venv/bin/python tests/gpu_coverage.py [--json OUT.json] [pytest arguments...]

GPU-only statements, read from the source (ast):
- every statement in a function of nano/kernels.py, nano/cublas.py and nano/graphs.py;
- in the other nano/*.py, the branches a device test selects: the body of an `if` whose test
  names the GPU ("gpu", a CUDA graph step) and negates nothing, and the `else` of
  one that names the CPU ("cpu", a NumPy array);
- the functions that only a GPU calls (GPU_FUNCTIONS).
"""
import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_engine_emulated.py", "tests/test_kernels.py", "tests/test_cuda_host.py",
         "tests/test_graphs_layout.py", "tests/test_kernels_compile.py", "tests/test_disagg.py",
         "tests/test_kv_pool.py", "tests/test_gpu_libraries.py"]
WHOLE = ("kernels.py", "cublas.py", "graphs.py")
GPU_TEST = re.compile(r"'gpu'|GraphStep|self\.graphs is not None|cuda_graphs")
CPU_TEST = re.compile(r"'cpu'|np\.ndarray")
GPU_FUNCTIONS = {"device.py": {"gpu_count", "gpu_of", "ranks_on_gpu"}}


def statements(nodes) -> set[int]:
    """The first line of every statement in `nodes`, nested ones included."""
    return {n.lineno for node in nodes for n in ast.walk(node) if isinstance(n, ast.stmt)}


def gpu_only(path: Path) -> set[int]:
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    if path.name in WHOLE:
        return statements(body for f in functions for body in f.body)
    lines = statements(body for f in functions if f.name in GPU_FUNCTIONS.get(path.name, ())
                       for body in f.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            negated = any(isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) for n in ast.walk(node.test))
            if GPU_TEST.search(test) and not negated:  # `name == "gpu" and not found`: there is none
                lines |= statements(node.body)
            if CPU_TEST.search(test):
                lines |= statements(node.orelse)
    return lines


def measure(pytest_args: list[str]) -> dict:
    import coverage
    with tempfile.TemporaryDirectory() as tmp:
        rc = Path(tmp) / "coveragerc"
        rc.write_text(f"[run]\nsource = {ROOT / 'nano'}\nparallel = true\npatch = subprocess\n"
                      f"data_file = {tmp}/.coverage\n")
        env = dict(os.environ, COVERAGE_RCFILE=str(rc))
        run = subprocess.run([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q",
                              "-p", "no:cacheprovider", *pytest_args], cwd=ROOT, env=env)
        subprocess.run([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=ROOT, env=env,
                       check=True)
        cov = coverage.Coverage(data_file=f"{tmp}/.coverage", config_file=str(rc))
        cov.load()
        report = {"pytest_exit_code": run.returncode, "files": {}}
        for path in sorted((ROOT / "nano").glob("*.py")):
            _, executable, _, missing, _ = cov.analysis2(str(path))
            wanted = gpu_only(path) & set(executable)
            if wanted:
                not_run = sorted(wanted & set(missing))
                report["files"][f"nano/{path.name}"] = {"statements": len(wanted), "not_run": not_run}
    total = sum(f["statements"] for f in report["files"].values())
    ran = total - sum(len(f["not_run"]) for f in report["files"].values())
    report.update(statements=total, ran=ran, percent=round(100 * ran / total, 1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the report here too")
    args, pytest_args = parser.parse_known_args()
    report = measure(pytest_args or TESTS)
    for name, f in report["files"].items():
        source = (ROOT / name).read_text().splitlines()
        print(f"{name}: {f['statements'] - len(f['not_run'])} of {f['statements']}")
        for line in f["not_run"]:
            print(f"    {line}: {source[line - 1].strip()}")
    print(f"GPU-only statements run: {report['ran']} of {report['statements']} ({report['percent']}%)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
