"""A disaggregated run's figures (serving.py): the usual summary over every request's result,
the step figures summed over the instances, and what only this mode has: the KV handoffs,
each pool's busy time, queue and occupancy, and how much prefill slowed decoding; each
pool's signals for Prometheus (PoolExport)."""
import numpy as np
from prometheus_client import Counter, Gauge

from nano.telemetry.metrics import Metrics, ttft_of
from nano.telemetry.prometheus import Export
from nano.telemetry.summary import merge_speculative, percentile, summarize


def summary(router, wall: float) -> dict:
    """Metrics.summary over every request's result, with the step figures (preemptions,
    prefix cache, steps) summed over the instances, plus the disaggregated figures."""
    metrics = Metrics(1)
    for seq in router.results.values():
        metrics.on_finish(seq)
    s = summarize(metrics, wall)
    reports = list(router.reports.values())
    prefill = [r.summary for r in reports if r.rank in router.prefill]
    decode = [r.summary for r in reports if r.rank in router.decode]
    every = prefill + decode
    s["preemptions_swap"] = sum(r["preemptions_swap"] for r in every)
    s["preemptions_recompute"] = sum(r["preemptions_recompute"] for r in every)
    s["preemption_reasons"] = {k: sum(r["preemption_reasons"].get(k, 0) for r in every)
                               for k in {k for r in every for k in r["preemption_reasons"]}}
    s["prefix_cache_hit_rate"] = float(np.mean([r["prefix_cache_hit_rate"] for r in prefill]))
    s["peak_kv_occupancy"] = max(r["peak_kv_occupancy"] for r in every)
    s["peak_running"] = max(r["peak_running"] for r in decode)
    s["steps"] = sum(r["steps"] for r in every)
    s.update(merge_speculative(every))
    s["mean_step_ms"] = sum(r["mean_step_ms"] * r["steps"] for r in every) / max(s["steps"], 1)
    s["decode_steps"] = sum(r["decode_steps"] for r in decode)
    s["mean_decode_step_ms"] = (sum(r["mean_decode_step_ms"] * r["decode_steps"] for r in decode)
                                / max(s["decode_steps"], 1))
    s["mean_decode_kv_tokens"] = (sum(r["mean_decode_kv_tokens"] * r["decode_steps"] for r in decode)
                                  / max(s["decode_steps"], 1))
    transfers = list(router.handoffs.values())
    s["handoffs"] = len(transfers)
    for key in ("bytes", "pack_s", "receive_s", "handoff_s"):
        s[f"kv_{key}_mean"] = float(np.mean([t[key] for t in transfers])) if transfers else 0.0
    ttft = [ttft_of(q) for q in router.results.values() if ttft_of(q) is not None]
    s["kv_transfer_fraction_of_ttft"] = ((s["kv_pack_s_mean"] + s["kv_receive_s_mean"]) / np.mean(ttft)
                                         if transfers and ttft else 0.0)
    for name, ranks in (("prefill", router.prefill), ("decode", router.decode)):
        busy = sum(r.summary["steps"] * r.summary["mean_step_ms"] / 1e3 for r in reports if r.rank in ranks)
        s[f"{name}_busy"] = busy / (len(ranks) * wall) if wall else 0.0  # of the instances' time, in steps
        samples = np.array(router.pool_samples[name] or [(0, 0.0)])
        s[f"{name}_queue_tokens_mean"], s[f"{name}_kv_occupancy_mean"] = samples.mean(axis=0)
        s[f"{name}_queue_tokens_peak"], s[f"{name}_kv_occupancy_peak"] = samples.max(axis=0)
    s["blocks_in_use_at_end"] = {r.rank: (r.used_blocks, r.used_swap_blocks) for r in reports}
    s.update(decode_interference([(r.steps, r.stalls) for r in reports if r.rank in router.decode],
                                 [(a, b) for r in reports if r.rank in router.prefill for a, b, p, _ in r.steps if p]))
    return s


def format_disagg(s: dict) -> str:
    leaked = {r: u for r, u in s["blocks_in_use_at_end"].items() if u != (0, 0)}
    return "\n".join([
        f"KV handoffs         {s['handoffs']}, mean {s['kv_bytes_mean'] / 1e6:.2f} MB; pack "
        f"{1e3 * s['kv_pack_s_mean']:.1f} ms + receive {1e3 * s['kv_receive_s_mean']:.1f} ms "
        f"({100 * s['kv_transfer_fraction_of_ttft']:.1f}% of mean TTFT); first token to decode-side "
        f"admission {1e3 * s['kv_handoff_s_mean']:.1f} ms",
        f"decode slowdown     {format_slowdown(s)}",
        *(f"{name} pool{' ' * (11 - len(name))}busy {100 * s[f'{name}_busy']:.0f}%; "
          f"queue {s[f'{name}_queue_tokens_mean']:.0f} tokens mean, "
          f"{s[f'{name}_queue_tokens_peak']:.0f} peak; KV occupancy {100 * s[f'{name}_kv_occupancy_mean']:.1f}% "
          f"mean, {100 * s[f'{name}_kv_occupancy_peak']:.1f}% peak" for name in ("prefill", "decode")),
        "blocks in use at end " + ("none (no leaks)" if not leaked else
                                   ", ".join(f"rank {r}: {u[0]} device, {u[1]} swap" for r, u in leaked.items())),
    ])


def format_slowdown(s: dict) -> str:
    """decode_interference's figures in a line."""
    return (f"steps during prefill {s['decode_slowdown_prefill_p50']:.2f}x / {s['decode_slowdown_prefill_p99']:.2f}x "
            f"(p50 / p99, {s['decode_steps_during_prefill']} steps), with none {s['decode_slowdown_quiet_p50']:.2f}x / "
            f"{s['decode_slowdown_quiet_p99']:.2f}x ({s['decode_steps_quiet']}) the time of a no-prefill step "
            f"of as many decodes")


def decode_interference(decoders, prefill_spans=()) -> dict:
    """How much prefill slows decoding. decoders: per engine that decodes, (steps, stalls):
    its step_log, and (start, end) spans of work it did between steps for its decodes' sake
    (a KV handoff received). prefill_spans: (start, end) of steps with prompt tokens on
    other engines. Each step that decodes is timed (plus the stalls since its engine's
    previous step) against the median step with the same number of decodes and no prefill
    anywhere ("quiet"): a ratio of 1.0 is a step prefill did not touch. A step is "during
    prefill" when it carried prompt tokens itself (colocated), overlapped a prefill span,
    or followed a stall. Returns p50 / p99 of the ratio for both kinds."""
    spans = np.array(sorted(prefill_spans), dtype=np.float64).reshape(-1, 2)
    reach = np.maximum.accumulate(spans[:, 1]) if len(spans) else spans[:, 1]
    kinds = []  # (decodes, seconds, during prefill) per decoding step
    for steps, stalls in decoders:
        # An engine's stalls do not overlap: sorted by start they are sorted by end too, and
        # those between two steps are a run of them, summed from their running total.
        stalls = np.array(sorted(stalls), dtype=np.float64).reshape(-1, 2)
        total = np.concatenate([[0.0], np.cumsum(stalls[:, 1] - stalls[:, 0])])
        previous_end = -np.inf
        for start, end, prompt_tokens, decodes in sorted(steps):
            lo, hi = np.searchsorted(stalls[:, 0], previous_end), np.searchsorted(stalls[:, 1], start, side="right")
            stall = float(total[hi] - total[lo]) if hi > lo else 0.0
            previous_end = end
            if not decodes:
                continue
            i = np.searchsorted(spans[:, 0], end)  # spans starting before this step ends
            overlap = bool(i) and reach[i - 1] > start
            kinds.append((decodes, end - start + stall, bool(prompt_tokens or overlap or stall)))
    quiet = {}
    for decodes, seconds, busy in kinds:
        if not busy:
            quiet.setdefault(decodes, []).append(seconds)
    base = {b: float(np.median(t)) for b, t in quiet.items()}
    ratios = {True: [], False: []}
    for decodes, seconds, busy in kinds:
        if decodes in base:
            ratios[busy].append(seconds / base[decodes])
    out = {"decode_steps_during_prefill": len(ratios[True]), "decode_steps_quiet": len(ratios[False])}
    for name, busy in (("prefill", True), ("quiet", False)):
        for q in (50, 99):
            out[f"decode_slowdown_{name}_p{q}"] = percentile(ratios[busy], q)
    return out


class PoolExport(Export):
    """A disaggregated run's Prometheus metrics, updated from the router's snapshots
    (Router.pools): each pool's signals, labelled pool, and the requests counted."""

    def __init__(self, model_name: str):
        super().__init__(model_name)
        self.gauges = {key: self.metric(Gauge, name, help_text, ["pool"]) for key, name, help_text in (
            ("instances", "nano_pool_instances", "Instances in the pool."),
            ("queue_depth_tokens", "nano_pool_queue_depth_tokens", "Prefill: prompt tokens not yet computed; "
                                                                   "decode: output tokens still to generate."),
            ("kv_occupancy", "nano_pool_kv_cache_usage_perc", "The pool's KV-cache usage. 1 means 100 percent."))}
        self.counters = {"arrived": self.metric(Counter, "nano_requests_arrived", "Requests that have arrived."),
                         "finished": self.metric(Counter, "nano_requests_finished", "Requests ended (any way).")}
        self.seen = dict.fromkeys(self.counters, 0)

    def update(self, snap: dict) -> None:
        for pool, values in snap["pools"].items():
            for key, gauge in self.gauges.items():
                gauge(pool=pool).set(values[key])
        for key, counter in self.counters.items():  # the router's counts only grow
            counter.inc(snap[key] - self.seen[key])
            self.seen[key] = snap[key]
