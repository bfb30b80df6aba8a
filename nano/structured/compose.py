"""Several logits processors as one (a request's grammar and its penalties, say): the engine
takes one per request (SamplingParams.logits_processor)."""
from __future__ import annotations

import numpy as np

from nano.sequence import LogitsProcessor, Sequence


class Chain(LogitsProcessor):
    """Each part sees seq.processor_state as its own (the chain keeps one slot per part).
    Masks combine by AND; edits by token: biases and shifts add, penalties multiply where two
    parts edit the same token (exact when at most one part edits it: a grammar only masks).
    Where the parts' bans (-inf edits) leave no token that the mask allows (a grammar that must
    end where min_tokens bans EOS, a grammar's only token a bad word), the bans are dropped, so
    that the row never samples from nothing, and failure(seq) says the request conflicts."""

    def __init__(self, *parts: LogitsProcessor):
        self.parts = [p for p in parts if p is not None]

    def _each(self, seq: Sequence, method: str, ahead: list[int]) -> list:
        states = seq.processor_state if isinstance(seq.processor_state, _States) else _States(len(self.parts))
        results = []
        try:
            for i, part in enumerate(self.parts):
                seq.processor_state = states[i]
                try:
                    results.append(getattr(part, method)(seq, ahead))
                finally:
                    states[i] = seq.processor_state
        finally:
            seq.processor_state = states
        return [r for r in results if r is not None]

    def edits(self, seq: Sequence, ahead: list[int] = ()):
        found = self._each(seq, "edits", ahead)
        mask = self.mask(seq, ahead)
        if mask is not None and found and _bans_all(mask, found):
            if not ahead:  # a draft's row is rejected anyway: no failure of the sequence's
                seq.processor_state.failure = CONFLICT
            found = [(tokens, biases, penalties, np.where(np.isneginf(shifts), 0, shifts).astype(np.float32))
                     for tokens, biases, penalties, shifts in found]
        if len(found) <= 1:
            return found[0] if found else None
        tokens = np.concatenate([f[0] for f in found]).astype(np.int32)
        unique, where = np.unique(tokens, return_inverse=True)
        biases, shifts = np.zeros(len(unique), np.float32), np.zeros(len(unique), np.float32)
        penalties = np.ones(len(unique), np.float32)
        np.add.at(biases, where, np.concatenate([f[1] for f in found]).astype(np.float32))
        np.multiply.at(penalties, where, np.concatenate([f[2] for f in found]).astype(np.float32))
        np.add.at(shifts, where, np.concatenate([f[3] for f in found]).astype(np.float32))
        return unique, biases, penalties, shifts

    def mask(self, seq: Sequence, ahead: list[int] = ()):
        found = self._each(seq, "mask", ahead)
        if len(found) <= 1:
            return found[0] if found else None
        return np.bitwise_and.reduce(np.stack(found), axis=0)


    def failure(self, seq: Sequence) -> str | None:
        """Why seq cannot go on as asked (a part's failure, or the parts' conflict), or None."""
        states = seq.processor_state
        if not isinstance(states, _States):
            return None
        return states.failure or next((why for part, state in zip(self.parts, states) if hasattr(part, "failure")
                                       and (why := _failure_of(part, seq, state))), None)


CONFLICT = ("the request's controls ban every token its grammar allows next (min_tokens, bad_words, "
            "stop_token_ids or logit_bias against the grammar)")


def _bans_all(mask: np.ndarray, found: list[tuple]) -> bool:
    """Whether the edits' -inf tokens are every token the mask (ceil(V / 32),) int32 allows."""
    banned = np.unique(np.concatenate([tokens[np.isneginf(shifts)] for tokens, _, _, shifts in found]))
    words = mask.view(np.uint32)
    allowed = int(np.bitwise_count(words).sum())
    if allowed > banned.size:
        return False
    return int(((words[banned // 32] >> (banned % 32).astype(np.uint32)) & 1).sum()) == allowed


def _failure_of(part: LogitsProcessor, seq: Sequence, state) -> str | None:
    """part.failure(seq), with seq.processor_state the part's own for the call."""
    states, seq.processor_state = seq.processor_state, state
    try:
        return part.failure(seq)
    finally:
        seq.processor_state = states


class _States(list):
    """The chain's per-part states, in seq.processor_state, and the chain's failure, if any."""

    def __init__(self, n: int):
        super().__init__([None] * n)
        self.failure: str | None = None


def chain(*parts: LogitsProcessor | None) -> LogitsProcessor | None:
    """The parts given (None ones dropped) as one processor: None, the one, or a Chain."""
    parts = [p for p in parts if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else Chain(*parts)
