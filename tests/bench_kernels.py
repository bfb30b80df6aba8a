"""Attention kernel benchmark; run on the GPU machine: python tests/bench_kernels.py

Decode (paged_attention): achieved GB/s, counting the bytes the kernel must move:
K and V of every context token for every KV head, plus q and out. Reported against the
device's copy bandwidth, measured with a large device-to-device copy (bytes read + written).
Prefill (prefill_attention): TFLOP/s, counting 2 FLOPs per multiply-add in Q K^T and in P V
over the causally visible (query, key) pairs only:
    FLOPs = 4 * nq * d * sum over chunks of n * (n + 1) / 2      (full prefill, chunk n = ctx).

Timing: cupy.cuda.Event around each launch, after a warm-up; the median of the repetitions.
The 256 MiB L2 flush before each repetition (outside the timed region) keeps small decode
cases from being served from the 50 MB L2. KV pools are sized to the case (block_size 16),
filled with random float16 (never zeros), and block tables are shuffled block ids.
"""
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nano import kernels  # noqa: E402

BLOCK_SIZE = 16
FLUSH = None  # allocated in main(), after the device is known to work


def median_ms(fn, reps=20, warmup=3, flush=True):
    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        if flush:
            FLUSH.fill(1)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def copy_bandwidth_gbs():
    """Device-to-device copy of 1 GiB, rotating over 4 buffer pairs; bytes read + written."""
    n = 1 << 30
    pairs = [(cupy.ones(n, cupy.uint8), cupy.empty(n, cupy.uint8)) for _ in range(4)]
    turn = [0]

    def copy():
        src, dst = pairs[turn[0] % len(pairs)]
        turn[0] += 1
        dst.data.copy_from_device_async(src.data, n)

    ms = median_ms(copy, reps=30, flush=False)
    return 2 * n / ms / 1e6


def random_f16(shape):
    """Random float16 in [-1, 1), generated in slices to bound the float32 temporary."""
    out = cupy.empty(shape, cupy.float16)
    flat = out.reshape(-1)
    step = 1 << 28
    for i in range(0, flat.size, step):
        part = flat[i:i + step]
        part[...] = cupy.random.uniform(-1, 1, part.size, dtype=cupy.float32)
    return out


def make_cache(seqs, ctx, nkv, d):
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    k_cache = random_f16((num_blocks, nkv, BLOCK_SIZE, d))
    v_cache = random_f16((num_blocks, nkv, BLOCK_SIZE, d))
    tables = cupy.asarray(np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
                          .reshape(seqs, blocks_per_seq))
    return k_cache, v_cache, tables


def bench_decode(seqs, ctx, nq, nkv, d):
    k_cache, v_cache, tables = make_cache(seqs, ctx, nkv, d)
    q = random_f16((seqs, nq, d))
    lens = cupy.full((seqs,), ctx, cupy.int32)
    ms = median_ms(lambda: kernels.paged_attention(q, k_cache, v_cache, tables, lens, d ** -0.5))
    parts, _ = kernels.decode_partitions(seqs * nkv, tables.shape[1] * BLOCK_SIZE, kernels._num_sms())
    nbytes = 2 * seqs * ctx * nkv * d * 2 + 2 * q.nbytes
    return ms, nbytes / ms / 1e6, parts


def bench_prefill(seqs, chunk, nq, nkv, d):
    k_cache, v_cache, tables = make_cache(seqs, chunk, nkv, d)
    q = random_f16((seqs * chunk, nq, d))
    cu = cupy.arange(0, seqs * chunk + 1, chunk, dtype=cupy.int32)
    lens = cupy.full((seqs,), chunk, cupy.int32)
    ms = median_ms(lambda: kernels.prefill_attention(q, k_cache, v_cache, cu, tables, lens, d ** -0.5),
                   reps=5, warmup=1)
    flops = 4 * nq * d * seqs * chunk * (chunk + 1) / 2
    return ms, flops / ms / 1e9


def main():
    global FLUSH
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {props['name'].decode()}, {kernels._num_sms()} SMs")
    FLUSH = cupy.empty(1 << 28, cupy.uint8)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")

    rows = []
    for nq, nkv, d in [(9, 3, 64), (32, 8, 128)]:
        for seqs in (1, 64, 256):
            for ctx in (512, 4096, 16384):
                ms, gbs, parts = bench_decode(seqs, ctx, nq, nkv, d)
                rows.append(f"| decode {nq}/{nkv}x{d} | S={seqs} ctx={ctx} parts={parts} | {ms:.3f} ms "
                            f"| {gbs:.0f} GB/s = {gbs / copy_gbs:.0%} of copy |")
                print(rows[-1], flush=True)
                cupy.get_default_memory_pool().free_all_blocks()
    for nq, nkv, d in [(32, 8, 128), (9, 3, 64)]:
        ms, tflops = bench_prefill(8, 2048, nq, nkv, d)
        rows.append(f"| prefill {nq}/{nkv}x{d} | 8 x 2048-token chunks | {ms:.3f} ms | {tflops:.1f} TFLOP/s |")
        print(rows[-1], flush=True)
        cupy.get_default_memory_pool().free_all_blocks()

    print(f"\n{props['name'].decode()}: copy bandwidth {copy_gbs:.0f} GB/s\n")
    print("| kernel (nq/nkv x d) | shape | median time | throughput |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
