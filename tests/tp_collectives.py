"""Run under mpirun by test_tp.py: known answers for nano.parallel's collectives.
Rank 0 prints "ok <world>" when every check passed on every rank."""
import numpy as np

from nano import parallel
from nano.errors import NanoError

group = parallel.world()
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

# The step message: swap pairs and packed inputs survive encode -> broadcast -> decode.
swap_out, swap_in, packed = [(3, 0), (4, 1)], [(7, 9)], np.arange(40, dtype=np.int32)
message = parallel.encode_step(swap_out, swap_in, packed) if r == 0 else None
got_out, got_in, got_packed = parallel.decode_step(group.broadcast(message))
assert (got_out, got_in) == (swap_out, swap_in) and np.array_equal(got_packed, packed)
message = parallel.encode_step([], [], None) if r == 0 else None
assert parallel.decode_step(group.broadcast(message)) == ([], [], None)
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
