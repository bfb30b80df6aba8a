"""The Llama-family forward pass, written once against `ops` (NumPy or CUDA).

One straight line per step: embed -> for each layer [RMSNorm (fused with the residual
add), fused QKV, RoPE fused with the KV-cache write, attention, output projection,
RMSNorm, fused gate/up, SiLU*up, down] -> final norm -> LM head on the rows that sample.
On the GPU a decode step of this function is captured once per batch-size bucket and
replayed as a CUDA graph (nano/graphs.py), so it must stay free of host synchronisation:
shapes and launch choices may depend only on array shapes, never on array values.
"""
from dataclasses import dataclass, fields

import numpy as np

from nano import ops
from nano.config import ROPE_TYPES, ModelConfig
from nano.kv_cache import KVCache, LayerKV


@dataclass
class ForwardBatch:
    """One step's flat inputs (built by runner.py). T = tokens this step, S = sequences.
    Sequences with one new token (decodes) come first; their rows are 0..num_decodes-1."""
    input_ids: object       # (T,) int32
    positions: object       # (T,) int32 position of each token in its sequence
    slot_mapping: object    # (T,) int32 cache slot of each token (block * block_size + offset), -1 = skip
    num_decodes: int        # sequences 0..num_decodes-1 have exactly one token (one row each)
    context_lens: object    # (S,) int32 tokens in the cache per sequence once this step's are written
    block_tables: object    # (S, max_blocks) int32, -1 padded
    cu_seqlens_q: object    # (S - num_decodes + 1,) int32 offsets of prefill chunks, relative to row num_decodes
    logits_indices: object  # (R,) int32 rows whose next-token logits are needed

    @classmethod
    def from_step(cls, views: dict, num_decodes: int) -> "ForwardBatch":
        """From the views of a packed step (plan.unpack_step), whose fields bear these names."""
        return cls(num_decodes=num_decodes, **{f.name: views[f.name] for f in fields(cls) if f.name in views})


@dataclass
class LayerWeights:
    input_norm: object      # (H,)
    qkv: object             # ((nq + 2 nkv) * d, H)  q, k, v projections stacked
    qkv_bias: object        # ((nq + 2 nkv) * d,) or None
    o_proj: object          # (H, nq * d)
    post_norm: object       # (H,)
    gate_up: object         # (2 I, H)  gate and up stacked
    down: object            # (H, I)


def rope_cos_sin(cfg: ModelConfig, max_positions: int) -> np.ndarray:
    """(max_positions, d) float32: cos of each position's angles in [:, :d/2], sin in [:, d/2:]."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3":  # the types config.ROPE_TYPES lets through
        inv_freq = _llama3_scaled(inv_freq, cfg.rope_scaling)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1+ long-context RoPE: slow down low frequencies, keep high ones, blend between."""
    factor, low, high, old_len = (s[key] for key in ROPE_TYPES["llama3"])
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(wavelen < old_len / high, inv_freq, np.where(wavelen > old_len / low, inv_freq / factor, scaled))


class LlamaModel:
    def __init__(self, cfg: ModelConfig, num_heads: int, num_kv_heads: int, embed, lm_head,
                 final_norm, layers: list[LayerWeights], cos_sin, all_reduce=None):
        """Weights already on the device, already this rank's shard: num_heads / num_kv_heads
        are the local counts (tp.py does the splitting; the model never sees the global split)."""
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.embed = embed              # (V, H)
        self.lm_head = lm_head          # (V, H), the embedding itself when tied
        self.final_norm = final_norm    # (H,)
        self.layers = layers
        self.cos_sin = cos_sin          # (max_positions, d) float32
        self.scale = cfg.head_dim ** -0.5
        self.all_reduce = all_reduce or (lambda x: x)  # sums partial outputs across TP ranks
        self.batch_invariant = False  # CPU: rows bitwise independent of the step (EngineConfig)

    @property
    def nbytes(self) -> int:
        """Bytes of the weights this rank holds (a tied LM head counted once)."""
        arrays = [self.embed, self.final_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for w in self.layers:
            arrays += [a for a in vars(w).values() if a is not None]
        return sum(a.nbytes for a in arrays)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> object:
        """kv_cache: the pool (nano/kv_cache.py). Returns logits (R, V) float32."""
        d, eps = self.cfg.head_dim, self.cfg.rms_norm_eps
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        linear = ops.invariant_linear if self.batch_invariant else ops.linear
        h = ops.embedding(batch.input_ids, self.embed)                       # (T, H)
        residual = None
        for layer, w in enumerate(self.layers):
            x, residual = ops.add_rms_norm(h, residual, w.input_norm, eps)
            qkv = linear(x, w.qkv, w.qkv_bias)                          # (T, (nq + 2 nkv) d)
            q = qkv[:, :q_size].reshape(-1, self.num_heads, d)              # (T, nq, d)
            k = qkv[:, q_size:q_size + kv_size].reshape(-1, self.num_kv_heads, d)
            v = qkv[:, q_size + kv_size:].reshape(-1, self.num_kv_heads, d)
            cache = kv_cache.layer(layer)
            q = ops.rope_store_kvcache(q, k, v, batch.positions, self.cos_sin, cache,
                                       batch.slot_mapping)                    # rotated q; K, V cached
            o = self._attention(q, cache, batch)                             # (T, nq, d)
            h = self.all_reduce(linear(o.reshape(-1, q_size), w.o_proj))  # (T, H)
            x, residual = ops.add_rms_norm(h, residual, w.post_norm, eps)
            h = self.all_reduce(linear(ops.silu_mul(linear(x, w.gate_up)), w.down))
        x, _ = ops.add_rms_norm(h, residual, self.final_norm, eps)
        return linear(x[batch.logits_indices], self.lm_head)             # (R, V)

    def _attention(self, q, cache: LayerKV, batch: ForwardBatch):
        """Decode rows through paged attention, prefill chunks through prefill attention."""
        nd = batch.num_decodes
        if self.batch_invariant:  # one attention for every row: its sequence's table, its position
            rows = np.concatenate([np.ones(nd, np.int64), np.diff(batch.cu_seqlens_q)])  # rows per sequence
            tables = np.repeat(batch.block_tables, rows, axis=0)
            return ops.invariant_attention(q, cache, tables, batch.positions, self.scale)
        if nd == q.shape[0]:
            return ops.paged_attention(q, cache, batch.block_tables, batch.context_lens, self.scale)
        prefill = ops.prefill_attention(q[nd:], cache, batch.cu_seqlens_q, batch.block_tables[nd:],
                                        batch.context_lens[nd:], self.scale)
        if nd == 0:
            return prefill
        decode = ops.paged_attention(q[:nd], cache, batch.block_tables[:nd], batch.context_lens[:nd],
                                     self.scale)
        return ops.concat([decode, prefill])
