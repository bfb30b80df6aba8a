"""Metrics for Prometheus (nano/telemetry/prometheus.py): vLLM's names, labels and buckets,
read back by Prometheus's own parser; the snapshot files a run writes."""
import json
import timeit

import pytest

from nano.cli.offline import warm_up
from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.sequence import SamplingParams
from nano.telemetry.export import MetricsWriter, gauges, snapshot
from nano.telemetry.metrics import Metrics, metrics_of, reset_metrics, ttft_of

text_string_to_metric_families = pytest.importorskip(  # the export's requirement
    "prometheus_client.parser").text_string_to_metric_families
from nano.telemetry.prometheus import (REQUEST_LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS,  # noqa: E402
                                       TTFT_BUCKETS, EngineExport, token_buckets)

# vLLM's series (name, type) that nano serves, each labelled model_name and engine.
VLLM = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_params_max_tokens": "histogram",
}
NANO = {"nano_requests_arrived": "counter", "nano_requests_rejected": "counter",
        "nano_requests_rejected_late": "counter", "nano_requests_served_late": "counter",
        "nano_requests_aborted": "counter", "nano_preemptions": "counter", "nano_requests_swapped": "gauge",
        "nano_queue_depth_tokens": "gauge", "nano_step_seconds": "gauge"}
PER_REQUEST = [name for name, kind in VLLM.items() if kind == "histogram" and name not in
               ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")]


def parse(text: str, model: str) -> tuple[dict, dict]:
    """(family name -> type, (sample name, other labels) -> value); every sample is labelled
    with the model's name and engine 0."""
    families = list(text_string_to_metric_families(text))
    samples = {}
    for family in families:
        for s in family.samples:
            labels = dict(s.labels)
            assert (labels.pop("model_name", None), labels.pop("engine", None)) == (model, "0"), s
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    return {f.name: f.type for f in families}, samples


def engine_with_export(model_dir, **config):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", num_blocks=64, **config))
    return engine, EngineExport(engine)


def test_vllms_series_count_what_the_engine_served(tiny_model, tmp_path):
    engine, export = engine_with_export(tiny_model)
    prom = tmp_path / "m.prom"
    writer = MetricsWriter(None, str(prom), export)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [5, 6, 7, 8, 9, 13, 14]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 1, 6)]
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        writer.after_step(engine)
    text = prom.read_text()
    assert text == export.text().decode()  # the file is the registry
    types, samples = parse(text, tiny_model.name)
    assert {**VLLM, **NANO}.items() <= types.items()

    def value(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("vllm:prompt_tokens_total") == sum(map(len, prompts)) == 15
    assert value("vllm:generation_tokens_total") == sum(s.num_output_tokens for s in seqs) == 11
    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:request_success_total", finished_reason="stop") == 0
    for name in PER_REQUEST:  # one observation per request
        assert value(name + "_count") == 3, name
    gaps = sum(s.num_output_tokens - 1 for s in seqs)
    assert value("vllm:inter_token_latency_seconds_count") == value("vllm:time_per_output_token_seconds_count") == gaps
    assert value("vllm:request_prompt_tokens_sum") == 15 and value("vllm:request_generation_tokens_sum") == 11
    assert value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(s.token_times[-1] - s.arrival_time for s in seqs))
    assert value("vllm:time_to_first_token_seconds_sum") == pytest.approx(sum(ttft_of(s) for s in seqs))
    assert value("vllm:request_queue_time_seconds_sum") + value("vllm:request_inference_time_seconds_sum") == \
        pytest.approx(value("vllm:e2e_request_latency_seconds_sum"))
    assert value("vllm:request_prefill_time_seconds_sum") + value("vllm:request_decode_time_seconds_sum") == \
        pytest.approx(value("vllm:request_inference_time_seconds_sum"))
    assert value("vllm:num_requests_running") == value("vllm:kv_cache_usage_perc") == 0
    assert value("nano_requests_arrived_total") == 3
    assert value("vllm:prefix_cache_queries_total") == metrics_of(engine).prefix_queried > 0
    assert value("vllm:prefix_cache_hits_total") == metrics_of(engine).prefix_hits
    # vLLM's buckets (vllm/v1/metrics/loggers.py)
    bounds = {name: [float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")]
              for f in text_string_to_metric_families(text) for name in [f.name]}
    assert bounds["vllm:time_to_first_token_seconds"] == [*TTFT_BUCKETS, float("inf")]
    assert bounds["vllm:inter_token_latency_seconds"] == [*TOKEN_LATENCY_BUCKETS, float("inf")]
    assert bounds["vllm:e2e_request_latency_seconds"] == [*REQUEST_LATENCY_BUCKETS, float("inf")]
    assert bounds["vllm:request_prompt_tokens"] == [*token_buckets(engine.max_model_len), float("inf")]


def test_token_buckets_are_vllms():
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(2048)[-3:] == [500, 1000, 2000]


def test_two_engines_in_one_process_do_not_collide(tiny_model):
    (a, export_a), (b, export_b) = engine_with_export(tiny_model), engine_with_export(tiny_model)
    a.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=2, ignore_eos=True))
    b.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    for engine, export, requests, tokens in ((a, export_a, 2, 4), (b, export_b, 1, 3)):
        export.update(snapshot(engine, engine.clock.now()))
        _, samples = parse(export.text().decode(), tiny_model.name)
        assert samples[("vllm:e2e_request_latency_seconds_count", ())] == requests
        assert samples[("vllm:generation_tokens_total", ())] == tokens


def test_counters_go_on_when_the_engines_metrics_start_afresh(tiny_model):
    """A warm-up's reset_metrics: the counters never go down, and no request is lost or twice."""
    engine, export = engine_with_export(tiny_model)
    engine.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=2, ignore_eos=True))
    export.update(snapshot(engine, engine.clock.now()))
    reset_metrics(engine)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
    export.update(snapshot(engine, engine.clock.now()))
    export.update(snapshot(engine, engine.clock.now()))  # again: nothing new is counted twice
    _, samples = parse(export.text().decode(), tiny_model.name)
    assert samples[("vllm:prompt_tokens_total", ())] == 3 + 3 + 4
    assert samples[("vllm:generation_tokens_total", ())] == 2 + 2 + 3
    assert samples[("vllm:request_success_total", (("finished_reason", "length"),))] == 3
    assert samples[("vllm:request_generation_tokens_count", ())] == 3
    assert samples[("nano_requests_arrived_total", ())] == 3


def test_an_export_made_after_a_warm_up_counts_none_of_it(tiny_model):
    """run.py --serve on a GPU warms up before it serves: its request arrived at no server."""
    engine, _ = engine_with_export(tiny_model)
    warm_up(engine)
    export = EngineExport(engine)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
    export.update(snapshot(engine, engine.clock.now()))
    _, samples = parse(export.text().decode(), tiny_model.name)
    assert samples[("nano_requests_arrived_total", ())] == 1
    assert samples[("vllm:prompt_tokens_total", ())] == 4 and samples[("vllm:generation_tokens_total", ())] == 3


def test_an_abort_is_counted_and_the_arrival_stays_counted(tiny_model):
    """Counters never go down: an aborted request has still arrived; it is no success."""
    engine, export = engine_with_export(tiny_model)
    seq = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    engine.step()
    engine.abort(seq)
    snap = snapshot(engine, engine.clock.now())
    assert (snap["arrived"], snap["aborted"], snap["running"]) == (1, 1, 0)
    export.update(snap)
    _, samples = parse(export.text().decode(), tiny_model.name)
    assert samples[("nano_requests_arrived_total", ())] == samples[("nano_requests_aborted_total", ())] == 1
    assert samples[("vllm:e2e_request_latency_seconds_count", ())] == 0
    assert samples[("vllm:num_requests_running", ())] == 0


def test_the_gauges_cost_the_same_however_many_requests_were_served(tiny_model):
    """The server sets its export from export.gauges after every step: that must cost what the
    requests in flight cost, not what a long-lived server has served (millions)."""
    engine, export = engine_with_export(tiny_model)

    def cost() -> float:
        return min(timeit.repeat(lambda: export.update(gauges(engine, engine.clock.now())), number=50, repeat=5))
    idle = cost()
    engine.generate([[1]] * 10_000, SamplingParams(max_tokens=1, ignore_eos=True))
    assert gauges(engine, engine.clock.now())["arrived"] == 10_000
    assert cost() < 3 * idle


def test_metrics_writer_appends_snapshots(tiny_model, tmp_path):
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("left over from an earlier run\n")
    engine, export = engine_with_export(tiny_model)
    writer = MetricsWriter(str(jsonl), None, export, interval=2)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        writer.after_step(engine)
    snaps = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [s["step"] for s in snaps] == [2, 4]
    assert snaps[-1]["ttft_histogram"][-1] == 0 and snaps[-1]["running"] == 1


def test_prefix_cache_queries_are_the_prompt_tokens_looked_up(tiny_model):
    """A request's query is the tokens it had at admission, not one more for the token its
    first step samples; a second run of the same prompt finds its full blocks cached."""
    engine, export = engine_with_export(tiny_model, block_size=4)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([[5, 6, 7, 8, 9], [5, 6, 7]], params)
    engine.generate([[5, 6, 7, 8, 9]], params)
    assert (metrics_of(engine).prefix_queried, metrics_of(engine).prefix_hits) == (5 + 3 + 5, 4)
    export.update(snapshot(engine, engine.clock.now()))
    _, samples = parse(export.text().decode(), tiny_model.name)
    assert samples[("vllm:prefix_cache_queries_total", ())] == 13
    assert samples[("vllm:prefix_cache_hits_total", ())] == 4


def test_the_engine_tells_its_observers_each_step_finish_and_abort(tiny_model):
    """With no observer the engine runs as ever; one attached hears every step (start before
    end), every request that ends and every abort, in that order, and Metrics counts the same."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_blocks=64))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert engine.observers == [] and engine.generate([[5, 6, 7]], params)[0].num_output_tokens == 3

    class Heard:
        def __init__(self):
            self.calls = []

        def on_step(self, plan, start, end, free_blocks, swap_bytes, all_reduce_seconds, all_reduce_bytes):
            self.calls.append(("step", start <= end and 0 < free_blocks <= 64))

        def on_finish(self, seq):
            self.calls.append(("finish", seq.seq_id))

        def on_abort(self, seq):
            self.calls.append(("abort", seq.seq_id))
    metrics, heard = Metrics.attach(engine), Heard()
    engine.observers.append(heard)
    kept, dropped = engine.add_request([5, 6, 7], params), engine.add_request([8, 9], params)
    engine.step()
    engine.abort(dropped)
    while engine.has_unfinished():
        engine.step()
    assert heard.calls == [("step", True), ("abort", dropped.seq_id), ("step", True), ("step", True),
                           ("finish", kept.seq_id)]
    assert (metrics.steps, len(metrics.step_log), metrics.requests, metrics.aborted) == (3, 3, 1, 1)
    assert metrics_of(engine) is metrics and reset_metrics(engine) is metrics_of(engine) is not metrics


class RecordingProposer:
    """A proposer's drafts kept per step, with each sequence's output count then."""

    def __init__(self, proposer):
        self.proposer, self.calls = proposer, []

    def propose(self, seq):
        drafts = self.proposer.propose(seq)
        self.calls.append((seq, drafts, seq.num_output_tokens))
        return drafts


class ScriptedProposer:
    """Drafts from the greedy tokens known in advance, some spoiled: a sequence's 2nd, 5th, 8th,
    ... drafts have the second token wrong, its 3rd, 6th, ... the first; the others are right."""

    def __init__(self, reference: dict, k: int):
        self.reference, self.k, self.calls = reference, k, {}

    def propose(self, seq):
        n, call = seq.num_output_tokens, self.calls.get(seq.seq_id, 0)
        self.calls[seq.seq_id] = call + 1
        drafts = list(self.reference[tuple(seq.token_ids[:seq.num_prompt_tokens])][n:n + self.k])
        spoil = {1: 1, 2: 0}.get(call % 3)
        if spoil is not None and spoil < len(drafts):
            drafts[spoil] = drafts[spoil] + 1
        return drafts


@pytest.mark.parametrize("proposer", ["ngram", "scripted"])
def test_speculative_decoding_counts_are_vllms(tiny_model, proposer):
    """vLLM's spec_decode counters equal what the drafts and the tokens that followed them
    give, counted here apart from the step's rows; the snapshot and summary derive from them;
    greedy tokens are the same as without drafts."""
    from nano.speculative import attach
    from nano.telemetry.summary import format_summary, summarize
    engine, export = engine_with_export(tiny_model)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], [20, 21, 22, 23]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = {tuple(p): s.output_token_ids for p, s in zip(prompts, engine.generate(prompts, params))}
    reset_metrics(engine)
    k = 3
    inner = (attach(engine, {"num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
             if proposer == "ngram" else ScriptedProposer(reference, k))
    recorder = engine.proposer = RecordingProposer(inner)
    seqs = [engine.add_request(p, params) for p in prompts]
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    while engine.has_unfinished():
        engine.step()
        for seq, proposed, before in recorder.calls:
            proposed = proposed[:seq.params.max_tokens - before - 1]  # the engine's cut (the context is far off)
            new = seq.output_token_ids[before:]
            if not proposed or not new:
                continue
            n = next((j for j, (d, t) in enumerate(zip(proposed, new)) if d != t), min(len(proposed), len(new)))
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(proposed), accepted + n
            for j in range(n):
                per_pos[j] += 1
        recorder.calls.clear()
    assert {tuple(p): s.output_token_ids for p, s in zip(prompts, seqs)} == reference
    assert drafts and 0 < accepted < draft_tokens  # some drafts accepted, some not
    if proposer == "scripted":
        assert per_pos[-1] > 0 and per_pos[0] > per_pos[1]  # every position reached, the first spoiled less
    m = metrics_of(engine)
    assert (m.spec_drafts, m.spec_draft_tokens, m.spec_accepted) == (drafts, draft_tokens, accepted)
    assert m.spec_accepted_per_pos == per_pos
    export.update(snapshot(engine, engine.clock.now()))
    types, samples = parse(export.text().decode(), tiny_model.name)
    assert all(types[f"vllm:spec_decode_num_{name}"] == "counter"
               for name in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"))
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ())] == draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ())] == accepted
    assert [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))]
            for j in range(k)] == per_pos
    snap, summary = snapshot(engine, engine.clock.now()), summarize(m, 1.0)
    for figures in (snap, summary):
        assert figures["spec_decode_acceptance_rate"] == pytest.approx(accepted / draft_tokens)
        assert figures["spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert f"of {draft_tokens} draft tokens accepted" in format_summary(summary)


def test_no_speculative_figures_without_speculation(tiny_model):
    engine, export = engine_with_export(tiny_model)
    engine.generate([[5, 6, 7, 5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert not any(key.startswith("spec_decode") for key in snapshot(engine, engine.clock.now()))
    export.update(snapshot(engine, engine.clock.now()))
    _, samples = parse(export.text().decode(), tiny_model.name)
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == 0
