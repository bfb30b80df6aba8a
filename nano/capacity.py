"""Capacity planning: how many sequences fit, and how fast a decode step can possibly be.

The engine sizes its KV pool with these same functions, so `run.py --plan`
prints exactly what the engine will allocate.

  KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element
  batch ceiling at context C = blocks in the pool // blocks one C-token sequence needs
  decode-step floor = (weight bytes + KV bytes read) / memory bandwidth
A decode step must read every weight once and every cached token of every sequence
once; nothing can make it faster than moving those bytes at the device's bandwidth.
"""
import os
import time
from dataclasses import dataclass, field

import numpy as np

from nano.config import ModelConfig

PLAN_CONTEXTS = (512, 2048, 8192)


def kv_bytes_per_token(cfg: ModelConfig, num_kv_heads: int, itemsize: int) -> int:
    return 2 * cfg.num_layers * num_kv_heads * cfg.head_dim * itemsize


def blocks_for_memory(memory: int, bytes_per_token: int, block_size: int) -> int:
    return memory // (bytes_per_token * block_size)


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory. Available is Linux's MemAvailable (free
    memory plus the page cache it can reclaim); elsewhere, what sysconf calls free."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, total
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * page, total


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


@dataclass
class CapacityPlan:
    model: str
    device: str
    kv_memory: int                    # bytes given to the KV pool (per rank)
    block_size: int
    weight_bytes: int                 # per rank
    kv_bytes_per_token: int           # per rank
    kv_bytes_per_token_full: int      # the same model without GQA (one KV head per query head)
    kv_bytes_per_token_per_rank: list[int]
    num_blocks: int
    bandwidth: float                  # bytes/s
    contexts: list[int] = field(default_factory=list)

    def ceiling(self, context: int) -> int:
        return self.num_blocks // -(-context // self.block_size)

    def leftover_tokens(self, context: int) -> int:
        per_seq = -(-context // self.block_size)
        return (self.num_blocks - self.ceiling(context) * per_seq) * self.block_size

    def step_floor(self, batch: int, context: int) -> float:
        """Seconds for one decode step of `batch` sequences at `context` tokens each."""
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / self.bandwidth


def plan_capacity(cfg: ModelConfig, model: str, device: str, kv_memory: int, block_size: int,
                  itemsize: int, weight_bytes: int, kv_heads_per_rank: list[int],
                  bandwidth: float, max_model_len: int) -> CapacityPlan:
    per_rank = [kv_bytes_per_token(cfg, h, itemsize) for h in kv_heads_per_rank]
    mine = per_rank[0]
    return CapacityPlan(
        model=model, device=device, kv_memory=kv_memory, block_size=block_size,
        weight_bytes=weight_bytes, kv_bytes_per_token=mine,
        kv_bytes_per_token_full=kv_bytes_per_token(cfg, cfg.num_heads, itemsize),
        kv_bytes_per_token_per_rank=per_rank,
        num_blocks=blocks_for_memory(kv_memory, mine, block_size), bandwidth=bandwidth,
        contexts=sorted({c for c in PLAN_CONTEXTS if c < max_model_len} | {max_model_len}))


def format_plan(p: CapacityPlan) -> str:
    gqa = p.kv_bytes_per_token_full / sum(p.kv_bytes_per_token_per_rank)
    lines = [
        f"model {p.model} on {p.device}; weights {p.weight_bytes / 1e6:.1f} MB per rank",
        f"KV cache per token  {p.kv_bytes_per_token} bytes on rank 0"
        + (f" (per rank: {', '.join(map(str, p.kv_bytes_per_token_per_rank))})"
           if len(p.kv_bytes_per_token_per_rank) > 1 else "")
        + f"; without GQA it would be {p.kv_bytes_per_token_full} ({gqa:.1f}x more)",
        f"KV pool             {p.kv_memory / 1e9:.2f} GB -> {p.num_blocks} blocks of {p.block_size} tokens "
        f"({p.num_blocks * p.block_size} tokens)",
        f"bandwidth           {p.bandwidth / 1e9:.1f} GB/s (measured copy, read + write)",
        "",
        f"{'context':>8} {'ceiling':>8} {'left over':>10} {'step floor':>11} {'per token':>10} {'floor tok/s':>12}",
    ]
    for c in p.contexts:
        n = p.ceiling(c)
        if n == 0:
            lines.append(f"{c:>8} {0:>8} {'-':>10} {'does not fit':>11}")
            continue
        step = p.step_floor(n, c)
        lines.append(f"{c:>8} {n:>8} {p.leftover_tokens(c):>7} tok {1e3 * step:>8.2f} ms "
                     f"{1e6 * step / n:>7.1f} us {n / step:>12.0f}")
    lines.append("ceiling: sequences of that context that fit at once; left over: pool tokens unused "
                 "at the ceiling; floor: (weights + KV read) / bandwidth for one decode step at the ceiling")
    return "\n".join(lines)


def plan_from_config(config) -> CapacityPlan:
    """What an engine built from `config` would allocate, without loading any weights."""
    from nano.engine import DEFAULT_CPU_KV_MEMORY, GPU_MEMORY_UTILIZATION
    from nano.runner import Device, select_device
    from nano.tp import plan_shard, shard_num_params
    from nano.weights import open_model

    folder = open_model(config.model, tokenizer=False)
    model_dir, cfg, names = folder.path, folder.config, set(folder.reader.names())
    bias = "model.layers.0.self_attn.q_proj.bias" in names
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in names
    device = Device(select_device(config.device))
    itemsize = np.dtype(device.dtype).itemsize
    shards = [plan_shard(cfg, r, config.tp) for r in range(config.tp)]
    weight_bytes = shard_num_params(cfg, shards[0], bias, tied) * itemsize
    if config.kv_cache_memory:
        memory = config.kv_cache_memory
    elif device.kind == "gpu":  # as the engine measures it: free memory once weights are loaded
        memory = int((device.free_memory() - weight_bytes) * GPU_MEMORY_UTILIZATION)
    else:
        memory = DEFAULT_CPU_KV_MEMORY
    max_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    plan = plan_capacity(cfg, model_dir.name, device.kind, memory, config.block_size, itemsize,
                         weight_bytes, [s.num_kv_heads for s in shards],
                         measure_copy_bandwidth(device.xp), max_len)
    if config.num_blocks:
        plan.num_blocks = config.num_blocks
    return plan
