"""Next-token choice: builds each row's sampling parameters and calls ops.sample.

ops.sample (NumPy on the CPU, one CUDA kernel on the GPU, the same algorithm) does greedy
at temperature 0, else a Gumbel-max draw restricted by top-k and top-p. Its randomness is a
hash of (the sequence's seed, the number of tokens it has output so far, token id), so a
sequence's output does not depend on which other requests happen to share its batch.
On the GPU a step moves its parameters in with one copy and the sampled ids out with one
copy; logits rows come to the host only for sequences that asked for them (return_logits).
"""
import numpy as np

from nano import ops
from nano.sequence import Sequence


class Sampler:
    def __init__(self, device):
        self.device = device

    def sample(self, logits, seqs: list[Sequence]) -> list[int]:
        """logits: (R, V), one row per sequence in seqs -> one token id per sequence."""
        keep = [i for i, seq in enumerate(seqs) if seq.params.return_logits]
        if keep:
            rows = self.device.to_host(logits[keep] if len(keep) < len(seqs) else logits)
            for i, row in zip(keep, rows.astype(np.float32)):
                seqs[i].logits.append(row)
        tokens = ops.sample(logits, *self._parameters(seqs))
        return self.device.to_host(tokens).tolist()

    def logprobs(self, logits, targets: list[int], k: int) -> list[tuple]:
        """Rows of logits (m, V) -> per row (the log-probability of its target token, that
        token's rank (1: the most likely), its k most likely [(token, logprob)] best first).
        Computed on the device: only these figures come to the host."""
        xp = self.device.xp
        logp = logits.astype(xp.float32)
        logp -= logp.max(axis=1, keepdims=True)
        logp -= xp.log(xp.exp(logp).sum(axis=1, keepdims=True))
        chosen = logp[xp.arange(len(targets)), xp.asarray(np.asarray(targets, np.int64))]
        rank = (logp > chosen[:, None]).sum(axis=1) + 1
        top = xp.argpartition(-logp, k - 1, axis=1)[:, :k] if k else xp.zeros((len(targets), 0), np.int64)
        top = xp.take_along_axis(top, xp.argsort(-xp.take_along_axis(logp, top, axis=1), axis=1), axis=1)
        out = [self.device.to_host(a).tolist() for a in (chosen, rank, top, xp.take_along_axis(logp, top, axis=1))]
        return [(c, r, list(zip(t, v))) for c, r, t, v in zip(*out)]

    def _parameters(self, seqs: list[Sequence]) -> tuple:
        """ops.sample's per-row arrays (temperature, top_k, top_p, seeds, counters), packed
        into one uint32 host array so that the GPU gets them in one copy, then viewed."""
        r = len(seqs)
        host = np.empty((6, r), np.uint32)
        host[0].view(np.float32)[:] = [s.params.temperature for s in seqs]
        host[1].view(np.int32)[:] = [s.params.top_k for s in seqs]
        host[2].view(np.float32)[:] = [s.params.top_p for s in seqs]
        host[3].view(np.int32)[:] = [s.num_output_tokens for s in seqs]
        host[4:].reshape(-1).view(np.uint64)[:] = [s.seed % 2**64 for s in seqs]  # any int seed
        xp = self.device.xp
        packed = xp.asarray(host)
        return (packed[0].view(xp.float32), packed[1].view(xp.int32), packed[2].view(xp.float32),
                packed[4:].reshape(-1).view(xp.uint64), packed[3].view(xp.int32))
