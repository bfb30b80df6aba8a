"""What a step costs, learned online from the steps the engine runs.

The scheduler asks two questions of it: is it cheaper to swap a preempted
sequence's KV to host and back, or to recompute its tokens later; and (under
the deadline policy) how long the remaining work of a request will take.

Step time is modelled as linear in what the step does:
    t = c0 + c_prefill * prefill_tokens + c_decode * decode_seqs + c_ctx * decode_context_tokens
(decode_context_tokens: the cached tokens the step's decodes attend to)
fitted by least squares over a sliding window of measured steps, with a prior
(the starting coefficients) so it answers sensibly before the first step.
"""
from collections import deque
from typing import NamedTuple

import numpy as np


class StepCoefficients(NamedTuple):
    """The step-time model's terms, in seconds."""
    base: float                # per step
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float   # per cached token a decode attends to


class CostModel:
    def __init__(self, prior: StepCoefficients, swap_bandwidth: float, window: int = 256):
        self.prior = np.array(prior, dtype=np.float64)   # StepCoefficients' order
        self.coef = self.prior.copy()                     # the fitted ones, same order
        self.samples: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self.swap_bandwidth = swap_bandwidth              # bytes/s host<->device, updated from real swaps

    @staticmethod
    def features(prefill_tokens: int, decode_seqs: int, context_tokens: int) -> np.ndarray:
        return np.array([1.0, prefill_tokens, decode_seqs, context_tokens])

    @property
    def coefficients(self) -> StepCoefficients:
        return StepCoefficients(*self.coef.tolist())

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return float(self.features(prefill_tokens, decode_seqs, context_tokens) @ self.coef)

    def observe_step(self, prefill_tokens: int, decode_seqs: int, context_tokens: int,
                     seconds: float) -> None:
        self.samples.append((self.features(prefill_tokens, decode_seqs, context_tokens), seconds))
        if len(self.samples) >= 8:
            # Ridge towards the prior: a window of similar steps cannot pin all four terms.
            x = np.stack([f for f, _ in self.samples])
            y = np.array([t for _, t in self.samples])
            scale = np.maximum(np.abs(x).max(axis=0), 1.0)
            xs, lam = x / scale, 1e-3 * len(y)
            prior = self.prior * scale
            w = np.linalg.solve(xs.T @ xs + lam * np.eye(4), xs.T @ y + lam * prior)
            self.coef = np.maximum(w / scale, 0.0)

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if seconds > 0 and num_bytes > 0:
            self.swap_bandwidth = 0.8 * self.swap_bandwidth + 0.2 * (num_bytes / seconds)

    def swap_cost(self, kv_bytes: int) -> float:
        """Out to host now and back later."""
        return 2.0 * kv_bytes / self.swap_bandwidth

    def recompute_cost(self, num_tokens: int) -> float:
        """Prefill of the whole sequence again, as extra tokens in later steps."""
        return num_tokens * self.coefficients.per_prefill_token
