"""Colocated vs disaggregated on the same cores and the same seeded arrival trace
(run.py --bench --disagg-compare P:D).

    colocated:      one engine in this process, every core its BLAS threads
    disaggregated:  mpirun -n P+D python run.py --disagg P:D (one core per rank), launched
                    here with the same flags; it writes its summary to a JSON file

Both see the same random-token requests (bench.random_requests, seed 0) arriving at the
same Poisson times (bench.poisson_arrivals); both warm up first. The table reports TTFT
and TPOT, SLO attainment and goodput, and the time between a request's output tokens
A decoding step's time relative to a step with as many decodes and no prefill anywhere
(metrics.decode_interference) measures the interference disaggregation removes.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from nano.disagg.metrics import decode_interference, format_slowdown
from nano.errors import NanoError
from nano.telemetry.metrics import metrics_of
from nano.telemetry.summary import summarize

ROOT = Path(__file__).resolve().parents[2]  # the checkout, where run.py is


def colocated_summary(engine, seqs, wall: float) -> dict:
    s = summarize(metrics_of(engine), wall)
    s.update(decode_interference([(metrics_of(engine).step_log, [])]))
    return s


def run_disaggregated(argv: list[str], split: str) -> dict:
    """The same command under mpirun, --disagg-compare turned into --disagg; its summary."""
    ranks = sum(int(x) for x in split.split(":"))
    return run_summary([*without(argv, "--disagg-compare"), "--disagg", split], "the disaggregated run",
                       mpirun_command(ranks, "--disagg-compare"))


def mpirun_command(ranks: int, what: str) -> list[str]:
    """mpirun -n RANKS with what this machine needs: as root, --allow-run-as-root; with more
    ranks than the cores this process may use, --oversubscribe."""
    mpirun = Path(sys.executable).parent / "mpirun"
    mpirun = str(mpirun) if mpirun.exists() else shutil.which("mpirun")
    if mpirun is None:
        raise NanoError(f"{what} needs mpirun (Open MPI's, installed with requirements.txt)")
    cmd = [mpirun, "-n", str(ranks)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if ranks > len(os.sched_getaffinity(0)):
        cmd.append("--oversubscribe")
    return cmd


def run_summary(args: list[str], what: str, launcher: list[str] = (), env: dict | None = None) -> dict:
    """python run.py ARGS --summary-json FILE, behind `launcher` (mpirun_command), its output
    passed through; the summary it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [*launcher, sys.executable, str(ROOT / "run.py"), *args, "--summary-json", str(out)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if proc.returncode != 0 or not out.exists():
            raise NanoError(f"{what} failed (exit {proc.returncode}): see its error above")
        print(proc.stdout, end="")
        return json.loads(out.read_text())


def without(argv: list[str], flag: str) -> list[str]:
    """argv less one flag and its value (as --flag V or --flag=V)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def table(results: dict[str, dict]) -> str:
    rows = ["| setup | TTFT p50 / p99 ms | TPOT p50 / p99 ms | SLO attained | goodput req/s "
            "| decode step during prefill, x a no-prefill step: p50 / p99 | KV moved per request | output tok/s |",
            "|---|---|---|---|---|---|---|---|"]
    for name, s in results.items():
        moved = (f"{s['kv_bytes_mean'] / 1e6:.1f} MB in {1e3 * (s['kv_pack_s_mean'] + s['kv_receive_s_mean']):.0f} ms "
                 f"({100 * s['kv_transfer_fraction_of_ttft']:.1f}% of TTFT)" if s.get("handoffs") else "-")
        rows.append(f"| {name} | {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} "
                    f"| {s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f} | {100 * s['slo_attainment']:.0f}% "
                    f"| {s['goodput_rps']:.2f} | {s['decode_slowdown_prefill_p50']:.2f}x / "
                    f"{s['decode_slowdown_prefill_p99']:.2f}x | {moved} "
                    f"| {s['output_tokens_per_s']:.1f} |")
    return "\n".join(rows)


def targets(name: str, s: dict) -> str:
    """A run against the targets: a decoding step while prefill runs within 1.2x (p99) of
    a step with as many decodes and none; the KV transfer within 5% of TTFT."""
    line = f"{name}: decode {format_slowdown(s)} (target: p99 <= 1.2x)"
    if s.get("handoffs"):
        line += f"; KV transfer {100 * s['kv_transfer_fraction_of_ttft']:.1f}% of mean TTFT (target <= 5%)"
    return line
