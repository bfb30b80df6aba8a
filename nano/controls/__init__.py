"""vLLM's sampling controls, as an add-on on the sampler's logits-processor seam
(nano.sequence.LogitsProcessor): repetition_penalty, frequency_penalty, presence_penalty,
logit_bias, min_tokens and bad_words, with vLLM's definitions and ranges.

    from nano import LLM
    from nano.controls import sampling_params

    llm = LLM()
    params = sampling_params(llm, temperature=0, max_tokens=32, presence_penalty=0.5,
                             logit_bias={1234: -100}, min_tokens=4, bad_words=["very"])
    print(llm.generate(["Tell me a story."], params)[0].text)

sampling_params takes SamplingParams' own fields and the controls' (an unknown one is a
NanoError naming it) and needs the model's tokenizer (an LLM, an engine or a Tokenizer): the
EOS tokens for min_tokens, the vocabulary for logit_bias, bad_words' tokens. A request without
a control gets no processor, so it costs nothing (docs/sampling.md)."""
import dataclasses
import numbers

import numpy as np

from nano import checks
from nano.errors import NanoError
from nano.sequence import LogitsProcessor, SamplingParams, Sequence


class ControlError(NanoError):
    """A control's bad value: one line, and the field it names (the server's 400 param)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _checked(field: str, check, *args, **kwargs):
    try:
        return check(*args, **kwargs)
    except NanoError as e:
        raise ControlError(field, str(e)) from None


# vLLM's ranges; each value's "off" is the default.
OFF = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None,
       "min_tokens": 0, "bad_words": None}
RULES = {
    "repetition_penalty": lambda n, v: checks.number(n, v, 1e-6, 1e6),  # vLLM's (0, inf), kept finite in float32
    "frequency_penalty": lambda n, v: checks.number(n, v, -2, 2),
    "presence_penalty": lambda n, v: checks.number(n, v, -2, 2),
    "min_tokens": lambda n, v: checks.integer(n, v, 0, checks.INT32_MAX),
    "logit_bias": lambda n, v: _bias_shape(n, v),
    "bad_words": lambda n, v: None if v is None else [
        checks.text(f"{n}[{i}]", w) for i, w in enumerate(checks.instance(n, v, (list, tuple), "a list of strings"))],
}


def _bias_shape(name: str, value) -> dict[int, float] | None:
    """{token id: bias in [-100, 100]}; ids as ints or, as OpenAI's JSON has them, strings of digits."""
    if value is None:
        return None
    checks.instance(name, value, dict, "an object of token ids to biases")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise NanoError(f"{name}: key {key!r:.40} is not a token id")
        out[int(token)] = checks.number(f"{name}[{key}]", bias, -100, 100)
    return out


def check_fields(fields: dict, where: str = "") -> dict:
    """The controls' values checked for type and range (no tokenizer needed): -> the values."""
    return {name: _checked(name, RULES[name], where + name, value) for name, value in fields.items()}


class Controls(LogitsProcessor):
    """The controls of one request (or of several: per sequence it keeps only the prompt's
    distinct tokens), as one sparse edit per step in vLLM's order: every token any control
    touches once, its bias logit_bias's, its penalty the repetition penalty (prompt and output
    tokens), its shift -(frequency x count + presence) over the output's tokens, or -inf for a
    banned one (min_tokens' stop tokens, a bad word's last token)."""

    def __init__(self, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                 logit_bias: dict[int, float] | None = None, min_tokens: int = 0, stop_ids=(),
                 bad_words_ids: list[list[int]] = ()):
        self.repetition_penalty = float(repetition_penalty)
        self.frequency_penalty, self.presence_penalty = float(frequency_penalty), float(presence_penalty)
        bias = logit_bias or {}
        self.bias_tokens = np.fromiter(bias, np.int64, len(bias))
        self.bias = np.fromiter(bias.values(), np.float32, len(bias))
        self.min_tokens = min_tokens
        self.stop_ids = np.array(sorted(set(stop_ids)), np.int64)  # banned until min_tokens
        self.bad_single = np.array(sorted({w[0] for w in bad_words_ids if len(w) == 1}), np.int64)
        # Multi-token bad words by the token before their last, so that a step checks only the
        # words whose prefix could end with the output's last token.
        self.bad_multi: dict[int, list[tuple[list[int], int]]] = {}
        for w in bad_words_ids:
            if len(w) > 1:
                self.bad_multi.setdefault(w[-2], []).append((list(w[:-1]), w[-1]))

    def edits(self, seq: Sequence, ahead: list[int] = ()):
        output = np.asarray(seq.output_token_ids + list(ahead), np.int64)
        parts, shifts = [], []  # tokens and their shifts, to be merged
        repeated = None
        if self.repetition_penalty != 1.0:
            if seq.processor_state is None:  # the prompt's tokens, found once per request
                seq.processor_state = np.unique(np.asarray(seq.token_ids[:seq.num_prompt_tokens], np.int64))
            repeated = np.union1d(seq.processor_state, output)
        if (self.frequency_penalty or self.presence_penalty) and output.size:
            seen, counts = np.unique(output, return_counts=True)
            parts.append(seen)
            shifts.append(-(self.frequency_penalty * counts + self.presence_penalty).astype(np.float32))
        banned = [self.bad_single]
        if output.size < self.min_tokens:
            banned.append(self.stop_ids)
        candidates = self.bad_multi.get(int(output[-1]), []) if output.size else []
        banned += [np.array([last], np.int64) for prefix, last in candidates
                   if len(prefix) <= output.size and output[output.size - len(prefix):].tolist() == prefix]
        banned = np.concatenate(banned)
        if banned.size:
            parts.append(banned)
            shifts.append(np.full(banned.size, -np.inf, np.float32))
        head = ([] if repeated is None else [repeated]) + [self.bias_tokens]
        if sum(a.size for a in head + parts) == 0:
            return None
        tokens, where = np.unique(np.concatenate(head + parts), return_inverse=True)
        biases, penalties = np.zeros(tokens.size, np.float32), np.ones(tokens.size, np.float32)
        total = np.zeros(tokens.size, np.float32)
        n = 0 if repeated is None else repeated.size
        penalties[where[:n]] = self.repetition_penalty
        biases[where[n:n + self.bias_tokens.size]] = self.bias
        if parts:
            np.add.at(total, where[n + self.bias_tokens.size:], np.concatenate(shifts))
        return tokens.astype(np.int32), biases, penalties, total


def bad_words_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokens for bad words: each word (left-stripped) alone, and after a space where
    that gives another first token in as many tokens (a word inside the text)."""
    bos = len(tokenizer.encode("", plain=True))  # the BOS token the model may put first
    out = []
    for word in words:
        ids = tokenizer.encode(word.lstrip(), plain=True)[bos:]
        spaced = tokenizer.encode(" " + word.lstrip(), plain=True)[bos:]
        if ids:
            out.append(ids)
        if spaced and (not ids or (spaced[0] != ids[0] and len(spaced) == len(ids))):
            out.append(spaced)
    return out


def _tokenizer_and_vocab(source):
    """An LLM, an engine (or nano/dp's front) or a Tokenizer -> (tokenizer, the logits' width)."""
    engine = getattr(source, "engine", source)
    if hasattr(engine, "tokenizer") and hasattr(engine, "model_config"):
        return engine.tokenizer, engine.model_config.vocab_size
    if hasattr(source, "eos_token_ids") and hasattr(source, "encode"):
        return source, source.num_ids
    raise NanoError(f"sampling_params needs an LLM, an engine or a Tokenizer, got {type(source).__name__}")


CORE = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(source, **fields) -> SamplingParams:
    """SamplingParams with vLLM's controls: SamplingParams' fields and the controls' (OFF)
    by name; the logits processor is set only when a control is on. Errors: a NanoError (a
    ControlError for a control's value) naming the field."""
    unknown = set(fields) - CORE - set(OFF)
    if unknown:
        raise NanoError(f"unknown sampling field {sorted(unknown)[0]!r}")
    controls = check_fields({k: v for k, v in fields.items() if k in OFF})
    params = SamplingParams(**{k: v for k, v in fields.items() if k in CORE})
    params.validate()
    on = {k: v for k, v in controls.items() if v != OFF[k] and v not in ({}, [])}
    if not (on or params.stop_token_ids):
        return params
    tokenizer, vocab = _tokenizer_and_vocab(source)
    if any(t >= vocab for t in params.stop_token_ids):
        raise ControlError("stop_token_ids", f"stop_token_ids: token ids must be in [0, {vocab})")
    if not on:
        return params
    if params.logits_processor is not None:
        raise NanoError(f"{sorted(on)[0]} and logits_processor: give one or the other")
    for token in on.get("logit_bias", {}):
        if token >= vocab:
            raise ControlError("logit_bias", f"logit_bias: token id {token} is out of the vocabulary (size {vocab})")
    if on.get("min_tokens", 0) > params.max_tokens:
        raise ControlError("min_tokens", f"min_tokens must be at most max_tokens ({params.max_tokens}), got "
                                         f"{on['min_tokens']}")
    words = bad_words_ids(tokenizer, on.get("bad_words", []))
    if any(t >= vocab for w in words for t in w):
        raise ControlError("bad_words", f"bad_words: a word's tokens are out of the vocabulary (size {vocab})")
    params.logits_processor = Controls(
        on.get("repetition_penalty", 1.0), on.get("frequency_penalty", 0.0), on.get("presence_penalty", 0.0),
        on.get("logit_bias"), on.get("min_tokens", 0), set(tokenizer.eos_token_ids) | set(params.stop_token_ids),
        words)
    return params


class Pending(LogitsProcessor):
    """Controls read before the model's tokenizer is loaded (a JSONL prompt file's line): their
    values checked, the rest (vocabulary, EOS, bad words' tokens) done by bind."""

    def __init__(self, fields: dict, where: str):
        self.fields, self.where = check_fields(fields, where), where

    def edits(self, seq, ahead=()):
        raise NanoError(f"{self.where}: controls not bound to the model (nano.controls.bind)")


def bind(source, params: SamplingParams) -> SamplingParams:
    """params with its Pending controls built for the model (as sampling_params does): others as they are."""
    pending = params.logits_processor
    if not isinstance(pending, Pending):
        return params
    core = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "logits_processor"}
    try:
        return sampling_params(source, **core, **pending.fields)
    except ControlError as e:
        raise ControlError(e.field, pending.where + str(e)) from None
