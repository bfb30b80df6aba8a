"""Next-token choice (each row's sampling parameters, to its op set's sample) and prompt scoring.
A sequence's draws depend on its seed and output count, never on its batch
(docs/how-it-works.md#sampling). It writes into no Sequence: the engine appends what it returns."""
import numpy as np

from nano.ops import OpSet
from nano.plan import StepRows
from nano.sequence import Sequence


class Sampler:
    def __init__(self, device, ops: OpSet):
        self.device, self.ops = device, ops

    def sample(self, logits, rows: StepRows) -> tuple[list[int], dict]:
        """A step's logits (R, V) -> a token id per sequence that samples (rows.sampling), and
        {i: its logits row (host float32)} for each i-th of them that asked (return_logits)."""
        if rows.score_rows:  # the other rows score prompts
            logits = logits[rows.sample_rows]
        keep = [i for i, seq in enumerate(rows.sampling) if seq.params.return_logits]
        kept = dict(zip(keep, self.device.to_host(logits[keep]).astype(np.float32))) if keep else {}
        logits = self._process(logits, rows.sampling, rows.drafts)
        tokens = self.ops.sample(logits, *self._parameters(rows.sampling, rows.counters))
        return self.device.to_host(tokens).tolist(), kept

    def _process(self, logits, seqs: list[Sequence], drafts: list[int]):
        """The rows' logits processors (sequence.LogitsProcessor), if any: their edits packed
        into one ops.edit_logits, their masks into one ops.mask_logits (the raw logits were
        kept above, as return_logits and logprobs report them)."""
        edits, masks, ahead = [], [], []
        for i, seq in enumerate(seqs):
            ahead = ahead + [drafts[i - 1]] if i and seqs[i - 1] is seq else []  # the drafts before this row
            if processor := seq.params.logits_processor:
                if (edit := processor.edits(seq, ahead)) is not None:
                    edits.append((np.full(len(edit[0]), i, np.int32), *edit))
                if (mask := processor.mask(seq, ahead)) is not None:
                    masks.append((i, mask))
        xp = self.device.xp
        if edits:
            logits = self.ops.edit_logits(logits, *(xp.asarray(np.concatenate(a).astype(dtype)) for a, dtype in
                                                     zip(zip(*edits), (np.int32, np.int32, np.float32, np.float32, np.float32))))
        if masks:
            rows, bits = zip(*masks)
            logits = self.ops.mask_logits(logits, xp.asarray(np.array(rows, np.int32)), xp.asarray(np.stack(bits)))
        return logits

    def score(self, logits, rows: StepRows) -> list[tuple]:
        """Prompt logprobs: a step's logits (R, V) -> per row that scores a prompt token
        (rows.scoring): the log-probability of its target token, that token's rank (1: the
        most likely), its sequence's prompt_logprobs most likely [(token, logprob)] best
        first. Computed on the device: only these figures come to the host."""
        if not rows.scoring:
            return []
        xp, targets = self.device.xp, rows.targets
        k = min(max(seq.params.prompt_logprobs for seq in rows.scoring), logits.shape[1])
        logp = logits[rows.score_rows].astype(xp.float32)
        logp -= logp.max(axis=1, keepdims=True)
        logp -= xp.log(xp.exp(logp).sum(axis=1, keepdims=True))
        chosen = logp[xp.arange(len(targets)), xp.asarray(np.asarray(targets, np.int64))]
        rank = (logp > chosen[:, None]).sum(axis=1) + 1
        top = xp.argpartition(-logp, k - 1, axis=1)[:, :k] if k else xp.zeros((len(targets), 0), np.int64)
        top = xp.take_along_axis(top, xp.argsort(-xp.take_along_axis(logp, top, axis=1), axis=1), axis=1)
        out = [self.device.to_host(a).tolist() for a in (chosen, rank, top, xp.take_along_axis(logp, top, axis=1))]
        return [(c, r, list(zip(t, v))[:seq.params.prompt_logprobs]) for seq, c, r, t, v in zip(rows.scoring, *out)]

    def _parameters(self, seqs: list[Sequence], counters: list[int]) -> tuple:
        """The sample op's per-row arrays (temperature, top_k, top_p, log_min_p, seeds,
        counters), packed into one uint32 host array so that the GPU gets them in one copy, then
        viewed; the seeds first, where their 8-byte words are aligned whatever the row count."""
        host = np.empty((7, len(seqs)), np.uint32)
        host[:2].reshape(-1).view(np.uint64)[:] = [s.seed % 2**64 for s in seqs]  # any int seed
        host[2].view(np.float32)[:] = [s.params.temperature for s in seqs]
        host[3].view(np.int32)[:] = [s.params.top_k for s in seqs]
        host[4].view(np.float32)[:] = [s.params.top_p for s in seqs]
        with np.errstate(divide="ignore"):  # min_p 0: log -inf, off
            host[5].view(np.float32)[:] = np.log(np.array([s.params.min_p for s in seqs], np.float32))
        host[6].view(np.int32)[:] = counters
        xp = self.device.xp
        packed = xp.asarray(host)
        return (packed[2].view(xp.float32), packed[3].view(xp.int32), packed[4].view(xp.float32),
                packed[5].view(xp.float32), packed[:2].reshape(-1).view(xp.uint64), packed[6].view(xp.int32))
