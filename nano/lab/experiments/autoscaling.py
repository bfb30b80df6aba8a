"""autoscaling: which signal says first that an engine needs help. Requests arrive at a rate
ramped from a quarter of the engine's measured capacity to twice it; after every step the
engine's own signals are read (telemetry.export.queue_state: queue depth in tokens; the KV pool's
occupancy), and, per time window, the fraction of wall time spent in steps (CPU busy) and
the TTFT of requests that got their first token in it. A signal alarms when it first
reaches half of its peak; docs/deadline-policy.md ("What to scale on") says queue depth in
tokens alarms before TTFT does, and CPU busy reads nearly full while the engine still keeps
up. Quick size: the simulated clock, full size: the real clock (nano/lab/timing.py)."""
import numpy as np

from nano.bench.workload import random_requests
from nano.lab.experiment import Experiment, Size, serve
from nano.lab.timing import clocked_engine
from nano.telemetry.export import queue_state
from nano.telemetry.metrics import metrics_of, ttft_of
from nano.telemetry.summary import percentile

RAMP = (0.25, 2.0)                  # offered rate at the start and the end, x capacity
SIGNALS = ("queue_tokens", "kv_occupancy", "cpu_busy", "ttft_p90_ms")
ALARM = 0.5                         # a signal alarms at this fraction of its peak


def settings(size: Size) -> dict:
    # A pool of about a dozen sequences of the workload, so that occupancy moves as load does.
    if size.quick:
        return dict(requests=80, calibration=24, input_len=(32, 256), output_len=(16, 64), num_blocks=160,
                    windows=24)
    return dict(requests=32, calibration=8, input_len=(16, 128), output_len=(8, 32), num_blocks=64, windows=16)


def requests(eng, n: int, s: dict, seed: int) -> list:
    prompts, params = random_requests(n, s["input_len"], s["output_len"], eng.model_config.vocab_size, seed=seed)
    return list(zip(prompts, params))


def offered(t: float, duration: float) -> float:
    """The offered rate t seconds in, x capacity: RAMP[0] growing linearly to RAMP[1] at duration."""
    return RAMP[0] + (RAMP[1] - RAMP[0]) * min(t / duration, 1.0)


def ramp_arrivals(n: int, capacity: float, seed: int) -> tuple[np.ndarray, float]:
    """Seconds after the start of n Poisson arrivals at the ramped rate, and the ramp's
    duration: the time n arrivals take on average."""
    duration = n / (capacity * sum(RAMP) / 2)
    rng, t, times = np.random.default_rng(seed + 1), 0.0, []
    for _ in range(n):
        t += rng.exponential(1.0) / (capacity * offered(t, duration))
        times.append(t)
    return np.array(times), duration


def run(size: Size) -> list[dict]:
    s = settings(size)
    knobs = dict(num_blocks=s["num_blocks"])
    eng = clocked_engine(size, **knobs)
    start = eng.clock.now()
    serve(eng, requests(eng, s["calibration"], s, size.seed + 100))
    capacity = s["calibration"] / (eng.clock.now() - start)   # requests/s, all there at once

    eng = clocked_engine(size, **knobs)
    arrivals, duration = ramp_arrivals(s["requests"], capacity, size.seed)
    start = eng.clock.now()
    seqs = [eng.add_request(p, sp, start + t) for (p, sp), t in zip(requests(eng, s["requests"], s, size.seed),
                                                                    arrivals)]
    samples = []  # (seconds since start, queue tokens, KV occupancy) after each step
    while eng.has_unfinished():
        eng.step()
        now = eng.clock.now()
        num_blocks, free, _, _ = eng.kv_blocks()
        samples.append((now - start, queue_state(eng, now).queue_tokens, 1 - free / num_blocks))
    end = samples[-1][0]
    edges = np.linspace(0, end, s["windows"] + 1)
    steps = np.array([(a - start, b - start) for a, b, _, _ in metrics_of(eng).step_log])
    samples = np.array(samples)
    first = np.array([q.first_token_time - start for q in seqs])
    ttft = np.array([ttft_of(q) for q in seqs])
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (samples[:, 0] >= lo) & (samples[:, 0] < hi)
        busy = np.clip(np.minimum(steps[:, 1], hi) - np.maximum(steps[:, 0], lo), 0, None).sum()
        mid = (lo + hi) / 2
        got = ttft[(first >= lo) & (first < hi)]
        rows.append({"t_s": round(mid, 3), "offered_x_capacity": offered(mid, duration) if mid <= arrivals[-1] else 0.0,
                     "arrivals": int(((arrivals >= lo) & (arrivals < hi)).sum()),
                     "queue_tokens": float(samples[inside, 1].mean()) if inside.any() else 0.0,
                     "kv_occupancy": float(samples[inside, 2].mean()) if inside.any() else 0.0,
                     "cpu_busy": float(busy / (hi - lo)),
                     "ttft_p90_ms": 1e3 * percentile(list(got), 90) if len(got) else 0.0,
                     "capacity_rps": capacity})
    return rows


def alarms(rows: list[dict]) -> dict[str, float]:
    """When each signal first reaches ALARM of its peak (seconds), and when the offered rate
    first passes capacity."""
    out = {}
    for name in SIGNALS:
        values = np.array([r[name] for r in rows])
        out[name] = next(r["t_s"] for r, v in zip(rows, values) if v >= ALARM * values.max())
    out["overload"] = next((r["t_s"] for r in rows if r["offered_x_capacity"] >= 1.0), rows[-1]["t_s"])
    return out


def plot(rows: list[dict], fig) -> None:
    t = [r["t_s"] for r in rows]
    when = alarms(rows)
    axes = fig.subplots(1, len(SIGNALS), sharex=True)
    titles = {"queue_tokens": "queue depth (tokens)", "kv_occupancy": "KV occupancy",
              "cpu_busy": "CPU busy (time in steps)", "ttft_p90_ms": "TTFT p90 (ms), by first token"}
    for ax, name in zip(axes, SIGNALS):
        ax.plot(t, [r[name] for r in rows], marker=".", color="tab:blue")
        ax.axvline(when[name], color="tab:red", linestyle=":", label=f"alarm {when[name]:.1f} s")
        ax.axvline(when["overload"], color="grey", linestyle="--", label=f"rate = capacity {when['overload']:.1f} s")
        ax.set_title(titles[name], fontsize=9)
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7, loc="upper left")
        rate = ax.twinx()
        rate.plot(t, [r["offered_x_capacity"] for r in rows], color="grey", alpha=0.4)
        rate.tick_params(labelsize=7, colors="grey")
    rate.set_ylabel("offered rate, x capacity", color="grey", fontsize=8)


def check(rows: list[dict]) -> str | None:
    when = alarms(rows)
    if not when["queue_tokens"] < when["ttft_p90_ms"]:
        return f"queue depth alarmed at {when['queue_tokens']:.1f} s, TTFT at {when['ttft_p90_ms']:.1f} s"
    calm = [r["cpu_busy"] for r in rows if 0 < r["offered_x_capacity"] < 1.0 and r["t_s"] < when["queue_tokens"]]
    if not calm or max(calm) < 0.8:
        return f"CPU busy stayed below 80% while the engine kept up (at most {max(calm, default=0):.0%})"
    return None


EXPERIMENT = Experiment(
    name="autoscaling",
    claim="As the request rate passes capacity, queue depth in tokens rises before TTFT does, "
          "while CPU busy reads nearly full even below capacity: scale on the queue (and KV occupancy), "
          "not on utilisation or latency.",
    varies=f"offered request rate, ramped from {RAMP[0]}x to {RAMP[1]}x the measured capacity over the run",
    fixed="seeded random requests (quick: prompts 32-256, outputs 16-64 tokens, a KV pool of 160 blocks; "
          "full: 16-128, 8-32, 64 blocks), FCFS",
    measures="per time window: queue depth in tokens, KV occupancy, CPU busy, TTFT p90; when each first "
             "reaches half its peak",
    run=run, plot=plot, check=check)
