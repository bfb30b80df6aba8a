"""Model folders and the checkpoint reader. A model is a Hugging Face style folder (config.json,
*.safetensors, tokenizer.json, tokenizer_config.json). Those nano knows by name (FETCHED) live
in weights/, made on first use by nano/default_model (run.py calls it before loading)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nano.config import ModelConfig
from nano.device import to_float32
from nano.errors import NanoError, read_json
from nano.tokenizer import Tokenizer
from nano.tp import check_checkpoint

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
FETCHED = (DEFAULT_MODEL, "gemma-3-270m")  # the names nano/default_model fetches (its MODELS)
WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def resolve_model(model: str | None) -> Path:
    """Return the folder of `model`: a name of FETCHED (None: the default) or a path to a HF
    folder."""
    if model is None or model in FETCHED:
        folder = WEIGHTS_DIR / (model or DEFAULT_MODEL)
        if not is_complete(folder):
            raise NanoError(f"weights/{folder.name} is not there yet: python -m nano.default_model "
                            f"{folder.name} "
                            f"fetches and converts it (run.py does on first use)")
        return folder
    if not isinstance(model, (str, os.PathLike)):
        raise NanoError(f"model must be a folder path, got {model!r:.40}")
    folder = Path(model)
    if not folder.is_dir():
        raise NanoError(f"model folder not found: {model}")
    # anything but a regular file is refused as it is read
    if not (folder / "config.json").exists():
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
    structure (every tensor's bytes inside its file) and names (tp.check_checkpoint), the tokenizer
    (if asked for; its ids are embedding rows). Damage is a NanoError. Shapes: as they load
    (tp.load_model)."""
    folder = resolve_model(model)
    config, reader = ModelConfig.from_hf(load_config(folder)), CheckpointReader(folder)
    check_checkpoint(config, reader.names())
    tok = Tokenizer(folder, config.eos_token_ids) if tokenizer else None
    if tok and tok.num_ids > config.vocab_size:
        raise NanoError(f"{folder / 'tokenizer.json'} has token ids up to {tok.num_ids - 1}, past "
                        f"config.json vocab_size {config.vocab_size}")
    return ModelFolder(folder, config, reader, tok)


def is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in MODEL_FILES)


def load_config(model_dir: Path) -> dict:
    return read_json(Path(model_dir) / "config.json")


class CheckpointReader:
    """Reads float tensors from *.safetensors files, memory-mapped: get(name, rows=...)
    touches only those rows' bytes, so a tensor-parallel rank pays only for its shard. A folder
    without an index holds one file, `single` (a LoRA adapter's is adapter_model.safetensors)."""

    _DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}

    def __init__(self, model_dir: Path, single: str = "model.safetensors"):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            contents = read_json(index)
            weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
            if not isinstance(weight_map, dict):
                raise NanoError(f"{index} has no weight_map object")
            files = sorted(set(map(str, weight_map.values())))
        else:
            files = [single]
        self._tensors = {}  # name -> (its bytes, memory-mapped; dtype string; shape)
        for fname in files:
            self._read_header(model_dir / fname)

    def _read_header(self, path: Path) -> None:
        """Index one file's tensors, checking that each one's bytes lie inside the file: a
        truncated or damaged file fails here, with its name, not while the model runs."""
        def damaged(why: str):
            return NanoError(f"{path} is damaged or truncated: {why}")

        if not path.is_file():
            raise NanoError(f"{path} is not a regular file" if path.exists()
                            else f"missing checkpoint file: {path}")
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > min(size - 8, 10**8):  # the format caps headers at 100 MB
                raise damaged(f"its header says {header_len} bytes, but the file has {size} and "
                              f"headers are <= 100 MB")
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
                # others: get() refuses them
                itemsize = self._DTYPES[dtype].itemsize if dtype in self._DTYPES else None
            # a dtype that is a list, a size of 1e999
            except (TypeError, KeyError, ValueError, OverflowError):
                raise damaged(f"bad header entry for {name}: {info!r:.80}") from None
            if not 0 <= start <= end <= size - base:
                raise damaged(f"tensor {name} ends at byte {end} of the data, which holds "
                              f"{size - base}")
            if itemsize and (min(shape, default=0) < 0
                             or end - start != math.prod(shape) * itemsize):
                raise damaged(f"tensor {name} of shape {shape} has {end - start} bytes")
            self._tensors[name] = (data[base + start:base + end], dtype, shape)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name) -> tuple[int, ...]:
        return self._entry(name)[2]

    def get(self, name, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """The tensor (or a slice of it) as C-contiguous float32."""
        data, dtype, shape = self._entry(name)
        if dtype not in self._DTYPES:
            raise NanoError(f"unsupported dtype {dtype} for tensor {name}")
        arr = data.view(self._DTYPES[dtype]).reshape(shape)
        if rows is not None:
            arr = arr[rows]
        if cols is not None:  # of a matrix: tp.load_model checks each tensor's shape first
            arr = arr[:, cols]
        return np.ascontiguousarray(to_float32(arr))  # BF16's bits are device.BFLOAT16's

    def _entry(self, name):
        try:
            return self._tensors[name]
        except KeyError:
            raise NanoError(f"tensor not found in checkpoint: {name}") from None
