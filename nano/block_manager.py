"""The paged KV cache's bookkeeping: which block holds which tokens, who shares it. It only
hands out block ids (the arrays live in runner.py); token t of a sequence is in block
block_table[t // block_size] at offset t % block_size. Prefix caching and the host swap pool:
docs/how-it-works.md#paged-kv-cache, #prefix-caching.
"""
from collections import OrderedDict

from nano.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None        # set once the block is full and registered
        self.token_ids: tuple[int, ...] = ()  # the tokens behind the hash, to verify hits


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int,
                 enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_swap_blocks = num_swap_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free device blocks in eviction order: reuse takes the front (least recently freed).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.free_host_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.cache_events: list[tuple[bool, int]] | None = None  # None: nobody listens

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], root=None) -> list[int]:
        """Cached blocks holding a prefix of token_ids, computed under the adapter `root`
        (None: the base model). Only full blocks before the last token count: the last token
        is always computed, since its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], root
        for i in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: hash every block of seq that is now full of computed tokens."""
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            # the first block's parent is the adapter: a block's KV depends on it
            h = chain_hash(seq.block_hashes[-1] if i else seq.lora, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            # A block already registered (shared by a hit) is in the table under this very
            # hash; if another sequence registered the same prefix first, this copy stays anonymous.
            if self.enable_prefix_caching and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id
                if self.cache_events is not None:
                    self.cache_events.append((True, h))

    # ---- allocation --------------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its old contents are about to be overwritten
            del self.hash_to_block[block.hash]
            if self.cache_events is not None:
                self.cache_events.append((False, block.hash))
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None  # back of the queue: evicted last

    def can_admit(self, seq: Sequence, hits: list[int], watermark_blocks: int) -> bool:
        """Would the free blocks stay above the watermark after admitting seq?"""
        new = self.num_blocks_for(seq.num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # leave the free queue
        return self.num_free_blocks - revived - new >= watermark_blocks

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give seq blocks for all its tokens, sharing the prefix hits."""
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        new = self.num_blocks_for(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self._take_free() for _ in range(new)]
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size

    def blocks_to_grow(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks seq needs so that num_new_tokens more tokens have slots."""
        return max(0, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
                   - len(seq.block_table))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.blocks_to_grow(seq, num_new_tokens)):
            seq.block_table.append(self._take_free())

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are evicted before the (more shareable) head.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table, seq.block_hashes = [], []

    # ---- swap --------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.free_host_blocks) >= len(seq.block_table)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's blocks to host blocks; returns (device, host) pairs to copy."""
        pairs = [(b, self.free_host_blocks.pop()) for b in seq.block_table]
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = [host for _, host in pairs]
        return pairs

    def free_swapped(self, seq: Sequence) -> None:
        """A swapped-out sequence that will not come back gives its host blocks up."""
        self.free_host_blocks.extend(seq.block_table)
        seq.block_table, seq.block_hashes = [], []

    def can_swap_in(self, seq: Sequence, num_new_tokens: int, watermark_blocks: int) -> bool:
        # Every swapped block comes back, even one grown for tokens it had not computed when
        # preempted (a later step may give it a smaller chunk).
        need = max(len(seq.block_table),
                   self.num_blocks_for(seq.num_computed_tokens + num_new_tokens))
        return self.num_free_blocks - need >= watermark_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring seq's blocks back into fresh device blocks; returns (host, device) pairs."""
        pairs = [(host, self._take_free()) for host in seq.block_table]
        self.free_host_blocks.extend(host for host, _ in pairs)
        seq.block_table = [dev for _, dev in pairs]
        return pairs
