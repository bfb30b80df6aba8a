"""LLMEngine: requests in, one step at a time, finished sequences out.

    step() = schedule -> swap -> prepare inputs -> forward -> sample -> postprocess

Under tensor parallelism (parallel.py) this engine is rank 0: it owns the tokenizer, the
scheduler and the sampler, and its runner sends each step's packed plan to the other ranks,
which replay it on their shards (worker.Worker).
"""
import numpy as np

from nano import checks, parallel
from nano.block_manager import BlockManager
from nano.clock import Clock
from nano.config import EngineConfig
from nano.cost_model import CostModel, StepCoefficients
from nano.errors import NanoError
from nano.metrics import Metrics, QueueState
from nano.plan import SchedulerOutput
from nano.sampler import Sampler
from nano.scheduler import Scheduler
from nano.sequence import SamplingParams, Sequence
from nano.shard import load_shard

# Rough device figures for the cost model's starting point (it then learns from real steps).
DEVICE_PRIORS = {  # flop/s, memory bytes/s, host<->device bytes/s
    "cpu": (5e10, 1e10, 5e9),
    "gpu": (3e14, 3e12, 2e10),
}


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Clock | None = None):
        self.config, self.clock = config, clock or Clock()
        self.group = parallel.tp_group()  # TP ranks: one, without MPI, unless under mpirun
        if self.group.rank > 0:
            raise NanoError("LLMEngine runs on TP rank 0; the other ranks run worker.Worker")
        self.shard = shard = load_shard(config, self.group)
        self.model_config, self.tokenizer = shard.model_config, shard.tokenizer
        self.max_model_len, self.device, self.runner = shard.max_model_len, shard.device, shard.runner
        self.kv_bytes_per_token, self.weight_bytes = shard.kv_bytes_per_token, shard.weight_bytes
        self.sampler = Sampler(self.device)
        self.block_manager = BlockManager(shard.num_blocks, config.block_size, shard.num_swap_blocks,
                                          config.enable_prefix_caching)
        self.cost = self._cost_model()
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len,
                                   self.kv_bytes_per_token, self.cost)
        self.metrics = Metrics(shard.num_blocks)
        self.rng = np.random.default_rng(config.seed % 2**64)  # any int seed, as the sampler's
        self.next_id = 0
        self.added = 0  # requests queued, ever: less those still to arrive, the arrived count

    # ---- start-up -----------------------------------------------------------------------
    def _cost_model(self) -> CostModel:
        flops, bandwidth, link = DEVICE_PRIORS[self.device.kind]
        params = self.weight_bytes / self.device.itemsize
        prior = StepCoefficients(base=self.weight_bytes / bandwidth, per_prefill_token=2 * params / flops,
                                 per_decode_seq=2 * params / flops,
                                 per_context_token=self.kv_bytes_per_token / bandwidth)
        return CostModel(prior, swap_bandwidth=link)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> Sequence:
        """Queue a request. A future arrival_time makes it invisible to the scheduler until then
        (how the --request-rate bench replays a Poisson arrival trace). Bad input raises
        NanoError here, before anything is queued: once in a step, it would fail the step."""
        seq = self.make_sequence(prompt, params, arrival_time)
        self.added += 1
        self.scheduler.add(seq)
        return seq

    def make_sequence(self, prompt: str | list[int], params: SamplingParams,
                      arrival_time: float | None = None) -> Sequence:
        """A request checked, tokenized and given an id and a seed, not queued (add_request
        queues it here; disaggregated serving's router sends it to a prefill instance)."""
        if not isinstance(params, SamplingParams):
            raise NanoError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(checks.text("prompt", prompt))
        else:
            token_ids = checks.token_ids("prompt", prompt, self.model_config.vocab_size)
        seed = params.seed if params.seed is not None else int(self.rng.integers(2**63))
        seq = Sequence(self.next_id, prompt if isinstance(prompt, str) else "", token_ids,
                       params, self.clock.now() if arrival_time is None else arrival_time, seed)
        self.next_id += 1
        return seq

    def reset_metrics(self) -> None:
        self.metrics = Metrics(self.block_manager.num_blocks, self.metrics.request_observers)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward pass over a freshly decided batch; returns sequences that finished."""
        start = self.clock.now()
        plan = self.scheduler.schedule(start)  # the step's inputs and logits rows, fixed
        swap = self.runner.swap(plan.blocks_to_swap_out, plan.blocks_to_swap_in)
        inputs = self.runner.prepare(plan.packed)  # under TP, sent to the other ranks too
        finished = list(plan.finished)
        if inputs is not None:
            logits = self.runner.forward(inputs)
            scores = self.sampler.score(logits, plan.rows)  # prompt logprobs
            tokens, kept = self.sampler.sample(logits, plan.rows)  # kept: rows for return_logits
            finished += self._postprocess(plan, scores, tokens, kept)
        elif not finished and self.scheduler.has_work():
            self._idle(start)
            return []
        self._observe(plan, start, swap, finished)
        return finished

    def _idle(self, now: float) -> None:
        """Nothing could run: only requests that have not arrived yet are left; wait for one
        (or for whoever holds sequences' blocks, Scheduler.hold, to release them)."""
        arrival = self.scheduler.next_arrival()
        if arrival is None and self.scheduler.held:
            return  # a pool full of held blocks: their holder frees them between steps
        if arrival is None:
            raise RuntimeError("scheduler made no progress")  # a bug, never a user error
        self.clock.sleep(arrival - now)

    def stop_workers(self) -> None:
        if self.group.world > 1:
            self.group.broadcast(None)

    def _postprocess(self, plan: SchedulerOutput, scores: list, tokens: list[int], kept: dict) -> list[Sequence]:
        """The step's results into its sequences: the only place a step writes them."""
        for seq, score in zip(plan.rows.scoring, scores):
            seq.prompt_logprobs.append(score)
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
        now, finished = self.clock.now(), []
        for i, (seq, token) in enumerate(zip(plan.rows.sampling, tokens)):
            if i in kept:
                seq.logits.append(kept[i])
            if seq.params.max_tokens == 0:  # it only scored its prompt: the token is not wanted
                self.scheduler.finish(seq, "length")
                finished.append(seq)
                continue
            seq.token_ids.append(token)
            seq.token_times.append(now)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.tokenizer.eos_token_ids and not seq.params.ignore_eos:
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _observe(self, plan: SchedulerOutput, start: float, swap: tuple[int, float],
                 finished: list[Sequence]) -> None:
        now = self.clock.now()
        seconds = now - start
        swap_bytes, swap_seconds = swap
        if plan.scheduled:
            self.cost.observe_step(plan.prefill_tokens, plan.num_decodes, plan.decode_kv_tokens, seconds - swap_seconds)
        self.metrics.step_log.append((start, now, plan.prefill_tokens, plan.num_decodes))
        self.cost.observe_swap(swap_bytes, swap_seconds)
        self.metrics.on_step(plan, seconds, self.block_manager.num_free_blocks, swap_bytes,
                             *self.group.take_all_reduce_stats())
        for seq in finished:
            self.metrics.on_finish(seq)

    def queue_state(self, now: float) -> QueueState:
        s = self.scheduler
        waiting = [q for q in s.waiting if q.arrival_time <= now]
        unfinished = waiting + s.running + list(s.swapped)
        return QueueState(
            arrived=self.added - (len(s.waiting) - len(waiting)), running=len(s.running),
            waiting=len(waiting), swapped=len(s.swapped),
            queue_tokens=sum(q.num_uncomputed_tokens for q in waiting)
            + sum(q.params.max_tokens - q.num_output_tokens for q in unfinished))

    # ---- all at once --------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 on_step=None) -> list[Sequence]:
        """Run every prompt to completion; returns their sequences in input order.
        If anything raises (bad input, an interrupt), this call's requests are dropped, so
        the engine is left as it was and the next call runs normally."""
        if not isinstance(prompts, (list, tuple)):
            raise NanoError(f"prompts must be a list of strings or token-id lists, got {type(prompts).__name__}")
        if isinstance(params, (list, tuple)) and len(params) != len(prompts):
            raise NanoError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        seqs = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                try:
                    seqs.append(self.add_request(prompt, sp))
                except NanoError as e:
                    raise NanoError(f"request {i}: {e}") from None
            while self.has_unfinished():
                finished = self.step()
                if on_step:
                    on_step(finished)
        except BaseException:
            for seq in seqs:
                self.abort(seq)
            raise
        return seqs

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running request from outside a step (the server found a stop string in its
        text): its blocks freed, counted as finished."""
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
            self.metrics.on_finish(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request: out of its queue, its blocks freed; counted as aborted."""
        if not seq.is_finished:
            self.scheduler.finish(seq, "aborted")
            self.metrics.aborted += 1

    def detokenize(self, seq: Sequence) -> str:
        """The text of seq's generated tokens."""
        return self.tokenizer.decode(seq.output_token_ids)
