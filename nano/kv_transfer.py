"""A sequence's KV blocks moved from a prefill instance's pool to a decode instance's
(disaggregated serving, disagg.py), and checked on arrival.

    payload:   (num_blocks, block_bytes) uint8, one row per block (ModelRunner.export_blocks):
               the block's slice of every block array, all layers, K and V (and, in an int8
               pool, the scales), so a row is everything one block holds
    checksums: (num_blocks,) one CRC-32 per row, seeded with (seq_id, block index)

Only the blocks the prefill filled travel: ceil(num_computed_tokens / block_size) of them.
The seed makes a row checksum name its place: a row that is corrupt, or that belongs to
another sequence or another block of this one (a stale or misrouted buffer), fails the
check even when its bytes are a valid block. CRC-32 runs at ~7 GB/s here (zlib), a few
ms for a 1,000-token float32 prompt of the default model (46 MB).
"""
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np

from nano.errors import NanoError
from nano.sequence import Sequence


class ChecksumError(NanoError):
    """A handed-over block did not arrive as it was sent."""


@dataclass
class Offer:
    """What a prefill instance sends a decode instance for one sequence, ahead of the payload."""
    seq: Sequence               # its state: tokens (prompt + first token), params, seed, times
    source: int                 # the prefill instance's rank
    tag: int                    # the payload message's tag
    num_blocks: int
    nbytes: int                 # of the payload
    checksums: list[int]
    pack_seconds: float         # gathering the blocks and checksumming them, on the prefill side
    offered_at: float           # clock time the offer was sent


def row_checksum(row: np.ndarray, seq_id: int, index: int) -> int:
    return zlib.crc32(row, zlib.crc32(struct.pack("<qq", seq_id, index)))


def pack(runner, seq: Sequence, source: int, tag: int, now) -> tuple[Offer, np.ndarray]:
    """The offer and the payload of seq's filled blocks, read from runner's pool."""
    start = time.perf_counter()
    num_blocks = -(-seq.num_computed_tokens // runner.block_size)
    payload = runner.export_blocks(seq.block_table[:num_blocks])
    checksums = [row_checksum(row, seq.seq_id, i) for i, row in enumerate(payload)]
    offer = Offer(wire_copy(seq), source, tag, num_blocks, payload.nbytes, checksums,
                  time.perf_counter() - start, now())
    return offer, payload


def verify(offer: Offer, payload: np.ndarray) -> None:
    """Raise ChecksumError naming the first block that does not match its checksum."""
    if payload.shape[0] != offer.num_blocks:
        raise ChecksumError(f"KV handoff of request {offer.seq.seq_id}: {payload.shape[0]} blocks "
                            f"arrived, {offer.num_blocks} were sent")
    for i, row in enumerate(payload):
        if row_checksum(row, offer.seq.seq_id, i) != offer.checksums[i]:
            raise ChecksumError(f"KV handoff of request {offer.seq.seq_id}: block {i} of "
                                f"{offer.num_blocks} failed its checksum (corrupt or stale)")


def wire_copy(seq: Sequence) -> Sequence:
    """seq's state without its block table (block ids mean nothing in another pool)."""
    copy = Sequence.__new__(Sequence)
    copy.__dict__.update(seq.__dict__, block_table=[], block_hashes=[],
                         token_ids=list(seq.token_ids), token_times=list(seq.token_times))
    return copy
