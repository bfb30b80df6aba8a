"""A GGUF file -> a Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), for the architectures in ARCHS (general.architecture: llama, gemma3).

Weights become float32 holding exactly the dequantized values, with two of llama.cpp's
changes undone: Llama's Q and K rows are permuted for its interleaved RoPE (HF rotates
halves), and Gemma's norm weights hold 1 + w (HF stores w; the model multiplies by 1 + w).
The tokenizer is rebuilt from the GGUF vocabulary as transformers' GGUF loader builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from nano.errors import NanoError


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp rotates adjacent pairs (x0,x1),(x2,x3).. while HF rotates halves
    (x_i, x_{i+d/2}); the converter reorders each head's rows from [half0 | half1]
    to interleaved, i.e. reshape(h, 2, d/2).swapaxes(1, 2). This is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {  # GGUF block tensor -> HF layer module, for every architecture
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# ffn_norm is the norm before the MLP: Llama calls it post_attention_layernorm, while Gemma
# has four norms per layer and that name means the one after attention.
_LLAMA_NAMES = _LAYER_NAMES | {"ffn_norm": "post_attention_layernorm"}
_GEMMA_NAMES = _LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class Arch:
    layer_names: dict[str, str]
    permute_qk: bool        # llama.cpp permuted Q/K rows for its RoPE
    norm_offset: float      # llama.cpp stored norm weights + this
    config: Callable[[dict, str], dict]  # (metadata, arch prefix) -> the config keys of this family
    tokenizer: Callable[[dict], tokenizers.Tokenizer]


def _hf_name(name: str, layer_names: dict[str, str]) -> str:
    if name.startswith("blk."):
        _, layer, kind, suffix = name.split(".")
        return f"model.layers.{layer}.{layer_names[kind]}.{suffix}"
    return {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }[name]


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write a HF folder into `out` from a GGUF file of an architecture in ARCHS."""
    import gguf  # only needed here; the GPU machine runs without it
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    name = meta["general.architecture"]
    if name not in ARCHS:
        raise NanoError(f"unsupported GGUF architecture: {name}")
    arch = ARCHS[name]
    n_head = meta[f"{name}.attention.head_count"]
    n_kv = meta.get(f"{name}.attention.head_count_kv", n_head)

    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if arch.permute_qk and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif arch.permute_qk and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        elif t.name.endswith("norm.weight"):
            w = w - np.float32(arch.norm_offset)
        tensors[_hf_name(t.name, arch.layer_names)] = np.ascontiguousarray(w)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    tokens = meta["tokenizer.ggml.tokens"]
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    hidden = meta[f"{name}.embedding_length"]
    config = {
        "hidden_size": hidden,
        "intermediate_size": meta[f"{name}.feed_forward_length"],
        "num_hidden_layers": meta[f"{name}.block_count"],
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": _f32(meta[f"{name}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get(f"{name}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta[f"{name}.context_length"],
        "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": bos_id,
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
        "torch_dtype": "float32",
    } | arch.config(meta, name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    tok = arch.tokenizer(meta)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos:  # for transformers, which reads it from tokenizer.json; nano reads add_bos_token
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", special_tokens=[(tokens[bos_id], bos_id)])
    tok.save(str(out / "tokenizer.json"))
    eos = config["eos_token_id"]
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer" if meta["tokenizer.ggml.model"] == "gpt2" else "GemmaTokenizer",
        "add_bos_token": add_bos,
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos[0] if isinstance(eos, list) else eos],
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def _f32(x: float) -> float:
    """GGUF stores floats as float32: write 1e-05, not 9.999999747378752e-06."""
    return float(str(np.float32(x)))


def _llama_config(meta: dict, name: str) -> dict:
    n_head = meta[f"{name}.attention.head_count"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "head_dim": meta.get(f"{name}.rope.dimension_count", meta[f"{name}.embedding_length"] // n_head),
    }


# Gemma 3 (text): what its GGUF metadata does not hold is fixed by the family, as in
# transformers' Gemma3TextConfig and google/gemma-3-270m's config.json.
_GEMMA3_GLOBAL_EVERY = 6  # every 6th layer attends to all keys, the others to a sliding window


def _gemma3_config(meta: dict, name: str) -> dict:
    layers = meta[f"{name}.block_count"]
    head_dim = meta[f"{name}.attention.key_length"]
    end_of_turn = meta["tokenizer.ggml.tokens"].index("<end_of_turn>")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": meta[f"{name}.attention.sliding_window"],
        "_sliding_window_pattern": _GEMMA3_GLOBAL_EVERY,
        "layer_types": ["full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_local_base_freq": 10000.0,
        "pad_token_id": meta["tokenizer.ggml.padding_token_id"],
        # a turn of the chat format ends with <end_of_turn>, the text with <eos>
        "eos_token_id": [meta["tokenizer.ggml.eos_token_id"], end_of_turn],
    }


_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types (llama.cpp's llama_token_type)


def _add_gguf_tokens(tok: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (kept
    whole, as llama.cpp matches them in the text) -- those the vocabulary holds as spelled:
    Gemma's runs of spaces are "▁▁.." there, found by the BPE, as transformers leaves them."""
    vocab = tok.get_vocab()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])


def _byte_level_bpe(meta: dict) -> tokenizers.Tokenizer:
    """SmolLM2's HF tokenizer (byte-level BPE) from the GGUF vocabulary and merges."""
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
    _add_gguf_tokens(tok, tokens, meta["tokenizer.ggml.token_type"])
    return tok


def _gemma_bpe(meta: dict) -> tokenizers.Tokenizer:
    """Gemma's HF tokenizer (SentencePiece BPE with byte fallback, "▁" for a space) from the
    GGUF vocabulary, as transformers builds it from a Gemma GGUF (GemmaTokenizer)."""
    if meta["tokenizer.ggml.model"] != "llama":
        raise NanoError(f"unsupported GGUF tokenizer: {meta['tokenizer.ggml.model']}")
    # GGUF spells the tokens of two or more spaces with spaces; the vocabulary with "▁".
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in meta["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab, _merges(tokens, vocab), unk_token="<unk>",
                                          fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_gguf_tokens(tok, meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])
    return tok


def _merges(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a vocabulary without merges implies (transformers' generate_merges):
    every split of a token into two tokens, ranked by the merged token's position in the
    file (Gemma's scores do not follow its merge order; the order does), then longer left
    and right parts first."""
    merges = []
    for merged in dict.fromkeys(tokens):
        pairs = [(merged[:i], merged[i:]) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        merges += sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))
    # reverse=True keeps equal keys in order, as transformers' sort does
    merges.sort(key=lambda p: (-vocab[p[0] + p[1]], len(p[0]), len(p[1])), reverse=True)
    return merges


ARCHS = {
    "llama": Arch(_LLAMA_NAMES, permute_qk=True, norm_offset=0.0, config=_llama_config,
                  tokenizer=_byte_level_bpe),
    "gemma3": Arch(_GEMMA_NAMES, permute_qk=False, norm_offset=1.0, config=_gemma3_config,
                   tokenizer=_gemma_bpe),
}
