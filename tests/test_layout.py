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
    assert {"bench", "chat", "cli", "default_model", "disagg", "server", "telemetry"} <= set(ADD_ONS)


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


# The device side of a step: it runs packed arrays (plan.py's packed step), never a request.
DEVICE_SIDE = ("runner", "model", "graphs", "worker")


def test_the_device_side_is_never_handed_a_sequence():
    """No device-side module imports Sequence, the plan that holds sequences, or the scheduler:
    what it runs comes as arrays, fixed when the step was planned."""
    banned = {"nano.sequence", "nano.scheduler", "nano.plan.SchedulerOutput", "nano.plan.StepRows"}
    offenders = {name: sorted(imported_modules(NANO / f"{name}.py") & banned) for name in DEVICE_SIDE}
    assert not any(offenders.values()), f"the device side imports {offenders}"


def test_the_forward_pass_runs_the_ops_it_is_given():
    """model.py imports no array library (its ops set brings them), and only shard.py, which
    chooses the ops set, reads the batch-invariant flag (config.py defines it)."""
    arrays = {m for m in imported_modules(NANO / "model.py") if m.split(".")[0] in ("numpy", "cupy")}
    assert not arrays, f"model.py imports {sorted(arrays)}"
    readers = sorted(p.name for p in CORE if any(isinstance(node, ast.Attribute) and node.attr == "batch_invariant"
                                                 for node in ast.walk(ast.parse(p.read_text()))))
    assert readers == ["config.py", "shard.py"], f"the batch-invariant flag is read in {readers}"


# What one reader can hold: the engine's own work (scheduling, the forward pass on two
# devices, TP ranks that end together, BLAS threads that survive a busy machine, user text
# that never becomes a special token, the batch-invariant CPU path that int8 runs by default,
# the never-fit rule a disaggregated router shares with the scheduler, prompt logprobs scored
# from the prefill rows across chunks, cache hits and recomputes, the prefix cache's stored
# and evicted blocks as events for a data-parallel router) in 4,350 lines.
# Growing past it means moving something out first.
CORE_LINES = 4350
# Of those, one step's path (STEP_PATH): 2,000 lines, and 60 more for prompt logprobs, which
# every stage of a step carries (the plan's rows, the packed logits rows, the scoring, the
# cache hits a scoring request may not take).
STEP_LINES = 2060


def test_the_core_stays_small():
    lines = {p.stem: len(p.read_text().splitlines()) for p in CORE}
    assert sum(lines.values()) <= CORE_LINES, f"the core is {sum(lines.values())} lines"
    step = sum(lines[name] for name in STEP_PATH)
    assert step <= STEP_LINES, f"one step's path is {step} lines"


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
