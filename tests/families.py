"""Tiny models of the six model families nano is to serve, each made from a seed: the models whose
transformers outputs are recorded in tests/data/families/<case>.json (by
tests/make_family_reference.py, run by hand; see docs/testing.md).

make_model(case, folder) writes a folder as a Hugging Face checkpoint of that architecture
has it: config.json, model.safetensors (float32, the checkpoint's tensor names), a word-level
tokenizer.json and tokenizer_config.json. The weights are normal draws from the case's seed
in a fixed order, the same bytes wherever NumPy draws the same stream; weights_checksum says
which weights a JSON was recorded from (tests/test_family_reference.py fails when they differ).

config.json comes in two spellings of the same model (spelling=): "v4", as the checkpoints
on the Hub have it (rope_theta, rope_scaling, Gemma 3's rope_local_base_freq and
sliding_window_pattern), and "v5", as transformers 5 writes it (rope_parameters, per layer
type for Gemma 3, and layer_types).

Imports nothing but NumPy, safetensors, tokenizers and the standard library: the tests import
it in CI, where there is no torch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

SPELLINGS = ("v4", "v5")


def _config(architecture: str, model_type: str, *, hidden: int, layers: int, heads: int, kv_heads: int,
            head_dim: int, intermediate: int, vocab: int, tie: bool, bos, eos, **keys) -> dict:
    """A config.json in the v4 spelling: the keys every family shares, then the family's own."""
    return {"architectures": [architecture], "model_type": model_type, "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
            "max_position_embeddings": 256, "tie_word_embeddings": tie, "bos_token_id": bos,
            "eos_token_id": eos, "torch_dtype": "float32", **keys}


# Each case: the seed of its weights, its config.json (v4 spelling) and its tokenizer's special
# tokens by id (the family's own strings; the tokenizer's eos_token is the config's first eos).
# Every length and window is chosen so the reference prompts (up to 48 tokens) cross it.
CASES = {
    "llama": dict(seed=11, specials={0: "<unk>", 1: "<s>", 2: "</s>"}, config=_config(
        "LlamaForCausalLM", "llama", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
        intermediate=128, vocab=256, tie=True, bos=1, eos=2, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, attention_bias=False, mlp_bias=False)),
    # Llama 3.x: llama3 RoPE scaling. original_max_position_embeddings is 64 so that, at
    # head_dim 32 and theta 5e5, some frequencies are kept, some smoothed and most divided by
    # the factor (Llama 3.2's 8192 would leave this tiny model's short prompts nearly untouched).
    "llama3": dict(seed=12, specials={0: "<|begin_of_text|>", 1: "<|end_of_text|>", 2: "<|eot_id|>",
                                      3: "<unk>"}, config=_config(
        "LlamaForCausalLM", "llama", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
        intermediate=256, vocab=384, tie=False, bos=0, eos=[1, 2], hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=500000.0, attention_bias=False, mlp_bias=False,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64, "rope_type": "llama3"})),
    # Qwen2.5: q/k/v biases (always, no config key). Its configs carry a sliding_window that
    # use_sliding_window=false switches off, as here: the window must be ignored.
    "qwen2": dict(seed=13, specials={0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "<unk>"},
                  config=_config(
        "Qwen2ForCausalLM", "qwen2", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
        intermediate=160, vocab=320, tie=True, bos=0, eos=2, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False, sliding_window=16,
        max_window_layers=2)),
    # Qwen3: RMSNorm of each query and key head before RoPE; head_dim 32 != 64 / 4.
    "qwen3": dict(seed=14, specials={0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "<unk>"},
                  config=_config(
        "Qwen3ForCausalLM", "qwen3", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32,
        intermediate=128, vocab=448, tie=False, bos=0, eos=2, hidden_act="silu", rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, attention_bias=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=3)),
    # Mistral: every layer sees a window of 16 keys.
    "mistral": dict(seed=15, specials={0: "<unk>", 1: "<s>", 2: "</s>"}, config=_config(
        "MistralForCausalLM", "mistral", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16,
        intermediate=128, vocab=288, tie=False, bos=1, eos=2, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=16)),
    # Gemma 3 (text): layers 0, 1, 3 slide over 12 keys with RoPE base 1e4, layer 2 is global
    # with base 1e6; scores scaled by 24^-0.5, not head_dim^-0.5; eos is <eos> or <end_of_turn>.
    "gemma3_text": dict(seed=16, specials={0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>",
                                           105: "<start_of_turn>", 106: "<end_of_turn>"}, config=_config(
        "Gemma3ForCausalLM", "gemma3_text", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32,
        intermediate=192, vocab=512, tie=True, bos=2, eos=[1, 106], pad_token_id=0,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=None, sliding_window=12, sliding_window_pattern=3,
        query_pre_attn_scalar=24, attention_bias=False, attn_logit_softcapping=None,
        final_logit_softcapping=None)),
}


def config(case: str, spelling: str = "v4") -> dict:
    """The case's config.json contents in `spelling` (SPELLINGS)."""
    cfg = json.loads(json.dumps(CASES[case]["config"]))  # a deep copy
    if spelling not in SPELLINGS:
        raise ValueError(f"spelling must be one of {SPELLINGS}, got {spelling!r}")
    return cfg if spelling == "v4" else _v5(cfg)


def _rope(theta: float, scaling: dict | None) -> dict:
    return {"rope_type": "default", "rope_theta": theta} | (scaling or {})


def _v5(cfg: dict) -> dict:
    """The v4 config as transformers 5 writes it: the RoPE numbers in rope_parameters (one set
    per layer type for Gemma 3, whose rope_scaling applies to its global layers alone), the
    attention kind of each layer in layer_types, dtype for torch_dtype."""
    cfg["dtype"] = cfg.pop("torch_dtype")
    theta, scaling = cfg.pop("rope_theta"), cfg.pop("rope_scaling", None)
    layers = cfg["num_hidden_layers"]
    if cfg["model_type"] == "gemma3_text":
        pattern = cfg.pop("sliding_window_pattern")
        cfg["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                              for i in range(layers)]
        cfg["rope_parameters"] = {"full_attention": _rope(theta, scaling),
                                  "sliding_attention": _rope(cfg.pop("rope_local_base_freq"), None)}
        cfg["use_bidirectional_attention"] = False
    else:
        cfg["rope_parameters"] = _rope(theta, scaling)
    if cfg["model_type"] in ("qwen2", "qwen3"):  # a window only where use_sliding_window says so
        if not cfg["use_sliding_window"]:
            cfg["sliding_window"] = None
        cfg["layer_types"] = ["sliding_attention" if cfg["sliding_window"] is not None
                              and i >= cfg["max_window_layers"] else "full_attention" for i in range(layers)]
    return cfg


def _weight_shapes(cfg: dict) -> dict:
    """name -> (shape, mean, std), in the order they are drawn. Matrices have std 1/sqrt(fan_in)
    (not HF's 0.02) and norms std 0.1 around their identity (1, or 0 for Gemma's 1 + w), so that
    attention is far from uniform and the logits far from flat at this width."""
    hidden, inter, hd, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    family = cfg["model_type"]
    gemma = family == "gemma3_text"

    def mat(rows, cols):
        return (rows, cols), 0.0, cols ** -0.5

    def norm(size):
        return (size,), 0.0 if gemma else 1.0, 0.1

    shapes = {"model.embed_tokens.weight": mat(vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
        shapes |= {p + n + ".weight": norm(hidden) for n in norms}
        shapes |= {p + "self_attn.q_proj.weight": mat(q, hidden), p + "self_attn.k_proj.weight": mat(kv, hidden),
                   p + "self_attn.v_proj.weight": mat(kv, hidden), p + "self_attn.o_proj.weight": mat(hidden, q)}
        if family == "qwen2":
            shapes |= {p + f"self_attn.{n}_proj.bias": ((rows,), 0.0, 0.5) for n, rows in (("q", q), ("k", kv), ("v", kv))}
        if family in ("qwen3", "gemma3_text"):
            shapes |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
        shapes |= {p + "mlp.gate_proj.weight": mat(inter, hidden), p + "mlp.up_proj.weight": mat(inter, hidden),
                   p + "mlp.down_proj.weight": mat(hidden, inter)}
    shapes["model.norm.weight"] = norm(hidden)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = mat(vocab, hidden)
    return shapes


def weights(case: str, edit: dict | None = None) -> dict[str, np.ndarray]:
    """The case's tensors by checkpoint name: float64 normals from its seed, rounded to float32
    (edit: config keys changed first, for the shapes they give)."""
    rng = np.random.default_rng(CASES[case]["seed"])
    return {name: (mean + std * rng.standard_normal(shape)).astype(np.float32)
            for name, (shape, mean, std) in _weight_shapes(CASES[case]["config"] | (edit or {})).items()}


def weights_checksum(folder: Path, file: str = "model.safetensors") -> str:
    """sha256 of a folder's safetensors file by content (each tensor's name, dtype, shape and
    bytes, by name), not by file bytes, which the library's header layout may change."""
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(Path(folder) / file)).items()):
        digest.update(f"{name}|{tensor.dtype.str}|{tensor.shape}|".encode())
        digest.update(np.ascontiguousarray(tensor).tobytes())
    return digest.hexdigest()


def tokenizer(case: str) -> Tokenizer:
    """Word level, split on whitespace: the case's special tokens at their ids, every other id i
    the word "w<i>" (so "w17 w200" is [17, 200]); exactly vocab_size ids."""
    specials, vocab = CASES[case]["specials"], CASES[case]["config"]["vocab_size"]
    words = {specials.get(i, f"w{i}"): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    return tok


def _tokenizer_config(case: str) -> dict:
    cfg, specials = CASES[case]["config"], CASES[case]["specials"]
    eos = cfg["eos_token_id"][0] if isinstance(cfg["eos_token_id"], list) else cfg["eos_token_id"]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[cfg["bos_token_id"]],
            "eos_token": specials[eos], "unk_token": "<unk>", "add_bos_token": False,
            "model_max_length": cfg["max_position_embeddings"]}


def make_model(case: str, folder: Path, spelling: str = "v4", edit: dict | None = None) -> Path:
    """Write the case's model into `folder` (made if missing) and return it. edit: config keys
    changed, the weights drawn in the shapes they give: the family in another shape (such as a
    head_dim the CUDA kernels take), with no reference data."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config(case, spelling) | (edit or {}), indent=2) + "\n")
    save_file(weights(case, edit), str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer(case).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(case), indent=2) + "\n")
    return folder
