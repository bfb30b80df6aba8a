"""One step's plan, fixed when the scheduler is done (SchedulerOutput), and the packed step: the
plan flattened into one int32 array laid out by StepSizes.fields(), which rank 0 broadcasts
under TP and one host-to-device copy moves (docs/how-it-works.md#one-step).
"""
from dataclasses import astuple, dataclass, field, fields

import numpy as np

from nano.sequence import Sequence


def is_decode(num_tokens: int) -> bool:
    """A row of one new token runs as a decode (paged attention over its cache), whether that
    token was generated or is a one-token prefill chunk."""
    return num_tokens == 1


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
class StepRows:  # what each row of a step's logits (the forward pass's output) is for
    sampling: list[Sequence] = field(default_factory=list)  # the sequences that sample a token,
    counters: list[int] = field(default_factory=list)       # their output counts (keys of their draws),
    sample_rows: list[int] = field(default_factory=list)    # their logits rows,
    drafts: list[int] = field(default_factory=list)         # the draft token each row checks, -1: none
    scoring: list[Sequence] = field(default_factory=list)   # per row that scores a prompt token: its sequence,
    targets: list[int] = field(default_factory=list)        # the token it scores,
    score_rows: list[int] = field(default_factory=list)     # its logits row


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    preempted: list[Preemption] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # newly given blocks from the waiting queue
    prefix_queried: int = 0  # their tokens looked up in the prefix cache (before this step samples)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler (rejected, or out of KV)
    # Fixed when planning ends (fix), whatever happens to the sequences after:
    packed: np.ndarray | None = None  # the packed step (below): the device's whole input
    rows: StepRows = field(default_factory=StepRows)
    prefill_tokens: int = 0
    num_decodes: int = 0
    decode_kv_tokens: int = 0  # KV tokens the decodes attend to, theirs this step included

    def fix(self, block_size: int) -> "SchedulerOutput":
        """Pack the rows, decodes first (stable); a logits row for each position that scores a prompt,
        and for a row's last and its drafts' if it reaches the end of its tokens (a chunk short of it samples nothing)."""
        seqs = sorted(self.scheduled, key=lambda item: not is_decode(item[1]))
        max_blocks = max((len(seq.block_table) for seq, _ in seqs), default=0)
        tables = np.full((len(seqs), max_blocks), -1, np.int32)
        ids, positions, context_lens, cu_seqlens, logits, rows = [], [], [], [0], [], self.rows
        for i, (seq, n) in enumerate(seqs):
            start, drafts = seq.num_computed_tokens, seq.draft_token_ids
            ids += seq.token_ids[start:start + n] + drafts
            positions += range(start, start + n)
            context_lens.append(start + n)
            tables[i, :len(seq.block_table)] = seq.block_table
            if not is_decode(n):
                cu_seqlens.append(cu_seqlens[-1] + n)
            for p in scored(seq, n):
                rows.scoring.append(seq)
                rows.targets.append(seq.token_ids[p + 1])
                rows.score_rows.append(len(logits))
                logits.append(len(ids) - n + p - start)
            # A row samples after the last token and after each draft (docs/speculative.md#the-accept-rule).
            for j, draft in enumerate([*drafts, -1] if start + n == seq.num_tokens + len(drafts) else []):
                rows.sampling.append(seq)
                rows.counters.append(seq.num_output_tokens + j)
                rows.sample_rows.append(len(logits))
                rows.drafts.append(draft)
                logits.append(len(ids) - 1 - len(drafts) + j)
        positions = np.asarray(positions, np.int32)
        row_of_token = np.repeat(np.arange(len(seqs)), [n for _, n in seqs])
        slot_mapping = tables[row_of_token, positions // block_size] * block_size + positions % block_size
        self.num_decodes = sum(is_decode(n) for _, n in seqs)
        self.prefill_tokens, self.decode_kv_tokens = len(ids) - self.num_decodes, sum(context_lens[:self.num_decodes])
        sizes = StepSizes(len(self.blocks_to_swap_out), len(self.blocks_to_swap_in), len(ids), len(seqs),
                          self.num_decodes, max_blocks, len(logits))
        self.packed = pack_step(sizes, blocks_to_swap_out=self.blocks_to_swap_out,
                                blocks_to_swap_in=self.blocks_to_swap_in, input_ids=ids, positions=positions,
                                slot_mapping=slot_mapping, context_lens=context_lens, block_tables=tables,
                                cu_seqlens_q=cu_seqlens, logits_indices=logits)
        return self


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
    logits: int = 0       # R: rows that sample or score a prompt (SchedulerOutput.rows)

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
