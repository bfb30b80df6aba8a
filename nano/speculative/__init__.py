"""Speculative decoding by n-gram prompt lookup, on the engine's proposer seam
(LLMEngine.proposer): before each step, every decoding sequence gets up to k draft tokens,
the ones that followed the last place its own tokens (prompt and output) hold its latest
n-gram; the step checks them all in one forward pass (docs/speculative.md).

    from nano import LLM
    from nano.speculative import attach

    llm = LLM()
    attach(llm.engine, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})

The config is vLLM's --speculative-config: method (ngram, the only one here; a draft model
or another method is another proposer on the same seam), num_speculative_tokens (k),
prompt_lookup_min / prompt_lookup_max (n), with vLLM's defaults. Like vLLM, it is set per
engine, not per request."""
import json
from dataclasses import dataclass

import numpy as np

from nano import checks
from nano.errors import NanoError
from nano.sequence import Sequence

METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
DEFAULT_NGRAM = 5  # vLLM's n when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int  # k: drafts per sequence per step
    prompt_lookup_min: int       # the shortest n-gram that may match
    prompt_lookup_max: int       # the longest, tried first
    method: str = "ngram"


def parse(config: str | dict | None) -> SpeculativeConfig | None:
    """--speculative-config's JSON (or a dict) -> a checked config; None (the flag not given)
    or {} -> None (off). Only a JSON object is a config ([], false, 0 and null are not); anything
    nano does not implement is a one-line NanoError naming it."""
    if config is None:
        return None
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as e:
            raise NanoError(f"--speculative-config is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise NanoError(f"--speculative-config must be a JSON object, got {json.dumps(config, default=repr):.40}")
    if not config:
        return None
    for key in config:
        if key not in KEYS:
            raise NanoError(f"--speculative-config key {key!r:.40} is not supported (nano has {', '.join(KEYS)})")
    method = config.get("method", "ngram")
    if method not in METHODS:
        raise NanoError(f"--speculative-config method {method!r:.40} is not supported (nano has ngram)")
    k = checks.integer("num_speculative_tokens", config.get("num_speculative_tokens"), 1, 64)
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_NGRAM
    low, high = high if low is None else low, low if high is None else high  # one given: both
    checks.integer("prompt_lookup_min", low, 1, 1024)
    checks.integer("prompt_lookup_max", high, 1, 1024)
    if low > high:
        raise NanoError(f"prompt_lookup_min ({low}) must be at most prompt_lookup_max ({high})")
    return SpeculativeConfig(k, low, high, method)


class NgramProposer:
    """Prompt lookup: for n from prompt_lookup_max down to prompt_lookup_min, the last n tokens
    are looked for earlier in the sequence; at the latest place they occur, the k tokens that
    followed them are the drafts. Where those run into the sequence's end, the text is taken to
    repeat: the drafts go on copying what they follow (`a b a b` drafts `a b a b ...`, not just
    `a`). No match: no drafts, and the sequence decodes as usual."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, seq: Sequence) -> list[int]:
        tokens, c = np.asarray(seq.token_ids), self.config
        for n in range(min(c.prompt_lookup_max, len(tokens) - 1), c.prompt_lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
            found = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(found):
                return np.resize(tokens[found[-1] + n:], c.num_speculative_tokens).tolist()  # repeats cyclically
        return []


def attach(engine, config: str | dict | SpeculativeConfig | None) -> NgramProposer | None:
    """Turn speculation on for this engine (off for None or {}); returns the proposer."""
    config = config if isinstance(config, SpeculativeConfig) else parse(config)
    engine.proposer = NgramProposer(config) if config else None
    return engine.proposer
