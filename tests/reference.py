"""An independent dense NumPy Llama forward pass, and tiny random models for tests.

DenseLlama shares nothing with the engine except file reading (CheckpointReader,
load_config): no paging, no batching, no kernels. Engine tests compare against it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from nano.weights import CheckpointReader, load_config


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class DenseLlama:
    def __init__(self, model_dir):
        cfg = load_config(Path(model_dir))
        if cfg.get("rope_scaling"):
            raise NotImplementedError("reference model has no rope_scaling")
        ckpt = CheckpointReader(Path(model_dir))
        names = set(ckpt.names())
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads", self.n_heads)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.n_heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = cfg.get("rope_theta", 10000.0)

        self.embed = ckpt.get("model.embed_tokens.weight")
        self.lm_head = ckpt.get("lm_head.weight") if "lm_head.weight" in names else self.embed
        self.norm = ckpt.get("model.norm.weight")
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            layer = {n[len(p):]: ckpt.get(n) for n in names if n.startswith(p)}
            self.layers.append(layer)
        # Answers already computed, by call: a shared (session) reference is asked for the
        # same prompts by test after test (every engine configuration against one forward).
        self._answers: dict = {}

    def _remember(self, key, compute):
        if key in self._answers:
            return self._answers[key]
        answer = self._answers[key] = compute()
        # Bounded, oldest out first: the default model's logits are 0.2 MB a position.
        while sum(getattr(a, "nbytes", 0) for a in self._answers.values()) > 64 * 2**20:
            self._answers.pop(next(iter(self._answers)))
        return answer

    def _rope(self, positions: np.ndarray):
        inv_freq = 1.0 / self.theta ** (np.arange(0, self.head_dim, 2) / self.head_dim)
        ang = positions[:, None] * inv_freq[None, :]
        ang = np.concatenate([ang, ang], axis=-1)[:, None, :]  # (T, 1, head_dim)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def _forward(self, ids: list[int], cache: list, start: int) -> np.ndarray:
        """Logits for `ids` at positions start..; `cache` holds per-layer [K, V] and grows."""
        T, hd, group = len(ids), self.head_dim, self.n_heads // self.n_kv
        x = self.embed[np.asarray(ids)]
        cos, sin = self._rope(np.arange(start, start + T, dtype=np.float64))
        # Query t (at position start+t) may see keys at positions <= start+t.
        mask = np.arange(start + T)[None, :] > np.arange(start, start + T)[:, None]
        for layer, kv in zip(self.layers, cache):
            h = _rms_norm(x, layer["input_layernorm.weight"], self.eps)
            q, k, v = (h @ layer[f"self_attn.{n}_proj.weight"].T + layer.get(f"self_attn.{n}_proj.bias", 0)
                       for n in "qkv")
            q = q.reshape(T, self.n_heads, hd)
            k = k.reshape(T, self.n_kv, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kv[0] = np.concatenate([kv[0], k])
            kv[1] = np.concatenate([kv[1], v.reshape(T, self.n_kv, hd)])
            qg = q.reshape(T, self.n_kv, group, hd)  # query heads grouped by their KV head
            scores = np.einsum("tkgd,skd->kgts", qg, kv[0]) / np.float32(np.sqrt(hd))
            scores = np.where(mask, -np.inf, scores)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("kgts,skd->tkgd", probs, kv[1]).reshape(T, -1)
            x = x + attn @ layer["self_attn.o_proj.weight"].T
            h = _rms_norm(x, layer["post_attention_layernorm.weight"], self.eps)
            gate = h @ layer["mlp.gate_proj.weight"].T
            up = h @ layer["mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ layer["mlp.down_proj.weight"].T
        return _rms_norm(x, self.norm, self.eps) @ self.lm_head.T

    def _empty_cache(self) -> list:
        empty = np.zeros((0, self.n_kv, self.head_dim), np.float32)
        return [[empty, empty] for _ in self.layers]

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """(T, vocab) float32 logits of a full causal forward over token_ids."""
        ids = [int(t) for t in token_ids]
        return self._remember(("logits", tuple(ids)),
                              lambda: self._forward(ids, self._empty_cache(), 0)).copy()

    def greedy(self, prompt_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
        """Greedily generated tokens (prompt excluded); like HF generate, a hit eos is included."""
        key = ("greedy", tuple(int(t) for t in prompt_ids), max_new_tokens, tuple(eos_ids))
        return list(self._remember(key, lambda: self._greedy(prompt_ids, max_new_tokens, eos_ids)))

    def _greedy(self, prompt_ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
        cache = self._empty_cache()
        logits = self._forward(list(prompt_ids), cache, 0)
        out = []
        while len(out) < max_new_tokens:
            tok = int(np.argmax(logits[-1]))
            out.append(tok)
            if tok in eos_ids:
                break
            logits = self._forward([tok], cache, len(prompt_ids) + len(out) - 1)
        return out


def assert_greedy_runs_agree(ref_seqs, seqs, tol: float) -> None:
    """Two greedy runs of the same requests (return_logits=True), `seqs` checked against
    `ref_seqs`: on every step both were fed the same tokens, logits within tol * max |ref|;
    each token of `seqs` the argmax of its own logits row; the runs may part only at a
    near-tie of the reference's top two logits (within 2 * tol * max |ref|, which rounding
    may break either way), and the comparison stops there, as their inputs then differ."""
    for r, s in zip(ref_seqs, seqs):
        for step, (lr, ls) in enumerate(zip(r.logits, s.logits)):
            scale = np.abs(lr).max()
            err = np.abs(ls - lr).max() / scale
            assert err <= tol, f"seq {r.seq_id} step {step}: relative logit error {err:.2e}"
            assert s.output_token_ids[step] == int(np.argmax(ls)), f"seq {r.seq_id} step {step}: not greedy"
            if r.output_token_ids[step] != s.output_token_ids[step]:
                top2 = np.sort(lr)[-2:]
                assert top2[1] - top2[0] <= 2 * tol * scale, f"seq {r.seq_id} step {step}: parted, no near-tie"
                break


# ---------------------------------------------------------------- tiny random models

# Real model shapes, for random-weight models on the GPU (make_random_model(dir, **shape)).
SMOLLM2_135M = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
LLAMA_32_1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256)

_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
           " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


# safetensors' tag and NumPy's dtype of each file dtype (bfloat16: its bits as uint16)
_FILE_DTYPES = {"float32": ("F32", np.float32), "float16": ("F16", np.float16), "bfloat16": ("BF16", np.uint16)}


def _write_safetensors(path: Path, tensors: dict, dtype: str) -> None:
    """Write `tensors` (name -> (shape, its float32 values as blocks in row-major order)) as a
    safetensors file of `dtype`, a block at a time: safetensors' NumPy API wants every tensor
    whole in memory and cannot write bfloat16."""
    tag, np_dtype = _FILE_DTYPES[dtype]
    header, offset = {}, 0
    for name, (shape, _) in tensors.items():
        size = math.prod(shape) * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for _, blocks in tensors.values():
            for block in blocks:
                f.write(_to_bf16_bits(block) if dtype == "bfloat16" else block.astype(np_dtype))


def _normal(rng, shape, mean, std):
    """The whole tensor as one block: float64 normals rounded to float32."""
    yield (mean + std * rng.standard_normal(shape)).astype(np.float32)


def _uniform(rng, shape, mean, std, block=2**16):
    """Uniform draws of the given mean and std (half-width std * sqrt(3)), `block` values at a
    time: float32 uniforms are ~15x cheaper to draw than float64 normals, and a block stays in
    cache through the arithmetic and the file dtype's conversion."""
    n = math.prod(shape)
    buf = np.empty(min(n, block), np.float32)
    for start in range(0, n, block):
        u = buf[:min(block, n - start)]
        rng.random(dtype=np.float32, out=u)
        u -= 0.5
        u *= std * math.sqrt(12)
        u += mean
        yield u


def _byte_tokenizer(vocab: int):
    """A byte-level tokenizer (no merges) with exactly `vocab` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab < len(_SPECIALS) + len(alphabet):
        raise ValueError(f"vocab must be at least {len(_SPECIALS) + len(alphabet)}")
    fillers = [f"<unused_{i}>" for i in range(vocab - len(_SPECIALS) - len(alphabet))]
    tokens = _SPECIALS + alphabet + fillers
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    return tok


def make_random_model(dir: Path, *, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                      vocab=512, max_pos=512, tie=True, bias=False, dtype="float32", seed=0,
                      uniform=False, qwen3=False) -> Path:
    """Write a random-weight HF Llama folder into `dir` and return it, with a byte-level
    tokenizer of exactly `vocab` ids (no download: it runs on the offline GPU machine too).
    Weights are normal draws; with `uniform`, uniform draws of the same mean and std, ~7x
    faster to make (the Llama-3.2-1B shape: ~6 s rather than ~40 on a 2-core VM): for models
    in real shapes, whose weights need only be random and seeded. With `qwen3`, a Qwen3 folder:
    a q_norm and k_norm per layer too, std 0.5 around 1 (far from the identity)."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads

    # Matrices use std 1/sqrt(fan_in) rather than HF's 0.02: at hidden=64 that
    # gives non-uniform attention and well-separated logits, so greedy
    # comparisons between engine and reference aren't decided by rounding.
    def mat(out_dim, in_dim):
        return (out_dim, in_dim), 0.0, 1 / math.sqrt(in_dim)

    norm = ((hidden,), 1.0, 0.1)
    specs = {"model.embed_tokens.weight": mat(vocab, hidden), "model.norm.weight": norm}  # name -> (shape, mean, std)
    if not tie:
        specs["lm_head.weight"] = mat(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = norm
        specs[p + "post_attention_layernorm.weight"] = norm
        specs[p + "self_attn.q_proj.weight"] = mat(heads * head_dim, hidden)
        specs[p + "self_attn.k_proj.weight"] = mat(kv_heads * head_dim, hidden)
        specs[p + "self_attn.v_proj.weight"] = mat(kv_heads * head_dim, hidden)
        specs[p + "self_attn.o_proj.weight"] = mat(hidden, heads * head_dim)
        specs[p + "mlp.gate_proj.weight"] = mat(intermediate, hidden)
        specs[p + "mlp.up_proj.weight"] = mat(intermediate, hidden)
        specs[p + "mlp.down_proj.weight"] = mat(hidden, intermediate)
        if bias:
            for n, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                specs[p + f"self_attn.{n}_proj.bias"] = ((rows * head_dim,), 0.0, 0.1)
        if qwen3:
            specs |= {p + f"self_attn.{n}_norm.weight": ((head_dim,), 1.0, 0.5) for n in ("q", "k")}
    rng, draw = np.random.default_rng(seed), _uniform if uniform else _normal
    # the draws are made as the file is written, in the order of `specs`
    _write_safetensors(dir / "model.safetensors",
                       {name: (shape, draw(rng, shape, mean, std)) for name, (shape, mean, std) in specs.items()},
                       dtype)

    config = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen3 else "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": max_pos,
        "vocab_size": vocab, "tie_word_embeddings": tie, "attention_bias": bias,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype,
    }
    (dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    _byte_tokenizer(vocab).save(str(dir / "tokenizer.json"))
    tok_config = {"add_bos_token": False, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                  "chat_template": _CHATML}
    (dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return dir
