"""Runs an experiment: its rows printed as a table, written as JSON (with the experiment's
text, the size and the machine) and drawn as a PNG, and its claim's direction checked.

Experiments are found with pkgutil: every module of nano/lab/experiments/ that defines
`EXPERIMENT`, so adding one is adding its file."""
import importlib
import json
import math
import os
import pkgutil
import platform
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, whatever the environment says
from matplotlib.figure import Figure

from nano.lab import experiments
from nano.lab.experiment import Experiment, Size
from nano.weights import DEFAULT_MODEL

FIGSIZE = (11, 4.2)  # inches; at DPI, a figure a docs page shows at full width
DPI = 110


def list_experiments() -> dict[str, Experiment]:
    """Every experiment by name, in name order."""
    found = {}
    for info in pkgutil.iter_modules(experiments.__path__):
        module = importlib.import_module(f"{experiments.__name__}.{info.name}")
        exp = getattr(module, "EXPERIMENT", None)
        if isinstance(exp, Experiment):
            found[exp.name] = exp
    return dict(sorted(found.items()))


def model_label(size: Size) -> str:
    if size.model is not None:
        return Path(size.model).name
    return "tiny random model" if size.quick else DEFAULT_MODEL


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "platform": platform.platform()}


def verdict(exp: Experiment, rows: list[dict]) -> str | None:
    """None when the claim's direction holds on the rows (or the experiment checks nothing)."""
    return exp.check(rows) if exp.check else None


def run_experiment(name: str, size: Size, out_dir) -> list[dict]:
    """Run one experiment; print its table and verdict; write out_dir/NAME.json and NAME.png."""
    exp = list_experiments()[name]
    print(f"{name}: {exp.claim}\n  varies: {exp.varies}\n  fixed: {exp.fixed}\n  measures: {exp.measures}",
          flush=True)
    start = time.perf_counter()
    rows = exp.run(size)
    seconds = time.perf_counter() - start
    print(table(rows))
    failed = verdict(exp, rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "claim": exp.claim, "varies": exp.varies, "fixed": exp.fixed,
              "measures": exp.measures, "size": asdict(size), "model": model_label(size),
              "machine": machine(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "seconds": round(seconds, 1), "check": failed if exp.check else "none", "rows": rows}
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    write_figure(exp, rows, size, out / f"{name}.png")
    if exp.check:
        print(f"check: {'holds' if failed is None else 'FAILED: ' + failed}")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')} ({seconds:.1f} s)", flush=True)
    return rows


def write_figure(exp: Experiment, rows: list[dict], size: Size, path: Path) -> None:
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    exp.plot(rows, fig)
    fig.suptitle(f"{exp.name}: {model_label(size)}, {size.device} device, seed {size.seed}", fontsize=10)
    fig.savefig(path)


def table(rows: list[dict]) -> str:
    """The rows as aligned columns: every key any row has, in first-seen order."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)
