"""Several logits processors as one (a request's grammar and its penalties, say): the engine
takes one per request (SamplingParams.logits_processor)."""
from __future__ import annotations

import numpy as np

from nano.sequence import LogitsProcessor, Sequence


class Chain(LogitsProcessor):
    """Each part sees seq.processor_state as its own (the chain keeps one slot per part).
    Masks combine by AND; edits by token: biases and shifts add, penalties multiply where two
    parts edit the same token (exact when at most one part edits it: a grammar only masks)."""

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


class _States(list):
    """The chain's per-part states, in seq.processor_state."""

    def __init__(self, n: int):
        super().__init__([None] * n)


def chain(*parts: LogitsProcessor | None) -> LogitsProcessor | None:
    """The parts given (None ones dropped) as one processor: None, the one, or a Chain."""
    parts = [p for p in parts if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else Chain(*parts)
