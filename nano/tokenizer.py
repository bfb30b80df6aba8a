"""The tokenizer (Hugging Face tokenizers) and the chat template (Jinja, as transformers)."""

from __future__ import annotations

import json
from datetime import datetime
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
