"""The tokenizer (Hugging Face tokenizers), with the model's special tokens and its chat
template's source (rendered by nano/chat)."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from nano.errors import NanoError, read_json


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
        cfg = read_json(cfg_path) if cfg_path.is_file() else {}
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
