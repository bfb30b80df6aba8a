"""The shape of the code: the engine flat in nano/, each add-on a package of its own that the
engine never imports, add-ons that build only on shared foundations, no modules that import
each other, the engine small enough to read, and run.py only assembling the add-ons."""
import ast
import io
import re
import subprocess
import sys
import tokenize
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
    assert {"bench", "chat", "cli", "deadline", "default_model", "disagg", "dp", "fleet", "lab", "server",
            "telemetry"} <= set(ADD_ONS)


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


# An add-on builds on another only where that one is a foundation, shared by every mode that
# needs it:
#   fleet      engines side by side under one launch (ranks, links, the router's capacity
#              check): what disaggregated serving and data-parallel replicas both stand on
#   cli        the command line's shared pieces: the parser and the shared flags, prompt files,
#              the --output file, progress, the warm-up
#   telemetry  how every mode reports (snapshots, Prometheus under vLLM's names, the run's
#              summary, the stall watch): one way for all, so that their figures compare
#   chat       the chat template: one rendering of a conversation, for the command line and the
#              server alike
#   controls   vLLM's sampling controls as a logits processor: one reading of a request's
#              penalties and biases, for prompt files, the Python API and the server
#   structured grammars as logits processors (llguidance), and the chain that combines
#              processors: for the server, the offline LLM and any mode that samples
#   lora       LoRA adapters as requests name them (LoRARequest, a PEFT folder's checks, the
#              pool they serve from): one for prompt files, the Python API and the server
# Any other add-on is a product of its own (bench, disagg, dp, server, ...): two of them meet
# only in run.py, which assembles them (the server serves what dp gives it). The lab is a
# driver like run.py: its experiments compare the modes, so it may import any of them; nothing
# imports the lab.
FOUNDATIONS = {"fleet", "cli", "telemetry", "chat", "controls", "structured", "speculative", "lora"}
DRIVERS = {"lab"}


def foreign_add_ons(path: Path, add_on: str) -> set[str]:
    """The add-ons a file of add_on imports that it may not: neither itself nor a foundation."""
    imported = {m.split(".")[1] for m in imported_modules(path) if m.startswith("nano.")}
    return imported & set(ADD_ONS) - FOUNDATIONS - {add_on}


def test_add_ons_build_only_on_the_foundations():
    offenders = {}
    for add_on in sorted(set(ADD_ONS) - DRIVERS):
        for path in sorted((NANO / add_on).rglob("*.py")):
            if foreign_add_ons(path, add_on):
                offenders[str(path.relative_to(NANO))] = sorted(foreign_add_ons(path, add_on))
    assert not offenders, f"add-ons importing add-ons that are not foundations: {offenders}"


def test_the_check_sees_an_import_between_products(tmp_path):
    """The rule above fails on a planted import: a product's, the lab's, a function's own."""
    planted = tmp_path / "planted.py"
    planted.write_text("from nano.fleet import ranks\nfrom nano.telemetry.summary import summarize\n"
                       "def f():\n    from nano.bench import workload\n    from nano.lab import cli\n")
    assert foreign_add_ons(planted, "dp") == {"bench", "lab"}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at root and the package's modules it imports, wherever the
    import sits (a function, `if TYPE_CHECKING:`). `from p import m` is an edge to the module
    p.m where there is one, else to p."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                edges |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in paths else node.module
                          for alias in node.names}
        graph[name] = edges & set(paths) - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The modules that import each other, directly or through others: each circle's members."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reachable = {name: reach(name) for name in graph}
    return {frozenset(m for m in reachable[name] if name in reachable[m]) for name in graph
            if name in reachable[name]}


def test_no_import_circles():
    circles = import_circles(import_graph(NANO))
    assert not circles, f"modules importing each other: {[sorted(c) for c in circles]}"


def test_the_check_sees_an_import_circle(tmp_path):
    """A circle closed by an annotation-only import is still a circle: planted, it is found."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("from pkg.c import C\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    assert import_circles(import_graph(package)) == {frozenset({"pkg.a", "pkg.b", "pkg.c"})}


# An engine object in an add-on, however it is named there: engine, eng, self.engine,
# node.instance.engine, base_engine, make_engine(...), clocked_engine(...).
ENGINE_NAME = re.compile(r"(^|_)eng(ine)?$")


def engine_surface() -> set[str]:
    """What an add-on may touch on an engine: LLMEngine's public methods and properties, and
    the attributes it publishes."""
    from nano.engine import LLMEngine
    return {n for n in vars(LLMEngine) if not n.startswith("_")} | set(LLMEngine.ADDON_ATTRIBUTES)


def engine_reaches(path: Path, surface: set[str]) -> list[str]:
    """'line: attribute' for each attribute of an engine object in path that is not on the
    engine's surface (engine.scheduler.add(seq), s = engine.scheduler, ...)."""
    def is_engine(node) -> bool:
        node = node.func if isinstance(node, ast.Call) else node
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return bool(ENGINE_NAME.search(name))
    return sorted(f"{node.lineno}: {node.attr}" for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Attribute) and is_engine(node.value) and node.attr not in surface)


def test_add_ons_use_only_the_engines_surface():
    surface = engine_surface()
    files = [p for a in ADD_ONS for p in sorted((NANO / a).rglob("*.py"))] + [NANO.parent / "run.py"]
    offenders = {str(p.relative_to(NANO.parent)): hits for p in files if (hits := engine_reaches(p, surface))}
    assert not offenders, f"add-ons reaching into the engine: {offenders}"


def test_the_check_sees_a_reach_into_the_engine(tmp_path):
    """The rule above fails on a planted call into the scheduler, and on an alias of it."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f(self, seq):\n    self.engine.queue(seq)\n    self.engine.scheduler.add(seq)\n"
                       "    s = engine.block_manager\n    return eng.clock.now(), make_engine().runner\n")
    assert engine_reaches(planted, engine_surface()) == ["3: scheduler", "4: block_manager", "5: runner"]


# The device side of a step: it runs packed arrays (plan.py's packed step), never a request.
DEVICE_SIDE = ("runner", "model", "graphs", "fleet/worker")


def test_the_device_side_is_never_handed_a_sequence():
    """No device-side module imports Sequence, the plan that holds sequences, or the scheduler:
    what it runs comes as arrays, fixed when the step was planned."""
    banned = {"nano.sequence", "nano.scheduler", "nano.plan.StepPlan", "nano.plan.Sample", "nano.plan.Score"}
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


def test_the_numpy_ops_never_look_for_a_device():
    """ops.py is NumPy alone: no op asks what arrays it was given or reaches for the kernels
    (the set a run uses is chosen once, shard.op_set)."""
    gpu = {m for m in imported_modules(NANO / "ops.py") if m.split(".")[0] == "cupy" or m.startswith("nano.kernels")}
    assert not gpu, f"ops.py imports {sorted(gpu)}"
    assert "__cuda_array_interface__" not in (NANO / "ops.py").read_text(), "an op tests its arrays' type"


# What one reader can hold: the engine's own work (scheduling with FCFS, the policy interface
# other policies plug into, the forward pass on two devices, TP ranks that end together, BLAS
# threads that survive a busy machine, user text that never becomes a special token, the
# batch-invariant CPU path that int8 runs by default, the never-fit rule a disaggregated
# router shares with the scheduler, prompt logprobs scored from the prefill rows across
# chunks, cache hits and recomputes, the prefix cache's stored and evicted blocks as events
# for a data-parallel router). Deep dives live in docs/, and helpers only add-ons use live
# with them. The budget counts code, not lines: a statement counts once however it is
# wrapped, and docstrings, comments and blank lines count nothing, so that neither packing
# nor prose pays. The ceilings are the code as it stood when they were set (2,580 and
# 1,185 lines), rounded up to the next hundred. They are never raised: growing past one
# means moving something out first.
CORE_CODE_LINES = 2600
# Of those, one step's path (STEP_PATH), prompt logprobs and drafts included.
STEP_CODE_LINES = 1200
LINE_LENGTH = 100  # characters, in every core file


def code_lines(source: str) -> int:
    """Count the logical lines of code in source: each statement, decorator or clause header
    once, however many physical lines it is wrapped over; docstrings, comments and blank
    lines not at all."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.add(first.lineno)
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
               tokenize.ENDMARKER}
    count, start = 0, None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in skipped:
            continue
        start = token.start[0] if start is None else start
        if token.type == tokenize.NEWLINE:
            count += start not in docstrings
            start = None
    return count


def long_lines(source: str, name: str) -> list[str]:
    """'name:line' for each line of source longer than LINE_LENGTH characters."""
    return [f"{name}:{i}" for i, line in enumerate(source.splitlines(), 1) if len(line) > LINE_LENGTH]


def test_the_core_stays_small():
    counts = {p.stem: code_lines(p.read_text()) for p in CORE}
    assert sum(counts.values()) <= CORE_CODE_LINES, f"the core is {sum(counts.values())} lines of code"
    step = sum(counts[name] for name in STEP_PATH)
    assert step <= STEP_CODE_LINES, f"one step's path is {step} lines of code"


def test_no_core_line_is_longer_than_the_limit():
    offenders = [hit for p in CORE for hit in long_lines(p.read_text(), p.name)]
    assert not offenders, f"core lines over {LINE_LENGTH} characters: {offenders}"


def test_the_budget_sees_a_planted_line():
    """One more statement is one more line of code, however it is written; a docstring, a
    comment, a wrapped call and blank lines are none; a 101-character line is one too long."""
    source = (NANO / "engine.py").read_text()
    base = code_lines(source)
    assert code_lines(source + "\nPLANTED = 1\n") == base + 1
    assert code_lines(source + '\n\n# a comment\ndef f():\n    """A docstring."""\n    return g(1,\n             2)\n') == base + 2
    counts = {p.stem: code_lines(p.read_text()) for p in CORE}
    room = CORE_CODE_LINES - sum(counts.values())
    planted = source + "".join(f"\nPLANTED_{i} = {i}" for i in range(room + 1)) + "\n"
    assert sum(counts.values()) - counts["engine"] + code_lines(planted) > CORE_CODE_LINES
    assert long_lines("x = 1\n" + "y = '" + "z" * 95 + "'\n", "planted.py") == ["planted.py:2"]
    assert long_lines("y = '" + "z" * 94 + "'\n", "planted.py") == []


def test_the_engine_imports_without_the_add_ons_dependencies():
    """As on a GPU machine that has only numpy, cupy, mpi4py, tokenizers and safetensors: the
    engine loads no fetch/convert-only, server-only, export-only or plotting (the lab) package."""
    probe = ("import sys, nano.engine, nano.fleet.worker, nano.llm; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & "
             "{'gguf', 'fastapi', 'uvicorn', 'pydantic', 'jinja2', 'prometheus_client', 'starlette', "
             "'matplotlib'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=NANO.parent, check=True).stdout.strip()
    assert out == "[]", f"the engine imported {out}"


RUN_LINES = 200  # run.py assembles the parser from the packages' flags and dispatches: no more


def test_run_py_only_assembles():
    lines = len((NANO.parent / "run.py").read_text().splitlines())
    assert lines <= RUN_LINES, f"run.py is {lines} lines: a mode's flags and checks belong with its package"
