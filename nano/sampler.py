"""Next-token choice: greedy at temperature 0, else temperature, top-k, top-p.

Every sequence draws from its own generator (seeded by its request), one
uniform number per token, so its output does not depend on which other
requests happen to share its batch.
"""
import numpy as np

from nano import ops
from nano.sequence import Sequence

# Top-p looks at the best candidates first: if they already hold the mass p
# (nearly always) a sort of 1024 values replaces a sort of the whole vocabulary.
TOP_P_CANDIDATES = 1024


class Sampler:
    def __init__(self, device):
        self.device = device

    def sample(self, logits, seqs: list[Sequence]) -> list[int]:
        """logits: (R, V), one row per sequence in seqs -> one token id per sequence."""
        greedy = [s.params.temperature == 0 for s in seqs]
        if all(greedy) and not any(s.params.return_logits for s in seqs):
            return self.device.to_host(ops.argmax(logits)).tolist()
        host = self.device.to_host(logits).astype(np.float32)  # (R, V)
        tokens = []
        for row, seq, is_greedy in zip(host, seqs, greedy):
            if seq.params.return_logits:
                seq.logits.append(row.copy())
            tokens.append(int(row.argmax()) if is_greedy else sample_row(row, seq))
        return tokens


def sample_row(logits: np.ndarray, seq: Sequence) -> int:
    """One draw from softmax(logits / T) restricted to the top-k and the top-p nucleus."""
    p = seq.params
    logits = logits / p.temperature
    if 0 < p.top_k < logits.size:
        kth = np.partition(logits, -p.top_k)[-p.top_k]
        logits = np.where(logits >= kth, logits, -np.inf)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p)
    cdf = np.cumsum(probs)
    u = seq.rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.size - 1))


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p."""
    k = min(TOP_P_CANDIDATES, probs.size)
    candidates = np.argpartition(probs, -k)[-k:]
    if probs[candidates].sum() < top_p:
        candidates = np.arange(probs.size)
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    cum = np.cumsum(probs[order])
    keep = order[:int(np.searchsorted(cum, top_p)) + 1]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out
