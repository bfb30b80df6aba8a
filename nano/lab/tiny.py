"""A tiny random-weight Llama folder for the lab's quick size: made once per process in a
temporary directory, so a quick run needs no download and takes seconds.

Two layers of width 64, a byte-level tokenizer of exactly `VOCAB` ids (no merges), float32
weights drawn with std 1/sqrt(fan_in). Its outputs are meaningless; its costs have the shape
of a real model's (a prefill token costs a matmul row, a decode reads its KV), which is all
the lab's quick checks need."""
import atexit
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 128, 512
MAX_POSITIONS = 4096                                 # room for the long prompts of chunking
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; 2 is EOS

_made: Path | None = None


def model_dir() -> Path:
    """The tiny model's folder, written on the first call of this process, removed at exit."""
    global _made
    if _made is None:
        root = Path(tempfile.mkdtemp(prefix="nano-lab-tiny-"))
        atexit.register(shutil.rmtree, root, True)
        _made = write_model(root / "tiny")
    return _made


def write_model(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": mat(VOCAB, HIDDEN), "model.norm.weight": norm()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": mat(HEADS * head_dim, HIDDEN),
                    p + "self_attn.k_proj.weight": mat(KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.v_proj.weight": mat(KV_HEADS * head_dim, HIDDEN),
                    p + "self_attn.o_proj.weight": mat(HIDDEN, HEADS * head_dim),
                    p + "mlp.gate_proj.weight": mat(INTERMEDIATE, HIDDEN),
                    p + "mlp.up_proj.weight": mat(INTERMEDIATE, HIDDEN),
                    p + "mlp.down_proj.weight": mat(HIDDEN, INTERMEDIATE)}
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": head_dim,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": MAX_POSITIONS,
              "vocab_size": VOCAB, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "bos_token": SPECIALS[1], "eos_token": SPECIALS[2]}, indent=2) + "\n")
    return folder


def _tokenizer() -> Tokenizer:
    """Byte-level, no merges: the specials, the 256 byte symbols, then fillers up to VOCAB."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = [f"<unused_{i}>" for i in range(VOCAB - len(SPECIALS) - len(alphabet))]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(SPECIALS + alphabet + fillers)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok
