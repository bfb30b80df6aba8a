"""deadlines: where throughput and deadlines part. FCFS and the deadline policy on the same
seeded arrivals, at loads below, near and above the workload's measured capacity, for a
workload whose requests share one target and one that mixes urgent interactive requests
with loose batch ones: the matrix of nano/bench/slo_matrix.py (run.py --bench
--policy-compare). Quick size: the tiny model on the simulated clock, full size: the real clock
(nano/lab/timing.py)."""
import numpy as np

from nano.bench import slo_matrix
from nano.deadline.cli import POLICIES, policy_factory
from nano.lab.experiment import Experiment, Size, model_of
from nano.lab.timing import clocked_engine
from nano.telemetry.summary import percentile
from nano.weights import open_model

WORKLOADS = ("uniform", "mixed")


def run(size: Size) -> list[dict]:
    def make(policy):
        return clocked_engine(size, policy_factory(policy), kv_cache_memory=256 * 2**20)

    vocab = open_model(model_of(size), tokenizer=False).config.vocab_size
    capacity = {}

    def note_capacity(name, load, seed, policy, outcome, cap):
        capacity[name] = cap

    results = slo_matrix.run_matrix(make, vocab, 40 if size.quick else 16, (size.seed,), WORKLOADS,
                                    on_result=note_capacity)
    rows = []
    for (name, load, seed, policy), o in results.items():
        ttft = [t for ts in o.ttft.values() for t in ts]
        rows.append({"workload": name, "load": load, "offered": slo_matrix.LOADS[load],
                     "capacity_rps": capacity[name], "policy": policy, "met": o.met, "requests": o.total,
                     "attainment": o.met / o.total, "goodput_rps": o.goodput,
                     **{f"{kind}_attained": m / n for kind, (m, n) in sorted(o.met_by_kind.items())},
                     "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
                     "wall_s": o.wall})
    return rows


def plot(rows: list[dict], fig) -> None:
    ax_good, ax_att = fig.subplots(1, 2)
    colors = dict(zip(WORKLOADS, ("tab:blue", "tab:red")))
    for name in WORKLOADS:
        for policy in POLICIES:
            sel = sorted((r for r in rows if r["workload"] == name and r["policy"] == policy),
                         key=lambda r: r["offered"])
            style = dict(color=colors[name], linestyle="-" if policy == "deadline" else "--", marker="o",
                         label=f"{name}, {policy}")
            ax_good.plot([r["offered"] for r in sel], [r["goodput_rps"] / r["capacity_rps"] for r in sel], **style)
            ax_att.plot([r["offered"] for r in sel], [100 * r["attainment"] for r in sel], **style)
    ax_good.set_title("goodput (requests meeting both targets), x capacity")
    ax_att.set_title("SLO attainment (%)")
    for ax in (ax_good, ax_att):
        ax.set_xlabel("offered load, x the workload's capacity")
        ax.legend(fontsize=8)


def goodput(rows: list[dict], name: str, load: str, policy: str) -> float:
    return float(np.mean([r["goodput_rps"] for r in rows
                          if (r["workload"], r["load"], r["policy"]) == (name, load, policy)]))


def check(rows: list[dict]) -> str | None:
    for load in ("near", "above"):
        fcfs, deadline = (goodput(rows, "mixed", load, p) for p in POLICIES)
        if deadline < fcfs:
            return f"mixed urgency, {load} capacity: deadline goodput {deadline:.2f} < FCFS {fcfs:.2f} req/s"
    return None


EXPERIMENT = Experiment(
    name="deadlines",
    claim="Where requests' urgency differs, serving by deadline meets more targets per second (goodput) "
          "than first-come-first-served at and above capacity; with one target for everyone it is never behind.",
    varies="policy (FCFS, deadline), offered load (0.6x, 1x, 1.5x the measured capacity), "
           "urgency mix (uniform targets; half interactive, half batch)",
    fixed="seeded requests and Poisson arrivals (the same for both policies), targets in units of the "
          "engine's own step times (nano/bench/slo_matrix.py)",
    measures="goodput, SLO attainment (overall and per kind), TTFT p50/p99",
    run=run, plot=plot, check=check)
