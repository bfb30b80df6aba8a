"""The shape of the code: the engine flat in nano/, each add-on a package of its own that the
engine never imports, and the engine small enough to read."""
import ast
import subprocess
import sys
from pathlib import Path

NANO = Path(__file__).resolve().parent.parent / "nano"
ADD_ONS = sorted(p.name for p in NANO.iterdir() if (p / "__init__.py").is_file())
CORE = sorted(NANO.glob("*.py"))
# The path a reader follows through one step.
STEP_PATH = ("engine", "scheduler", "policy", "block_manager", "plan", "sequence", "runner", "model",
             "ops", "sampler")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function: 'nano.disagg.serving',
    'nano.kv_cache', 'numpy', ..."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_add_ons_are_packages():
    assert {"bench", "chat", "cli", "deadline", "default_model", "disagg", "server", "telemetry"} <= set(ADD_ONS)


def test_no_core_module_imports_an_add_on():
    offenders = {}
    for path in CORE:
        hits = sorted(m for m in imported_modules(path)
                      if m.split(".")[:2] in [["nano", a] for a in ADD_ONS])
        if hits:
            offenders[path.name] = hits
    assert not offenders, f"core modules importing add-ons: {offenders}"


def test_the_check_sees_an_add_on_import(tmp_path):
    """The rule above fails on a planted import, wherever it sits in the file."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from nano.server import app\n    return app\n")
    assert "nano.server.app" in imported_modules(planted)


# What one reader can hold: the engine's own work (scheduling with FCFS, the policy interface
# other policies plug into, the forward pass on two devices, TP ranks that end together, BLAS
# threads that survive a busy machine, user text that never becomes a special token, the
# batch-invariant CPU path that int8 runs by default, the never-fit rule a disaggregated
# router shares with the scheduler, prompt logprobs scored from the prefill rows across
# chunks, cache hits and recomputes, the prefix cache's stored and evicted blocks as events
# for a data-parallel router) in 4,110 lines.
# Growing past it means moving something out first.
CORE_LINES = 4110
# Of those, one step's path (STEP_PATH), prompt logprobs included, which every stage of a
# step carries (the plan's rows, the packed logits rows, the scoring, the cache hits a
# scoring request may not take): 1,900 lines.
STEP_LINES = 1900


def test_the_core_stays_small():
    lines = {p.stem: len(p.read_text().splitlines()) for p in CORE}
    assert sum(lines.values()) <= CORE_LINES, f"the core is {sum(lines.values())} lines"
    step = sum(lines[name] for name in STEP_PATH)
    assert step <= STEP_LINES, f"one step's path is {step} lines"


def import_circles(paths: list[Path]) -> list[list[str]]:
    """Every cycle of imports among these modules (TYPE_CHECKING imports included), each as
    the modules along it: a module that needs another's names only for annotations still
    cannot be read, or moved, without it."""
    names = {p.stem for p in paths}
    graph = {p.stem: sorted({m.split(".")[1] for m in imported_modules(p)
                             if m.startswith("nano.") and m.split(".")[1] in names} - {p.stem})
             for p in paths}
    circles = []

    def walk(path: list[str]) -> None:
        for nxt in graph[path[-1]]:
            if nxt == path[0]:
                circles.append(path)
            elif nxt not in path and nxt > path[0]:  # each circle once, from its first module
                walk(path + [nxt])

    for start in sorted(graph):
        walk([start])
    return circles


def test_no_import_circle_in_the_core():
    assert not import_circles(CORE), "core modules importing each other"


def test_the_circle_check_sees_a_type_checking_import(tmp_path):
    """As scheduler.py <-> policy.py were, a circle closed only for annotations."""
    (tmp_path / "a.py").write_text("from nano.b import B\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nano.a import A\n")
    assert import_circles(sorted(tmp_path.glob("*.py"))) == [["a", "b"]]


def test_the_engine_imports_without_the_add_ons_dependencies():
    """As on a GPU machine that has only numpy, cupy, mpi4py, tokenizers and safetensors: the
    engine loads no fetch/convert-only, server-only, export-only or plotting (the lab) package."""
    probe = ("import sys, nano.engine, nano.worker, nano.llm; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'gguf', 'fastapi', 'uvicorn', 'pydantic', 'jinja2', 'prometheus_client', 'starlette', "
             "'matplotlib'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=NANO.parent, check=True).stdout.strip()
    assert out == "[]", f"the engine imported {out}"
