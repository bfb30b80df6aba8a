"""The Llama-family forward pass, written once against a set of ops (ops.OpSet, chosen when
the shard is loaded: NumPy or CUDA kernels, batch-invariant or not).

One straight line per step: embed -> per layer [RMSNorm (+ residual), fused QKV, (q/k head
norms,) RoPE + KV-cache write, attention (in the layer's window), output projection, (its norm,)
RMSNorm, fused gate/up, SiLU*up or GELU*up, down, (its norm)] -> final norm -> LM head on the
rows that sample or score a prompt (plan.StepPlan); the parts in brackets and what else
differs by family: docs/models.md.
On the GPU a decode step of this function is captured once per batch-size bucket and
replayed as a CUDA graph (nano/graphs.py), so it must stay free of host synchronisation:
shapes and launch choices may depend only on array shapes, never on array values.
"""
from dataclasses import dataclass, field, fields

from nano.config import ModelConfig
from nano.kv_cache import KVCache
from nano.ops import OpSet


@dataclass
class ForwardBatch:
    """One step's flat inputs (built by runner.py). T = tokens this step, S = sequences.
    Sequences with one new token (decodes) come first; their rows are 0..num_decodes-1."""
    input_ids: object       # (T,) int32
    positions: object       # (T,) int32 position of each token in its sequence
    # (T,) int32 cache slot of each token (block * block_size + offset), -1 = skip
    slot_mapping: object
    num_decodes: int        # sequences 0..num_decodes-1 have exactly one token (one row each)
    # (S,) int32 tokens in the cache per sequence once this step's are written
    context_lens: object
    block_tables: object    # (S, max_blocks) int32, -1 padded
    # (S - num_decodes + 1,) int32 offsets of prefill chunks, relative to row num_decodes
    cu_seqlens_q: object
    logits_indices: object  # (R,) int32 rows whose next-token logits are needed
    lora_slots: object = None  # (S,) int32 each sequence's adapter slot, -1 = none (nano/lora)

    @classmethod
    def from_step(cls, views: dict, num_decodes: int) -> "ForwardBatch":
        """From the views of a packed step (plan.unpack_step), whose fields bear these names."""
        return cls(num_decodes=num_decodes,
                   **{f.name: views[f.name] for f in fields(cls) if f.name in views})


@dataclass
class LayerWeights:
    input_norm: object      # (H,)
    qkv: object             # ((nq + 2 nkv) * d, H)  q, k, v projections stacked
    qkv_bias: object        # ((nq + 2 nkv) * d,) or None
    o_proj: object          # (H, nq * d)
    post_norm: object       # (H,)
    gate_up: object         # (2 I, H)  gate and up stacked
    down: object            # (H, I)
    # (d,) RMSNorm weight of every q head before RoPE (Qwen3, Gemma 3), or None
    q_norm: object = None
    k_norm: object = None   # (d,) of every k head, or None
    attn_out_norm: object = None  # (H,) RMSNorm of the attention's output (Gemma 3), or None
    mlp_out_norm: object = None   # (H,) of the MLP's output, or None
    # LoRA adapters' pools (nano/lora): projection name -> (A, B, scales); empty without them
    lora: dict = field(default_factory=dict)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, num_heads: int, num_kv_heads: int, embed, lm_head,
                 final_norm, layers: list[LayerWeights], cos_sin, ops: OpSet, all_reduce=None):
        """Weights already on the device, already this rank's shard: num_heads / num_kv_heads
        are the local counts (tp.py does the splitting; the model never sees the global split)."""
        self.cfg, self.ops = cfg, ops
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.embed = embed              # (V, H)
        self.lm_head = lm_head          # (V, H), the embedding itself when tied
        self.final_norm = final_norm    # (H,)
        self.layers = layers
        # per layer: (max_positions, d) float32, one table per RoPE base
        self.cos_sin = cos_sin
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.all_reduce = all_reduce or (lambda x: x)  # sums partial outputs across TP ranks

    @property
    def nbytes(self) -> int:
        """Bytes of the weights this rank holds (a tied LM head counted once)."""
        arrays = ([self.embed, self.final_norm]
                  + ([] if self.lm_head is self.embed else [self.lm_head]))
        for w in self.layers:
            arrays += [a for a in vars(w).values() if hasattr(a, "nbytes")]
        return sum(a.nbytes for a in arrays)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> object:
        """kv_cache: the pool (nano/kv_cache.py). Returns logits (R, V) float32."""
        d, eps, ops = self.cfg.head_dim, self.cfg.rms_norm_eps, self.ops
        # GeGLU or SwiGLU
        act_mul = ops.gelu_tanh_mul if self.cfg.activation == "gelu_tanh" else ops.silu_mul
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        h = ops.embedding(batch.input_ids, self.embed, self.cfg.embed_scale)  # (T, H)
        residual = None
        # each projection plus its rows' adapters' product (nano/lora), or alone without them
        add_lora = ops.add_lora if self.layers[0].lora else lambda y, x, lora, batch: y
        for layer, w in enumerate(self.layers):
            x, residual = ops.add_rms_norm(h, residual, w.input_norm, eps)
            qkv = add_lora(ops.linear(x, w.qkv, w.qkv_bias), x, w.lora.get("qkv"), batch)
            q = qkv[:, :q_size].reshape(-1, self.num_heads, d)              # (T, nq, d)
            k = qkv[:, q_size:q_size + kv_size].reshape(-1, self.num_kv_heads, d)
            v = qkv[:, q_size + kv_size:].reshape(-1, self.num_kv_heads, d)
            cache = kv_cache.layer(layer)
            # rotated q (normed first); K, V cached
            q = ops.rope_store_kvcache(q, k, v, batch.positions, self.cos_sin[layer], cache,
                                       batch.slot_mapping,
                                       w.q_norm, w.k_norm, eps)
            o = ops.attention(q, cache, batch, self.scale, self.cfg.windows[layer]).reshape(
                -1, q_size)                                                   # (T, nq d)
            h = self.all_reduce(add_lora(ops.linear(o, w.o_proj), o, w.lora.get("o_proj"),
                                             batch))                          # (T, H)
            if w.attn_out_norm is not None:  # normed before it joins the residual stream
                h, _ = ops.add_rms_norm(h, None, w.attn_out_norm, eps)
            x, residual = ops.add_rms_norm(h, residual, w.post_norm, eps)
            act = act_mul(add_lora(ops.linear(x, w.gate_up), x, w.lora.get("gate_up"), batch))
            h = self.all_reduce(add_lora(ops.linear(act, w.down), act, w.lora.get("down"),
                                             batch))
            if w.mlp_out_norm is not None:
                h, _ = ops.add_rms_norm(h, None, w.mlp_out_norm, eps)
        x, _ = ops.add_rms_norm(h, residual, self.final_norm, eps)
        return ops.linear(x[batch.logits_indices], self.lm_head)             # (R, V)
