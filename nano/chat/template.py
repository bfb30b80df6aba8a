"""Chat templates: a conversation rendered into the prompt text its model was trained on
(the model's Jinja template, in the environment HF transformers uses), for the command
line's prompts (nano/cli) and the server's chat completions (nano/server)."""
import codecs
import json
import re
import weakref
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nano.errors import NanoError


def render(tokenizer, messages: str | list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
           chat_template: str | None = None) -> str:
    """Render a conversation (a list of {"role", "content"} and, for tool calls, "tool_calls",
    "tool_call_id", "name"; a string is one user message) the way HF transformers'
    apply_chat_template does, ready for the assistant's turn (unless add_generation_prompt is
    False: the server's /tokenize takes it). tools: OpenAI's tool dicts, as the template's
    `tools`; chat_template: a template in place of the tokenizer's (--chat-template)."""
    source = chat_template or tokenizer.chat_template
    if source is None:
        raise NanoError("this model has no chat template")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    try:
        return _compile_template(source).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except jinja2.TemplateError as e:  # a broken template, or one that raise_exception()s
        raise NanoError(f"the model's chat template failed: {e}") from None


# Placeholders for special-token text in messages: lone surrogates, which no user text holds
# (checks.text rejects them) and which a template passes through as any other character.
_PLACEHOLDERS = (0xD800, 0xE000)
# Each tokenizer's special tokens as one regex, made on its first conversation: listing them
# takes milliseconds where there are hundreds (Llama 3 reserves 256).
_SPECIAL_TOKENS = weakref.WeakKeyDictionary()


def special_tokens(tokenizer) -> re.Pattern | None:
    """A regex that finds the text of any of the tokenizer's special tokens (None: it has none),
    the longer first where one is a prefix of another: a regex takes the first that matches."""
    if tokenizer not in _SPECIAL_TOKENS:
        specials = sorted((t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        _SPECIAL_TOKENS[tokenizer] = re.compile("|".join(map(re.escape, specials))) if specials else None
    return _SPECIAL_TOKENS[tokenizer]


def load(source: str) -> str:
    """--chat-template's value as vLLM reads it: a file's path, or else (if it holds any of
    "{", "}" or a newline) the template itself, its backslash escapes read as Python's."""
    try:
        with open(source, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in source for c in "{}\n"):
            raise NanoError(f"--chat-template {source!r} looks like a file path, but it failed to be opened: "
                            f"{e.strerror}") from None
    return codecs.decode(source, "unicode_escape")


def encode(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
           chat_template: str | None = None) -> list[int]:
    """render(), tokenized with the template's own special tokens special and the messages'
    text plain: "<|im_end|><|im_start|>system" typed in a message is text, not a new turn.
    Special-token text in a message (any string in it: its content, its tool calls) or in the
    tools is swapped for a placeholder before rendering (so the template still sees, and may
    trim or split, the rest of the text), then tokenized on its own as plain text where the
    placeholder landed."""
    specials = special_tokens(tokenizer)
    spelled: dict[str, str] = {}  # placeholder -> the special token's text it stands for
    by_text: dict[str, str] = {}

    def hide(match: re.Match) -> str:
        if match.group() not in by_text:
            if _PLACEHOLDERS[0] + len(by_text) == _PLACEHOLDERS[1]:
                raise NanoError("the messages hold the text of too many different special tokens")
            by_text[match.group()] = chr(_PLACEHOLDERS[0] + len(by_text))
            spelled[by_text[match.group()]] = match.group()
        return by_text[match.group()]

    def hidden(value):  # every string in the messages and the tools, keys too
        if isinstance(value, str):
            return specials.sub(hide, value)
        if isinstance(value, dict):
            return {hidden(k): hidden(v) for k, v in value.items()}
        return [hidden(v) for v in value] if isinstance(value, list) else value

    if specials is not None:
        messages, tools = hidden(messages), hidden(tools)
    rendered = render(tokenizer, messages, add_generation_prompt, tools, chat_template)
    pieces = re.split("([\ud800-\udfff])", rendered)  # odd indexes: placeholders
    return tokenizer.encode_parts([(spelled[p], True) if i % 2 else (p, False) for i, p in enumerate(pieces)])


def _compile_template(source: str):
    # Same environment as transformers (utils/chat_template_utils.py).
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
