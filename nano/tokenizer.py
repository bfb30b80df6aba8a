"""The tokenizer (Hugging Face tokenizers), with the model's special tokens and its chat
template's source (rendered by nano/chat)."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from nano import checks
from nano.errors import NanoError, read_file, read_json


class Tokenizer:
    def __init__(self, model_dir: Path, eos_token_ids=()):
        """eos_token_ids: the model's (config.json's, checked by ModelConfig); the tokenizer's
        own eos_token is one too. Generation stops at any of them."""
        model_dir = Path(model_dir)
        path, cfg_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
        source = read_file(path, 256 << 20)  # the largest real ones are ~35 MB
        try:
            # The library's tokenizer is public: add-ons read the vocabulary from it (grammars,
            # the chat template's special tokens, the bytes of the server's logprobs).
            self.hf = tokenizers.Tokenizer.from_str(source.decode())
        except Exception as e:  # the library raises a bare Exception for a bad file
            raise NanoError(f"cannot load {path}: {e}") from None
        self.num_ids = max(self.hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        cfg = read_json(cfg_path) if cfg_path.exists() else {}
        if not isinstance(cfg, dict):
            raise NanoError(f"{cfg_path} is not a JSON object")

        def token(key):  # a string, or an AddedToken dict
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            return None if value is None else checks.text(f"{cfg_path} {key}", value)

        self.bos_token, self.eos_token = token("bos_token"), token("eos_token")
        template = cfg.get("chat_template")
        # named: HF uses "default"
        if isinstance(template, list) and all(isinstance(t, dict) for t in template):
            template = next((t.get("template") for t in template if t.get("name") == "default"),
                            None)
        self.chat_template = None if template is None else checks.text(f"{cfg_path} chat_template",
                                                                       template)

        add_bos = checks.flag(f"{cfg_path} add_bos_token",
                              cfg.get("add_bos_token") or False) and self.bos_token
        self._bos_id = self.hf.token_to_id(self.bos_token) if add_bos else None
        if add_bos and self._bos_id is None:
            raise NanoError(f"{cfg_path} bos_token {self.bos_token!r:.40} is not a token of {path}")

        # The same tokenizer with special-token matching off (tokenizers' encode_special_tokens),
        # for text a user typed: "<|im_end|>" in it is those ten characters, not the end of a turn.
        self._plain = tokenizers.Tokenizer.from_str(self.hf.to_str())
        self._plain.encode_special_tokens = True

        eos_id = self.hf.token_to_id(self.eos_token) if self.eos_token is not None else None
        self.eos_token_ids: set[int] = (set(eos_token_ids)
                                        | ({eos_id} if eos_id is not None else set()))

    def encode(self, text: str, plain: bool = False) -> list[int]:
        """plain: user text, in which a special token's text is plain text (never the token)."""
        return self.encode_parts([(text, plain)])

    def encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Text given as (text, plain) parts, each tokenized on its own (as the tokenizer itself
        splits text at special tokens); the BOS token first if the model wants one."""
        ids = [self._bos_id] if self._bos_id is not None else []
        for text, plain in parts:
            if text:
                ids += (self._plain if plain else self.hf).encode(text,
                                                                  add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
