"""The lab: the driver (discovery, table, JSON, PNG, verdict), run.py --lab, and lab-a's
experiments at quick size: each writes its PNG and JSON, and its claim's direction holds
where it is robust."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nano.lab import driver
from nano.lab.experiment import Experiment, Size

ROOT = Path(__file__).resolve().parent.parent
QUICK = Size(quick=True, model=None, device="cpu", seed=0)
LAB_A = ("batching", "ceiling", "chunking", "paging", "watermark", "preemption", "prefix")


def run_quick(name: str, tmp_path) -> tuple[list[dict], dict]:
    rows = driver.run_experiment(name, QUICK, tmp_path)
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert record["rows"] == rows and record["claim"] == driver.list_experiments()[name].claim
    return rows, record


@pytest.mark.parametrize("name", [name for name in LAB_A if name != "batching"])
def test_experiment_at_quick_size_writes_its_figure_and_holds_its_claim(name, tmp_path):
    rows, record = run_quick(name, tmp_path)
    assert rows
    assert record["check"] is None, record["check"]


def test_batching_reformed_fills_the_slots_a_fixed_batch_leaves_idle(tmp_path):
    """The counts are exact, so they are asserted here: the same tokens in fewer steps, fewer
    idle slots. The tokens/s at quick size are a second's timings on the tiny model, whose
    smaller batches also step faster (5,461 against 5,445 tokens/s in one run): benchmark
    figures that the lab's check judges at full size, never assertions of a test."""
    rows, _ = run_quick("batching", tmp_path)
    for batch in {r["batch"] for r in rows}:
        fixed, reformed = (next(r for r in rows if r["batch"] == batch and r["mode"] == mode)
                           for mode in ("fixed", "re-formed"))
        assert fixed["output_tokens"] == reformed["output_tokens"]
        assert fixed["steps"] > reformed["steps"] and fixed["idle_slot_steps"] > reformed["idle_slot_steps"]


def test_every_experiment_is_found_and_named_by_its_module():
    found = driver.list_experiments()
    assert set(LAB_A) <= set(found)
    for name, exp in found.items():
        assert isinstance(exp, Experiment) and exp.name == name
        assert all(getattr(exp, f) for f in ("claim", "varies", "fixed", "measures"))


def test_the_driver_records_a_failed_check(tmp_path, monkeypatch):
    """A claim that does not hold is written into the JSON and makes --lab exit 1."""
    failing = Experiment(name="failing", claim="c", varies="v", fixed="f", measures="m",
                         run=lambda size: [{"x": 1, "y": 2.5}], plot=lambda rows, fig: fig.subplots(),
                         check=lambda rows: "y is not below x")
    monkeypatch.setattr(driver, "list_experiments", lambda: {"failing": failing})
    driver.run_experiment("failing", QUICK, tmp_path)
    assert json.loads((tmp_path / "failing.json").read_text())["check"] == "y is not below x"


def test_table_has_every_key_as_a_column():
    text = driver.table([{"a": 1, "b": 0.123456}, {"a": 22, "c": "z"}])
    head, first, second = text.splitlines()
    assert head.split() == ["a", "b", "c"] and first.split() == ["1", "0.1235"] and second.split() == ["22", "z"]


def lab(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_cli_lists_the_experiments():
    out = lab("--lab", "list")
    assert out.returncode == 0, out.stderr
    assert {line.split()[0] for line in out.stdout.splitlines()} >= set(LAB_A)


def test_cli_runs_one_quick_experiment(tmp_path):
    out = lab("--lab", "batching", "--lab-quick", "--lab-out", str(tmp_path), "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "check: holds" in out.stdout and "tokens_per_s" in out.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"batching.png", "batching.json"}


@pytest.mark.parametrize("args, message", [
    (["--lab", "nope"], "--lab 'nope' is not an experiment: choose from"),
    (["--lab", "batching", "--block-size", "32"], "drop --block-size"),
    (["--lab", "batching", "--bench"], "drop --bench"),
    (["--lab-quick"], "--lab-quick and --lab-out go with --lab NAME"),
    (["--lab", "batching", "--seed", "-x"], "argument --seed"),
])
def test_cli_bad_lab_arguments_are_one_line_errors(args, message, tmp_path):
    out = lab(*args, "--lab-out", str(tmp_path)) if "--lab" in args else lab(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_cli_lab_out_must_be_a_folder(tmp_path):
    (tmp_path / "file").write_text("")
    out = lab("--lab", "batching", "--lab-quick", "--lab-out", str(tmp_path / "file" / "sub"))
    assert out.returncode == 2 and out.stderr.startswith("error: --lab-out"), out.stderr
