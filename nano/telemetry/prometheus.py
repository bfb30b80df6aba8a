"""The engine's metrics for Prometheus, through prometheus_client, under the names, labels and
histogram buckets vLLM uses (vllm/v1/metrics/loggers.py, v0.11), so that dashboards,
autoscalers and load testers built for vLLM read nano unchanged; nano's own signals (queue
depth in tokens, swapped requests, the deadline policy's counts) are named nano_*.

Each export has a CollectorRegistry of its own: two engines in one process (tests, a
comparison run) never share a series. GET /metrics (generate_latest) and --metrics-prom
(write_to_textfile) read the same registry. Per-request histograms are observed as each
request ends (Metrics.request_observers, once per request); counters follow the sums the
engine keeps (metrics.py), never going down, and gauges are set from the engine's
(export.gauges) by whoever steps it: the server's engine thread after every step, so that
GET /metrics renders the registry without waiting for one; --metrics-prom with each file."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, write_to_textfile

from nano.sequence import Status
from nano.telemetry.export import writing
from nano.telemetry.metrics import metrics_of, tpot_of, ttft_of

# vLLM's buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
SERVED = ("stop", "length")  # vLLM's finished_reason values for a request that ran to its end
LABELS = ("model_name", "engine")  # engine: vLLM's data-parallel engine index; nano has one


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class Export:
    """A registry and the metric families that bind its labels."""

    def __init__(self, model_name: str):
        self.registry, self.model_name = CollectorRegistry(), model_name

    def metric(self, kind, name: str, help_text: str, labels=(), **kwargs):
        """A metric of this registry, labelled model_name and engine (and labels, left open)."""
        family = kind(name, help_text, LABELS + tuple(labels), registry=self.registry, **kwargs)
        bound = {"model_name": self.model_name, "engine": "0"}
        return family.labels(**bound) if not labels else lambda **more: family.labels(**bound, **more)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def write(self, path: str) -> None:
        """The registry rewritten to path (atomically: a textfile collector never reads half)."""
        with writing(path):
            write_to_textfile(path, self.registry)


class EngineExport(Export):
    """One LLMEngine's metrics; with max_loras (an engine that serves LoRA adapters), vLLM's
    vllm:lora_requests_info too."""

    def __init__(self, engine, model_name: str | None = None, max_loras: int | None = None):
        super().__init__(model_name or engine.model_name)
        self.engine, self.max_loras = engine, max_loras
        gauge, counter, histogram = (lambda *a, **k: self.metric(Gauge, *a, **k),
                                     lambda *a, **k: self.metric(Counter, *a, **k),
                                     lambda *a, **k: self.metric(Histogram, *a, **k))
        # vLLM's
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed "
                             "(preempted by swapping: nano_requests_swapped).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counters = {  # key of Metrics' sums -> counter
            "prompt_tokens": counter("vllm:prompt_tokens", "Number of prefill tokens processed "
                                     "(counted as each request ends)."),
            "generated_tokens": counter("vllm:generation_tokens", "Number of generation tokens processed "
                                        "(counted as each request ends)."),
            "preemptions": counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            "prefix_queried": counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                                      "of queried tokens."),
            "prefix_hits": counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                                   "cached tokens."),
            "spec_drafts": counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
            "spec_draft_tokens": counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
            "spec_accepted": counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            # nano's own
            "rejected": counter("nano_requests_rejected", "Requests rejected (never fit, or could no longer "
                                "make their deadline)."),
            "rejected_late": counter("nano_requests_rejected_late", "Requests rejected because they could no "
                                     "longer make their latency targets (--drop-late)."),
            "served_late": counter("nano_requests_served_late", "Requests finished, but past a latency target."),
            "aborted": counter("nano_requests_aborted", "Requests dropped unfinished (the client went away)."),
        }
        success = counter("vllm:request_success", "Count of successfully processed requests.", ["finished_reason"])
        self.success = {reason: success(finished_reason=reason) for reason in SERVED}
        token_latency = TOKEN_LATENCY_BUCKETS
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              buckets=TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             buckets=token_latency)
        # vLLM's name for the same observations before 0.11, which dashboards still query
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                              buckets=token_latency)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                      "time_per_output_token_seconds per request.", buckets=token_latency)
        phase = {name: histogram(f"vllm:{name}", help_text, buckets=REQUEST_LATENCY_BUCKETS) for name, help_text in (
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
            ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."))}
        self.e2e, self.queue, self.inference, self.prefill, self.decode = phase.values()
        lengths = token_buckets(engine.max_model_len)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                    buckets=lengths)
        self.generation_len = histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                        "processed.", buckets=lengths)
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                    "parameter.", buckets=lengths)
        # nano's own
        self.arrived = counter("nano_requests_arrived", "Requests that have arrived.")
        self.swapped = gauge("nano_requests_swapped", "Requests preempted to host swap space, waiting to resume.")
        self.queue_tokens = gauge("nano_queue_depth_tokens", "Waiting prompt tokens plus remaining output tokens "
                                  "of every unfinished request: the autoscaling signal.")
        self.step_seconds = gauge("nano_step_seconds", "Duration of the last engine step.")
        preemptions = counter("nano_preemptions", "Preemptions by kind (their sum: vllm:num_preemptions).", ["kind"])
        for kind in ("swap", "recompute"):
            self.counters[f"preemptions_{kind}"] = preemptions(kind=kind)
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per "
                                        "draft position.", ["position"])
        # vLLM's, labelled as vLLM labels it: no model_name, no engine
        self.lora_info = None if max_loras is None else Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), registry=self.registry)
        self.seen, self.seen_of = {}, None  # the engine's sums already counted, and of which Metrics
        # Requests queued before this export (a warm-up's) are none of the ones it counts.
        self.arrived_seen = engine.num_requests_queued
        metrics_of(engine).request_observers.append(self.observe)

    def observe(self, seq) -> None:
        """A request that has ended (on the engine's thread, in its step)."""
        if seq.finish_reason not in SERVED:
            return  # rejected: no latencies; counted by nano_requests_rejected
        self.success[seq.finish_reason].inc()
        self.prompt_len.observe(seq.num_prompt_tokens)
        self.generation_len.observe(seq.num_output_tokens)
        self.max_tokens.observe(seq.params.max_tokens)
        if not seq.token_times:
            return  # a prompt scored only (max_tokens 0): no token, so no latencies to observe
        first, last = seq.first_token_time, seq.token_times[-1]
        self.ttft.observe(ttft_of(seq))
        for before, after in zip(seq.token_times, seq.token_times[1:]):
            self.itl.observe(after - before)
            self.tpot.observe(after - before)
        self.request_tpot.observe(tpot_of(seq) or 0.0)  # as vLLM: 0 for a request of one token
        self.e2e.observe(last - seq.arrival_time)
        self.queue.observe(seq.scheduled_time - seq.arrival_time)
        self.inference.observe(last - seq.scheduled_time)
        self.prefill.observe(first - seq.scheduled_time)
        self.decode.observe(last - first)

    def update(self, snap: dict) -> None:
        """Gauges from the engine's (export.gauges, or a snapshot holding them); counters up to
        the engine's sums. On the thread that steps the engine."""
        self.running.set(snap["running"])
        self.waiting.set(snap["waiting"])
        self.swapped.set(snap["swapped"])
        self.kv_usage.set(snap["kv_occupancy"])
        self.queue_tokens.set(snap["queue_depth_tokens"])
        self.step_seconds.set(snap["step_time"])
        m = metrics_of(self.engine)
        if m is not self.seen_of:  # metrics started afresh (after a warm-up): count on from them
            self.seen, self.seen_of = {}, m
        sums = {key: getattr(m, key) for key in self.counters if not key.startswith("preemptions")}
        sums.update(preemptions=sum(m.preemptions.values()), preemptions_swap=m.preemptions["swap"],
                    preemptions_recompute=m.preemptions["recompute"])
        for key, counter in self.counters.items():
            counter.inc(sums[key] - self.seen.get(key, 0))
            self.seen[key] = sums[key]
        for position, accepted in enumerate(m.spec_accepted_per_pos):  # a series per position drafted
            key = f"spec_accepted_pos_{position}"
            self.accepted_per_pos(position=str(position)).inc(accepted - self.seen.get(key, 0))
            self.seen[key] = accepted
        self.arrived.inc(snap["arrived"] - self.arrived_seen)  # the engine never forgets an arrival
        self.arrived_seen = snap["arrived"]
        if self.lora_info is not None:
            self.update_lora(snap["time"])

    def update_lora(self, now: float) -> None:
        """vLLM's vllm:lora_requests_info: the names of the adapters that running requests use,
        and of those that arrived requests waiting (or swapped out) use, each comma-separated
        in order of first use, as labels; the wall-clock time as its value, so that a reader
        takes the newest series. Only that series is kept, where vLLM keeps every one it set."""
        running, waiting = {}, {}
        for seq in self.engine.unfinished():
            if seq.lora is not None and seq.arrival_time <= now:
                (running if seq.status is Status.RUNNING else waiting)[seq.lora.lora_name] = None
        self.lora_info.clear()
        self.lora_info.labels(max_lora=str(self.max_loras), waiting_lora_adapters=",".join(waiting),
                              running_lora_adapters=",".join(running)).set_to_current_time()
