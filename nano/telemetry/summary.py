"""The end of a run: what the engine measured (metrics.py), summed up (summarize) and
printed (format_summary); the --summary-json file holds the same dict."""
import numpy as np

from nano.telemetry.metrics import Metrics


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(m: Metrics, wall: float) -> dict:
    """The run's figures from what the engine measured over wall seconds."""
    per_step = 1 / m.steps if m.steps else 0.0
    return {
        "requests": m.requests,
        "rejected": m.rejected,
        "prompt_tokens": m.prompt_tokens,
        "generated_tokens": m.generated_tokens,
        "wall_s": wall,
        "output_tokens_per_s": m.generated_tokens / wall if wall else 0.0,
        "total_tokens_per_s": (m.prompt_tokens + m.generated_tokens) / wall if wall else 0.0,
        **{f"ttft_p{q}_ms": 1e3 * percentile(m.ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_ms": 1e3 * percentile(m.tpot, q) for q in (50, 90, 99)},
        "slo_attainment": m.slo_met / m.requests if m.requests else 0.0,
        "served_late": m.served_late,
        "rejected_late": m.rejected_late,
        "goodput_rps": m.slo_met / wall if wall else 0.0,
        "preemptions_swap": m.preemptions["swap"],
        "preemptions_recompute": m.preemptions["recompute"],
        "preemption_reasons": dict(m.preemption_reasons),
        "prefix_cache_hit_rate": m.prefix_hits / m.prefix_queried if m.prefix_queried else 0.0,
        "peak_kv_occupancy": m.peak_kv_occupancy,
        "peak_running": m.peak_running,
        "steps": m.steps,
        "mean_step_ms": 1e3 * m.step_time * per_step,
        "decode_steps": m.decode_steps,
        "mean_decode_step_ms": 1e3 * m.decode_time / m.decode_steps if m.decode_steps else 0.0,
        "mean_decode_kv_tokens": m.decode_kv_tokens / m.decode_steps if m.decode_steps else 0.0,
        "all_reduce_ms_per_step": 1e3 * m.all_reduce_time * per_step,
        "all_reduce_bytes_per_step": m.all_reduce_bytes * per_step,
        **speculative(m.spec_drafts, m.spec_draft_tokens, m.spec_accepted, m.spec_accepted_per_pos),
    }


def speculative(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> dict:
    """Speculative decoding's figures, when it ran (else none): vLLM's counts, the acceptance
    rate (accepted / draft tokens) and the mean acceptance length (1 + accepted / drafts: the
    tokens a sequence gains per step it checks drafts in)."""
    if not drafts:
        return {}
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted, "spec_decode_num_accepted_tokens_per_pos": list(per_pos),
            "spec_decode_acceptance_rate": accepted / draft_tokens,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts}


def merge_speculative(summaries: list[dict]) -> dict:
    """speculative()'s figures over several engines' summaries (instances, replicas)."""
    per_pos: list[int] = []
    for s in summaries:
        mine = s.get("spec_decode_num_accepted_tokens_per_pos", [])
        per_pos = [a + b for a, b in zip(per_pos + [0] * len(mine), mine + [0] * len(per_pos))]
    return speculative(*(sum(s.get(f"spec_decode_num_{key}", 0) for s in summaries)
                         for key in ("drafts", "draft_tokens", "accepted_tokens")), per_pos)


def format_summary(s: dict) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["preemption_reasons"].items())) or "none"
    return "\n".join([
        f"requests            {s['requests']} ({s['rejected']} rejected)",
        f"tokens              {s['prompt_tokens']} prompt, {s['generated_tokens']} generated",
        f"wall time           {s['wall_s']:.2f} s",
        f"throughput          {s['output_tokens_per_s']:.1f} output tok/s, {s['total_tokens_per_s']:.1f} total tok/s",
        f"TTFT                p50 {s['ttft_p50_ms']:.1f} ms, p90 {s['ttft_p90_ms']:.1f} ms, p99 {s['ttft_p99_ms']:.1f} ms",
        f"time per out token  p50 {s['tpot_p50_ms']:.1f} ms, p90 {s['tpot_p90_ms']:.1f} ms, p99 {s['tpot_p99_ms']:.1f} ms",
        f"SLO attainment      {100 * s['slo_attainment']:.1f}% of requests, goodput {s['goodput_rps']:.2f} req/s; "
        f"{s['served_late']} served late, {s['rejected_late']} rejected as late",
        f"preemptions         {s['preemptions_swap']} swap, {s['preemptions_recompute']} recompute ({reasons})",
        f"prefix cache hits   {100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens",
        f"peak KV occupancy   {100 * s['peak_kv_occupancy']:.1f}%, {s['peak_running']} sequences in one step",
        f"steps               {s['steps']}, mean {s['mean_step_ms']:.1f} ms",
    ] + ([  # tensor parallelism only; the time includes waiting for the slowest rank
        f"all-reduce          {s['all_reduce_ms_per_step']:.1f} ms and "
        f"{s['all_reduce_bytes_per_step'] / 1e6:.2f} MB per step (mean, rank 0)",
    ] if s["all_reduce_bytes_per_step"] else []) + ([
        f"speculative decoding {100 * s['spec_decode_acceptance_rate']:.1f}% of "
        f"{s['spec_decode_num_draft_tokens']} draft tokens accepted, mean acceptance length "
        f"{s['spec_decode_mean_acceptance_length']:.2f} ({s['spec_decode_num_drafts']} drafts)",
    ] if s.get("spec_decode_num_drafts") else []))
