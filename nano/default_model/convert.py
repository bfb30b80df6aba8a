"""A llama-architecture GGUF file -> a Hugging Face folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json).

GGUF stores the Q and K projection rows permuted for llama.cpp's interleaved RoPE; they
are put back in Hugging Face's order (rotate-half RoPE). The tokenizer is rebuilt from the
GGUF vocabulary and merges. Weights become float32 holding exactly the dequantized values.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tokenizers

from nano.errors import NanoError


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp rotates adjacent pairs (x0,x1),(x2,x3).. while HF rotates halves
    (x_i, x_{i+d/2}); the converter reorders each head's rows from [half0 | half1]
    to interleaved, i.e. reshape(h, 2, d/2).swapaxes(1, 2). This is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str:
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    return {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }[name]


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write a HF Llama folder into `out` from a llama-architecture GGUF file.

    Weights become float32 holding exactly the GGUF's dequantized values.
    """
    import gguf  # only needed here; the GPU machine runs without it
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    arch = meta["general.architecture"]
    n_head = meta[f"{arch}.attention.head_count"]
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    hidden = meta[f"{arch}.embedding_length"]

    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        tensors[_hf_name(t.name)] = np.ascontiguousarray(w)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    tokens = meta["tokenizer.ggml.tokens"]
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta["tokenizer.ggml.eos_token_id"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": meta.get(f"{arch}.rope.dimension_count", hidden // n_head),
        "rms_norm_eps": _f32(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta[f"{arch}.context_length"],
        "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    _build_tokenizer(meta).save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos_id],
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def _f32(x: float) -> float:
    """GGUF stores floats as float32: write 1e-05, not 9.999999747378752e-06."""
    return float(str(np.float32(x)))


_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types (llama.cpp's llama_token_type)


def _build_tokenizer(meta: dict) -> tokenizers.Tokenizer:
    """Rebuild SmolLM2's HF tokenizer (byte-level BPE) from the GGUF vocabulary."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise NanoError(f"unsupported GGUF tokenizer: {meta['tokenizer.ggml.model']}")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    # Matches SmolLM2's tokenizer.json ("tokenizer.ggml.pre" == "smollm"): every
    # digit is its own token, then the GPT-2 byte-level regex split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return tok


