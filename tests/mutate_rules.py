"""Break each rule of the scheduler and the block manager, one at a time, and check that a fast
test notices.

A "rule" is a condition: the test of every `if`, `while`, conditional expression and
comprehension filter, and each operand of an `and` / `or` among them. Each is broken in a
copy of the repository in two ways where it applies, each a one-line change:
  negated          `if x:`           -> `if not (x):`
  clause dropped   `if a and b:`     -> `if True and b:`   (for `or`: `False or b`)
and the fast tests run against the copy. A break that no test fails is a survivor: a rule
nothing guards. Run by hand (a few minutes per file on 2 cores):

    .venv/bin/python tests/mutate_rules.py                      # both files
    .venv/bin/python tests/mutate_rules.py nano/scheduler.py    # one
"""
import ast
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("nano/scheduler.py", "nano/block_manager.py")
FAST_TESTS = ("tests/test_block_manager.py", "tests/test_scheduler.py", "tests/test_stress.py",
              "tests/test_equivalence.py", "tests/test_kv_pool.py")
TIMEOUT = 600  # seconds per mutant: a break that makes the engine loop for ever is caught too


def conditions(tree: ast.AST) -> list[ast.expr]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            found.append(node.test)
        elif isinstance(node, ast.comprehension):
            found.extend(node.ifs)
    return found


def mutants(source: str) -> list[tuple[int, str, str]]:
    """(line, description, mutated source) for every break of every condition."""
    lines = source.splitlines(keepends=True)
    out = []

    def replace(node: ast.expr, text: str) -> str:
        start = sum(len(l) for l in lines[:node.lineno - 1]) + node.col_offset
        end = sum(len(l) for l in lines[:node.end_lineno - 1]) + node.end_col_offset
        return source[:start] + text + source[end:]

    for test in conditions(ast.parse(source)):
        segment = ast.get_source_segment(source, test)
        out.append((test.lineno, f"negated: {segment}", replace(test, f"(not ({segment}))")))
        if isinstance(test, ast.BoolOp):
            neutral = "True" if isinstance(test.op, ast.And) else "False"
            for operand in test.values:
                dropped = ast.get_source_segment(source, operand)
                out.append((operand.lineno, f"dropped: {dropped}", replace(operand, neutral)))
    return out


def survives(copy: Path, relpath: str, mutated: str) -> bool:
    (copy / relpath).write_text(mutated)
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              *FAST_TESTS], cwd=copy, capture_output=True, timeout=TIMEOUT)
        return run.returncode == 0
    except subprocess.TimeoutExpired:
        return False


def main(files: list[str]) -> int:
    survivors = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "weights", ".build"))
        (copy / "weights").symlink_to(ROOT / "weights")
        for relpath in files:
            source = (ROOT / relpath).read_text()
            found = mutants(source)
            for i, (line, what, mutated) in enumerate(found, 1):
                alive = survives(copy, relpath, mutated)
                print(f"{relpath}:{line} [{i}/{len(found)}] {'SURVIVED' if alive else 'caught'}: {what}",
                      flush=True)
                if alive:
                    survivors.append(f"{relpath}:{line} {what}")
            (copy / relpath).write_text(source)
    print(f"{len(survivors)} survivor(s)" + "".join(f"\n  {s}" for s in survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(FILES)))
