"""What the engine measures: latency per request, and what each step did to the KV pool."""
from collections import Counter

import numpy as np

from nano.scheduler import SchedulerOutput
from nano.sequence import Sequence


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Metrics:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.requests = 0
        self.rejected = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft: list[float] = []          # seconds, arrival -> first token
        self.tpot: list[float] = []          # seconds per output token after the first
        self.preemptions: Counter[str] = Counter()         # by mode: swap / recompute
        self.preemption_reasons: Counter[str] = Counter()  # "swap:swap_cheaper", ...
        self.prefix_queried = 0              # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                 # of those, found cached
        self.peak_kv_occupancy = 0.0
        self.steps = 0
        self.step_time = 0.0
        self.swap_bytes = 0
        self.all_reduce_time = 0.0           # tensor parallelism: rank 0's all-reduces
        self.all_reduce_bytes = 0

    def on_step(self, plan: SchedulerOutput, seconds: float, free_blocks: int, swap_bytes: int,
                all_reduce_seconds: float = 0.0, all_reduce_bytes: int = 0) -> None:
        self.steps += 1
        self.step_time += seconds
        self.swap_bytes += swap_bytes
        self.all_reduce_time += all_reduce_seconds
        self.all_reduce_bytes += all_reduce_bytes
        self.peak_kv_occupancy = max(self.peak_kv_occupancy, 1 - free_blocks / self.num_blocks)
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
            return
        self.prompt_tokens += seq.num_prompt_tokens
        self.generated_tokens += seq.num_output_tokens
        if seq.first_token_time is not None:
            self.ttft.append(seq.first_token_time - seq.arrival_time)
        if seq.num_output_tokens > 1:
            self.tpot.append((seq.token_times[-1] - seq.first_token_time) / (seq.num_output_tokens - 1))

    def summary(self, wall: float) -> dict:
        return {
            "requests": self.requests,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "wall_s": wall,
            "output_tokens_per_s": self.generated_tokens / wall if wall else 0.0,
            "total_tokens_per_s": (self.prompt_tokens + self.generated_tokens) / wall if wall else 0.0,
            "ttft_p50_ms": 1e3 * percentile(self.ttft, 50),
            "ttft_p99_ms": 1e3 * percentile(self.ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(self.tpot, 50),
            "tpot_p99_ms": 1e3 * percentile(self.tpot, 99),
            "preemptions_swap": self.preemptions["swap"],
            "preemptions_recompute": self.preemptions["recompute"],
            "preemption_reasons": dict(self.preemption_reasons),
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queried if self.prefix_queried else 0.0,
            "peak_kv_occupancy": self.peak_kv_occupancy,
            "steps": self.steps,
            "mean_step_ms": 1e3 * self.step_time / self.steps if self.steps else 0.0,
            "all_reduce_ms_per_step": 1e3 * self.all_reduce_time / self.steps if self.steps else 0.0,
            "all_reduce_bytes_per_step": self.all_reduce_bytes / self.steps if self.steps else 0.0,
        }


def format_summary(s: dict) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["preemption_reasons"].items())) or "none"
    return "\n".join([
        f"requests            {s['requests']} ({s['rejected']} rejected)",
        f"tokens              {s['prompt_tokens']} prompt, {s['generated_tokens']} generated",
        f"wall time           {s['wall_s']:.2f} s",
        f"throughput          {s['output_tokens_per_s']:.1f} output tok/s, {s['total_tokens_per_s']:.1f} total tok/s",
        f"TTFT                p50 {s['ttft_p50_ms']:.1f} ms, p99 {s['ttft_p99_ms']:.1f} ms",
        f"time per out token  p50 {s['tpot_p50_ms']:.1f} ms, p99 {s['tpot_p99_ms']:.1f} ms",
        f"preemptions         {s['preemptions_swap']} swap, {s['preemptions_recompute']} recompute ({reasons})",
        f"prefix cache hits   {100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens",
        f"peak KV occupancy   {100 * s['peak_kv_occupancy']:.1f}%",
        f"steps               {s['steps']}, mean {s['mean_step_ms']:.1f} ms",
    ] + ([  # tensor parallelism only; the time includes waiting for the slowest rank
        f"all-reduce          {s['all_reduce_ms_per_step']:.1f} ms and "
        f"{s['all_reduce_bytes_per_step'] / 1e6:.2f} MB per step (mean, rank 0)",
    ] if s["all_reduce_bytes_per_step"] else []))
