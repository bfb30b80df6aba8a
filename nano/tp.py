"""Tensor parallelism: all the sharding lives here; the model only sees local head counts.

Each rank owns a contiguous range of KV heads with their query heads (attention needs no
communication), gate/up by output rows, o_proj and down by input columns: their partial sums are a
layer's two all-reduces. Embedding, LM head and q/k norms are replicated (docs/tensor-parallel.md).
"""
from dataclasses import dataclass

import numpy as np

from nano.config import ARCHITECTURES, ROPE_TYPES, ModelConfig
from nano.errors import NanoError
from nano.model import LayerWeights, LlamaModel
from nano.ops import REFERENCE, OpSet


@dataclass
class Partition:
    """What one rank holds and computes."""
    rank: int
    world: int
    q_heads: range        # global query heads this rank computes
    kv_heads: range       # global KV heads this rank holds in its cache
    inter: slice          # MLP intermediate columns

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def partition(cfg: ModelConfig, rank: int, world: int) -> Partition:
    """What rank `rank` of `world` computes. Up to one rank per KV head, the KV heads are
    split into contiguous groups (the first ranks take one more when uneven) and each rank
    takes its heads' query heads. With more ranks than KV heads there is nothing left to
    split on the KV side: each rank holds one KV head (a copy, computed on every rank that
    shares it) and the ranks sharing it split that head's query heads."""
    nq, nkv = cfg.num_heads, cfg.num_kv_heads
    if world > nq:
        raise NanoError(f"--tp {world} is more ranks than the model's {nq} query heads")
    group = nq // nkv  # query heads per KV head
    if world <= nkv:
        kv = _split(nkv, world, rank)
        q = range(kv.start * group, kv.stop * group)
    else:
        head = next(h for h in range(nkv) if rank in _split(world, nkv, h))
        sharers = _split(world, nkv, head)
        local = _split(group, len(sharers), rank - sharers.start)
        kv = range(head, head + 1)
        q = range(head * group + local.start, head * group + local.stop)
    inter = _split(cfg.intermediate_size, world, rank)
    return Partition(rank, world, q, kv, slice(inter.start, inter.stop))


def _split(n: int, parts: int, i: int) -> range:
    """Part i of 0..n-1 cut into `parts` contiguous ranges, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (i < extra))


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads (load_model reads these, check_checkpoint holds a
    checkpoint to them), with the whole shape config.json implies."""
    d, h, inter, vocab = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d  # rows of q_proj, of k_proj and v_proj
    layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
             "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter)}
    if cfg.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                  "self_attn.v_proj.bias": (kv,)}
    if cfg.qk_norm:  # one weight for all q heads, one for all k heads
        layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    if cfg.sandwich_norms:  # post_attention_layernorm is then the attention output's norm
        layer |= {"pre_feedforward_layernorm.weight": (h,),
                  "post_feedforward_layernorm.weight": (h,)}
    head = {} if cfg.tie_word_embeddings else {"lm_head.weight": (vocab, h)}
    return {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), **head,
            **{f"model.layers.{i}.{name}": shape
               for i in range(cfg.num_layers) for name, shape in layer.items()}}


def check_checkpoint(cfg: ModelConfig, names) -> None:
    """Refuse a checkpoint with a tensor the forward does not read, or without one it reads. Let be,
    as transformers does: rotary_emb.inv_freq buffers (older transformers saved them; RoPE comes
    from config.json), a tied checkpoint's lm_head.weight (the head is the embedding, tied over
    it)."""
    shapes, forward = checkpoint_shapes(cfg), ARCHITECTURES[cfg.architecture][1]
    unused = sorted(n for n in set(names) - set(shapes) - {"lm_head.weight"}
                    if not n.endswith("rotary_emb.inv_freq"))
    missing = sorted(set(shapes) - set(names))
    for tensors, line in ((unused, "checkpoint tensor {} is not used by the {} forward"),
                          (missing, "checkpoint has no tensor {}, which the {} forward reads")):
        if tensors:
            raise NanoError(line.format(tensors[0], forward)
                            + (f" ({len(tensors) - 1} more)" if tensors[1:] else ""))


def load_model(reader, cfg: ModelConfig, part: Partition, to_device, max_positions: int,
               all_reduce=None, ops: OpSet = REFERENCE) -> LlamaModel:
    """Read only this rank's slices from the checkpoint and build the model, running ops, on the
    device."""
    # the rows of this rank's heads in q_proj, in k_proj and v_proj
    q_rows, kv_rows = (slice(heads.start * cfg.head_dim, heads.stop * cfg.head_dim)
                       for heads in (part.q_heads, part.kv_heads))
    shapes = checkpoint_shapes(cfg)

    def get(name, rows=None, cols=None):
        """A slice of a tensor whose whole shape must be what config.json implies."""
        if reader.shape(name) != shapes[name]:
            raise NanoError(f"tensor {name} has shape {reader.shape(name)}, config.json implies "
                            f"{shapes[name]}")
        return reader.get(name, rows=rows, cols=cols)

    def weight(array):  # a (N, K) matrix that ops.linear multiplies by
        return to_device(array, cpu_column_major=True)

    # an RMSNorm weight as the ops multiply by it (Gemma stores w for 1 + w)
    def norm(name, used=True):
        return to_device(get(name) + np.float32(cfg.norm_offset)) if used else None

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = np.concatenate([get(p + "self_attn.q_proj.weight", rows=q_rows),
                              get(p + "self_attn.k_proj.weight", rows=kv_rows),
                              get(p + "self_attn.v_proj.weight", rows=kv_rows)])
        bias = None
        if cfg.attention_bias:
            bias = to_device(np.concatenate([get(p + "self_attn.q_proj.bias", rows=q_rows),
                                             get(p + "self_attn.k_proj.bias", rows=kv_rows),
                                             get(p + "self_attn.v_proj.bias", rows=kv_rows)]))
        gate_up = np.concatenate([get(p + "mlp.gate_proj.weight", rows=part.inter),
                                  get(p + "mlp.up_proj.weight", rows=part.inter)])
        sandwich = cfg.sandwich_norms
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=weight(qkv),
            qkv_bias=bias,
            o_proj=weight(get(p + "self_attn.o_proj.weight", cols=q_rows)),
            post_norm=norm(p + ("pre_feedforward" if sandwich else "post_attention")
                           + "_layernorm.weight"),
            gate_up=weight(gate_up),
            down=weight(get(p + "mlp.down_proj.weight", cols=part.inter)),
            q_norm=norm(p + "self_attn.q_norm.weight", cfg.qk_norm),
            k_norm=norm(p + "self_attn.k_norm.weight", cfg.qk_norm),
            attn_out_norm=norm(p + "post_attention_layernorm.weight", sandwich),
            mlp_out_norm=norm(p + "post_feedforward_layernorm.weight", sandwich),
        ))
    # Replicated, not split by vocabulary: the model and the sampler stay unaware of TP.
    tied = cfg.tie_word_embeddings
    # tied: the LM head too
    embed = to_device(get("model.embed_tokens.weight"), cpu_column_major=tied)
    lm_head = embed if tied else weight(get("lm_head.weight"))
    local = [cfg.local_rope_theta is not None and window is not None for window in cfg.windows]
    tables = {kind: to_device(rope_cos_sin(cfg, max_positions, kind),
                              keep_float32=True) for kind in set(local)}
    return LlamaModel(cfg, part.num_heads, part.num_kv_heads, embed, lm_head,
                      norm("model.norm.weight"),
                      layers, [tables[kind] for kind in local], ops, all_reduce)


def rope_cos_sin(cfg: ModelConfig, max_positions: int, local: bool = False) -> np.ndarray:
    """(max_positions, d) float32: cos of each position's angles in [:, :d/2], sin in [:, d/2:].
    local: the table of the sliding-window layers' own base (cfg.local_rope_theta, unscaled)."""
    d, theta = cfg.head_dim, cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    # the types config.ROPE_TYPES lets through
    if not local and (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        inv_freq = _llama3_scaled(inv_freq, cfg.rope_scaling)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1+ long-context RoPE: slow down low frequencies, keep high ones, blend between."""
    factor, low, high, old_len = (s[key] for key in ROPE_TYPES["llama3"])
    wavelen = 2 * np.pi / inv_freq
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(wavelen < old_len / high, inv_freq,
                    np.where(wavelen > old_len / low, inv_freq / factor, scaled))

