"""Prompt files (--prompt-file): plain text, one prompt per line, or JSONL with per-request
sampling overrides; and the chat template applied to them."""
import dataclasses
import json

from nano import checks
from nano.chat.template import render as render_chat
from nano.errors import NanoError
from nano.sequence import FIELD_RULES, SamplingParams

JSONL_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "seed": "seed", "ttft_slo_ms": "ttft_slo", "tpot_slo_ms": "tpot_slo"}


def ms(value: float | None) -> float | None:
    return None if value is None else value / 1e3


def read_requests(path: str, defaults: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """Prompts and their sampling parameters: plain text, one prompt per line, or JSONL with
    per-request overrides (latency targets in ms)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(i, line.rstrip("\n")) for i, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise NanoError(f"cannot read prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise NanoError(f"prompt file {path} is not UTF-8 text") from None
    if not lines:
        raise NanoError(f"prompt file {path} has no prompts")
    if not path.endswith(".jsonl"):
        return [(line, defaults) for _, line in lines]
    return [_jsonl_request(path, i, line, defaults) for i, line in lines]


def _jsonl_request(path: str, lineno: int, line: str, defaults: SamplingParams):
    """One line's prompt and its SamplingParams, each field checked by SamplingParams' own
    rule (FIELD_RULES) under the name the file gives it."""
    where = f"{path} line {lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise NanoError(f"{where}: not JSON ({e.msg})") from None
    except ValueError:  # Python reads no integer of over 4300 digits
        raise NanoError(f"{where}: a number too long to read") from None
    except RecursionError:
        raise NanoError(f"{where}: nested too deeply") from None
    if not isinstance(record, dict) or "prompt" not in record:
        raise NanoError(f'{where}: expected an object with a "prompt" string')
    unknown = set(record) - set(JSONL_FIELDS) - {"prompt"}
    if unknown:
        raise NanoError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    prompt = checks.text(f"{where}: field prompt", record.pop("prompt"))
    overrides = {}
    for key, value in record.items():
        field = JSONL_FIELDS[key]
        value = FIELD_RULES[field](f"{where}: field {key}", value)
        overrides[field] = ms(value) if key.endswith("_ms") else value
    return prompt, dataclasses.replace(defaults, **overrides)


def model_inputs(tokenizer, prompts: list[str], chat: bool) -> list[str]:
    """The text the model sees: each prompt in the chat template, unless --no-chat or the
    model has none."""
    if not chat or tokenizer.chat_template is None:
        return list(prompts)
    return [render_chat(tokenizer, p) for p in prompts]
