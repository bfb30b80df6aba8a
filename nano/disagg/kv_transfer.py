"""A sequence's KV blocks moved from a prefill instance's pool to a decode instance's
(disaggregated serving, disagg.py), and checked on arrival.

    payload:   (num_blocks, block_bytes) uint8, one row per block (LLMEngine.hand_off):
               the block's slice of every block array, all layers, K and V (and, in an int8
               pool, the scales), so a row is everything one block holds
    checksums: (num_blocks,) one CRC-32 per row, seeded with (seq_id, block index)

Only the blocks the prefill filled travel: ceil(num_computed_tokens / block_size) of them,
in pieces of whole blocks, about PIECE_BYTES each, so that a decode instance can take a
payload a few pieces between two steps instead of stalling its running decodes for all of
it (disagg.DecodeInstance).
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
from nano.fleet.ranks import wire_copy
from nano.sequence import Sequence

PIECE_BYTES = 2 * 2**20  # ~1.3 ms to receive, check and write on this CPU (1.6 GB/s)


class ChecksumError(NanoError):
    """A handed-over block did not arrive as it was sent."""


@dataclass(eq=False)
class Offer:
    """What a prefill instance sends a decode instance for one sequence, ahead of the payload."""
    seq: Sequence               # its state: tokens (prompt + first token), params, seed, times
    source: int                 # the prefill instance's rank
    tag: int                    # the payload message's tag
    num_blocks: int
    nbytes: int                 # of the payload
    blocks_per_piece: int       # the payload goes as messages of this many blocks (the last: what is left)
    checksums: list[int]
    pack_seconds: float         # gathering the blocks and checksumming them, on the prefill side
    offered_at: float           # clock time the offer was sent


def row_checksum(row: np.ndarray, seq_id: int, index: int) -> int:
    return zlib.crc32(row, zlib.crc32(struct.pack("<qq", seq_id, index)))


def pack(engine, seq: Sequence, source: int, tag: int, now, buffers=None) -> tuple[Offer, np.ndarray]:
    """The offer and the payload of seq's filled blocks, handed off by engine (into a buffer
    from buffers, a PayloadBuffers, if given)."""
    start = time.perf_counter()
    payload = engine.hand_off(seq, buffers.take if buffers else None)
    num_blocks = len(payload)
    checksums = [row_checksum(row, seq.seq_id, i) for i, row in enumerate(payload)]
    per_piece = max(1, PIECE_BYTES // payload.shape[1])
    offer = Offer(wire_copy(seq), source, tag, num_blocks, payload.nbytes, per_piece, checksums,
                  time.perf_counter() - start, now())
    return offer, payload


class PayloadBuffers:
    """Payload memory, reused. A fresh buffer is paid for in page faults at its first touch:
    on this 2-core VM that made a 40 MB pack take 40 ms instead of 10, and slowed the decode
    rank's steps on the other core by up to 1.8x (docs/perf_notes.md). So a payload's
    buffer comes back here once its sends are done, and the next one of its size reuses it:
    the memory kept is the most payload ever in flight at once."""

    def __init__(self):
        self.free: list[np.ndarray] = []  # flat uint8

    def take(self, nbytes: int) -> np.ndarray:
        """A flat buffer of at least nbytes: the smallest free one that fits, or a new one."""
        fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
        if not fits:
            return np.empty(nbytes, np.uint8)
        return self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))

    def give(self, buffer: np.ndarray) -> None:
        self.free.append(buffer)


def pieces(offer: Offer) -> list[tuple[int, int]]:
    """(first block, number of blocks) of each message the payload is sent as, in order."""
    step = offer.blocks_per_piece
    return [(first, min(step, offer.num_blocks - first)) for first in range(0, offer.num_blocks, step)]


def verify(offer: Offer, rows: np.ndarray, first: int = 0) -> None:
    """Check rows (blocks first, first + 1, ... of the payload) against the offer's
    checksums; raise ChecksumError naming the first block that does not match."""
    seq_id = offer.seq.seq_id
    if first + len(rows) > offer.num_blocks:
        raise ChecksumError(f"KV handoff of request {seq_id}: block {first + len(rows) - 1} arrived, "
                            f"{offer.num_blocks} were sent")
    for i, row in enumerate(rows, first):
        if row_checksum(row, seq_id, i) != offer.checksums[i]:
            raise ChecksumError(f"KV handoff of request {seq_id}: block {i} of {offer.num_blocks} "
                                f"failed its checksum (corrupt or stale)")
