"""Chat templates: a conversation rendered into the prompt text its model was trained on
(the model's Jinja template, in the environment HF transformers uses), for the command
line's prompts (nano/cli) and the server's chat completions (nano/server)."""
import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nano.errors import NanoError


def render(tokenizer, messages: str | list[dict]) -> str:
    """Render a conversation (a list of {"role", "content"}; a string is one user message)
    the way HF transformers' apply_chat_template does, ready for the assistant's turn."""
    if tokenizer.chat_template is None:
        raise NanoError("this model has no chat template")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    try:
        return _compile_template(tokenizer.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
        )
    except jinja2.TemplateError as e:  # a broken template, or one that raise_exception()s
        raise NanoError(f"the model's chat template failed: {e}") from None


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
