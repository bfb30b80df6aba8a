"""Where a request goes: the router's policies, and its picture of each replica's prefix cache.

    round-robin    replicas in turn, blind to load and cache
    least-loaded   the fewest queued tokens (prompt tokens not yet computed + output tokens
                   still to come), then the lowest KV occupancy: the signals every replica
                   reports after each step
    kv-aware       the lowest cost = prompt tokens the replica would compute (after the
                   prefix it is thought to hold) + the tokens it has still to compute for
                   the requests it holds (counted the same way: a queue of requests whose
                   prefix is cached there is short); on a tie, the replica
                   whose cache holds the fewest blocks (SGLang's choice when no replica has
                   the prefix: a new tenant's prefix goes where it evicts least)

Remaining ties go to the replica sent the fewest requests so far (then the lowest rank): at
low load every replica is idle, and a fixed tie-break would send everything to one.

kv-aware is NVIDIA Dynamo's KV router cost (overlap weight 1: the blocks a worker must
prefill plus its load), counted in tokens; SGLang's router instead takes the longest cached
prefix until the load is too uneven. Both terms are in tokens of work, so a cached prefix
is worth exactly the queue it lets a request skip.

CacheIndex holds, per replica, the chained block hashes (block_manager.chain_hash) it has
reported stored and not evicted (BlockManager.cache_events), plus those of the prompts just
sent to it (they will be stored once computed: without them, a burst of one tenant's
requests would scatter before the first one's blocks are reported). The index may be
stale either way: a prefix it shows that the replica has evicted costs a miss there, never
a wrong token (the replica's own prefix cache checks every hit).
"""
from nano.block_manager import chain_hash
from nano.errors import NanoError

POLICIES = ("round-robin", "least-loaded", "kv-aware")


def prompt_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks that a prefix-cache hit can cover (not
    the block of the last token, which is always computed: BlockManager.match_prefix)."""
    hashes, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


class CacheIndex:
    def __init__(self, replicas: list[int]):
        self.blocks: dict[int, set[int]] = {r: set() for r in replicas}

    def apply(self, replica: int, events: list[tuple[bool, int]]) -> None:
        """A replica's (stored?, hash) events, in the order it saw them."""
        held = self.blocks[replica]
        for stored, h in events:
            if stored:
                held.add(h)
            else:
                held.discard(h)

    def overlap(self, replica: int, hashes: list[int]) -> int:
        """Leading blocks of the prompt the replica is thought to hold (a chained hash names
        its whole prefix, so the first one missing ends the match)."""
        held, n = self.blocks[replica], 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n


class Policy:
    """choose(seq, hashes) -> replica. The router gives it its load view (queued(r),
    occupancy(r), work(r): tokens r has still to compute) and the cache index."""

    def __init__(self, name: str, replicas: list[int], block_size: int, queued, occupancy, work, index: CacheIndex):
        if name not in POLICIES:
            raise NanoError(f"--dp-policy must be one of {', '.join(POLICIES)}, got {name!r}")
        self.name, self.replicas, self.block_size = name, replicas, block_size
        self.queued, self.occupancy, self.work, self.index = queued, occupancy, work, index
        self.routed = {r: 0 for r in replicas}  # requests chosen for each replica so far

    def choose(self, seq, hashes: list[int]) -> int:
        if self.name == "round-robin":
            key = lambda r: (self.routed[r], r)  # noqa: E731
        elif self.name == "least-loaded":
            key = lambda r: (self.queued(r), self.occupancy(r), self.routed[r], r)  # noqa: E731
        else:
            key = lambda r: (self.cost(seq, hashes, r), len(self.index.blocks[r]), self.routed[r], r)  # noqa: E731
        replica = min(self.replicas, key=key)
        self.routed[replica] += 1
        return replica

    def cost(self, seq, hashes: list[int], replica: int) -> int:
        uncached = seq.num_prompt_tokens - self.block_size * self.index.overlap(replica, hashes)
        return uncached + self.work(replica)
