"""What a step costs, learned online from the steps the engine runs. The scheduler asks it
whether swapping a preempted sequence's KV to host and back is cheaper than recomputing its
tokens, and (the deadline policy) how long a request's remaining work will take.

Step time is linear in what the step does, fitted over a sliding window of measured steps
with a prior (the starting coefficients) so it answers sensibly before the first step:
    t = c0 + c_prefill * prefill_tokens + c_decode * decode_seqs + c_ctx * decode_context_tokens
(decode_context_tokens: the cached tokens the step's decodes attend to).
"""
import itertools
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

    def observe_step(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, seconds: float) -> None:
        self.samples.append((self.features(prefill_tokens, decode_seqs, context_tokens), seconds))
        if len(self.samples) >= 8:
            self.coef = self._fit(np.stack([f for f, _ in self.samples]), np.array([t for _, t in self.samples]))

    def _fit(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Ridge towards the prior (similar steps cannot pin all four terms), every term >= 0: the best
        fit on a subset of the terms, the rest 0, with none negative (not one free fit clipped: perf_notes.md)."""
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)
        xs, lam, prior = x / scale, 1e-3 * len(y), self.prior * scale

        def fit(on: np.ndarray) -> tuple[float, np.ndarray]:  # (loss, terms): those `on` fitted, the rest 0
            w, a = np.zeros(4), xs[:, on]
            w[on] = np.linalg.solve(a.T @ a + lam * np.eye(on.sum()), a.T @ y + lam * prior[on])
            return np.sum((xs @ w - y) ** 2) + lam * np.sum((w - prior) ** 2), w
        fits = [fit(np.array(on)) for on in itertools.product((False, True), repeat=4)]
        return min((f for f in fits if f[1].min() >= 0), key=lambda f: f[0])[1] / scale

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if seconds > 0 and num_bytes > 0:
            self.swap_bandwidth = 0.8 * self.swap_bandwidth + 0.2 * (num_bytes / seconds)

    def swap_cost(self, kv_bytes: int) -> float:
        return 2.0 * kv_bytes / self.swap_bandwidth  # out to host now and back later

    def recompute_cost(self, num_tokens: int) -> float:
        """Prefill of the whole sequence again, as extra tokens in later steps."""
        return num_tokens * self.coefficients.per_prefill_token
