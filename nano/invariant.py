"""Batch-invariant mode (EngineConfig.batch_invariant, CPU only): a NumPy op set whose every row
comes out bitwise the same whatever else is in the step, at some cost in speed. shard.py chooses it
(by default for an int8 KV pool on the CPU); docs/int8-kv.md says why and what it costs."""
import functools

import numpy as np

from nano.kv_cache import LayerKV
from nano.ops import OpSet, add_lora, gather_tables, seen


# OpenBLAS rounds a row by where it falls in its kernel's tiles, but computes every row of a
# product of exactly 8 rows alike: the rows go through GEMMs of that many, zero-padded.
INVARIANT_ROWS = 8


def invariant_linear(x, weight, bias=None):
    """linear as one GEMM per INVARIANT_ROWS rows of x (numpy's batched matmul loops)."""
    rows, tiles = x.shape[0], -(-x.shape[0] // INVARIANT_ROWS)
    x = np.concatenate([x, np.zeros((tiles * INVARIANT_ROWS - rows, x.shape[1]), x.dtype)])
    y = (x.reshape(tiles, INVARIANT_ROWS, x.shape[1]) @ weight.T).reshape(-1,
                                                                          weight.shape[0])[:rows]
    if bias is not None:
        y += bias
    return y


def invariant_attention(q, cache: LayerKV, batch, scale, window=None):
    """Batch-invariant attention, decode and prefill rows alike: row t attends to the keys
    seen by positions[t] in its own sequence, through the same fixed-shape steps whatever the
    other rows are: scores and sums per cache block of block_size keys, then the blocks
    added in order (np.cumsum), so that a block past the row's context (exp(-inf) = 0)
    changes nothing; a max is exact in any order. q: (T, nq, d) -> (T, nq, d)."""
    # per sequence
    rows = np.concatenate([np.ones(batch.num_decodes, np.int64), np.diff(batch.cu_seqlens_q)])
    tables, positions = np.repeat(batch.block_tables, rows, axis=0), batch.positions  # each row's
    out = np.empty_like(q)
    # Each row gathers its own K/V as float32: rows whose gathered K is ~1 MiB at a time stay
    # in cache (8 MiB: 1.4x slower at 32 x 1k contexts; docs/perf_notes.md).
    rows = max(1, 2**20 // (4 * q.shape[-1] * cache.k.shape[1] * (int(positions.max()) + 16)))
    for lo in range(0, q.shape[0], rows):
        part = slice(lo, lo + rows)
        out[part] = _invariant_rows(q[part], cache, tables[part], positions[part], scale, window)
    return out


def _invariant_rows(q, cache: LayerKV, tables, positions, scale, window):
    t, nq, d = q.shape
    nkv, bs = cache.k.shape[1:3]
    nb = int(positions.max()) // bs + 1

    # (t, nkv, 1, nb, bs, *rest) float32; -1 entries gather some block, masked out below
    def blocks(array):
        rows = gather_tables(array, tables[:, :nb]).reshape(t, nkv, 1, nb, bs, *array.shape[3:])
        return rows.astype(np.float32, copy=False)

    # (t, nkv, group, nb, bs)
    scores = np.matvec(blocks(cache.k), q.reshape(t, nkv, nq // nkv, 1, d))
    scores *= scale if cache.k_scale is None else scale * blocks(cache.k_scale)
    # (t, nb, bs)
    valid = seen(np.arange(nb * bs).reshape(nb, bs), positions[:, None, None], window)
    scores = np.where(valid[:, None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=(-2, -1), keepdims=True))       # masked: exactly 0
    total = np.cumsum(probs.sum(axis=-1), axis=-1)[..., -1:]                # (t, nkv, group, 1)
    if cache.v_scale is not None:
        probs *= blocks(cache.v_scale)
    out = np.cumsum(np.vecmat(probs, blocks(cache.v)), axis=-2)[..., -1, :]  # (t, nkv, group, d)
    return (out / total).reshape(t, nq, d)


BATCH_INVARIANT = OpSet(invariant_linear, invariant_attention, fixed_threads=True,
                        add_lora=functools.partial(add_lora, linear=invariant_linear))
