"""The policy matrix (run.py --bench --policy-compare): FCFS and deadline scheduling on the
same seeded arrivals, for three workload classes at three loads, several seeds.

Workloads (targets in units of the engine's own step times, so one definition serves the
real clock and the simulated clock of the tests; see `Units`):
  uniform   every request the same targets, prompts 16-384 tokens
  loose     every request the same loose targets, prompts 16-512 tokens, outputs 16-64:
            well below capacity FCFS meets them all, and a policy must not lose any
  mixed     half interactive (short prompts, tight TTFT), half batch requests (long
            prompts, loose TTFT)
  bursts    a stream of interactive requests; one arrival in 8 is instead a burst of 4
            long prompts at once, with loose targets
Loads: offered request rate as a fraction of the workload's capacity, measured by serving
all of its requests at once under FCFS (requests / makespan).
Goodput: requests that met both targets, per second of the run.
"""
from dataclasses import dataclass, field

import numpy as np

from nano.sequence import SamplingParams
from nano.telemetry.metrics import met_slo, tpot_of, ttft_of
from nano.telemetry.summary import percentile

WORKLOADS = ("uniform", "loose", "mixed", "bursts")
LOADS = {"below": 0.6, "near": 1.0, "above": 1.5}
BURST = 4             # long prompts arriving together
BURST_EVERY = 8       # one arrival event in BURST_EVERY is a burst


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    kind: str                     # interactive | batch | uniform (reported per kind)
    arrival: float = 0.0          # seconds from the start


@dataclass
class Units:
    """Time scales for the targets, from the engine's step-time model: `ttft`, one prefill
    step of 256 tokens; `tpot`, one decode step of 16 sequences at 256 tokens of context."""
    ttft: float
    tpot: float

    @classmethod
    def of(cls, cost) -> "Units":
        return cls(cost.step_time(256, 0, 0), cost.step_time(0, 16, 16 * 256))


# kind -> (prompt tokens, output tokens, TTFT target in ttft units, TPOT target in tpot units)
KINDS = {
    "uniform": ((16, 384), (8, 32), 6.0, 3.0),
    "loose": ((16, 512), (16, 64), 6.0, 6.0),
    "interactive": ((16, 64), (8, 24), 2.0, 3.0),
    "batch": ((128, 448), (8, 32), 30.0, 6.0),
}


def _request(kind: str, rng, vocab: int, units: Units) -> Request:
    (lo, hi), (olo, ohi), ttft, tpot = KINDS[kind]
    prompt = rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist()
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=int(rng.integers(olo, ohi + 1)),
                            ttft_slo=ttft * units.ttft, tpot_slo=tpot * units.tpot)
    return Request(prompt, params, kind)


def workload(name: str, num: int, seed: int, vocab: int, units: Units) -> list[list[Request]]:
    """Arrival events (each one request, or a burst) of about `num` requests, in order."""
    rng = np.random.default_rng(seed)
    events: list[list[Request]] = []
    while sum(map(len, events)) < num:
        if name in ("uniform", "loose"):
            events.append([_request(name, rng, vocab, units)])
        elif name == "mixed":
            events.append([_request("interactive" if rng.random() < 0.5 else "batch", rng, vocab, units)])
        elif len(events) % BURST_EVERY == BURST_EVERY - 1:
            events.append([_request("batch", rng, vocab, units) for _ in range(BURST)])
        else:
            events.append([_request("interactive", rng, vocab, units)])
    return events


def with_arrivals(events: list[list[Request]], rate: float, seed: int) -> list[Request]:
    """Poisson arrivals of `rate` requests/s on average (a burst's requests arrive together)."""
    gaps = np.random.default_rng(seed + 1).exponential(1.0, len(events))
    mean_size = sum(map(len, events)) / len(events)
    times = np.cumsum(gaps) * mean_size / rate
    return [Request(r.prompt, r.params, r.kind, float(t)) for ev, t in zip(events, times) for r in ev]


@dataclass
class Outcome:
    """One policy's run of one workload at one load and seed."""
    met: int
    total: int
    wall: float
    ttft: dict[str, list[float]] = field(default_factory=dict)   # per kind, seconds
    tpot: dict[str, list[float]] = field(default_factory=dict)
    met_by_kind: dict[str, tuple[int, int]] = field(default_factory=dict)
    late: int = 0       # finished, but missed a target
    dropped: int = 0    # rejected as late (--drop-late)

    @property
    def goodput(self) -> float:
        return self.met / self.wall if self.wall else 0.0


def serve(engine, requests: list[Request]) -> Outcome:
    """Add every request at its arrival time, run to the end, tally per kind."""
    start = engine.clock.now()
    seqs = [engine.add_request(r.prompt, r.params, start + r.arrival) for r in requests]
    while engine.has_unfinished():
        engine.step()
    wall = engine.clock.now() - start
    out = Outcome(sum(met_slo(s) for s in seqs), len(seqs), wall)
    for r, s in zip(requests, seqs):
        met, total = out.met_by_kind.get(r.kind, (0, 0))
        out.met_by_kind[r.kind] = (met + met_slo(s), total + 1)
        if s.finish_reason == "rejected":
            out.dropped += 1
            continue
        out.late += not met_slo(s)
        out.ttft.setdefault(r.kind, []).append(ttft_of(s))
        if tpot_of(s) is not None:
            out.tpot.setdefault(r.kind, []).append(tpot_of(s))
    return out


def calibrate(make_engine, name: str, num: int, vocab: int) -> tuple[float, np.ndarray]:
    """(capacity in requests/s, fitted step-time coefficients) of a workload: its seed-0
    requests all there at the start, served FCFS (which ignores targets, so any units do).
    The step-time model fitted on those steps then prices every run's targets and plans."""
    engine = make_engine("fcfs")
    requests = [r for ev in workload(name, num, 0, vocab, Units.of(engine.cost)) for r in ev]
    return len(requests) / serve(engine, requests).wall, engine.cost.coef.copy()


def run_matrix(make_engine, vocab: int, num: int, seeds, workloads=WORKLOADS, loads=LOADS,
               on_result=None) -> dict:
    """{(workload, load, seed, policy): Outcome}. make_engine(policy) builds a fresh engine;
    each starts from the step-time model calibrate() fitted for the workload."""
    results = {}
    for name in workloads:
        cap, coef = calibrate(make_engine, name, num, vocab)
        for load, factor in loads.items():
            for seed in seeds:
                for policy in ("fcfs", "deadline"):
                    engine = make_engine(policy)
                    engine.cost.coef[:] = engine.cost.prior[:] = coef
                    events = workload(name, num, seed, vocab, Units.of(engine.cost))
                    outcome = serve(engine, with_arrivals(events, factor * cap, seed))
                    results[name, load, seed, policy] = outcome
                    if on_result:
                        on_result(name, load, seed, policy, outcome, cap)
    return results


def kind_table(results: dict) -> str:
    """Per workload, load and request kind: each policy's SLO attainment and TTFT / TPOT
    p50 / p99 over all seeds."""
    rows = ["| workload | load | kind | policy | SLO attained | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
            "|---|---|---|---|---|---|---|"]
    for name, load in _cells(results):
        kinds = sorted({k for (w, l, _, _), o in results.items() if (w, l) == (name, load) for k in o.met_by_kind})
        for kind in kinds:
            for policy in ("fcfs", "deadline"):
                runs = [o for (w, l, _, p), o in results.items() if (w, l, p) == (name, load, policy)]
                met = sum(o.met_by_kind.get(kind, (0, 0))[0] for o in runs)
                total = sum(o.met_by_kind.get(kind, (0, 0))[1] for o in runs)
                ttft = [t for o in runs for t in o.ttft.get(kind, [])]
                tpot = [t for o in runs for t in o.tpot.get(kind, [])]
                rows.append(f"| {name} | {load} | {kind} | {policy} | {100 * met / max(total, 1):.0f}% | "
                            f"{1e3 * percentile(ttft, 50):.0f} / {1e3 * percentile(ttft, 99):.0f} | "
                            f"{1e3 * percentile(tpot, 50):.0f} / {1e3 * percentile(tpot, 99):.0f} |")
    return "\n".join(rows)


def _cells(results: dict) -> list[tuple[str, str]]:
    """The (workload, load) pairs present, in WORKLOADS x LOADS order."""
    return sorted({k[:2] for k in results}, key=lambda k: (WORKLOADS.index(k[0]), list(LOADS).index(k[1])))


def matrix_table(results: dict) -> str:
    """Per workload and load: each policy's goodput (mean and range over seeds), SLO
    attainment, TTFT / TPOT p50 / p99 over all seeds, and attainment per request kind."""
    rows = ["| workload | load | policy | goodput req/s (mean, min-max over seeds) | SLO attained | "
            "TTFT p50 / p99 ms | TPOT p50 / p99 ms | attained by kind | late / dropped |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, load in _cells(results):
        for policy in ("fcfs", "deadline"):
            runs = [o for (w, l, _, p), o in results.items() if (w, l, p) == (name, load, policy)]
            good = [o.goodput for o in runs]
            met, total = sum(o.met for o in runs), sum(o.total for o in runs)
            ttft = [t for o in runs for ts in o.ttft.values() for t in ts]
            tpot = [t for o in runs for ts in o.tpot.values() for t in ts]
            kinds = {}
            for o in runs:
                for kind, (m, n) in o.met_by_kind.items():
                    a, b = kinds.get(kind, (0, 0))
                    kinds[kind] = (a + m, b + n)
            by_kind = ", ".join(f"{k} {100 * m / n:.0f}%" for k, (m, n) in sorted(kinds.items()))
            rows.append(
                f"| {name} | {load} | {policy} | {np.mean(good):.2f} ({min(good):.2f}-{max(good):.2f}) | "
                f"{100 * met / total:.0f}% | {1e3 * percentile(ttft, 50):.0f} / {1e3 * percentile(ttft, 99):.0f} | "
                f"{1e3 * percentile(tpot, 50):.0f} / {1e3 * percentile(tpot, 99):.0f} | {by_kind} | "
                f"{sum(o.late for o in runs)} / {sum(o.dropped for o in runs)} |")
    return "\n".join(rows)
