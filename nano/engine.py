"""LLMEngine takes requests in, runs one step at a time and hands finished sequences out.
docs/how-it-works.md#one-step follows a step; docs/extending.md lists the seams add-ons use.
Under tensor parallelism (parallel.py) this engine is rank 0, and its runner sends each step's
packed plan to the other ranks (fleet/worker.Worker). Add-ons use only its public methods and
LLMEngine.ADDON_ATTRIBUTES (tests/test_layout.py): the order of the scheduler's, block
manager's and runner's calls is the engine's alone.
"""
import numpy as np

from nano import checks, parallel
from nano.block_manager import BlockManager
from nano.clock import Clock
from nano.config import EngineConfig
from nano.cost_model import CostModel
from nano.errors import NanoError
from nano.plan import StepPlan
from nano.policy import FCFS
from nano.sampler import Sampler
from nano.scheduler import Scheduler
from nano.sequence import SamplingParams, Sequence
from nano.shard import load_shard


def accepted(tokens: list[int], drafts: list[int]) -> list[int]:
    """Keep the sampled tokens up to and including the first that differs from its draft;
    without drafts, keep the one token (docs/speculative.md#the-accept-rule)."""
    for j, draft in enumerate(drafts):
        if tokens[j] != draft:
            return tokens[:j + 1]
    return tokens


class LLMEngine:
    # What add-ons may read besides the public methods (tests/test_layout.py holds them to it).
    ADDON_ATTRIBUTES = ("config", "model_config", "tokenizer", "clock", "observers", "device",
                        "cost", "capacity", "max_model_len", "kv_bytes_per_token", "weight_bytes",
                        "model_name", "ops", "num_requests_queued", "forward", "proposer")

    def __init__(self, config: EngineConfig, clock: Clock | None = None, policy=FCFS,
                 wrap_forward=None):
        """Load the model's shard and build the scheduler around its KV pool. policy is the
        scheduling policy's class (policy.py), such as nano/deadline's; wrap_forward(forward)
        returns the forward pass that steps run, as a simulated clock's times each one."""
        self.config, self.clock = config, clock or Clock()
        self.group = parallel.tp_group()  # TP ranks: one, without MPI, unless under mpirun
        if self.group.rank > 0:
            raise NanoError("LLMEngine runs on TP rank 0; the other ranks run fleet/worker.Worker")
        self.shard = shard = load_shard(config, self.group)
        self.model_config, self.tokenizer, self.model_name = (shard.model_config, shard.tokenizer,
                                                              shard.model_dir.name)
        self.ops = shard.runner.model.ops  # the forward's op set (ops.py), chosen by load_shard
        self.max_model_len, self.device, self.runner = (shard.max_model_len, shard.device,
                                                        shard.runner)
        self.kv_bytes_per_token, self.weight_bytes = shard.kv_bytes_per_token, shard.weight_bytes
        self.forward = wrap_forward(self.runner.forward) if wrap_forward else self.runner.forward
        self.sampler = Sampler(self.device, self.ops)
        self.block_manager = BlockManager(shard.num_blocks, config.block_size,
                                          shard.num_swap_blocks,
                                          config.enable_prefix_caching)
        self.cost = CostModel.for_device(self.device.kind, self.weight_bytes, self.device.itemsize,
                                         self.kv_bytes_per_token)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len,
                                   self.kv_bytes_per_token, self.cost, policy)
        self.capacity = self.scheduler.capacity
        # What watches the run (nano/telemetry's Metrics): each gets on_step(plan, start, end,
        # free_blocks, swap_bytes, all_reduce_seconds, all_reduce_bytes), on_finish(seq) and
        # on_abort(seq).
        self.observers: list = []
        # What proposes draft tokens to check (nano/speculative's n-gram lookup): its
        # propose(seq) returns a list. None turns speculative decoding off.
        self.proposer = None
        self.rng = np.random.default_rng(config.seed % 2**64)  # any int seed, as the sampler's
        self.next_id = 0
        self.num_requests_queued = 0  # ever; less those still to arrive, the arrived count

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, lora_request=None) -> Sequence:
        """Queue a request. A future arrival_time hides it from the scheduler until then, which
        is how the --request-rate bench replays a Poisson arrival trace. Bad input raises
        NanoError here, before anything is queued: once in a step, it would fail the step."""
        seq = self.make_sequence(prompt, params, arrival_time, lora_request)
        self.queue(seq)
        return seq

    def make_sequence(self, prompt: str | list[int], params: SamplingParams,
                      arrival_time: float | None = None, lora_request=None) -> Sequence:
        """Check a request, tokenize it and give it an id and a seed, without queueing it:
        add_request queues it here, and disaggregated serving's router sends it elsewhere.
        lora_request (nano/lora's LoRARequest) names its adapter, read now."""
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
        if lora_request is not None:
            if self.runner.adapters is None:
                raise NanoError("lora_request needs LoRA enabled (enable_lora, nano/lora)")
            seq.lora = self.runner.adapters.resolve(lora_request)
        self.next_id += 1
        return seq

    def queue(self, seq: Sequence) -> None:
        """Queue a made sequence: make_sequence's, or one a router sends."""
        self.num_requests_queued += 1
        self.scheduler.waiting.append(seq)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward pass over a freshly decided batch; return the sequences that finished."""
        start = self.clock.now()
        drafted = self._propose_drafts() if self.proposer else []  # speculative decoding only
        plan = self.scheduler.schedule(start)  # the step's inputs and logits rows, frozen
        swap = self.runner.swap(plan.blocks_to_swap_out, plan.blocks_to_swap_in)
        inputs = self.runner.prepare(plan.packed)  # under TP, sent to the other ranks too
        finished = list(plan.finished)
        if inputs is not None:
            logits = self.forward(inputs)
            if plan.scores:  # prompt logprobs only
                self._score_prompts(plan, logits)
            tokens, returned_logits = self.sampler.sample(logits, plan.samples)
            finished += self._postprocess(plan, tokens, returned_logits)
        elif not finished and self.scheduler.has_work():
            self._idle(start)
            return []
        for seq in drafted:  # drafts live for one step: a sequence it did not run checks none
            seq.draft_token_ids = []
        self._observe(plan, start, swap, finished)
        return finished

    def _propose_drafts(self) -> list[Sequence]:
        """Ask the proposer for drafts for the decoding sequences, as many as their max_tokens
        and the model's context allow; return the sequences that got them."""
        seqs = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        for seq in seqs:
            room = min(seq.params.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens) - 1
            seq.draft_token_ids = self.proposer.propose(seq)[:max(room, 0)]
        return seqs

    def _score_prompts(self, plan: StepPlan, logits) -> None:
        """Append the prompt logprobs the step's scoring rows give to their sequences."""
        for score, logprobs in zip(plan.scores, self.sampler.score(logits, plan.scores)):
            score.seq.prompt_logprobs.append(logprobs)

    def _postprocess(self, plan: StepPlan, tokens: list[list[int]],
                     returned_logits: list[list]) -> list[Sequence]:
        """Write the step's tokens into its sequences, the only place a step changes them:
        append each accepted token, check for a stop, and free a finished sequence."""
        for seq, n in plan.scheduled:
            # a draft's KV counts once accepted
            seq.num_computed_tokens += n - len(seq.draft_token_ids)
            self.block_manager.register_full_blocks(seq)
        now, finished = self.clock.now(), []
        for sample, sampled, kept in zip(plan.samples, tokens, returned_logits):
            seq = sample.seq
            for j, token in enumerate(accepted(sampled, sample.drafts)):
                seq.logits += kept[j:j + 1]  # empty unless the request asked (return_logits)
                if seq.params.max_tokens == 0:  # it only scored its prompt: no token is wanted
                    reason = "length"
                else:
                    seq.token_ids.append(token)
                    seq.token_times.append(now)
                    if seq.first_token_time is None:
                        seq.first_token_time = now
                    if j < len(sample.drafts) and token == sample.drafts[j]:
                        # the KV this step wrote for the draft is right
                        seq.num_computed_tokens += 1
                        self.block_manager.register_full_blocks(seq)
                    reason = self._stop_reason(seq, token)
                if reason:
                    self.scheduler.finish(seq, reason)
                    finished.append(seq)
                    break
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        if ((token in self.tokenizer.eos_token_ids and not seq.params.ignore_eos)
                or token in seq.params.stop_token_ids):
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _idle(self, now: float) -> None:
        """Wait for the next arrival when nothing could run, since only requests that have not
        arrived yet are left; with none, wait for whoever holds blocks (Scheduler.hold)."""
        arrival = self.scheduler.next_arrival()
        if arrival is not None:
            self.clock.sleep(arrival - now)
        # else a pool full of held blocks: their holder frees them between steps
        elif not self.scheduler.held:
            raise RuntimeError("scheduler made no progress")  # a bug, never a user error

    def _observe(self, plan: StepPlan, start: float, swap: tuple[int, float],
                 finished: list[Sequence]) -> None:
        now = self.clock.now()
        swap_bytes, swap_seconds = swap
        if plan.scheduled:
            self.cost.observe_step(plan.prefill_tokens, plan.num_decodes, plan.decode_kv_tokens,
                                   now - start - swap_seconds)
        self.cost.observe_swap(swap_bytes, swap_seconds)
        all_reduce = self.group.take_all_reduce_stats()  # taken every step, watched or not
        for o in self.observers:
            o.on_step(plan, start, now, self.block_manager.num_free_blocks, swap_bytes, *all_reduce)
            for seq in finished:
                o.on_finish(seq)

    # ---- all at once --------------------------------------------------------------------
    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 on_step=None, lora_request=None) -> list[Sequence]:
        """Run every prompt to completion; return their sequences in input order.
        If anything raises (bad input, an interrupt), this call's requests are dropped, so
        the engine is left as it was and the next call runs normally."""
        if not isinstance(prompts, (list, tuple)):
            raise NanoError(f"prompts must be a list of strings or token-id lists, got "
                            f"{type(prompts).__name__}")
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        for name, per_prompt in (("SamplingParams", params), ("lora_requests", loras)):
            if len(per_prompt) != len(prompts):
                raise NanoError(f"{len(prompts)} prompts but {len(per_prompt)} {name}")
        seqs = []
        try:
            for i, (prompt, sp, lora) in enumerate(zip(prompts, params, loras)):
                try:
                    seqs.append(self.add_request(prompt, sp, lora_request=lora))
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

    # ---- what add-ons use ------------------------------------------------------------------
    def use_adapters(self, adapters) -> None:
        """Serve LoRA adapters from nano/lora's pool: requests name them, each step places
        its rows' adapters in the pool's slots, and at most max_loras run at once."""
        self.runner.use_adapters(adapters)
        self.scheduler.max_loras = adapters.max_loras

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def unfinished(self) -> list[Sequence]:
        """List every unfinished sequence, queue by queue; each one's status says which."""
        s = self.scheduler
        return [*s.waiting, *s.running, *s.swapped, *s.held]

    def stop_workers(self) -> None:
        if self.group.world > 1:
            self.group.broadcast(None)

    def touch_kv_cache(self) -> None:
        """Write the whole KV pool once: its first-touch page faults out of measured steps."""
        self.runner.touch_kv_cache()

    def swap(self, blocks_out: list[tuple[int, int]],
             blocks_in: list[tuple[int, int]]) -> tuple[int, float]:
        """Copy (device, host) block pairs out to the host and back, as a preempting step
        does; return the bytes moved and the seconds it took."""
        return self.runner.swap(blocks_out, blocks_in)

    def kv_blocks(self) -> tuple[int, int, int, int]:
        """Count the KV pool's device blocks, the free ones, its host swap blocks and the free
        ones."""
        pool = self.block_manager
        return (pool.num_blocks, pool.num_free_blocks, pool.num_swap_blocks,
                len(pool.free_host_blocks))

    def cached_tokens(self, token_ids: list[int]) -> int:
        """Count the leading tokens of token_ids that the prefix cache holds now."""
        return len(self.block_manager.match_prefix(token_ids)) * self.config.block_size

    def take_cache_events(self) -> list[tuple[bool, int]]:
        """Return the prefix cache's blocks stored, as (True, hash), and evicted, as (False,
        hash), since the last call; the first call starts the record a data-parallel router
        reads."""
        events, self.block_manager.cache_events = self.block_manager.cache_events or [], []
        return events

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running request from outside a step, as the server does when it finds a stop
        string in the text: free its blocks and count it as finished."""
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
            # counted where it ends: another engine
            for o in self.observers if reason != "handed_off" else ():
                (o.on_abort if reason == "aborted" else o.on_finish)(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request: take it out of its queue, free its blocks and count it
        as aborted."""
        self.finish(seq, "aborted")

    # A KV handoff between engines (nano/disagg):
    def hand_off(self, seq: Sequence, take=None) -> np.ndarray:
        """Take a running seq out of the batch for another engine to adopt, keeping its blocks
        until finish(seq, "handed_off"); return their KV, a row per block, in the buffer
        take(nbytes) gives."""
        self.scheduler.hold(seq)
        n, size = (self.block_manager.num_blocks_for(seq.num_computed_tokens),
                   self.runner.kv_cache.block_nbytes)
        return self.runner.read_blocks(seq.block_table[:n],
                                       take(n * size)[:n * size].reshape(n, size) if take else None)

    def adopt(self, seq: Sequence) -> str | bool:
        """Reserve blocks for another engine's handed-off seq, held for write_kv; return
        Scheduler.reserve's answer."""
        return self.scheduler.reserve(seq)

    def write_kv(self, seq: Sequence, first: int, rows: np.ndarray) -> None:
        """Write hand_off's rows into an adopted seq's blocks from block `first` on; after the
        last, seq joins the batch."""
        self.runner.write_blocks(seq.block_table[first:first + len(rows)], rows)
        if first + len(rows) == self.block_manager.num_blocks_for(seq.num_computed_tokens):
            self.block_manager.register_full_blocks(seq)
            self.scheduler.resume(seq)

    def detokenize(self, seq: Sequence) -> str:
        """Decode the text of seq's generated tokens."""
        return self.tokenizer.decode(seq.output_token_ids)
