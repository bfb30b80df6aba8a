"""What the engine measures: latency per request, what each step did to the KV pool, and
the snapshots an autoscaler reads (--metrics-file JSONL, --metrics-prom Prometheus text)."""
import json
import os
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from nano.errors import writing
from nano.plan import SchedulerOutput, decode_context
from nano.policy import LATE
from nano.sequence import Sequence

STEP_LOG = 100_000  # steps kept in Metrics.step_log: 3 MB

# Latency histogram bucket bounds in seconds (Prometheus style: cumulative, then +Inf).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def histogram(values: list[float]) -> list[int]:
    """Cumulative counts per bucket bound, then the total (+Inf)."""
    counts = np.searchsorted(np.sort(values), BUCKETS, side="right").tolist() if values else [0] * len(BUCKETS)
    return counts + [len(values)]


@dataclass
class QueueState:
    """The scheduler's queues at one instant (arrived requests only)."""
    arrived: int
    running: int
    waiting: int
    swapped: int
    queue_tokens: int   # waiting prompt tokens + remaining output tokens of everything unfinished


class Metrics:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.requests = 0                    # finished, rejected included
        self.rejected = 0
        self.slo_met = 0                     # finished within both latency targets
        self.served_late = 0                 # finished, but missed a latency target
        self.rejected_late = 0               # rejected because they could no longer make it (--drop-late)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft: list[float] = []          # seconds, arrival -> first token
        self.tpot: list[float] = []          # seconds per output token after the first
        self.preemptions: Counter[str] = Counter()         # by mode: swap / recompute
        self.preemption_reasons: Counter[str] = Counter()  # "swap:swap_cheaper", ...
        self.prefix_queried = 0              # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                 # of those, found cached
        self.kv_occupancy = 0.0
        self.peak_kv_occupancy = 0.0
        self.peak_running = 0                # most sequences in one step
        self.steps = 0
        self.step_time = 0.0
        self.last_step_time = 0.0
        self.decode_steps = 0                # steps with only decodes: compared to the bandwidth floor
        self.decode_time = 0.0
        self.decode_kv_tokens = 0            # cached tokens those steps read
        self.swap_bytes = 0
        self.all_reduce_time = 0.0           # tensor parallelism: rank 0's all-reduces
        self.all_reduce_bytes = 0
        # (start, end, prompt tokens, decodes) of the latest steps, for end-of-run analyses
        # (how much prefill slows decodes); bounded, as a server's run has no end
        self.step_log: deque[tuple[float, float, int, int]] = deque(maxlen=STEP_LOG)

    def on_step(self, plan: SchedulerOutput, seconds: float, free_blocks: int, swap_bytes: int,
                all_reduce_seconds: float = 0.0, all_reduce_bytes: int = 0) -> None:
        self.steps += 1
        self.step_time += seconds
        self.last_step_time = seconds
        decodes = plan.decodes()
        if decodes and len(decodes) == len(plan.scheduled):  # a decode-only step
            self.decode_steps += 1
            self.decode_time += seconds
            self.decode_kv_tokens += decode_context(decodes)
        self.swap_bytes += swap_bytes
        self.all_reduce_time += all_reduce_seconds
        self.all_reduce_bytes += all_reduce_bytes
        self.kv_occupancy = 1 - free_blocks / self.num_blocks
        self.peak_kv_occupancy = max(self.peak_kv_occupancy, self.kv_occupancy)
        self.peak_running = max(self.peak_running, len(plan.scheduled))
        for p in plan.preempted:
            self.preemptions[p.mode] += 1
            self.preemption_reasons[f"{p.mode}:{p.reason}"] += 1
        for seq in plan.admitted:
            self.prefix_queried += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens

    def on_finish(self, seq: Sequence) -> None:
        self.requests += 1
        if seq.finish_reason == "rejected":
            self.rejected += 1
            self.rejected_late += bool(seq.error and seq.error.startswith(LATE))
            return
        self.served_late += not seq.met_slo()
        self.prompt_tokens += seq.num_prompt_tokens
        self.generated_tokens += seq.num_output_tokens
        self.slo_met += seq.met_slo()
        if seq.ttft is not None:
            self.ttft.append(seq.ttft)
        if seq.tpot is not None:
            self.tpot.append(seq.tpot)

    # ---- end of run -------------------------------------------------------------------------
    def summary(self, wall: float) -> dict:
        per_step = 1 / self.steps if self.steps else 0.0
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "wall_s": wall,
            "output_tokens_per_s": self.generated_tokens / wall if wall else 0.0,
            "total_tokens_per_s": (self.prompt_tokens + self.generated_tokens) / wall if wall else 0.0,
            **{f"ttft_p{q}_ms": 1e3 * percentile(self.ttft, q) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": 1e3 * percentile(self.tpot, q) for q in (50, 90, 99)},
            "slo_attainment": self.slo_met / self.requests if self.requests else 0.0,
            "served_late": self.served_late,
            "rejected_late": self.rejected_late,
            "goodput_rps": self.slo_met / wall if wall else 0.0,
            "preemptions_swap": self.preemptions["swap"],
            "preemptions_recompute": self.preemptions["recompute"],
            "preemption_reasons": dict(self.preemption_reasons),
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queried if self.prefix_queried else 0.0,
            "peak_kv_occupancy": self.peak_kv_occupancy,
            "peak_running": self.peak_running,
            "steps": self.steps,
            "mean_step_ms": 1e3 * self.step_time * per_step,
            "decode_steps": self.decode_steps,
            "mean_decode_step_ms": 1e3 * self.decode_time / self.decode_steps if self.decode_steps else 0.0,
            "mean_decode_kv_tokens": self.decode_kv_tokens / self.decode_steps if self.decode_steps else 0.0,
            "all_reduce_ms_per_step": 1e3 * self.all_reduce_time * per_step,
            "all_reduce_bytes_per_step": self.all_reduce_bytes * per_step,
        }

    # ---- snapshots for autoscaling ------------------------------------------------------------
    def snapshot(self, now: float, queues: QueueState) -> dict:
        return {
            "time": now, "step": self.steps,
            "arrived": queues.arrived, "finished": self.requests - self.rejected,
            "running": queues.running, "waiting": queues.waiting, "swapped": queues.swapped,
            "rejected": self.rejected,
            "queue_depth_tokens": queues.queue_tokens,
            "kv_occupancy": self.kv_occupancy,
            "ttft_histogram": histogram(self.ttft), "tpot_histogram": histogram(self.tpot),
            "preemptions": {"swap": self.preemptions["swap"], "recompute": self.preemptions["recompute"]},
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queried if self.prefix_queried else 0.0,
            "step_time": self.last_step_time,
            "mean_step_time": self.step_time / self.steps if self.steps else 0.0,
            "ttft_sum": float(sum(self.ttft)), "tpot_sum": float(sum(self.tpot)),
        }


def prometheus_text(snap: dict) -> str:
    """One snapshot in the Prometheus text exposition format."""
    lines = []

    def metric(name, kind, help_text, samples):
        lines.extend([f"# HELP nano_{name} {help_text}", f"# TYPE nano_{name} {kind}"])
        lines.extend(f"nano_{name}{labels} {value}" for labels, value in samples)

    metric("requests_arrived_total", "counter", "Requests that have arrived.", [("", snap["arrived"])])
    metric("requests_finished_total", "counter", "Requests finished (not rejected).", [("", snap["finished"])])
    metric("requests_rejected_total", "counter", "Requests rejected.", [("", snap["rejected"])])
    for state in ("running", "waiting", "swapped"):
        metric(f"requests_{state}", "gauge", f"Requests {state} now.", [("", snap[state])])
    metric("queue_depth_tokens", "gauge", "Waiting prompt tokens plus remaining output tokens.",
           [("", snap["queue_depth_tokens"])])
    metric("kv_cache_occupancy", "gauge", "Fraction of KV blocks in use.", [("", snap["kv_occupancy"])])
    metric("preemptions_total", "counter", "Preemptions by kind.",
           [(f'{{kind="{k}"}}', v) for k, v in snap["preemptions"].items()])
    metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache.",
           [("", snap["prefix_cache_hit_rate"])])
    metric("step_seconds", "gauge", "Duration of the last engine step.", [("", snap["step_time"])])
    for name, key in (("time_to_first_token_seconds", "ttft"), ("time_per_output_token_seconds", "tpot")):
        counts = snap[f"{key}_histogram"]
        bounds = [str(b) for b in BUCKETS] + ["+Inf"]
        metric(name, "histogram", f"Request {name.replace('_', ' ')}.",
               [(f'_bucket{{le="{b}"}}', c) for b, c in zip(bounds, counts)]
               + [("_sum", snap[f"{key}_sum"]), ("_count", counts[-1])])
    return "\n".join(lines) + "\n"


class MetricsWriter:
    """Appends snapshots to a JSONL file and/or rewrites a Prometheus text file (atomically,
    for a node exporter's textfile collector to pick up)."""

    def __init__(self, jsonl_path: str | None, prom_path: str | None, prom_text=None):
        self.jsonl_path, self.prom_path = jsonl_path, prom_path
        self.prom_text = prom_text or prometheus_text
        if jsonl_path:  # a new run starts a new file
            with writing(jsonl_path):
                open(jsonl_path, "w", encoding="utf-8").close()

    def write(self, snap: dict) -> None:
        if self.jsonl_path:  # opened per snapshot: nothing is left open for anyone to close
            with writing(self.jsonl_path), open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(snap) + "\n")
        if self.prom_path:
            tmp = self.prom_path + ".tmp"
            with writing(self.prom_path):
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(self.prom_text(snap))
                os.replace(tmp, self.prom_path)
