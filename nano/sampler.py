"""Next-token choice (each row's sampling parameters, to its op set's sample) and prompt scoring.
A sequence's draws depend on its seed and output count, never on its batch
(docs/how-it-works.md#sampling). The sampler writes into no Sequence: the engine appends what
it returns."""
import numpy as np

from nano.device import to_float32
from nano.ops import OpSet
from nano.plan import Sample, Score
from nano.sequence import Sequence


class Sampler:
    def __init__(self, device, ops: OpSet):
        self.device, self.ops = device, ops

    def sample(self, logits, samples: list[Sample]) -> tuple[list[list[int]], list[list]]:
        """Turn a step's logits (R, V) into each sample's tokens, one per row, and its logits
        rows as host float32 arrays where its request asked for them (return_logits)."""
        rows = [(sample, j) for sample in samples for j in range(len(sample.rows))]
        if len(rows) < logits.shape[0]:  # the other rows score prompts
            logits = logits[[row for sample in samples for row in sample.rows]]
        seqs = [sample.seq for sample, _ in rows]
        keep = [i for i, seq in enumerate(seqs) if seq.params.return_logits]
        kept = iter(to_float32(self.device.to_host(logits[keep])) if keep else [])
        returned = [[next(kept) for _ in s.rows] if s.seq.params.return_logits else []
                    for s in samples]
        logits = self._process(logits, rows)
        output_counts = [sample.output_count + j for sample, j in rows]
        tokens = self.ops.sample(logits, *self._parameters(seqs, output_counts))
        tokens = iter(self.device.to_host(tokens).tolist())
        return [[next(tokens) for _ in sample.rows] for sample in samples], returned

    def _process(self, logits, rows: list[tuple[Sample, int]]):
        """Apply the rows' logits processors (sequence.LogitsProcessor), if any: their edits
        packed into one ops.edit_logits, their masks into one ops.mask_logits. The raw logits
        were kept before, as return_logits and logprobs report them. Row i is (sample, j): the
        row after the sample's first j drafts."""
        edits, masks = [], []
        for i, (sample, j) in enumerate(rows):
            if processor := sample.seq.params.logits_processor:
                if (edit := processor.edits(sample.seq, sample.drafts[:j])) is not None:
                    edits.append((np.full(len(edit[0]), i, np.int32), *edit))
                if (mask := processor.mask(sample.seq, sample.drafts[:j])) is not None:
                    masks.append((i, mask))
        xp = self.device.xp
        if edits:
            columns = zip(zip(*edits), (np.int32, np.int32, np.float32, np.float32, np.float32))
            logits = self.ops.edit_logits(logits, *(xp.asarray(np.concatenate(a).astype(dtype))
                                                    for a, dtype in columns))
        if masks:
            rows, bits = zip(*masks)
            logits = self.ops.mask_logits(logits, xp.asarray(np.array(rows, np.int32)),
                                          xp.asarray(np.stack(bits)))
        return logits

    def score(self, logits, scores: list[Score]) -> list[tuple]:
        """Score prompts: turn a step's logits (R, V) into, per Score, the log-probability of
        its target token, that token's rank (1 is the most likely) and its request's
        prompt_logprobs most likely [(token, logprob)], best first. The work runs on the
        device: only these figures come to the host."""
        if not scores:
            return []
        xp, targets = self.device.xp, [score.target for score in scores]
        k = min(max(score.seq.params.prompt_logprobs for score in scores), logits.shape[1])
        logp = to_float32(logits[[score.row for score in scores]])
        logp -= logp.max(axis=1, keepdims=True)
        logp -= xp.log(xp.exp(logp).sum(axis=1, keepdims=True))
        chosen = logp[xp.arange(len(targets)), xp.asarray(np.asarray(targets, np.int64))]
        rank = (logp > chosen[:, None]).sum(axis=1) + 1
        top = xp.argpartition(-logp, k - 1, axis=1)[:, :k] if k else xp.zeros((len(targets), 0),
                                                                              np.int64)
        top = xp.take_along_axis(top, xp.argsort(-xp.take_along_axis(logp, top, axis=1), axis=1),
                                 axis=1)
        host = [self.device.to_host(a).tolist()
                for a in (chosen, rank, top, xp.take_along_axis(logp, top, axis=1))]
        return [(c, r, list(zip(t, v))[:score.seq.params.prompt_logprobs])
                for score, c, r, t, v in zip(scores, *host)]

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
            host[5].view(np.float32)[:] = np.log(np.array([s.params.min_p for s in seqs],
                                                          np.float32))
        host[6].view(np.int32)[:] = counters
        xp = self.device.xp
        packed = xp.asarray(host)
        return (packed[2].view(xp.float32), packed[3].view(xp.int32), packed[4].view(xp.float32),
                packed[5].view(xp.float32), packed[:2].reshape(-1).view(xp.uint64),
                packed[6].view(xp.int32))
