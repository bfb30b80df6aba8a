"""Metrics output: the Prometheus text format read back by Prometheus's own parser, and the
snapshot files a run writes."""
import json

import pytest

from nano.telemetry.export import BUCKETS, MetricsWriter, histogram, prometheus_text

text_string_to_metric_families = pytest.importorskip(  # a test-only requirement
    "prometheus_client.parser").text_string_to_metric_families


def snapshot(step: int) -> dict:
    ttft = [0.003, 0.04, 0.04, 0.7, 12.0][:step + 2]
    return {
        "time": 1.5 * step, "step": step, "arrived": 9, "finished": 4, "running": 2, "waiting": 1,
        "swapped": 1, "rejected": 1, "aborted": 1, "queue_depth_tokens": 340, "kv_occupancy": 0.625,
        "ttft_histogram": histogram(ttft), "tpot_histogram": histogram([0.02, 0.03]),
        "preemptions": {"swap": 2, "recompute": 1}, "prefix_cache_hit_rate": 0.25,
        "step_time": 0.0125, "mean_step_time": 0.011, "ttft_sum": sum(ttft), "tpot_sum": 0.05,
    }


def test_prometheus_text_parses_with_prometheus_client():
    snap = snapshot(3)
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text(snap))}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert families["nano_requests_arrived"].type == "counter"
    assert samples[("nano_requests_arrived_total", ())] == 9
    assert samples[("nano_requests_rejected_total", ())] == 1
    assert samples[("nano_requests_aborted_total", ())] == 1
    assert families["nano_kv_cache_occupancy"].type == "gauge"
    assert samples[("nano_kv_cache_occupancy", ())] == 0.625
    assert samples[("nano_requests_swapped", ())] == 1
    assert samples[("nano_preemptions_total", (("kind", "swap"),))] == 2
    assert samples[("nano_preemptions_total", (("kind", "recompute"),))] == 1

    ttft = families["nano_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    buckets = [(float(s.labels["le"]), s.value) for s in ttft.samples if s.name.endswith("_bucket")]
    assert [b for b, _ in buckets] == list(BUCKETS) + [float("inf")]
    counts = [c for _, c in buckets]
    assert counts == sorted(counts) and counts[-1] == 5  # cumulative, +Inf counts every request
    assert counts[BUCKETS.index(0.005)] == 1 and counts[BUCKETS.index(0.05)] == 3
    assert samples[("nano_time_to_first_token_seconds_count", ())] == 5
    assert samples[("nano_time_to_first_token_seconds_sum", ())] == pytest.approx(snap["ttft_sum"])


def test_metrics_writer_appends_snapshots_and_rewrites_prometheus(tmp_path):
    jsonl, prom = tmp_path / "m.jsonl", tmp_path / "m.prom"
    jsonl.write_text("left over from an earlier run\n")
    writer = MetricsWriter(str(jsonl), str(prom))
    for step in range(3):
        writer.write(snapshot(step))
    assert [json.loads(line)["step"] for line in jsonl.read_text().splitlines()] == [0, 1, 2]
    families = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    count = [s for s in families["nano_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert count[0].value == 4  # the last snapshot's, not a mix
    assert not (tmp_path / "m.prom.tmp").exists()


def test_an_abort_is_counted_and_the_arrival_stays_counted(tiny_model):
    """Counters never go down: an aborted request has still arrived."""
    from nano.config import EngineConfig
    from nano.engine import LLMEngine
    from nano.sequence import SamplingParams
    from nano.telemetry.export import snapshot as engine_snapshot
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=16))
    seq = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    engine.step()
    engine.abort(seq)
    snap = engine_snapshot(engine, engine.clock.now())
    assert (snap["arrived"], snap["aborted"], snap["running"]) == (1, 1, 0)
