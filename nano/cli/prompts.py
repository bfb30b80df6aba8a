"""Prompt files (--prompt-file): plain text, one prompt per line, or JSONL with per-request
sampling overrides; the chat template applied to them; and a run's requests as the engine
takes them (Workload)."""
import dataclasses
import json
import os
from typing import NamedTuple

from nano import checks, controls
from nano.chat.template import render as render_chat
from nano.errors import NanoError
from nano.sequence import FIELD_RULES, SamplingParams

JSONL_FIELDS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "min_p": "min_p", "seed": "seed", "stop_token_ids": "stop_token_ids",
                "ttft_slo_ms": "ttft_slo", "tpot_slo_ms": "tpot_slo"}


def ms(value: float | None) -> float | None:
    return None if value is None else value / 1e3


class Request(NamedTuple):
    """A prompt file's request: its prompt, its SamplingParams, and the adapter it names (a
    JSONL "lora" field: the name, until nano/lora's command line makes it a LoRARequest)."""
    prompt: str
    params: SamplingParams
    lora: object = None


def read_requests(path: str, defaults: SamplingParams) -> list[Request]:
    """Prompts and their sampling parameters: plain text, one prompt per line, or JSONL with
    per-request overrides (latency targets in ms) and adapters."""
    try:
        lines = _read_lines(path)
    except OSError as e:
        raise NanoError(f"cannot read prompt file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise NanoError(f"prompt file {path} is not UTF-8 text") from None
    if not lines:
        raise NanoError(f"prompt file {path} has no prompts")
    if not path.endswith(".jsonl"):
        return [Request(line, defaults) for _, line in lines]
    return [_jsonl_request(path, i, line, defaults) for i, line in lines]


# What a prompt file may hold: far more than any real run needs (a line of 16 Mi characters is
# a prompt of millions of tokens), and reached at once by an endless source such as /dev/zero.
MAX_LINE, MAX_CHARS, MAX_PROMPTS = 16 << 20, 1 << 30, 10**6


def _read_lines(path: str) -> list[tuple[int, str]]:
    """The file's non-blank lines and their numbers. It may be a pipe (<(cmd), /dev/stdin): it
    is opened non-blocking, since opening a FIFO would otherwise wait for a writer, then read
    blocking (a FIFO that nothing has open for writing reads as empty)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    lines, chars = [], 0
    with open(fd, encoding="utf-8") as f:
        for i, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), ""), 1):
            chars += len(line)
            if len(line.rstrip("\n")) > MAX_LINE:
                raise NanoError(f"{path} line {i}: longer than a prompt file's bound of {MAX_LINE >> 20} Mi "
                                f"characters")
            if chars > MAX_CHARS:
                raise NanoError(f"{path} line {i}: the file passes a prompt file's bound of {MAX_CHARS >> 20} Mi "
                                f"characters")
            if line.strip():
                lines.append((i, line.rstrip("\n")))
            if len(lines) > MAX_PROMPTS:
                raise NanoError(f"{path} line {i}: more than a prompt file's bound of {MAX_PROMPTS} prompts")
    return lines


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
    unknown = set(record) - set(JSONL_FIELDS) - set(controls.OFF) - {"prompt", "lora"}
    if unknown:
        raise NanoError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    prompt = checks.text(f"{where}: field prompt", record.pop("prompt"))
    lora = record.pop("lora", None)
    if lora is not None:
        checks.text(f"{where}: field lora", lora)
    overrides, pending = {}, {key: record.pop(key) for key in controls.OFF if key in record}
    if pending or "stop_token_ids" in record:  # built once the model's tokenizer is loaded (bind)
        overrides["logits_processor"] = controls.Pending(pending, f"{where}: field ")
    for key, value in record.items():
        field = JSONL_FIELDS[key]
        value = FIELD_RULES[field](f"{where}: field {key}", value)
        overrides[field] = ms(value) if key.endswith("_ms") else value
    return Request(prompt, dataclasses.replace(defaults, **overrides), lora)


def bound(engine, requests) -> list[SamplingParams]:
    """The requests' SamplingParams, their controls (nano/controls) built for the engine's model."""
    return [controls.bind(engine, r.params) for r in requests]


def model_inputs(tokenizer, prompts: list[str], chat: bool, chat_template: str | None = None) -> list[str]:
    """The text the model sees: each prompt in the chat template (--chat-template's, else the
    model's), unless --no-chat or there is none."""
    if not chat or (chat_template or tokenizer.chat_template) is None:
        return list(prompts)
    return [render_chat(tokenizer, p, chat_template=chat_template) for p in prompts]


class Workload(NamedTuple):
    """A run's requests as the engine takes them: each prompt's text for the output ('' for a
    prompt of token ids), the model's inputs, each request's SamplingParams, and arrival times
    in seconds after the start (None: all at once)."""
    prompts: list[str]
    inputs: list
    per_request: list[SamplingParams]
    arrivals: list[float] | None = None


def prompt_workload(requests, chat: bool, chat_template: str | None = None):
    """The prompt file's requests for the engine that runs them: engine -> Workload."""
    def make(engine) -> Workload:
        prompts = [r.prompt for r in requests]
        return Workload(prompts, model_inputs(engine.tokenizer, prompts, chat, chat_template), bound(engine, requests))
    return make
