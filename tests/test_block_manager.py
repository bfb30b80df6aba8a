"""Block manager unit tests: prefix hashing, sharing, LRU eviction, swap bookkeeping."""
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
