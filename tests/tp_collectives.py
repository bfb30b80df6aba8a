"""Run under mpirun by test_tp.py: known answers for nano.parallel's collectives.
Rank 0 prints "ok <world>" when every check passed on every rank."""
import numpy as np

from nano import parallel, plan
from nano.errors import NanoError

group = parallel.tp_group()
r, n = group.rank, group.world

# All-reduce, in place: rank r adds (r + 1) * base, so the sum is exactly n(n+1)/2 * base
# (small integers: float32 adds them exactly, in any order).
base = np.arange(6 * 576, dtype=np.float32).reshape(6, 576) % 1000 - 500
x = (r + 1) * base
out = group.all_reduce(x)
assert out is x, "all_reduce must work in place"
assert np.array_equal(x, n * (n + 1) // 2 * base), "wrong all-reduce sum"
seconds, nbytes = group.take_all_reduce_stats()
assert nbytes == (base.nbytes if n > 1 else 0) and seconds >= 0  # one rank: nothing to add
assert group.take_all_reduce_stats() == (0.0, 0)

# The step message: a packed step (swap pairs and inputs) arrives whole on every rank.
sizes = plan.PackedShape(swap_out=2, swap_in=1, tokens=3, seqs=2, decodes=1, max_blocks=2, logits=2)
swap_out, swap_in = [(3, 0), (4, 1)], [(7, 9)]
fields = dict(blocks_to_swap_out=swap_out, blocks_to_swap_in=swap_in, input_ids=[5, 6, 7],
              positions=[9, 0, 1], slot_mapping=[41, 16, 17], context_lens=[10, 2],
              block_tables=[[1, 2], [3, -1]], cu_seqlens_q=[0, 2], logits_indices=[0, 2],
              lora_slots=[-1, 3])
message = plan.pack_step(sizes, **fields) if r == 0 else None
got = group.broadcast(message)
assert plan.packed_shape(got) == sizes
views = plan.unpack_step(got, sizes)
assert all(np.array_equal(views[k], np.asarray(v)) for k, v in fields.items())
nothing = {k: () for k in fields} | {"cu_seqlens_q": [0]}  # a step that only waits
empty = plan.pack_step(plan.PackedShape(), **nothing) if r == 0 else None
assert plan.packed_shape(group.broadcast(empty)) == plan.PackedShape()
assert group.broadcast(None) is None  # STOP

assert group.min(10 + r) == 10

# A failure on the last rank alone is raised on every rank, naming that rank.
if n > 1:
    try:
        with group.together():
            if r == n - 1:
                raise NanoError("only here")
        raise AssertionError("together() did not raise")
    except parallel.SharedError as e:
        assert str(e) == f"rank {n - 1}: only here", str(e)

if r == 0:
    print(f"ok {n}")
