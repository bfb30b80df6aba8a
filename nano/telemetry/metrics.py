"""What the engine measures: latency per request, what each step did to the KV pool; exported
for autoscalers and dashboards by export.py and prometheus.py, summed up by summary.py.

Metrics is one of the engine's observers (LLMEngine.observers). Whoever builds an engine
attaches one (Metrics.attach(engine)) before its first step; code handed only an engine reads
it with metrics_of(engine), which attaches one if none is (counting from then on);
reset_metrics(engine) starts the figures afresh (after a warm-up), its request_observers kept."""
from collections import Counter, deque

from nano.plan import StepPlan
from nano.policy import LATE
from nano.sequence import Sequence

STEP_LOG = 100_000  # steps kept in Metrics.step_log: 3 MB


class Metrics:
    def __init__(self, num_blocks: int, request_observers=()):
        self.num_blocks = num_blocks
        # Each called once with every request that ends finished or rejected: for what needs
        # each request's own figures, not the sums kept here (Prometheus histograms).
        self.request_observers = list(request_observers)
        self.requests = 0                    # finished, rejected included
        self.rejected = 0
        self.aborted = 0                     # dropped unfinished (abort(): a client went away)
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
        # speculative decoding (engine.proposer), vLLM's counts: sequences that checked drafts in a
        # step, the drafts they checked, of those accepted, and accepted by position (0: the first)
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted = 0
        self.spec_accepted_per_pos: list[int] = []  # as long as the most drafts one sequence checked
        # (start, end, prompt tokens, decodes) of the latest steps, for end-of-run analyses
        # (how much prefill slows decodes); bounded, as a server's run has no end
        self.step_log: deque[tuple[float, float, int, int]] = deque(maxlen=STEP_LOG)

    @classmethod
    def attach(cls, engine, request_observers=()) -> "Metrics":
        metrics = cls(engine.kv_blocks()[0], request_observers)
        engine.observers.append(metrics)
        return metrics

    def on_step(self, plan: StepPlan, start: float, end: float, free_blocks: int, swap_bytes: int,
                all_reduce_seconds: float = 0.0, all_reduce_bytes: int = 0) -> None:
        seconds = end - start
        self.step_log.append((start, end, plan.prefill_tokens, plan.num_decodes))
        self.steps += 1
        self.step_time += seconds
        self.last_step_time = seconds
        if plan.num_decodes and plan.num_decodes == len(plan.scheduled):  # a decode-only step
            self.decode_steps += 1
            self.decode_time += seconds
            self.decode_kv_tokens += plan.decode_kv_tokens
        self.swap_bytes += swap_bytes
        self.all_reduce_time += all_reduce_seconds
        self.all_reduce_bytes += all_reduce_bytes
        self.peak_kv_occupancy = max(self.peak_kv_occupancy, 1 - free_blocks / self.num_blocks)
        self.peak_running = max(self.peak_running, len(plan.scheduled))
        for p in plan.preempted:
            self.preemptions[p.mode] += 1
            self.preemption_reasons[f"{p.mode}:{p.reason}"] += 1
        self.prefix_queried += plan.prefix_queried
        for seq in plan.admitted:
            self.prefix_hits += seq.num_cached_tokens
        self.count_drafts(plan)

    def count_drafts(self, plan: StepPlan) -> None:
        """The step's drafts and how many were accepted: a sample's new tokens start at its
        output count, and the accepted drafts are the leading ones its new tokens equal."""
        for sample in plan.samples:
            drafts = sample.drafts
            if not drafts:
                continue
            new = sample.seq.output_token_ids[sample.output_count:]
            accepted = 0
            while accepted < min(len(drafts), len(new)) and new[accepted] == drafts[accepted]:
                accepted += 1
            self.spec_drafts += 1
            self.spec_draft_tokens += len(drafts)
            self.spec_accepted += accepted
            self.spec_accepted_per_pos += [0] * (len(drafts) - len(self.spec_accepted_per_pos))
            for j in range(accepted):
                self.spec_accepted_per_pos[j] += 1

    def on_finish(self, seq: Sequence) -> None:
        self.requests += 1
        for observe in self.request_observers:
            observe(seq)
        if seq.finish_reason == "rejected":
            self.rejected += 1
            self.rejected_late += bool(seq.error and seq.error.startswith(LATE))
            return
        self.served_late += not met_slo(seq)
        self.prompt_tokens += seq.num_prompt_tokens
        self.generated_tokens += seq.num_output_tokens
        self.slo_met += met_slo(seq)
        if ttft_of(seq) is not None:
            self.ttft.append(ttft_of(seq))
        if tpot_of(seq) is not None:
            self.tpot.append(tpot_of(seq))

    def on_abort(self, seq: Sequence) -> None:
        self.aborted += 1


def ttft_of(seq: Sequence) -> float | None:
    """Seconds from arrival to the first token (None before it)."""
    return None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time


def tpot_of(seq: Sequence) -> float | None:
    """Seconds per output token after the first (None before the second)."""
    if seq.num_output_tokens < 2:
        return None
    return (seq.token_times[-1] - seq.first_token_time) / (seq.num_output_tokens - 1)


def met_slo(seq: Sequence) -> bool:
    """Finished within both of its latency targets (a target not set is met)."""
    p = seq.params
    if seq.finish_reason == "rejected" or ttft_of(seq) is None:
        return False
    return ((p.ttft_slo is None or ttft_of(seq) <= p.ttft_slo)
            and (p.tpot_slo is None or tpot_of(seq) is None or tpot_of(seq) <= p.tpot_slo))


def metrics_of(engine) -> Metrics:
    """The engine's Metrics observer; one attached if it has none."""
    return next((o for o in engine.observers if isinstance(o, Metrics)), None) or Metrics.attach(engine)


def reset_metrics(engine) -> Metrics:
    """The engine's Metrics replaced by a fresh one (a warm-up's figures dropped), keeping its
    request_observers."""
    old = metrics_of(engine)
    engine.observers.remove(old)
    return Metrics.attach(engine, old.request_observers)
