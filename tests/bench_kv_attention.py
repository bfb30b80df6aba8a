"""Decode attention reading an int8 KV pool against a full-precision one, on the CPU
(NumPy, the engine's CPU path):  python tests/bench_kv_attention.py

One layer of the default model's shape (9 query heads, 3 KV heads, head dim 64), a batch
of BATCH sequences at each context length, block size 16, block tables of shuffled block
ids. ops.paged_attention gathers each sequence's blocks, so the int8 pool moves a quarter
of float32's bytes (plus scales) but converts them to float32 for the products: the table
says what that nets. The GPU version of this comparison is in tests/bench_kernels.py.
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nano import ops  # noqa: E402
from nano.kv_cache import LayerKV  # noqa: E402

NQ, NKV, D, BLOCK_SIZE, BATCH = 9, 3, 64, 16, 8
CONTEXTS = (1024, 4096, 8192, 16384)


def pool(rng, num_blocks, int8):
    k, v = (rng.standard_normal((num_blocks, NKV, BLOCK_SIZE, D), dtype=np.float32) for _ in range(2))
    if not int8:
        return LayerKV(k, v)
    (k, k_scale), (v, v_scale) = ops.quantize(k), ops.quantize(v)
    return LayerKV(k, v, k_scale, v_scale)


def median_ms(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main():
    rng = np.random.default_rng(0)
    print("| context | batch | float32 ms | int8 ms | int8 speed-up | KV MB read float32 / int8 |")
    print("|---|---|---|---|---|---|")
    for ctx in CONTEXTS:
        per_seq = ctx // BLOCK_SIZE
        tables = rng.permutation(BATCH * per_seq).astype(np.int32).reshape(BATCH, per_seq)
        lens = np.full(BATCH, ctx, np.int32)
        q = rng.standard_normal((BATCH, NQ, D), dtype=np.float32)
        ms, mb = {}, {}
        for int8 in (False, True):
            cache = pool(rng, BATCH * per_seq, int8)
            ms[int8] = median_ms(lambda: ops.paged_attention(q, cache, tables, lens, D ** -0.5))
            mb[int8] = sum(a.nbytes for a in vars(cache).values() if isinstance(a, np.ndarray)) / 1e6
        print(f"| {ctx} | {BATCH} | {ms[False]:.1f} | {ms[True]:.1f} | {ms[False] / ms[True]:.2f}x | "
              f"{mb[False]:.0f} / {mb[True]:.0f} |")


if __name__ == "__main__":
    main()
