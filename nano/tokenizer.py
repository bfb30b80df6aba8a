"""The tokenizer (Hugging Face tokenizers), with the model's special tokens and its chat
template's source (rendered by nano/chat)."""

from __future__ import annotations

import re
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

        # The same tokenizer with special-token matching off (tokenizers' encode_special_tokens),
        # for text a user typed: "<|im_end|>" in it is those ten characters, not the end of a turn.
        self._plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
        self._plain.encode_special_tokens = True
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)  # longest first: the regex takes the first that matches
        self.special_tokens = re.compile("|".join(map(re.escape, specials))) if specials else None

        self.eos_token_ids: set[int] = set(eos_token_ids)
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self._tok.token_to_id(self.eos_token))

    def encode(self, text: str, plain: bool = False) -> list[int]:
        """plain: user text, in which a special token's text is plain text (never the token)."""
        return self.encode_parts([(text, plain)])

    def encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Text given as (text, plain) parts, each tokenized on its own (as the tokenizer itself
        splits text at special tokens); the BOS token first if the model wants one."""
        ids = [self._bos_id] if self._bos_id is not None else []
        for text, plain in parts:
            if text:
                ids += (self._plain if plain else self._tok).encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
