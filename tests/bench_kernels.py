"""Attention kernel benchmark; run on the GPU machine: python tests/bench_kernels.py [--json OUT]

Decode (paged_attention), float16 and int8 KV caches side by side: achieved GB/s, counting
the bytes the kernel must move: K and V of every context token for every KV head (d halfs,
or d int8 values plus a float16 scale, each), plus q and out. Reported against the device's
copy bandwidth, measured with a large device-to-device copy (bytes read + written), with the
int8 / float16 speed-up (time ratio) per case: an int8 cache moves 0.52x (d 64) or 0.51x
(d 128) of the bytes, so a bandwidth-bound kernel gains up to ~1.9x; the target is >= 1.6x at
contexts >= 4096. Short single-sequence cases are bound by launch and latency, not bytes.
Prefill (prefill_attention): TFLOP/s, counting 2 FLOPs per multiply-add in Q K^T and in P V
over the causally visible (query, key) pairs only:
    FLOPs = 4 * nq * d * sum over chunks of n * (n + 1) / 2      (full prefill, chunk n = ctx).

Timing: cupy.cuda.Event around each launch, after a warm-up; the median of the repetitions.
The 256 MiB L2 flush before each repetition (outside the timed region) keeps small decode
cases from being served from the 50 MB L2. KV pools are sized to the case (block_size 16),
filled with pseudo-random values (a hash of the index, computed on the device: no cuRAND,
which requirements.txt does not install; never zeros; int8 scales positive), and block
tables are shuffled block ids. --json writes every row as a record.

The inputs come from decode_inputs / prefill_inputs, which tests/test_kernels.py also runs on
the CPU emulator (with xp = its CuPy stand-in), so the benchmark's calls are checked on every
CI run even though the timing needs a GPU.
"""
import argparse
import json
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nano import kernels  # noqa: E402
from nano.kv_cache import LayerKV  # noqa: E402

BLOCK_SIZE = 16
FLUSH = None  # allocated in main(), after the device is known to work
DECODE_SHAPES = [(9, 3, 64), (32, 8, 128), (4, 1, 256)]  # (nq, nkv, d): SmolLM2-135M, Llama-3-8B, Gemma 3 270M
DECODE_SEQS = (1, 32, 256)
DECODE_CONTEXTS = (512, 4096, 8192, 16384)
TARGET = 1.6  # int8 / float16 speed-up wanted at contexts >= 4096
PREFILL_TARGET = 200  # TFLOP/s wanted of prefill at 32/8 x 128, 8 x 2,048 tokens, float16


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


def random_f16(shape, xp=cupy):
    """Pseudo-random float16 in [-1, 1): on the GPU a hash of each element's index, in slices
    (bounding the temporaries), elsewhere (the emulator's stand-in) from NumPy."""
    if xp is not cupy:
        return xp.asarray(np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float16))
    out = cupy.empty(shape, cupy.float16)
    flat = out.reshape(-1)
    step = 1 << 28
    for i in range(0, flat.size, step):
        h = cupy.arange(i, i + min(step, flat.size - i), dtype=cupy.uint32) * cupy.uint32(2654435761)
        h ^= h >> 15
        h *= cupy.uint32(2246822519)
        h ^= h >> 13
        flat[i:i + h.size] = (h >> 8).astype(cupy.float32) / 2**23 - 1
    return out


def make_cache(seqs, ctx, nkv, d, dtype, xp=cupy):
    """(LayerKV, block tables) for `seqs` sequences of `ctx` tokens. int8: the bytes of random
    halfs as values, scales in [0.005, 0.01)."""
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    shape = (num_blocks, nkv, BLOCK_SIZE, d)
    if dtype == "float16":
        cache = LayerKV(random_f16(shape, xp), random_f16(shape, xp))
    else:
        half = shape[:-1] + (d // 2,)
        values = [random_f16(half, xp).view(xp.int8).reshape(shape) for _ in range(2)]
        scales = [xp.asarray(((random_f16(shape[:3], xp) + 3) * 0.0025).astype(xp.float16)) for _ in range(2)]
        cache = LayerKV(values[0], values[1], *scales)
    tables = xp.asarray(np.random.default_rng(0).permutation(num_blocks).astype(np.int32)
                        .reshape(seqs, blocks_per_seq))
    return cache, tables


def decode_inputs(seqs, ctx, nq, nkv, d, dtype, xp=cupy):
    """Arguments of kernels.paged_attention but the scale: q, cache, block tables, context lengths."""
    cache, tables = make_cache(seqs, ctx, nkv, d, dtype, xp)
    return random_f16((seqs, nq, d), xp), cache, tables, xp.asarray(np.full(seqs, ctx, np.int32))


def prefill_inputs(seqs, chunk, nq, nkv, d, dtype, xp=cupy):
    """Arguments of kernels.prefill_attention but the scale: q, cache, cu_seqlens_q, block
    tables, context lengths (full prefills of `chunk` tokens)."""
    cache, tables = make_cache(seqs, chunk, nkv, d, dtype, xp)
    cu = xp.asarray(np.arange(0, seqs * chunk + 1, chunk, dtype=np.int32))
    return (random_f16((seqs * chunk, nq, d), xp), cache, cu, tables,
            xp.asarray(np.full(seqs, chunk, np.int32)))


def kv_bytes(seqs, ctx, nkv, d, dtype):
    """K and V bytes a decode over the whole context reads (int8: values and scales)."""
    per_row = 2 * d if dtype == "float16" else d + 2
    return 2 * seqs * ctx * nkv * per_row


def bench_decode(seqs, ctx, nq, nkv, d, dtype):
    q, cache, tables, lens = decode_inputs(seqs, ctx, nq, nkv, d, dtype)
    ms = median_ms(lambda: kernels.paged_attention(q, cache, tables, lens, d ** -0.5))
    parts, _ = kernels.decode_partitions(seqs * nkv, tables.shape[1] * BLOCK_SIZE, kernels._num_sms())
    nbytes = kv_bytes(seqs, ctx, nkv, d, dtype) + 2 * q.nbytes
    return ms, nbytes / ms / 1e6, parts


def bench_prefill(seqs, chunk, nq, nkv, d, dtype="float16"):
    q, cache, cu, tables, lens = prefill_inputs(seqs, chunk, nq, nkv, d, dtype)
    ms = median_ms(lambda: kernels.prefill_attention(q, cache, cu, tables, lens, d ** -0.5),
                   reps=5, warmup=1)
    flops = 4 * nq * d * seqs * chunk * (chunk + 1) / 2
    return ms, flops / ms / 1e9


def free():
    """Give the last case's arrays (gone with its function's locals) back to the device."""
    cupy.get_default_memory_pool().free_all_blocks()


def main():
    global FLUSH
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the results here as JSON too")
    args = parser.parse_args()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"device: {props['name'].decode()}, {kernels._num_sms()} SMs")
    FLUSH = cupy.empty(1 << 28, cupy.uint8)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")

    rows, speedups, records = [], [], []
    for nq, nkv, d in DECODE_SHAPES:
        for seqs in DECODE_SEQS:
            for ctx in DECODE_CONTEXTS:
                f16_ms, f16_gbs, parts = bench_decode(seqs, ctx, nq, nkv, d, "float16")
                free()
                i8_ms, i8_gbs, _ = bench_decode(seqs, ctx, nq, nkv, d, "int8")
                free()
                speedup = f16_ms / i8_ms
                if ctx >= 4096:
                    speedups.append(speedup)
                records.append(dict(kernel="decode", nq=nq, nkv=nkv, d=d, seqs=seqs, ctx=ctx, parts=parts,
                                    float16_ms=f16_ms, float16_gbs=f16_gbs, int8_ms=i8_ms, int8_gbs=i8_gbs))
                rows.append(f"| decode {nq}/{nkv}x{d} | S={seqs} ctx={ctx} parts={parts} "
                            f"| {f16_ms:.3f} ms, {f16_gbs:.0f} GB/s = {f16_gbs / copy_gbs:.0%} "
                            f"| {i8_ms:.3f} ms, {i8_gbs:.0f} GB/s = {i8_gbs / copy_gbs:.0%} "
                            f"| {speedup:.2f}x |")
                print(rows[-1], flush=True)
    for nq, nkv, d in [(32, 8, 128), (9, 3, 64), (4, 1, 256)]:
        ms, tflops = bench_prefill(8, 2048, nq, nkv, d)
        free()
        i8_ms, i8_tflops = bench_prefill(8, 2048, nq, nkv, d, "int8")
        free()
        records.append(dict(kernel="prefill", nq=nq, nkv=nkv, d=d, seqs=8, chunk=2048, float16_ms=ms,
                            float16_tflops=tflops, int8_ms=i8_ms, int8_tflops=i8_tflops))
        rows.append(f"| prefill {nq}/{nkv}x{d} | 8 x 2048-token chunks | {ms:.3f} ms, {tflops:.1f} TFLOP/s "
                    f"| {i8_ms:.3f} ms, {i8_tflops:.1f} TFLOP/s | {ms / i8_ms:.2f}x |")
        print(rows[-1], flush=True)
    prefill = next(r for r in records if r["kernel"] == "prefill" and (r["nq"], r["nkv"], r["d"]) == (32, 8, 128))

    print(f"\n{props['name'].decode()}: copy bandwidth {copy_gbs:.0f} GB/s\n")
    print("| kernel (nq/nkv x d) | shape | float16 cache | int8 cache | int8 speed-up |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nint8 / float16 decode speed-up at contexts >= 4096: min {min(speedups):.2f}x, "
          f"median {float(np.median(speedups)):.2f}x (target >= {TARGET}x)")
    print(f"prefill attention, 32/8 x 128, 8 x 2,048 tokens causal: {prefill['float16_tflops']:.1f} TFLOP/s "
          f"(float16; target >= {PREFILL_TARGET})")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": props["name"].decode(), "copy_gbs": copy_gbs,
                                               "cases": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
