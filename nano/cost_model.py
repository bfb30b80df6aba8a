"""What a step costs, learned online from the steps the engine runs. The scheduler asks it
whether swapping a preempted sequence's KV to host and back is cheaper than recomputing its
tokens, and (the deadline policy) how long a request's remaining work will take.

Step time is linear in what the step does, fitted over a sliding window of measured steps
with a prior (the starting coefficients) so it answers sensibly before the first step:
    t = c0 + c_prefill * prefill_tokens + c_decode * decode_seqs + c_ctx * decode_context_tokens
"""
import itertools
from typing import NamedTuple

import numpy as np


class StepCoefficients(NamedTuple):
    """The step-time model's terms, in seconds."""
    base: float                # per step
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float   # per cached token a decode attends to


# Rough device figures for the starting point (it then learns from real steps).
DEVICE_PRIORS = {  # flop/s, memory bytes/s, host<->device bytes/s
    "cpu": (5e10, 1e10, 5e9),
    "gpu": (3e14, 3e12, 2e10),
}
# (16, 4): the terms each fit keeps
SUBSETS = np.array(list(itertools.product((0.0, 1.0), repeat=4)))
# (16, 4, 4): each subset's normal equations are the full ones with the dropped terms' rows and
# columns zeroed (KEPT) and a 1 on their diagonal (PINNED), which solves them to 0
KEPT, PINNED = SUBSETS[:, :, None] * SUBSETS[:, None, :], np.eye(4) * (1 - SUBSETS[:, None, :])


class CostModel:
    def __init__(self, prior: StepCoefficients, swap_bandwidth: float, window: int = 256):
        self.prior = np.array(prior, dtype=np.float64)   # StepCoefficients' order
        self.fitted = (0, self.prior.copy())  # (steps observed at the last fit, its coefficients)
        # The window of observed steps as a ring: column observed % window is the next replaced.
        # It is two arrays rather than a list of steps so that the fit reads it without copying
        # it into one on every fit, a term's features contiguous for the fit's maximum of each
        # (docs/perf_notes.md#the-fit-on-every-step-cheaper).
        self.features_seen, self.seconds_seen = np.zeros((4, window)), np.zeros(window)  # (4, W)
        self.observed = 0
        # bytes/s host<->device, updated from real swaps
        self.swap_bandwidth = swap_bandwidth

    @classmethod
    def for_device(cls, kind: str, weight_bytes: int, itemsize: int,
                   kv_bytes_per_token: int) -> "CostModel":
        """A step reads every weight and does 2 flops per parameter per token."""
        flops, bandwidth, link = DEVICE_PRIORS[kind]
        per_token = 2 * (weight_bytes / itemsize) / flops
        return cls(StepCoefficients(weight_bytes / bandwidth, per_token, per_token,
                                    kv_bytes_per_token / bandwidth), link)

    @property
    def coef(self) -> np.ndarray:
        """The coefficients in StepCoefficients' order, fitted again when asked for after new
        steps: a step whose cost no decision needs does not pay for a fit."""
        # The prior until 8 steps: the columns past the count observed are not steps yet.
        if self.fitted[0] < self.observed >= 8:
            self.fitted = self.observed, self._fit(self.features_seen[:, :self.observed],
                                                   self.seconds_seen[:self.observed])
        return self.fitted[1]

    @property
    def coefficients(self) -> StepCoefficients:
        return StepCoefficients(*self.coef.tolist())

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        return float(np.array([1.0, prefill_tokens, decode_seqs, context_tokens]) @ self.coef)

    def observe_step(self, prefill_tokens: int, decode_seqs: int, context_tokens: int,
                     seconds: float) -> None:
        column = self.observed % len(self.seconds_seen)
        self.features_seen[:, column] = 1.0, prefill_tokens, decode_seqs, context_tokens
        self.seconds_seen[column], self.observed = seconds, self.observed + 1

    def _fit(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Ridge towards the prior (similar steps cannot pin all four terms), every term >= 0: the
        best of the fits on each subset of the terms (the others pinned to 0; all 16 at once) with
        none negative (perf_notes). x: (4, n) each term's feature in n steps; y: (n,) seconds."""
        scale = np.maximum(x.max(axis=1), 1.0)  # the features are counts: none is negative
        xs, lam = x / scale[:, None], 1e-3 * len(y)
        # normal equations
        gram, moment = xs @ xs.T + lam * np.eye(4), xs @ y + lam * self.prior * scale
        w = np.linalg.solve(KEPT * gram + PINNED, (SUBSETS * moment)[..., None])[..., 0]  # (16, 4)
        # the ridge loss less a constant
        loss = ((w @ gram - 2 * moment) * w).sum(axis=1)
        return w[np.where((w >= 0).all(axis=1), loss, np.inf).argmin()] / scale

    def observe_swap(self, num_bytes: int, seconds: float) -> None:
        if seconds > 0 and num_bytes > 0:
            self.swap_bandwidth = 0.8 * self.swap_bandwidth + 0.2 * (num_bytes / seconds)

    def swap_cost(self, kv_bytes: int) -> float:
        return 2.0 * kv_bytes / self.swap_bandwidth  # out to host now and back later

    def recompute_cost(self, num_tokens: int) -> float:  # its tokens prefilled again in later steps
        return num_tokens * self.coefficients.per_prefill_token
