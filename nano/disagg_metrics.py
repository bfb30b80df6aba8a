"""A disaggregated run's figures (disagg.py): the usual summary over every request's result,
the step figures summed over the instances, and what only this mode has: the KV handoffs,
each pool's busy time, queue and occupancy, and how much prefill slowed decoding."""
import numpy as np

from nano.metrics import Metrics, decode_interference


def summary(router, wall: float) -> dict:
    """Metrics.summary over every request's result, with the step figures (preemptions,
    prefix cache, steps) summed over the instances, plus the disaggregated figures."""
    metrics = Metrics(1)
    for seq in router.results.values():
        metrics.on_finish(seq)
    s = metrics.summary(wall)
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
    s["mean_step_ms"] = sum(r["mean_step_ms"] * r["steps"] for r in every) / max(s["steps"], 1)
    s["decode_steps"] = sum(r["decode_steps"] for r in decode)
    s["mean_decode_step_ms"] = (sum(r["mean_decode_step_ms"] * r["decode_steps"] for r in decode)
                                / max(s["decode_steps"], 1))
    s["mean_decode_kv_tokens"] = (sum(r["mean_decode_kv_tokens"] * r["decode_steps"] for r in decode)
                                  / max(s["decode_steps"], 1))
    transfers = [q.kv_transfer for q in router.results.values() if q.kv_transfer]
    s["handoffs"] = len(transfers)
    for key in ("bytes", "pack_s", "receive_s", "handoff_s"):
        s[f"kv_{key}_mean"] = float(np.mean([t[key] for t in transfers])) if transfers else 0.0
    ttft = [q.ttft for q in router.results.values() if q.ttft is not None]
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
