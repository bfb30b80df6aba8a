"""The device boundary: every operation the model performs on arrays, in NumPy. These are
the CPU path (float32) and the oracle the GPU tests hold each CUDA kernel to: nano/kernels.py
has the same functions on CuPy arrays (float16, float32 accumulation). Which set a run uses
is chosen once, by device (OpSet, at the end).

Shapes used below:
  T  tokens in the step          H  hidden size       V  vocab size
  S  sequences in the step       nq query heads       nkv  KV heads      d  head dim
  cache: one layer's LayerKV (nano/kv_cache.py: its arrays' shapes, the int8 scheme)
  block_tables: (S, max_blocks) int32, -1 past each sequence's last block
  window: W keys, the layer's sliding window (position p sees keys p - W + 1 .. p), or None
"""
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from nano.kv_cache import INT8_MAX, SCALE_DTYPE, LayerKV


def embedding(ids, table, scale=1.0):
    """ids: (T,) int32, table: (V, H) -> (T, H), times scale (Gemma 3's sqrt(H))."""
    return table[ids] * np.float32(scale) if scale != 1.0 else table[ids]


def rms_norm(x, weight, eps):
    """x: (T, H), weight: (H,) -> (T, H); x * rsqrt(mean(x^2) + eps) * weight."""
    var = np.add.reduce(x * x, axis=-1, keepdims=True)
    var /= np.intp(x.shape[-1])  # np.mean's own two steps, bit for bit, without its Python layers
    return x / np.sqrt(var + eps) * weight


def add_rms_norm(x, residual, weight, eps):
    """Residual add fused with RMSNorm: returns (rms_norm(x + residual), x + residual).
    x, residual: (T, H); residual None means the first layer (residual = x)."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x


def linear(x, weight, bias=None):
    """x: (T, K), weight: (N, K) as in checkpoints, bias: (N,) -> (T, N). On the CPU the
    weight is stored column-major (Device.put), so this is one GEMM with plain operands."""
    y = x @ weight.T
    if bias is not None:
        y += bias
    return y


def add_lora(y, x, lora, batch, linear=linear):
    """y (T, N) plus, for each row with an adapter, scale * (x A^T) B^T, in place. lora: (A (L, r,
    K), B (L, N, r), scales (L,)) pools of L slots; row t takes its sequence's slot from
    batch.lora_slots (S,), -1 = none: decode rows one each, prefill chunks one per chunk. linear
    is the products' GEMM (the batch-invariant op set's, there)."""
    a, b, scales = lora
    chunks = np.concatenate([np.ones(batch.num_decodes, np.int64), np.diff(batch.cu_seqlens_q)])
    slots = np.repeat(batch.lora_slots, chunks)  # (T,)
    for s in np.unique(slots[slots >= 0]):  # one pair of GEMMs per adapter in the step
        rows = np.flatnonzero(slots == s)
        y[rows] += scales[s] * linear(linear(x[rows], a[s]), b[s])
    return y


def silu_mul(gate_up):
    """gate_up: (T, 2I) = [gate | up] -> silu(gate) * up: (T, I)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    out = np.negative(gate)  # silu(g) * up = g / (1 + exp(-g)) * up, in one buffer
    np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out


def gelu_tanh_mul(gate_up):
    """gate_up: (T, 2I) = [gate | up] -> gelu_tanh(gate) * up: (T, I), GeGLU (Gemma)."""
    gate, up = np.split(gate_up, 2, axis=-1)
    inner = np.tanh(np.float32(np.sqrt(2 / np.pi)) * (gate + np.float32(0.044715) * gate ** 3))
    return np.float32(0.5) * gate * (1 + inner) * up


def rope_store_kvcache(q, k, v, positions, cos_sin, cache: LayerKV, slot_mapping, q_norm=None,
                       k_norm=None, eps=0.0):
    """Rotate-half RoPE on q and k (each head RMS-normed first with q_norm, k_norm (d,) if given:
    Qwen3), then write k and v into their cache slots (one kernel on the GPU), quantized if the
    cache is int8. q: (T, nq, d), k, v: (T, nkv, d), possibly views into the fused QKV output, not
    modified; positions: (T,); cos_sin: (max_positions, d), cos in [:, :d/2], sin in [:, d/2:];
    slot_mapping: (T,) int32, slot = block * block_size + offset, -1 for a token whose KV is
    already cached (skipped). With k_rotate, K is stored as k H and q returned as q H (H =
    hadamard(d)). Returns the rotated q: (T, nq, d), on the CPU possibly a strided view."""
    half, nq = q.shape[-1] // 2, q.shape[1]
    cos = cos_sin[positions, None, :half]  # (T, 1, d/2)
    sin = cos_sin[positions, None, half:]
    qk = np.concatenate([q, k], axis=1)  # q and k rotated together: one set of small ops, not two
    # so normalized together too: each head's row by its weight, (nq + nkv, d)
    if q_norm is not None:
        qk = rms_norm(qk, np.stack([q_norm] * nq + [k_norm] * k.shape[1]), eps)
    rotated = np.empty_like(qk)
    x1, x2 = qk[..., :half], qk[..., half:]
    np.multiply(x1, cos, out=rotated[..., :half])
    rotated[..., :half] -= x2 * sin
    np.multiply(x2, cos, out=rotated[..., half:])
    rotated[..., half:] += x1 * sin
    q, keys, values, slots = rotated[:, :nq], rotated[:, nq:], v, slot_mapping
    if (slot_mapping < 0).any():  # a prefix-cached token or a padding row: written by no one
        keep = slot_mapping >= 0
        keys, values, slots = keys[keep], v[keep], slot_mapping[keep]
    blocks, offsets = np.divmod(slots, cache.k.shape[2])
    if cache.k_rotate:
        h = hadamard(q.shape[-1])
        keys, q = keys @ h, q @ h
    for rows, data, scales in ((keys, cache.k, cache.k_scale), (values, cache.v, cache.v_scale)):
        if scales is None:
            data[blocks, :, offsets] = rows
        else:
            data[blocks, :, offsets], scales[blocks, :, offsets] = quantize(rows)
    return q


@functools.cache
def hadamard(d: int) -> np.ndarray:
    """(d, d) float32 Sylvester Hadamard matrix / sqrt(d), d a power of two (shard.py refuses
    the rotation for a model of another head dim): symmetric and orthonormal (H H = I). x @ H
    is what the GPU computes as log2(d) butterfly stages (a, b) -> (a + b, a - b), one per bit
    of the channel index, then a 1/sqrt(d) factor."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(d)).astype(np.float32)
    h.flags.writeable = False
    return h


def quantize(x):
    """Symmetric int8 with one scale per row of the last axis: x (..., d) float ->
    (values (..., d) int8, scales (...) float16). The scale is rounded to float16 before
    dividing, so q * scale is the stored scale's own reconstruction."""
    scale = (np.abs(x).max(axis=-1) / np.float32(INT8_MAX)).astype(SCALE_DTYPE)
    s = scale.astype(np.float32)
    values = np.rint(x / np.where(s > 0, s, 1)[..., None])
    return np.clip(values, -INT8_MAX, INT8_MAX).astype(np.int8), scale


def _gather_context(cache, block_table, context_len):
    """One sequence's first context_len cached rows: cache (num_blocks, nkv, block_size, *rest)
    -> (nkv, context_len, *rest); rest is (d,) for K/V and () for their scales."""
    num_blocks = -(-context_len // cache.shape[2])
    return gather_tables(cache, block_table[None, :num_blocks])[0, :, :context_len]


def seen(keys, positions, window):
    """Which keys the queries see: key positions (..., n) against query positions p broadcast
    to them, e.g. (q, 1, ..., 1) -> (q, ..., n) bool: keys 0 .. p, or the last `window` of them."""
    seen = keys <= positions
    return seen if window is None else seen & (keys > positions - window)


def _attend(q, keys, values, query_positions, scale, window, k_scale=None, v_scale=None):
    """q: (n, nq, d) at query_positions (n,); keys/values: (nkv, ctx, d) float or int8, with
    k_scale/v_scale (nkv, ctx) for int8. Each query attends to the keys seen by its position.
    Returns (n, nq, d)."""
    n, nq, d = q.shape
    nkv, ctx, _ = keys.shape
    group = nq // nkv
    qg = q.reshape(n, nkv, group, d).transpose(1, 0, 2, 3).reshape(nkv, n * group, d)
    scores = qg @ keys.transpose(0, 2, 1).astype(np.float32, copy=False)  # (nkv, n*group, ctx)
    scores *= scale if k_scale is None else scale * k_scale[:, None, :].astype(np.float32)
    pos = np.repeat(query_positions, group)  # row r belongs to query r // group
    # in place: no temporaries
    np.copyto(scores, -np.inf, where=~seen(np.arange(ctx), pos[:, None], window))
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    if v_scale is not None:
        probs *= v_scale[:, None, :].astype(np.float32)
    out = probs @ values.astype(np.float32, copy=False)  # (nkv, n*group, d)
    return out.reshape(nkv, n, group, d).transpose(1, 0, 2, 3).reshape(n, nq, d)


# The NumPy decode attention batches up to DECODE_GROUP sequences per product, fewer when
# their contexts are long: about DECODE_GROUP_TOKENS padded rows per product keeps the
# gathered K/V (and an int8 pool's float32 conversion) near the caches (docs/perf_notes.md).
DECODE_GROUP = 32
DECODE_GROUP_TOKENS = 8192


def paged_attention(q, cache: LayerKV, block_tables, context_lens, scale, window=None):
    """Decode attention: one new query token per sequence over its cached context (or its window).
    q: (S, nq, d); context_lens: (S,) tokens in cache including this step's -> (S, nq, d)."""
    out = np.empty_like(q)
    # A few sequences at a time, padded to the longest: one batched product instead of S
    # small ones, with bounded memory.
    group = max(1, min(DECODE_GROUP,
                       DECODE_GROUP_TOKENS // max(int(context_lens.max(initial=1)), 1)))
    for lo in range(0, q.shape[0], group):
        hi = min(lo + group, q.shape[0])
        out[lo:hi] = _decode_group(q[lo:hi], cache, block_tables[lo:hi], context_lens[lo:hi], scale,
                                   window)
    return out


def gather_tables(array, tables):
    """array (num_blocks, nkv, block_size, *rest), tables (s, n) -> (s, nkv, n * block_size,
    *rest), in one copy: index straight into that order."""
    heads = np.arange(array.shape[1])[None, :, None]
    return array[tables[:, None, :], heads].reshape(tables.shape[0], array.shape[1], -1,
                                                    *array.shape[3:])


def _decode_group(q, cache: LayerKV, block_tables, context_lens, scale, window):
    s, nq, d = q.shape
    nkv, block_size = cache.k.shape[1], cache.k.shape[2]
    num_blocks = -(-int(context_lens.max()) // block_size)
    tables = block_tables[:, :num_blocks]  # -1 entries gather some block; masked out below
    length = num_blocks * block_size

    gather = functools.partial(gather_tables, tables=tables)  # (s, nkv, length, *rest)

    def rows(array):  # K or V rows as float32: an int8 gather moves a quarter of the bytes
        return gather(array).astype(np.float32, copy=False)[:, :, None]

    # np.matvec / np.vecmat rather than a batched @, which makes one BLAS call per tiny
    # (group x d) @ (d x length) product (docs/perf_notes.md).
    qg = q.reshape(s, nkv, nq // nkv, d)
    scores = np.matvec(rows(cache.k), qg)                             # (s, nkv, group, length)
    scores *= (scale if cache.k_scale is None
               else scale * gather(cache.k_scale)[:, :, None].astype(np.float32))
    valid = seen(np.arange(length), context_lens[:, None] - 1, window)  # (s, length)
    # in place, as below: no more temporaries
    np.copyto(scores, -np.inf, where=~valid[:, None, None, :])
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    if cache.v_scale is not None:
        probs *= gather(cache.v_scale)[:, :, None].astype(np.float32)
    return np.vecmat(probs, rows(cache.v)).reshape(s, nq, d)


# The NumPy prefill attention takes a chunk's queries a few at a time, so that each product's
# float32 scores stay under PREFILL_SCORE_BYTES: larger temporaries are above glibc's mmap
# threshold (32 MiB at most) and would be mapped and page-faulted afresh (docs/perf_notes.md).
PREFILL_SCORE_BYTES = 8 * 2**20


def prefill_attention(q, cache: LayerKV, cu_seqlens_q, block_tables, context_lens, scale,
                      window=None):
    """A chunk of query tokens per sequence over that sequence's cached blocks, causal (and
    windowed). The chunk's own K/V are already in the cache; a chunk may start mid-sequence (a later
    chunk, or after a prefix-cache hit): its queries sit at positions context_len - chunk_len ..
    context_len - 1. q: (T, nq, d); cu_seqlens_q: (S+1,) chunk offsets into q -> (T, nq, d)."""
    out = np.empty_like(q)
    for i, ctx in enumerate(context_lens.tolist()):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        context = [None if a is None else _gather_context(a, block_tables[i], ctx)
                   for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)]
        positions = np.arange(ctx - (end - start), ctx)
        rows = max(1, PREFILL_SCORE_BYTES // (4 * q.shape[1] * ctx))
        for lo in range(start, end, rows):  # a few queries at a time: the scores stay small
            hi = min(lo + rows, end)
            out[lo:hi] = _attend(q[lo:hi], context[0], context[1], positions[lo - start:hi - start],
                                 scale, window, *context[2:])
    return out


def step_attention(q, cache: LayerKV, batch, scale, window=None, *, paged, prefill, concatenate):
    """A step's attention from a set's paged and prefill attention (and its arrays' concatenate):
    the step's decode rows, which come first, through paged, its prefill chunks through prefill."""
    nd, tables, lens = batch.num_decodes, batch.block_tables, batch.context_lens
    if nd == q.shape[0]:
        return paged(q, cache, tables, lens, scale, window)
    chunks = prefill(q[nd:], cache, batch.cu_seqlens_q, tables[nd:], lens[nd:], scale, window)
    if nd == 0:
        return chunks
    return concatenate([paged(q[:nd], cache, tables[:nd], lens[:nd], scale, window), chunks])


# A step's attention (batch: model.ForwardBatch) through this module's two attentions.
attention = functools.partial(step_attention, paged=paged_attention, prefill=prefill_attention,
                              concatenate=np.concatenate)


def gather_blocks(pool, block_ids, out=None):
    """Collect blocks of every layer into one contiguous staging array so that a swap is
    one device-host copy. pool: one of KVCache.block_arrays(), (L, 2, nb, *rest) (rest:
    (nkv, bs, d) for K/V, (nkv, bs) for scales), block_ids: (n,) -> (L, 2, n, *rest).
    CPU: out, a view of that shape (a KV handoff's payload), is written in place."""
    return np.take(pool, block_ids, axis=2, out=out, mode="clip")  # clip: written unbuffered


def scatter_blocks(pool, block_ids, staging):
    """Inverse of gather_blocks: pool[:, :, block_ids[i]] = staging[:, :, i]."""
    pool[:, :, block_ids] = staging


def edit_logits(logits, rows, tokens, biases, penalties, shifts):
    """Sparse edits, in place: for each e, x = logits[rows[e], tokens[e]] + biases[e] becomes
    (x / penalties[e] if x > 0 else x * penalties[e]) + shifts[e]; -inf bans the token.
    rows, tokens: (E,) int32, no (row, token) twice; biases, penalties, shifts: (E,) float32."""
    x = logits[rows, tokens].astype(np.float32) + biases
    logits[rows, tokens] = np.where(x > 0, x / penalties, x * penalties) + shifts
    return logits


def mask_logits(logits, rows, masks):
    """In place: logits[rows[i], t] = -inf where bit t % 32 of masks[i, t // 32] is clear.
    rows: (M,) int32, distinct; masks: (M, ceil(V / 32)) int32, bit set = token allowed."""
    allowed = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
    logits[rows] = np.where(allowed.astype(bool), logits[rows], -np.inf)
    return logits


def sample(logits, temperature, top_k, top_p, log_min_p, seeds, counters):
    """One token per row. logits: (R, V); temperature: (R,) float32, 0 = greedy; top_k: (R,) int32,
    <= 0 or >= V = off; top_p: (R,) float32, 1 = off; log_min_p: (R,) float32, log of min_p (-inf =
    off); seeds: (R,) uint64; counters: (R,) int32, the row's sequence's output tokens so far ->
    (R,) int32. Thresholds by bisection over order-preserving keys, then a Gumbel-max draw whose
    noise hashes (seed, counter, token id); cuda/sampling.cu runs the same steps
    (docs/how-it-works.md)."""
    logits = np.asarray(logits, np.float32)
    if not np.any(temperature):  # all greedy: one argmax for the step, not one per row
        return np.argmax(logits, axis=-1).astype(np.int32)
    seeds = np.asarray(seeds, np.uint64)
    return np.array([_sample_row(x, np.float32(t), int(k), np.float32(p), np.float32(m), int(seed),
                                 int(c))
                     for x, t, k, p, m, seed,
                     c in zip(logits, temperature, top_k, top_p, log_min_p, seeds, counters)],
                    dtype=np.int32).reshape(len(logits))


def _fmix32(h):
    """murmur3's 32-bit finalizer on a Python int, or in place on a uint32 array."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h &= 0xFFFFFFFF  # an int grows; a uint32 array has wrapped like C already
    h ^= h >> 13
    h *= 0xC2B2AE35
    h &= 0xFFFFFFFF
    h ^= h >> 16
    return h


@functools.cache
def _token_hashes(size: int) -> np.ndarray:
    """i * 0x9E3779B9 (mod 2^32) for every token id i: the same for every draw, so kept."""
    hashes = np.arange(size, dtype=np.uint32) * np.uint32(0x9E3779B9)
    hashes.flags.writeable = False
    return hashes


def float_keys(x):
    """float32 array -> uint32 keys that order like the floats (a < b <=> key a < key b)."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return np.where(u & 0x80000000, ~u, u | 0x80000000).astype(np.uint32)


def uniforms(seed: int, counter: int, size: int) -> np.ndarray:
    """The (0, 1) numbers behind one draw: u_i = top 23 bits of a hash of (seed, counter, i),
    plus half a step, so neither 0 nor 1 (exact in float32, identical on the GPU)."""
    key = _fmix32((seed & 0xFFFFFFFF) ^ _fmix32((seed >> 32) ^ _fmix32(counter & 0xFFFFFFFF)))
    h = _fmix32(_token_hashes(size) + np.uint32(key))
    h >>= 9
    u = h.astype(np.float32)  # in place below: 49152 draws in 0.05 ms instead of 0.08-0.2
    u += np.float32(0.5)
    u *= np.float32(2.0 ** -23)
    return u


def _largest_passing(lo: int, hi: int, passes) -> int:
    """Bisection: the largest t in [lo, hi] with passes(t), given passes(lo) and a test
    that, once false, stays false for larger t. At most 32 steps over 32-bit keys."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if passes(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _sample_row(x, t, top_k, top_p, log_min_p, seed, counter) -> int:
    if t == 0:
        return int(np.argmax(x))
    noise = np.log(uniforms(seed, counter, x.size))  # Gumbel noise -log(-log u), in place
    np.negative(noise, out=noise)
    np.log(noise, out=noise)
    scores = x / t
    scores -= noise
    # the whole vocabulary is allowed
    if not (0 < top_k < x.size or top_p < 1 or log_min_p > -np.inf):
        return int(np.argmax(scores))
    keys = float_keys(x)
    key_max = int(keys.max())
    # min_p: p_i >= min_p * p_max  <=>  x_i >= max(x) + T * log(min_p); keys >= threshold are
    # allowed
    threshold = int(float_keys(x.max() + t * log_min_p)) if log_min_p > -np.inf else 0
    if 0 < top_k < x.size:
        threshold = max(threshold, _largest_passing(
            0, key_max, lambda m: np.count_nonzero(keys >= m) >= top_k))
    if top_p < 1:
        e = np.exp(x / t - x.max() / t)
        target = top_p * e[keys >= threshold].sum(dtype=np.float32)
        threshold = _largest_passing(threshold, key_max,
                                     lambda m: e[keys >= m].sum(dtype=np.float32) >= target)
    return int(np.argmax(np.where(keys >= threshold, scores, -np.inf)))


@dataclass(frozen=True)
class OpSet:
    """The ops on one kind of array: those a forward pass runs (model.LlamaModel calls no other),
    sampling and swap copies; chosen once per shard (shard.op_set), never per call: REFERENCE
    or invariant.BATCH_INVARIANT on the CPU, kernels.CUDA on a GPU. The NumPy sets differ in how
    a GEMM and attention group rows; a GEMM's rounding depends on BLAS's thread count too,
    which a batch-invariant set keeps (fixed_threads)."""
    linear: Callable
    attention: Callable
    fixed_threads: bool
    embedding: Callable = embedding
    add_rms_norm: Callable = add_rms_norm
    rope_store_kvcache: Callable = rope_store_kvcache
    silu_mul: Callable = silu_mul
    gelu_tanh_mul: Callable = gelu_tanh_mul
    sample: Callable = sample
    edit_logits: Callable = edit_logits
    mask_logits: Callable = mask_logits
    add_lora: Callable = add_lora
    gather_blocks: Callable = gather_blocks
    scatter_blocks: Callable = scatter_blocks


REFERENCE = OpSet(linear, attention, fixed_threads=False)
