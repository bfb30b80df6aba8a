"""Tensor parallelism: all the sharding lives here; the model only sees local head counts.

Attention is split by KV-head groups: each rank owns a contiguous range of KV
heads together with their query heads, so attention needs no communication.
The MLP's gate/up are split by output rows (columns of the activation) and
down by input columns; the attention output projection by input columns. Each
rank's o_proj / down produce partial sums that one all-reduce adds up, so a
layer costs two all-reduces. Embedding and LM head are replicated.
"""
from dataclasses import dataclass

import numpy as np

from nano.config import ModelConfig
from nano.model import LayerWeights, LlamaModel, rope_cos_sin


@dataclass
class ShardPlan:
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


def plan_shard(cfg: ModelConfig, rank: int, world: int) -> ShardPlan:
    inter = slice(cfg.intermediate_size * rank // world, cfg.intermediate_size * (rank + 1) // world)
    return ShardPlan(rank, world, range(cfg.num_heads), range(cfg.num_kv_heads), inter)


def _rows(heads: range, d: int) -> slice:
    return slice(heads.start * d, heads.stop * d)


def load_model(reader, cfg: ModelConfig, plan: ShardPlan, to_device, max_positions: int,
               all_reduce=None) -> LlamaModel:
    """Read only this rank's slices from the checkpoint and build the model on the device."""
    d = cfg.head_dim
    q_rows, kv_rows = _rows(plan.q_heads, d), _rows(plan.kv_heads, d)

    names = set(reader.names())
    get = reader.get

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = np.concatenate([get(p + "self_attn.q_proj.weight", rows=q_rows),
                              get(p + "self_attn.k_proj.weight", rows=kv_rows),
                              get(p + "self_attn.v_proj.weight", rows=kv_rows)])
        bias = None
        if p + "self_attn.q_proj.bias" in names:
            bias = to_device(np.concatenate([get(p + "self_attn.q_proj.bias", rows=q_rows),
                                             get(p + "self_attn.k_proj.bias", rows=kv_rows),
                                             get(p + "self_attn.v_proj.bias", rows=kv_rows)]))
        gate_up = np.concatenate([get(p + "mlp.gate_proj.weight", rows=plan.inter),
                                  get(p + "mlp.up_proj.weight", rows=plan.inter)])
        layers.append(LayerWeights(
            input_norm=to_device(get(p + "input_layernorm.weight")),
            qkv=to_device(qkv),
            qkv_bias=bias,
            o_proj=to_device(get(p + "self_attn.o_proj.weight", cols=q_rows)),
            post_norm=to_device(get(p + "post_attention_layernorm.weight")),
            gate_up=to_device(gate_up),
            down=to_device(get(p + "mlp.down_proj.weight", cols=plan.inter)),
        ))
    embed = to_device(get("model.embed_tokens.weight"))
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in names
    lm_head = embed if tied else to_device(get("lm_head.weight"))
    return LlamaModel(cfg, plan.num_heads, plan.num_kv_heads, embed, lm_head,
                      to_device(get("model.norm.weight")), layers,
                      to_device(rope_cos_sin(cfg, max_positions), keep_float32=True), all_reduce)
