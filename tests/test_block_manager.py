"""Block manager unit tests: prefix hashing, sharing, LRU eviction, swap bookkeeping."""
import random

import pytest

from nano import block_manager
from nano.block_manager import BlockManager
from nano.sequence import SamplingParams, Sequence


def seq(i, tokens):
    return Sequence(i, "", tokens, SamplingParams(), 0.0, seed=i)


def admit_and_compute(bm, s):
    hits = bm.match_prefix(s.token_ids)
    bm.admit(s, hits)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)
    return hits


def test_shared_prefix_blocks_are_shared_and_last_token_recomputed():
    bm = BlockManager(num_blocks=10, block_size=4, num_swap_blocks=0)
    a = seq(0, list(range(10)))                # blocks [0..3] [4..7] [8, 9]
    admit_and_compute(bm, a)
    b = seq(1, list(range(8)) + [99])          # shares two full blocks
    hits = bm.match_prefix(b.token_ids)
    assert hits == a.block_table[:2]
    bm.admit(b, hits)
    assert b.num_computed_tokens == 8
    assert all(bm.blocks[x].ref_count == 2 for x in hits)
    c = seq(2, list(range(8)))                 # exactly two blocks: the last token must be computed
    assert bm.match_prefix(c.token_ids) == a.block_table[:1]


def test_without_prefix_caching_no_block_is_registered():
    bm = BlockManager(num_blocks=10, block_size=4, num_swap_blocks=0, enable_prefix_caching=False)
    bm.cache_events = []
    admit_and_compute(bm, seq(0, list(range(10))))
    assert not bm.hash_to_block and not bm.cache_events
    assert all(b.hash is None for b in bm.blocks)


def test_hash_chains_over_the_parent():
    bm = BlockManager(num_blocks=10, block_size=2, num_swap_blocks=0)
    admit_and_compute(bm, seq(0, [1, 2, 3, 4, 5]))
    # Same second block [3, 4] after a different first block: no hit on it.
    assert bm.match_prefix([9, 9, 3, 4, 5]) == []


def test_same_block_after_another_parent_is_not_served():
    """A block's hash names its whole prefix: b's second block holds the same tokens as a's,
    but its KV was computed after other tokens, so c (b's prefix) must get b's block, not a's."""
    bm = BlockManager(num_blocks=10, block_size=2, num_swap_blocks=0)
    a = seq(0, [1, 2, 3, 4, 5])
    b = seq(1, [9, 9, 3, 4, 5])
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    hits = bm.match_prefix([9, 9, 3, 4, 6])
    assert hits == b.block_table[:2]
    assert a.block_table[1] not in hits


def test_a_shared_block_stays_held_until_its_last_sharer_frees_it():
    bm = BlockManager(num_blocks=4, block_size=2, num_swap_blocks=0)
    a, b = seq(0, [1, 2, 3]), seq(1, [1, 2, 4])
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    shared = a.block_table[0]
    assert b.block_table[0] == shared and bm.blocks[shared].ref_count == 2
    bm.free(a)
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free_blocks
    c = seq(2, [7, 8, 9, 10])                  # takes both free blocks: never b's
    bm.admit(c, [])
    assert shared not in c.block_table and bm.num_free_blocks == 0
    tail = b.block_table[1]
    bm.free(b)
    assert list(bm.free_blocks) == [tail, shared] and bm.blocks[shared].ref_count == 0


def test_hash_collision_is_verified(monkeypatch):
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: 42)  # everything collides
    bm = BlockManager(num_blocks=10, block_size=2, num_swap_blocks=0)
    admit_and_compute(bm, seq(0, [1, 2, 3]))
    assert bm.match_prefix([1, 2, 7]) != []
    assert bm.match_prefix([5, 6, 7]) == []    # same hash, other tokens: a miss, not a wrong hit


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, num_swap_blocks=0)
    a, b = seq(0, [1, 2, 3]), seq(1, [5, 6, 7])
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4
    assert bm.match_prefix([1, 2, 0]) and bm.match_prefix([5, 6, 0])
    c = seq(2, [8, 9, 10, 11, 12])             # needs 3 blocks: evicts a's first (freed earliest)
    bm.admit(c, bm.match_prefix(c.token_ids))
    assert bm.match_prefix([1, 2, 0]) == []
    assert bm.match_prefix([5, 6, 0]) != []     # b freed later: still cached


def test_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=2, num_swap_blocks=0)
    a = seq(0, [1, 2, 3])
    admit_and_compute(bm, a)
    bm.free(a)
    b = seq(1, [1, 2, 4])
    hits = bm.match_prefix(b.token_ids)
    assert bm.can_admit(b, hits, watermark_blocks=2)
    assert not bm.can_admit(b, hits, watermark_blocks=3)
    bm.admit(b, hits)
    assert hits[0] not in bm.free_blocks and bm.blocks[hits[0]].ref_count == 1
    assert bm.num_free_blocks == 2


def test_swap_out_and_in_round_trip():
    bm = BlockManager(num_blocks=6, block_size=2, num_swap_blocks=4)
    a = seq(0, [1, 2, 3, 4, 5])
    admit_and_compute(bm, a)
    device_blocks = list(a.block_table)
    out = bm.swap_out(a)
    assert [d for d, _ in out] == device_blocks
    assert a.block_table == [h for _, h in out]
    assert bm.num_free_blocks == 6 and len(bm.free_host_blocks) == 1
    b = seq(1, list(range(8)))
    admit_and_compute(bm, b)                   # 4 blocks, 1 host block left
    assert not bm.can_swap_out(b)
    bm.free(b)
    back = bm.swap_in(a)
    assert [h for h, _ in back] == [h for _, h in out]
    assert len(bm.free_host_blocks) == 4 and bm.num_free_blocks == 3


def check_invariants(bm, running, swapped):
    """Every device block is free (ref count 0, in the free queue) or held: its ref count is
    the number of running tables listing it, and one shared by two tables is a registered
    prefix block at the same index in both; host blocks are each free or in one swapped table."""
    holders = {}
    for s in running:
        assert len(set(s.block_table)) == len(s.block_table), s
        assert len(s.block_table) >= bm.num_blocks_for(s.num_computed_tokens)
        for i, b in enumerate(s.block_table):
            holders.setdefault(b, []).append(i)
    for block in bm.blocks:
        at = holders.get(block.block_id, [])
        assert block.ref_count == len(at), block.block_id
        assert (block.block_id in bm.free_blocks) == (block.ref_count == 0), block.block_id
        if len(at) > 1:
            assert block.hash is not None and len(set(at)) == 1, block.block_id
    for h, b in bm.hash_to_block.items():
        assert bm.blocks[b].hash == h
    host = [b for s in swapped for b in s.block_table] + bm.free_host_blocks
    assert sorted(host) == list(range(bm.num_swap_blocks))


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_keeps_block_tables_consistent(seed):
    """Admissions with shared prefixes, decode growth, frees, swaps out and in, in random order."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4, num_swap_blocks=16)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    running, swapped = [], []
    for i in range(300):
        op = rng.random()
        if op < 0.3:
            s = seq(i, rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
            hits = bm.match_prefix(s.token_ids)
            if bm.can_admit(s, hits, 0):
                admit_and_compute(bm, s)
                running.append(s)
        elif op < 0.6 and running:             # a decode: one more token, its slot, its KV
            s = rng.choice(running)
            if bm.blocks_to_grow(s, 1) <= bm.num_free_blocks:
                bm.grow(s, 1)
                s.num_computed_tokens += 1
                s.token_ids.append(rng.randrange(50))
                bm.register_full_blocks(s)
        elif op < 0.75 and running:
            s = running.pop(rng.randrange(len(running)))
            bm.free(s)
        elif op < 0.85 and running:
            s = rng.choice(running)
            if bm.can_swap_out(s):
                running.remove(s)
                bm.swap_out(s)
                swapped.append(s)
        elif swapped:
            s = swapped[0]
            if rng.random() < 0.2:
                bm.free_swapped(swapped.pop(0))
            elif bm.can_swap_in(s, 0, 0):
                bm.swap_in(swapped.pop(0))
                running.append(s)
        check_invariants(bm, running, swapped)
