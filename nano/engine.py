"""LLMEngine: requests in, one step at a time, finished sequences out.

    step() = schedule -> swap -> prepare inputs -> forward -> sample -> postprocess

Under tensor parallelism (parallel.py) this engine runs on every rank: rank 0 does
all of step() and broadcasts each step's swaps and packed inputs after preparing
them; the other ranks only swap and run the forward pass (run_worker).
"""
import numpy as np

from nano import checks, parallel
from nano.block_manager import BlockManager
from nano.capacity import blocks_for_memory, host_memory, kv_bytes_per_token
from nano.clock import Clock
from nano.config import EngineConfig
from nano.cost_model import CostModel
from nano.errors import NanoError
from nano.metrics import Metrics, MetricsWriter, QueueState
from nano.runner import Device, ModelRunner, gpu_count, select_device
from nano.sampler import Sampler
from nano.plan import SchedulerOutput
from nano.scheduler import Scheduler
from nano.sequence import SamplingParams, Sequence
from nano.tp import load_model, plan_shard
from nano.weights import open_model

# Rough device figures for the cost model's starting point (it then learns from real steps).
DEVICE_PRIORS = {  # flop/s, memory bytes/s, host<->device bytes/s
    "cpu": (5e10, 1e10, 5e9),
    "gpu": (3e14, 3e12, 2e10),
}
DEFAULT_CPU_KV_MEMORY = 2 * 2**30
GPU_MEMORY_UTILIZATION = 0.9


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Clock | None = None):
        self.config, self.clock = config, clock or Clock()
        self.group = group = parallel.world()  # TP ranks: one, without MPI, unless under mpirun
        with group.together():  # a rank failing here fails them all, before any collective
            config.validate()
            group.require(config.tp)
            folder = open_model(config.model, tokenizer=group.rank == 0)
            self.model_dir = folder.path
            self.model_config = cfg = folder.config
            self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                                     cfg.max_position_embeddings)
            self.shards = [plan_shard(cfg, r, group.world) for r in range(group.world)]
            shard = self.shards[group.rank]
            kind = select_device(config.device)
            # Ranks take the visible GPUs round-robin; several may share one.
            self.device = Device(kind, group.rank % gpu_count() if kind == "gpu" else 0)
            group.cuda_aware = kind == "gpu" and group.world > 1 and parallel.cuda_aware_mpi()
            model = load_model(folder.reader, cfg, shard, self.device.put,
                               self.max_model_len, group.all_reduce)
            self.tokenizer = folder.tokenizer  # rank 0's alone

        # Each rank's pool holds only its KV heads; all must agree on the number of blocks.
        self.kv_bytes_per_token = self._kv_bytes_per_token(shard)
        block_bytes = self.kv_bytes_per_token * config.block_size
        num_blocks = group.min(config.num_blocks or blocks_for_memory(
            self._kv_memory(), self.kv_bytes_per_token, config.block_size))
        if num_blocks < 1:  # agreed, so every rank raises it
            raise parallel.SharedError(f"KV cache memory holds no block of {block_bytes} bytes")
        num_swap_blocks = group.min(config.swap_space // block_bytes)
        with group.together():
            self._check_memory(num_blocks * block_bytes, num_swap_blocks * block_bytes)
        self.weight_bytes = _nbytes(model)
        self.runner = ModelRunner(model, self.device, num_blocks, num_swap_blocks,
                                  config.block_size, Sampler(self.device),
                                  # MPI all-reduces run on the host: a TP step cannot be captured
                                  cuda_graphs=not config.enforce_eager and group.world == 1,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len)
        if group.rank > 0:
            return  # a worker holds its shard and KV pool; rank 0 owns all below
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size, num_swap_blocks,
                                          config.enable_prefix_caching)
        self.cost = self._cost_model(model)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len,
                                   self.kv_bytes_per_token, self.cost)
        self.metrics = Metrics(num_blocks)
        self.metrics_writer = (MetricsWriter(config.metrics_file, config.metrics_prom)
                               if config.metrics_file or config.metrics_prom else None)
        self.rng = np.random.default_rng(config.seed % 2**64)  # any int seed, as the sampler's
        self.next_id = 0
        self.arrival_times: list[float] = []  # of every request added, for the arrived count

    # ---- start-up -----------------------------------------------------------------------
    def _kv_bytes_per_token(self, shard) -> int:
        return kv_bytes_per_token(self.model_config, shard.num_kv_heads, np.dtype(self.device.dtype).itemsize)

    def _kv_memory(self) -> int:
        if self.config.kv_cache_memory:
            return self.config.kv_cache_memory
        if self.device.kind == "gpu":
            # Measured after every rank has loaded its weights (the together block above).
            free = self.device.free_memory()
            sharing = len(range(self.group.rank % gpu_count(), self.group.world, gpu_count()))
            return int(free * GPU_MEMORY_UTILIZATION) // sharing
        return DEFAULT_CPU_KV_MEMORY

    def _check_memory(self, kv_bytes: int, swap_bytes: int) -> None:
        """Refuse a KV pool or swap space the machine cannot hold, before allocating it (else
        a NumPy or CuPy error, or the kernel killing the process once the pages are used).
        The KV pool is written as it fills, so it must fit in what is free now; swap space is
        only touched under preemption, so it must fit in the machine's memory."""
        free = self.device.free_memory()
        if kv_bytes > free:
            where = "GPU" if self.device.kind == "gpu" else "host"
            raise NanoError(f"a KV cache of {kv_bytes / 1e9:.2f} GB does not fit: {free / 1e9:.2f} GB of "
                            f"{where} memory is available (give a smaller --kv-cache-memory or --num-blocks)")
        _, total = host_memory()
        if swap_bytes > total:
            raise NanoError(f"swap space of {swap_bytes / 1e9:.2f} GB does not fit: this machine has "
                            f"{total / 1e9:.2f} GB of memory (give a smaller --swap-space)")

    def _cost_model(self, model) -> CostModel:
        flops, bandwidth, link = DEVICE_PRIORS[self.device.kind]
        params = self.weight_bytes / np.dtype(self.device.dtype).itemsize
        prior = (self.weight_bytes / bandwidth, 2 * params / flops, 2 * params / flops,
                 self.kv_bytes_per_token / bandwidth)
        return CostModel(prior, swap_bandwidth=link)

    def describe(self) -> str:
        bm, bs = self.block_manager, self.config.block_size
        per_seq = bm.num_blocks_for(self.max_model_len)
        return (f"model {self.model_dir.name} on {self.device.kind}: weights {self.weight_bytes / 1e6:.0f} MB; "
                f"KV cache {self.kv_bytes_per_token} bytes/token, {bm.num_blocks} blocks of {bs} tokens "
                f"({bm.num_blocks * bs} tokens, {bm.num_blocks * bs * self.kv_bytes_per_token / 1e9:.2f} GB); "
                f"batch ceiling {bm.num_blocks // per_seq} sequences of {self.max_model_len} tokens; "
                f"swap space {bm.num_swap_blocks} blocks" + self._describe_ranks())

    def _describe_ranks(self) -> str:
        """Under TP the figures above are rank 0's. Every rank has the same number of blocks
        (so the same batch ceiling), but a block holds only that rank's KV heads."""
        if self.group.world == 1:
            return ""
        lines = [f"\ntensor parallel over {self.group.world} ranks (figures above: rank 0), "
                 f"each {self.block_manager.num_blocks} blocks:"]
        for p in self.shards:
            per_token = self._kv_bytes_per_token(p)
            pool = self.block_manager.num_blocks * self.config.block_size * per_token
            lines.append(f"  rank {p.rank}: query heads {p.q_heads.start}..{p.q_heads.stop - 1}, "
                         f"KV heads {p.kv_heads.start}..{p.kv_heads.stop - 1}: "
                         f"KV cache {per_token} bytes/token, {pool / 1e9:.2f} GB")
        return "\n".join(lines)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> Sequence:
        """Queue a request. A future arrival_time makes it invisible to the scheduler until then
        (how the --request-rate bench replays a Poisson arrival trace). Bad input raises
        NanoError here, before anything is queued: once in a step, it would fail the step."""
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
        self.arrival_times.append(seq.arrival_time)
        self.scheduler.add(seq)
        return seq

    def reset_metrics(self) -> None:
        self.metrics = Metrics(self.block_manager.num_blocks)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward pass over a freshly decided batch; returns sequences that finished."""
        start = self.clock.now()
        plan = self.scheduler.schedule(start)
        swap_bytes, swap_seconds = self.runner.swap(plan)
        finished = list(plan.finished)
        packed, sampling = self.runner.pack(plan) if plan.scheduled else (None, [])
        if self.group.world > 1:  # the other ranks replay the step on their shards
            self.group.broadcast(parallel.encode_step(plan.blocks_to_swap_out,
                                                      plan.blocks_to_swap_in, packed))
        if plan.scheduled:
            logits = self.runner.forward(self.runner.load(packed))
            tokens = self.runner.sample(logits, sampling)
            finished += self._postprocess(plan, sampling, tokens)
        elif not finished and self.scheduler.has_work():
            self._idle(start)
            return []
        self._observe(plan, start, swap_bytes, swap_seconds, finished)
        return finished

    def _idle(self, now: float) -> None:
        """Nothing could run: only requests that have not arrived yet are left; wait for one."""
        arrival = self.scheduler.next_arrival()
        if arrival is None:
            raise RuntimeError("scheduler made no progress")  # a bug, never a user error
        self.clock.sleep(arrival - now)

    def run_worker(self) -> None:
        """Ranks > 0: replay the steps rank 0 broadcasts on this rank's shard until it stops."""
        while (message := self.group.broadcast(None)) is not None:
            swap_out, swap_in, packed = parallel.decode_step(message)
            self.runner.swap(SchedulerOutput(blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in))
            if packed is not None:
                self.runner.forward(self.runner.load(packed))  # rank 0 alone samples

    def stop_workers(self) -> None:
        if self.group.world > 1:
            self.group.broadcast(None)

    def _postprocess(self, plan: SchedulerOutput, sampling: list[Sequence],
                     tokens: list[int]) -> list[Sequence]:
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.register_full_blocks(seq)
        now, finished = self.clock.now(), []
        for seq, token in zip(sampling, tokens):
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
        if token in self.eos_ids and not seq.params.ignore_eos:
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _observe(self, plan, start, swap_bytes, swap_seconds, finished) -> None:
        now = self.clock.now()
        seconds = now - start
        prefill = sum(n for _, n in plan.scheduled if n > 1)
        decodes = sum(1 for _, n in plan.scheduled if n == 1)
        context = sum(s.num_computed_tokens for s, n in plan.scheduled if n == 1)  # KV the decodes read
        if plan.scheduled:
            self.cost.observe_step(prefill, decodes, context, seconds - swap_seconds)
        self.cost.observe_swap(swap_bytes, swap_seconds)
        self.metrics.on_step(plan, seconds, self.block_manager.num_free_blocks, swap_bytes,
                             *self.group.take_all_reduce_stats())
        for seq in finished:
            self.metrics.on_finish(seq)
        if self.metrics_writer and self.metrics.steps % self.config.metrics_interval == 0:
            self.metrics_writer.write(self.metrics.snapshot(now, self.queue_state(now)))

    def queue_state(self, now: float) -> QueueState:
        s = self.scheduler
        waiting = [q for q in s.waiting if q.arrival_time <= now]
        unfinished = waiting + s.running + list(s.swapped)
        return QueueState(
            arrived=sum(t <= now for t in self.arrival_times), running=len(s.running),
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

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request: out of its queue, its blocks freed, as if it never came."""
        if not seq.is_finished:
            self.scheduler.abort(seq)
            self.arrival_times.remove(seq.arrival_time)

    def decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids)


def _nbytes(model) -> int:
    arrays = [model.embed, model.final_norm] + ([] if model.lm_head is model.embed else [model.lm_head])
    for w in model.layers:
        arrays += [a for a in vars(w).values() if a is not None]
    return sum(a.nbytes for a in arrays)
