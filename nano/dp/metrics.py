"""A data-parallel run's figures: the usual summary over every request's result (the total),
and per replica what it was sent and did; the replicas' signals for Prometheus, one series
per replica under an `engine` label (as vLLM labels its engines)."""
import numpy as np
from prometheus_client import Counter, Gauge

from nano.telemetry.metrics import Metrics, ttft_of
from nano.telemetry.prometheus import LABELS, Export
from nano.telemetry.summary import merge_speculative, percentile, summarize


def prefill_tokens(report) -> int:
    """Prompt tokens a replica computed (cache hits are not computed; a recompute is, again)."""
    return sum(prefill for _, _, prefill, _ in report.steps)


def summary(router, wall: float) -> dict:
    """summarize() over every result, the step figures summed over the replicas, and each
    replica's own figures under "replicas"."""
    metrics = Metrics(1)
    for seq in router.results.values():
        metrics.on_finish(seq)
    s = summarize(metrics, wall)
    reports = [router.reports[r] for r in router.ranks]
    for key in ("preemptions_swap", "preemptions_recompute", "steps", "decode_steps"):
        s[key] = sum(r.summary[key] for r in reports)
    s["mean_step_ms"] = sum(r.summary["mean_step_ms"] * r.summary["steps"] for r in reports) / max(s["steps"], 1)
    s["peak_kv_occupancy"] = max(r.summary["peak_kv_occupancy"] for r in reports)
    s["peak_running"] = max(r.summary["peak_running"] for r in reports)
    s.update(merge_speculative([r.summary for r in reports]))
    seqs = list(router.results.values())
    prompt = sum(q.num_prompt_tokens for q in seqs)
    s["prefix_cache_hit_rate"] = sum(q.num_cached_tokens for q in seqs) / prompt if prompt else 0.0
    s["prefill_tokens"] = sum(prefill_tokens(r) for r in reports)
    s["policy"] = router.policy.name
    s["replicas"] = {}
    for r, report in zip(router.ranks, reports):
        mine = [q for q in seqs if router.replica_of.get(q.seq_id) == r]
        samples = np.array(router.samples[r] or [(0, 0.0)])
        s["replicas"][r] = {
            "requests": len(mine), "prefill_tokens": prefill_tokens(report),
            "prefix_cache_hit_rate": report.summary["prefix_cache_hit_rate"],
            "expected_hit_blocks": router.expected_hits[r],
            "ttft_p50_ms": 1e3 * percentile([ttft_of(q) for q in mine if ttft_of(q) is not None], 50),
            "busy": report.summary["steps"] * report.summary["mean_step_ms"] / 1e3 / wall if wall else 0.0,
            "queue_tokens_mean": float(samples[:, 0].mean()), "kv_occupancy_mean": float(samples[:, 1].mean()),
            "kv_occupancy_peak": float(samples[:, 1].max()),
            "blocks_in_use_at_end": report.used_blocks + report.used_swap_blocks,
        }
    return s


def format_replicas(s: dict) -> str:
    lines = [f"replicas            {len(s['replicas'])}, policy {s['policy']}: {s['prefill_tokens']} prompt "
             f"tokens computed (of {s['prompt_tokens']})"]
    for r, x in s["replicas"].items():
        lines.append(f"  replica {r}         {x['requests']} requests, {x['prefill_tokens']} prompt tokens computed, "
                     f"prefix hits {100 * x['prefix_cache_hit_rate']:.1f}%, TTFT p50 {x['ttft_p50_ms']:.0f} ms, "
                     f"busy {100 * x['busy']:.0f}%, queue {x['queue_tokens_mean']:.0f} tokens mean, "
                     f"KV {100 * x['kv_occupancy_mean']:.0f}% mean / {100 * x['kv_occupancy_peak']:.0f}% peak")
    leaked = {r: x["blocks_in_use_at_end"] for r, x in s["replicas"].items() if x["blocks_in_use_at_end"]}
    lines.append("blocks in use at end " + ("none (no leaks)" if not leaked else
                                           ", ".join(f"replica {r}: {n}" for r, n in leaked.items())))
    return "\n".join(lines)


def compare_table(results: dict[str, dict]) -> str:
    """Policies (or replica counts) side by side on the same requests and arrivals."""
    rows = ["| run | prefix hit rate | prompt tokens computed | TTFT p50 / p99 ms | goodput req/s "
            "| output tok/s | requests per replica |", "|---|---|---|---|---|---|---|"]
    for name, s in results.items():
        spread = " / ".join(str(x["requests"]) for x in s["replicas"].values())
        rows.append(f"| {name} | {100 * s['prefix_cache_hit_rate']:.1f}% | {s['prefill_tokens']} "
                    f"| {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {s['goodput_rps']:.2f} "
                    f"| {s['output_tokens_per_s']:.1f} | {spread} |")
    return "\n".join(rows)


class ReplicaExport(Export):
    """A data-parallel run's Prometheus metrics, updated from the router's snapshots
    (Router.replicas): each replica's signals under vLLM's `engine` label (its rank), as vLLM
    labels the engines of its own data-parallel runs."""

    def __init__(self, model_name: str):
        super().__init__(model_name)
        family = lambda kind, name, help_text: kind(name, help_text, LABELS, registry=self.registry)
        self.gauges = {"kv_occupancy": family(Gauge, "vllm:kv_cache_usage_perc",
                                              "KV-cache usage. 1 means 100 percent usage."),
                       "queue_depth_tokens": family(Gauge, "nano_queue_depth_tokens", "Waiting prompt tokens "
                                                    "plus remaining output tokens of every unfinished request.")}
        self.routed = family(Counter, "nano_requests_routed", "Requests the router sent to the replica.")
        self.finished = Counter("nano_requests_finished", "Requests ended (any way), all replicas.", ["model_name"],
                                registry=self.registry).labels(model_name=model_name)
        self.seen: dict = {}  # what the counters have counted: per replica routed, and "finished"

    def update(self, snap: dict) -> None:
        for r, values in snap["replicas"].items():
            labels = {"model_name": self.model_name, "engine": str(r)}
            for key, gauge in self.gauges.items():
                gauge.labels(**labels).set(values[key])
            self.routed.labels(**labels).inc(values["routed"] - self.seen.get(r, 0))  # the router's counts only grow
            self.seen[r] = values["routed"]
        self.finished.inc(snap["finished"] - self.seen.get("finished", 0))
        self.seen["finished"] = snap["finished"]
