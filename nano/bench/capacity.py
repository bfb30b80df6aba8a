"""Capacity planning: how many sequences fit, and how fast a decode step can possibly be.

The engine sizes its KV pool with the same functions (kv_cache.pool_memory, pool_blocks),
so `run.py --capacity` prints exactly what the engine will allocate.

  KV bytes per token = 2 (K and V) x layers x KV heads x (head_dim x bytes per element,
                       or head_dim + 2 for int8 values and their float16 scale; kv_cache.py)
  batch ceiling at context C = blocks in the pool // blocks one C-token sequence needs
  decode-step floor = (weight bytes + KV bytes read) / memory bandwidth
A decode step must read every weight once and every cached token of every sequence
once; nothing can make it faster than moving those bytes at the device's bandwidth.
"""
import time
from dataclasses import dataclass, field

import numpy as np

from nano import kv_cache
from nano.cli.output import kv_label
from nano.config import EngineConfig, ModelConfig, max_model_len
from nano.device import Device, ranks_on_gpu, select_device
from nano.tp import Partition, partition
from nano.weights import open_model

CONTEXTS = (512, 2048, 8192)  # the report's rows: those below the model context, then it

def measure_copy_bandwidth(xp, nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Bytes read + written per second by a large copy on the device `xp` (numpy or cupy)."""
    src = xp.ones(nbytes // 4, dtype=np.float32)
    dst = xp.empty_like(src)
    times = []
    for _ in range(reps + 1):
        if xp is np:
            start = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - start)
        else:
            begin, end = xp.cuda.Event(), xp.cuda.Event()
            begin.record()
            dst[...] = src
            end.record()
            end.synchronize()
            times.append(xp.cuda.get_elapsed_time(begin, end) / 1e3)
    return 2 * nbytes / float(np.median(times[1:]))  # the first copy warms up


def shard_num_params(cfg: ModelConfig, part: Partition, bias: bool, tied: bool) -> int:
    """Weights one rank holds (what tp.load_model loads), from shapes alone."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, part.inter.stop - part.inter.start
    qkv_rows = (part.num_heads + 2 * part.num_kv_heads) * d
    per_layer = (qkv_rows * h + bias * qkv_rows + h * part.num_heads * d  # qkv (+ bias), o_proj
                 + 3 * h * inter + 2 * h                                   # gate/up/down, norms
                 + 2 * h * cfg.sandwich_norms                              # output norms (Gemma 3)
                 + 2 * d * cfg.qk_norm)                                    # q/k head norms (Qwen3, Gemma 3)
    return cfg.num_layers * per_layer + cfg.vocab_size * h * (1 if tied else 2) + h


@dataclass
class CapacityReport:
    model: str
    device: str
    kv_memory: int                    # bytes given to the KV pool (per rank)
    kv_dtype: str                     # what the pool holds (cli.output.kv_label)
    block_size: int
    weight_bytes: int                 # per rank
    kv_bytes_per_token: int           # per rank
    kv_bytes_per_token_full: int      # the same model without GQA (one KV head per query head)
    kv_bytes_per_token_per_rank: list[int]
    num_blocks: int
    full_precision_blocks: int | None  # an int8 pool sized by memory: what the device's dtype would get
    bandwidth: float                  # bytes/s
    contexts: list[int] = field(default_factory=list)
    windows: tuple = ()               # per layer: its sliding window of keys, None = all (ModelConfig.windows)

    def ceiling(self, context: int) -> int:
        return self.num_blocks // -(-context // self.block_size)

    def windowed_ceiling(self, context: int) -> int:
        """The ceiling were each sliding-window layer to keep only the blocks its window can
        span (ceil(W / block_size) + 1, a window rarely starting on a block boundary) instead of
        the whole context, as nano's pool, one block table for every layer, does."""
        full = -(-context // self.block_size)
        blocks = sum(full if w is None else min(full, -(-w // self.block_size) + 1) for w in self.windows)
        return self.num_blocks * len(self.windows) // blocks

    def leftover_tokens(self, context: int) -> int:
        per_seq = -(-context // self.block_size)
        return (self.num_blocks - self.ceiling(context) * per_seq) * self.block_size

    def step_floor(self, batch: int, context: int) -> float:
        """Seconds for one decode step of `batch` sequences at `context` tokens each."""
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.bandwidth


def format_report(p: CapacityReport) -> str:
    gqa = p.kv_bytes_per_token_full / sum(p.kv_bytes_per_token_per_rank)
    lines = [
        f"model {p.model} on {p.device}; weights {p.weight_bytes / 1e6:.1f} MB per rank",
        f"KV cache per token  {p.kv_bytes_per_token} bytes on rank 0 ({p.kv_dtype})"
        + (f" (per rank: {', '.join(map(str, p.kv_bytes_per_token_per_rank))})"
           if len(p.kv_bytes_per_token_per_rank) > 1 else "")
        + f"; without GQA it would be {p.kv_bytes_per_token_full} ({gqa:.1f}x more)",
        f"KV pool             {p.kv_memory / 1e9:.2f} GB -> {p.num_blocks} blocks of {p.block_size} tokens "
        f"({p.num_blocks * p.block_size} tokens)",
        *([f"                    {p.num_blocks / p.full_precision_blocks:.2f}x the {p.full_precision_blocks} blocks "
           f"a full-precision pool gets from the same memory"] if p.full_precision_blocks else []),
        f"bandwidth           {p.bandwidth / 1e9:.1f} GB/s (measured copy, read + write)",
        *([f"sliding window      {sum(w is not None for w in p.windows)} of {len(p.windows)} layers see only their "
           f"last {', '.join(sorted({str(w) for w in p.windows if w is not None}))} keys; nano keeps every block "
           f"of a sequence (the last column: if those layers kept only their window's)"] if any(p.windows) else []),
        "",
        f"{'context':>8} {'ceiling':>8} {'left over':>10} {'step floor':>11} {'per token':>10} {'floor tok/s':>12}"
        + (f" {'windowed':>9}" if any(p.windows) else ""),
    ]
    for c in p.contexts:
        n = p.ceiling(c)
        windowed = f" {p.windowed_ceiling(c):>9}" if any(p.windows) else ""
        if n == 0:
            lines.append(f"{c:>8} {0:>8} {'-':>10} {'does not fit':>11}" + (f" {'':>10} {'':>12}{windowed}" if windowed else ""))
            continue
        step = p.step_floor(n, c)
        lines.append(f"{c:>8} {n:>8} {p.leftover_tokens(c):>7} tok {1e3 * step:>8.2f} ms "
                     f"{1e6 * step / n:>7.1f} us {n / step:>12.0f}{windowed}")
    lines.append("ceiling: sequences of that context that fit at once; left over: pool tokens unused "
                 "at the ceiling; floor: (weights + KV read) / bandwidth for one decode step at the ceiling")
    return "\n".join(lines)


def capacity_report(config: EngineConfig) -> CapacityReport:
    """What an engine built from `config` would allocate on rank 0, without loading any
    weights: the pool is sized by the engine's function, from the memory free now less the
    weights of the ranks that will share rank 0's GPU."""
    folder = open_model(config.model, tokenizer=False)
    cfg = folder.config
    bias, tied = cfg.attention_bias, cfg.tie_word_embeddings
    kind = select_device(config.device)
    device = Device(kind, 0, config.element_dtype(cfg, kind))
    shards = [partition(cfg, r, config.tp) for r in range(config.tp)]
    weight_bytes = [shard_num_params(cfg, s, bias, tied) * device.itemsize for s in shards]
    free = device.free_memory()
    if device.kind == "gpu":
        free -= sum(weight_bytes[r] for r in ranks_on_gpu(0, config.tp))
    def per_token_of(num_kv_heads):
        return kv_cache.bytes_per_token(cfg, num_kv_heads, config.kv_cache_dtype, device.itemsize)

    per_token = [per_token_of(s.num_kv_heads) for s in shards]
    memory = kv_cache.pool_memory(config, device.kind, free, 0, config.tp)
    context = max_model_len(config, cfg)
    return CapacityReport(
        model=folder.path.name, device=device.kind, kv_memory=memory,
        kv_dtype=kv_label(config.kv_cache_dtype, config.key_scheme, device.dtype), block_size=config.block_size,
        weight_bytes=weight_bytes[0], kv_bytes_per_token=per_token[0],
        kv_bytes_per_token_full=per_token_of(cfg.num_heads),
        kv_bytes_per_token_per_rank=per_token,
        num_blocks=kv_cache.pool_blocks(config, memory, per_token[0]),
        full_precision_blocks=None if config.kv_cache_dtype == "auto" or config.num_blocks else kv_cache.blocks_for_memory(
            memory, kv_cache.bytes_per_token(cfg, shards[0].num_kv_heads, "auto", device.itemsize), config.block_size),
        bandwidth=measure_copy_bandwidth(device.xp),
        contexts=sorted({c for c in CONTEXTS if c < context} | {context}), windows=cfg.windows)
