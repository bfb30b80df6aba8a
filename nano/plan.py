"""One step's plan: what the scheduler decided for the step (SchedulerOutput), which the
runner, the engine, the metrics and the TP broadcast all read; and the packed step, the
plan flattened into one int32 array laid out by StepSizes.fields().

The packed step is what rank 0 broadcasts under TP (every rank unpacks the same array) and
what one host-to-device copy moves before a forward pass; a CUDA graph's static input
buffer (graphs.py) has the same layout.
"""
from dataclasses import astuple, dataclass, field, fields

import numpy as np

from nano.sequence import Sequence


def is_decode(num_tokens: int) -> bool:
    """A row of one new token runs as a decode (paged attention over its cache), whether that
    token was generated or is a one-token prefill chunk."""
    return num_tokens == 1


def samples(seq: Sequence, num_tokens: int) -> bool:
    """Whether seq samples its next token after this step's num_tokens: only if they reach the
    end of its tokens (a prefill chunk short of the prompt's end samples nothing)."""
    return seq.num_computed_tokens + num_tokens == seq.num_tokens


def scored(seq: Sequence, num_tokens: int) -> range:
    """Positions among this step's num_tokens whose logits score the prompt's next token, for
    a request that asked for prompt logprobs: those before the prompt's last token (whose
    logits sample) that it holds no score for yet (a prompt recomputed is scored once)."""
    if seq.params.prompt_logprobs is None:
        return range(0)
    start = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
    return range(start, min(seq.num_computed_tokens + num_tokens, seq.num_prompt_tokens - 1))


def decode_context(seqs) -> int:
    """KV tokens the decoding sequences `seqs` hold: what their attention reads, the input the
    cost model prices a decode by."""
    return sum(seq.num_computed_tokens for seq in seqs)


@dataclass
class Preemption:
    seq: Sequence
    mode: str          # swap | recompute
    reason: str        # why this mode: forced | swap_cheaper | recompute_cheaper | no_swap_space


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    preempted: list[Preemption] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # newly given blocks from the waiting queue
    prefix_queried: int = 0  # their tokens looked up in the prefix cache (before this step samples)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (rejected, or out of KV)

    def rows(self) -> list[tuple[Sequence, int]]:
        """The scheduled sequences in the forward pass's row order: decodes first (stable)."""
        return sorted(self.scheduled, key=lambda item: not is_decode(item[1]))

    def decodes(self) -> list[Sequence]:
        return [seq for seq, n in self.scheduled if is_decode(n)]

    def sampling(self) -> list[Sequence]:
        """The sequences that sample a token this step, in row order (one logits row each).
        Ask before postprocessing advances them."""
        return [seq for seq, n in self.rows() if samples(seq, n)]

    def logits_rows(self) -> list[tuple[Sequence, int | None]]:
        """The forward pass's logits rows in order: (sequence, position) for each position
        that scores a prompt (scored), (sequence, None) for each row that samples."""
        out = []
        for seq, n in self.rows():
            out += [(seq, p) for p in scored(seq, n)] + [(seq, None)] * samples(seq, n)
        return out


# ---- the packed step -------------------------------------------------------------------
@dataclass(frozen=True)
class StepSizes:
    """The packed step's header: the counts that give every field its shape."""
    swap_out: int = 0     # block pairs to swap out
    swap_in: int = 0      # block pairs to swap in
    tokens: int = 0       # T: new tokens, all rows
    seqs: int = 0         # S: rows, decodes first
    decodes: int = 0      # rows 0..decodes-1 have one token each
    max_blocks: int = 0   # block table width
    logits: int = 0       # R: rows that sample or score a prompt (SchedulerOutput.logits_rows)

    def fields(self) -> dict[str, tuple[int, ...]]:
        """The layout, in order: each field a C-order int32 block of this shape. The input
        fields are named as model.ForwardBatch's."""
        return {
            "blocks_to_swap_out": (self.swap_out, 2),   # (device block, host block)
            "blocks_to_swap_in": (self.swap_in, 2),     # (host block, device block)
            "input_ids": (self.tokens,),
            "positions": (self.tokens,),
            "slot_mapping": (self.tokens,),
            "context_lens": (self.seqs,),
            "block_tables": (self.seqs, self.max_blocks),
            "cu_seqlens_q": (self.seqs - self.decodes + 1,),  # prefill chunks' offsets
            "logits_indices": (self.logits,),
        }


HEADER = len(fields(StepSizes))


def pack_step(sizes: StepSizes, **values) -> np.ndarray:
    """The header, then every field of sizes.fields() in order, in one int32 host array."""
    parts = [np.asarray(astuple(sizes), np.int32)]
    parts += [np.asarray(values[name], np.int32).reshape(shape).ravel()
              for name, shape in sizes.fields().items()]
    return np.concatenate(parts)


def step_sizes(packed: np.ndarray) -> StepSizes:
    """The header of a packed step on the host."""
    return StepSizes(*packed[:HEADER].tolist())


def unpack_step(packed, sizes: StepSizes) -> dict:
    """Views into a packed step (NumPy or CuPy), one per field, in its shape. The sizes come
    from the host copy: reading a device copy's header would wait for the device."""
    views, at = {}, HEADER
    for name, shape in sizes.fields().items():
        size = int(np.prod(shape))
        views[name] = packed[at:at + size].reshape(shape)
        at += size
    return views
