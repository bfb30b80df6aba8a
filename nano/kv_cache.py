"""The KV cache: its layout, its element types, and what one token of it costs.

Layout (one pool per TP rank, holding that rank's KV heads):
  data:   (num_layers, 2, num_blocks, nkv, block_size, d)   [:, 0] keys, [:, 1] values
          the device's dtype (--dtype's on a GPU, float32 on the CPU), or int8 with
          --kv-cache-dtype int8
  scales: (num_layers, 2, num_blocks, nkv, block_size) float16, int8 pools only (docs/int8-kv.md)
Why a block is contiguous per layer and KV head: docs/how-it-works.md#paged-kv-cache. A block's
scales sit at the same (layer, k/v, block) index as its data, so whatever moves a block (swap,
prefix-cache reuse, hand-off) moves data[:, :, b] and scales[:, :, b] together.
"""
from dataclasses import dataclass

import numpy as np

from nano.config import EngineConfig, ModelConfig
from nano.device import ranks_on_gpu

SCALE_DTYPE = np.float16
INT8_MAX = 127
DEFAULT_CPU_KV_MEMORY = 2 * 2**30
# Of the GPU memory still free once the weights are loaded (vLLM's gpu_memory_utilization
# is a fraction of the total instead).
GPU_FREE_MEMORY_FRACTION = 0.9


def bytes_per_token(cfg: ModelConfig, num_kv_heads: int, kv_cache_dtype: str,
                    device_itemsize: int) -> int:
    """KV bytes one token costs on a rank holding num_kv_heads: K and V of every layer and
    KV head, plus their scales in an int8 pool (the default model's: docs/int8-kv.md)."""
    rows = 2 * cfg.num_layers * num_kv_heads
    if kv_cache_dtype == "int8":
        return rows * (cfg.head_dim + np.dtype(SCALE_DTYPE).itemsize)
    return rows * cfg.head_dim * device_itemsize


# ---- pool sizing: the engine's (shard.py) and the capacity report's (nano/bench) --------
def blocks_for_memory(memory: int, bytes_per_token: int, block_size: int) -> int:
    return memory // (bytes_per_token * block_size)


def pool_memory(config: EngineConfig, device: str, free_after_weights: int, rank: int,
                world: int) -> int:
    """Bytes for rank's KV pool: --kv-cache-memory if given; on a GPU, a fraction of what is
    free once the weights of every rank on it are loaded, split among those ranks; on the
    CPU a fixed default."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    if device == "gpu":
        return int(free_after_weights * GPU_FREE_MEMORY_FRACTION) // len(ranks_on_gpu(rank, world))
    return DEFAULT_CPU_KV_MEMORY


def pool_blocks(config: EngineConfig, memory: int, bytes_per_token: int) -> int:
    """Blocks in the KV pool: --num-blocks if given, else as many as `memory` holds."""
    return config.num_blocks or blocks_for_memory(memory, bytes_per_token, config.block_size)


@dataclass
class LayerKV:
    """One layer's view of the cache, what the ops take."""
    k: object                       # (num_blocks, nkv, block_size, d) float or int8
    v: object                       # (num_blocks, nkv, block_size, d)
    k_scale: object = None          # (num_blocks, nkv, block_size) float16, int8 only
    v_scale: object = None
    k_rotate: bool = False          # K and q multiplied by the Hadamard matrix


class KVCache:
    """A pool of KV blocks (see the module docstring for the layout), on the device or, for
    swap space, in host memory."""

    def __init__(self, xp, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype, kv_cache_dtype: str, key_scheme: str | None = None):
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        int8 = kv_cache_dtype == "int8"
        # np.zeros maps pages lazily: swap space costs host memory only once used.
        self.data = xp.zeros(shape, dtype=np.int8 if int8 else dtype)
        self.scales = xp.zeros(shape[:-1], dtype=SCALE_DTYPE) if int8 else None
        self.k_rotate = key_scheme == "rotate"

    def layer(self, i: int) -> LayerKV:
        if self.scales is None:
            return LayerKV(self.data[i, 0], self.data[i, 1])
        return LayerKV(self.data[i, 0], self.data[i, 1], self.scales[i, 0], self.scales[i, 1],
                       self.k_rotate)

    def block_arrays(self) -> list:
        """Every array indexed by block on axis 2: what moves when a block moves."""
        return [self.data] if self.scales is None else [self.data, self.scales]

    @property
    def block_nbytes(self) -> int:
        """What one block holds, all layers and arrays."""
        return sum(a.nbytes // a.shape[2] for a in self.block_arrays())
