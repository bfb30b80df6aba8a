"""One step's plan, frozen when the scheduler is done (StepPlan), and the packed step: the plan
flattened into one int32 array laid out by PackedShape.layout(), which rank 0 broadcasts under
TP and one host-to-device copy moves (docs/how-it-works.md#one-step).
"""
import math
from dataclasses import dataclass, field, fields

import numpy as np

from nano.sequence import Sequence


def is_decode(num_tokens: int) -> bool:
    """Treat a row of one new token as a decode (paged attention over its cache), whether that
    token was generated or is a one-token prefill chunk."""
    return num_tokens == 1


def scored(seq: Sequence, num_tokens: int) -> range:
    """Return the positions among this step's num_tokens whose logits score the prompt's next
    token, for a request that asked for prompt logprobs: those before the prompt's last token
    (whose logits sample) that it holds no score for yet, so that a recomputed prompt is
    scored once."""
    if seq.params.prompt_logprobs is None:
        return range(0)
    start = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
    return range(start, min(seq.num_computed_tokens + num_tokens, seq.num_prompt_tokens - 1))


def decode_context(seqs) -> int:
    """Count the KV tokens the decoding sequences `seqs` hold: what their attention reads, the
    input the cost model prices a decode by."""
    return sum(seq.num_computed_tokens for seq in seqs)


@dataclass
class Preemption:
    seq: Sequence
    mode: str          # swap | recompute
    reason: str        # forced | swap_cheaper | recompute_cheaper | no_swap_space


@dataclass(slots=True)  # slots: one is made per sequence that samples, at every step
class Sample:
    """A sequence that samples this step: a logits row after its last token, and one more
    after each draft it checks (docs/speculative.md#the-accept-rule)."""
    seq: Sequence
    rows: range          # its logits rows, one per token it may gain, consecutive
    drafts: list[int]    # the draft token each row but the last checks
    output_count: int    # its output tokens when planned: the first row's draw key


@dataclass(slots=True)
class Score:
    """A prompt position whose logits row scores the prompt's next token (prompt logprobs)."""
    seq: Sequence
    row: int
    target: int          # the prompt token it scores


@dataclass
class StepPlan:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    preempted: list[Preemption] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # given blocks from the waiting queue
    prefix_queried: int = 0  # their tokens looked up in the prefix cache
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler
    # What freeze() sets, whatever happens to the sequences afterwards:
    packed: np.ndarray | None = None  # the packed step (below): the device's whole input
    samples: list[Sample] = field(default_factory=list)
    scores: list[Score] = field(default_factory=list)
    prefill_tokens: int = 0
    num_decodes: int = 0
    decode_kv_tokens: int = 0  # KV tokens the decodes attend to, this step's included

    def freeze(self, block_size: int) -> "StepPlan":
        """Pack the scheduled sequences, decodes first (a stable sort), and give each logits
        row its purpose: one row per prompt position scored, and for a sequence whose tokens
        this step reaches the end of, one row after its last token and after each draft. A
        prefill chunk short of the prompt's end samples nothing."""
        seqs = sorted(self.scheduled, key=lambda item: not is_decode(item[1]))
        ids, positions, context_lens, cu_seqlens, logits_indices = [], [], [], [0], []
        for seq, n in seqs:  # one pass, each attribute read once: it runs for every row
            start, drafts, tokens = seq.num_computed_tokens, seq.draft_token_ids, seq.token_ids
            # the packed index of this sequence's position p is offset + p
            offset = len(ids) - start
            ids += tokens[start:start + n] + drafts
            positions += range(start, start + n)
            context_lens.append(start + n)
            if not is_decode(n):
                cu_seqlens.append(cu_seqlens[-1] + n)
            for p in scored(seq, n):
                self.scores.append(Score(seq, len(logits_indices), tokens[p + 1]))
                logits_indices.append(offset + p)
            if start + n == len(tokens) + len(drafts):
                rows = range(len(logits_indices), len(logits_indices) + len(drafts) + 1)
                self.samples.append(Sample(seq, rows, list(drafts),
                                           len(tokens) - seq.num_prompt_tokens))
                logits_indices += range(offset + len(tokens) - 1, offset + start + n)
        # the tables as rows padded with -1, filled in one assignment rather than one per row
        widths = np.asarray([len(seq.block_table) for seq, _ in seqs], np.int32)
        tables = np.full((len(seqs), widths.max(initial=0)), -1, np.int32)
        tables[np.arange(tables.shape[1]) < widths[:, None]] = [
            block for seq, _ in seqs for block in seq.block_table]
        positions = np.asarray(positions, np.int32)
        row_of_token = np.repeat(np.arange(len(seqs)), [n for _, n in seqs])
        slot_mapping = (tables[row_of_token, positions // block_size] * block_size
                        + positions % block_size)
        self.num_decodes = len(seqs) - (len(cu_seqlens) - 1)  # the rest are prefill chunks
        self.prefill_tokens = len(ids) - self.num_decodes
        self.decode_kv_tokens = sum(context_lens[:self.num_decodes])
        shape = PackedShape(len(self.blocks_to_swap_out), len(self.blocks_to_swap_in), len(ids),
                            len(seqs), self.num_decodes, tables.shape[1], len(logits_indices))
        self.packed = pack_step(shape, blocks_to_swap_out=self.blocks_to_swap_out,
                                blocks_to_swap_in=self.blocks_to_swap_in, input_ids=ids,
                                positions=positions, slot_mapping=slot_mapping,
                                context_lens=context_lens, block_tables=tables,
                                cu_seqlens_q=cu_seqlens, logits_indices=logits_indices,
                                lora_slots=[s.lora.lora_int_id if s.lora else -1 for s, _ in seqs])
        return self


# ---- the packed step -------------------------------------------------------------------
@dataclass(frozen=True)
class PackedShape:
    """The packed step's header: the counts that give every field its shape."""
    swap_out: int = 0     # block pairs to swap out
    swap_in: int = 0      # block pairs to swap in
    tokens: int = 0       # T: new tokens, all rows
    seqs: int = 0         # S: rows, decodes first
    decodes: int = 0      # rows 0..decodes-1 have one token each
    max_blocks: int = 0   # block table width
    logits: int = 0       # R: rows that sample or score a prompt (StepPlan.samples, .scores)

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Return the fields in order, each a C-order int32 block of this shape. The input
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
            # each row's adapter: its id as rank 0 packs it, its slot once placed (runner.py)
            "lora_slots": (self.seqs,),
        }


HEADER = len(fields(PackedShape))


def pack_step(shape: PackedShape, **values) -> np.ndarray:
    """Write the header, then every field of shape.layout() in order, into one int32 host
    array."""
    parts = [np.asarray([getattr(shape, f.name) for f in fields(shape)], np.int32)]
    parts += [np.asarray(values[name], np.int32).reshape(dims).ravel()
              for name, dims in shape.layout().items()]
    return np.concatenate(parts)


def packed_shape(packed: np.ndarray) -> PackedShape:
    """Read the header of a packed step on the host."""
    return PackedShape(*packed[:HEADER].tolist())


def unpack_step(packed, shape: PackedShape) -> dict:
    """Return views into a packed step (NumPy or CuPy), one per field, in its shape. The shape
    comes from the host copy: reading a device copy's header would wait for the device."""
    views, at = {}, HEADER
    for name, dims in shape.layout().items():
        size = math.prod(dims)
        views[name] = packed[at:at + size].reshape(dims)
        at += size
    return views
