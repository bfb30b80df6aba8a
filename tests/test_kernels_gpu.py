"""Each CUDA kernel against its NumPy reference in nano/ops.py (needs a GPU).

Inputs are drawn in float32, rounded to float16, and both sides see the same rounded
values: the reference runs the ops on them as float32 NumPy arrays, the kernel on float16
CuPy arrays. What remains is the kernel's float16 output rounding (relative 2^-11 ~ 4.9e-4)
and float32 accumulation order, hence:

  F16_MAX_ERR   max |got - ref| / max(1, max |ref|) <= 4e-3   (a few float16 ulps at the
                largest magnitude; ~8x the rounding of one output)
  F16_NORM_ERR  ||got - ref|| / ||ref|| <= 2e-3                 (rounding averages out)

Copies (embedding, KV-cache writes, swaps) and argmax must match exactly.
Buffers the kernels allocate are poisoned with NaN (float) or -7 (int32) first, so an
element a kernel forgets to write fails the comparison.
"""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from nano import kernels, ops  # noqa: E402

pytestmark = pytest.mark.gpu

F16_MAX_ERR = 4e-3
F16_NORM_ERR = 2e-3


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Make cupy.empty / empty_like (used by nano.kernels for outputs) return poisoned memory."""
    empty, empty_like = cupy.empty, cupy.empty_like

    def poison(a):
        a.fill(np.nan if a.dtype.kind == "f" else -7)
        return a

    monkeypatch.setattr(cupy, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(cupy, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def f16(x):
    """Round to float16 and return (float32 copy for the reference, CuPy float16 for the kernel)."""
    x = np.asarray(x).astype(np.float16)
    return x.astype(np.float32), cupy.asarray(x)


def assert_close(got, ref):
    got = cupy.asnumpy(got).astype(np.float32)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "kernel left unwritten (NaN) or non-finite elements"
    err = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
    norm_err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= F16_MAX_ERR and norm_err <= F16_NORM_ERR, (err, norm_err)


# ---------------------------------------------------------------- layers

def test_embedding(rng):
    table, table_d = f16(rng.normal(size=(1000, 136)))
    ids = rng.integers(0, 1000, size=37).astype(np.int32)
    got = ops.embedding(cupy.asarray(ids), table_d)
    np.testing.assert_array_equal(cupy.asnumpy(got).astype(np.float32), ops.embedding(ids, table))


@pytest.mark.parametrize("tokens, hidden", [(1, 576), (33, 960), (7, 4104)])
def test_rms_norm(rng, tokens, hidden):
    x, x_d = f16(rng.normal(size=(tokens, hidden)))
    w, w_d = f16(rng.uniform(0.5, 1.5, size=hidden))
    assert_close(ops.rms_norm(x_d, w_d, 1e-5), ops.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(rng, with_residual):
    x, x_d = f16(rng.normal(size=(29, 576)))
    r, r_d = f16(rng.normal(size=(29, 576))) if with_residual else (None, None)
    w, w_d = f16(rng.uniform(0.5, 1.5, size=576))
    out, res = ops.add_rms_norm(x_d, r_d, w_d, 1e-5)
    ref_out, ref_res = ops.add_rms_norm(x, r, w, 1e-5)
    assert_close(res, ref_res)
    assert_close(out, ref_out)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(rng, bias):
    x, x_d = f16(rng.normal(size=(19, 192)) / 8)
    w, w_d = f16(rng.normal(size=(72, 192)) / 8)
    b, b_d = f16(rng.normal(size=72)) if bias else (None, None)
    assert_close(ops.linear(x_d, w_d, b_d), ops.linear(x, w, b))


@pytest.mark.parametrize("nq, nkv, d", [(9, 3, 64), (32, 8, 128)])
def test_rope_on_strided_views(rng, nq, nkv, d):
    """q and k are views into one fused QKV output, as the model produces them."""
    tokens = 21
    qkv, qkv_d = f16(rng.normal(size=(tokens, (nq + 2 * nkv) * d)))
    positions = rng.integers(0, 4096, size=tokens).astype(np.int32)
    inv_freq = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    angles = np.arange(4096)[:, None] * inv_freq[None, :]
    cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)

    def split(a):
        return a[:, :nq * d].reshape(tokens, nq, d), a[:, nq * d:(nq + nkv) * d].reshape(tokens, nkv, d)

    ops.rope(*split(qkv), positions, cos_sin)
    ops.rope(*split(qkv_d), cupy.asarray(positions), cupy.asarray(cos_sin))
    assert_close(qkv_d, qkv)  # also checks the V part was left alone


def test_silu_mul(rng):
    gate_up, gate_up_d = f16(rng.normal(size=(17, 2 * 1544)) * 3)
    assert_close(ops.silu_mul(gate_up_d), ops.silu_mul(gate_up))


def test_argmax_ties_go_to_lowest_index(rng):
    logits = rng.normal(size=(5, 128256)).astype(np.float16)
    logits[1, [70000, 900, 128255]] = 30.0  # tie: lowest index wins
    logits[2, -1] = 30.0                    # maximum in the last column
    logits[3, :] = -60000.0                 # all equal
    logits[4, 0] = 30.0                     # first column
    got = cupy.asnumpy(ops.argmax(cupy.asarray(logits)))
    np.testing.assert_array_equal(got, ops.argmax(logits.astype(np.float32)))


# ---------------------------------------------------------------- cache

def test_store_kvcache_skips_minus_one(rng):
    num_blocks, nkv, block_size, d, tokens = 10, 3, 16, 64, 23
    k_cache, k_cache_d = f16(rng.normal(size=(num_blocks, nkv, block_size, d)))
    v_cache, v_cache_d = f16(rng.normal(size=(num_blocks, nkv, block_size, d)))
    k, k_d = f16(rng.normal(size=(tokens, nkv, d)))
    v, v_d = f16(rng.normal(size=(tokens, nkv, d)))
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[[0, 5, 22]] = -1
    ops.store_kvcache(k, v, k_cache, v_cache, slots)
    ops.store_kvcache(k_d, v_d, k_cache_d, v_cache_d, cupy.asarray(slots))
    np.testing.assert_array_equal(cupy.asnumpy(k_cache_d).astype(np.float32), k_cache)
    np.testing.assert_array_equal(cupy.asnumpy(v_cache_d).astype(np.float32), v_cache)


def test_swap_round_trip_is_bitwise(rng):
    layers, num_blocks, nkv, block_size, d = 3, 20, 2, 16, 64
    kv = rng.normal(size=(layers, 2, num_blocks, nkv, block_size, d)).astype(np.float16)
    kv_d = cupy.asarray(kv)
    src = np.array([3, 11, 0, 19, 7], np.int32)
    dst = np.array([4, 1, 15, 8, 12], np.int32)
    staging = ops.gather_blocks(kv_d, cupy.asarray(src))
    np.testing.assert_array_equal(cupy.asnumpy(staging).view(np.uint16), kv[:, :, src].view(np.uint16))
    ops.scatter_blocks(kv_d, cupy.asarray(dst), staging)
    expected = kv.copy()
    expected[:, :, dst] = kv[:, :, src]
    np.testing.assert_array_equal(cupy.asnumpy(kv_d).view(np.uint16), expected.view(np.uint16))


# ---------------------------------------------------------------- attention

def make_cache(rng, context_lens, nkv, d, block_size):
    """A KV cache holding each sequence's context in shuffled physical blocks."""
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + 3  # a few blocks nobody owns
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(context_lens), max(needed)), -1, np.int32)
    start = 0
    for i, n in enumerate(needed):
        tables[i, :n] = ids[start:start + n]
        start += n
    k_cache, k_cache_d = f16(rng.normal(size=(num_blocks, nkv, block_size, d)))
    v_cache, v_cache_d = f16(rng.normal(size=(num_blocks, nkv, block_size, d)))
    return (k_cache, v_cache, tables), (k_cache_d, v_cache_d, cupy.asarray(tables))


HEADS = [(9, 3, 64), (8, 8, 64), (32, 8, 128), (64, 8, 128), (12, 4, 128), (24, 3, 64)]  # groups 3, 1, 4, 8, 3, 8


@pytest.mark.parametrize("nq, nkv, d", HEADS)
@pytest.mark.parametrize("context_lens, block_size", [
    ([1], 16),                                  # a single token
    ([8200], 16),                               # long context: split-KV path
    ([1, 17, 64, 100, 333], 16),                # mixed lengths, partial last blocks
    ([250, 3, 129], 32),                        # another power-of-two block size
    ([5, 70, 2], 1),                            # block_size 1
])
def test_paged_attention(rng, nq, nkv, d, context_lens, block_size):
    (k_cache, v_cache, tables), (k_cache_d, v_cache_d, tables_d) = make_cache(rng, context_lens, nkv, d, block_size)
    q, q_d = f16(rng.normal(size=(len(context_lens), nq, d)))
    lens = np.array(context_lens, np.int32)
    scale = d ** -0.5
    got = ops.paged_attention(q_d, k_cache_d, v_cache_d, tables_d, cupy.asarray(lens), scale)
    assert_close(got, ops.paged_attention(q, k_cache, v_cache, tables, lens, scale))


def test_paged_attention_many_sequences_no_split(rng):
    """Enough sequences to fill the GPU: one partition per (sequence, KV head)."""
    nq, nkv, d, block_size = 9, 3, 64, 16
    context_lens = rng.integers(1, 600, size=120).tolist()
    assert kernels.decode_partitions(120 * nkv, 600 * 2, 132)[0] == 1
    (k_cache, v_cache, tables), (k_cache_d, v_cache_d, tables_d) = make_cache(rng, context_lens, nkv, d, block_size)
    q, q_d = f16(rng.normal(size=(len(context_lens), nq, d)))
    lens = np.array(context_lens, np.int32)
    got = ops.paged_attention(q_d, k_cache_d, v_cache_d, tables_d, cupy.asarray(lens), 0.125)
    assert_close(got, ops.paged_attention(q, k_cache, v_cache, tables, lens, 0.125))


@pytest.mark.parametrize("nq, nkv, d", HEADS)
@pytest.mark.parametrize("chunks", [
    [(1, 1)],                               # (chunk length, context length): one token
    [(37, 37), (50, 300), (1, 90)],         # full prefill, mid-sequence chunk, 1-token chunk
    [(64, 64), (130, 1000), (21, 21)],      # exact tile, long chunk deep into the sequence
])
def test_prefill_attention(rng, nq, nkv, d, chunks):
    block_size = 16
    context_lens = [ctx for _, ctx in chunks]
    (k_cache, v_cache, tables), (k_cache_d, v_cache_d, tables_d) = make_cache(rng, context_lens, nkv, d, block_size)
    cu = np.concatenate([[0], np.cumsum([n for n, _ in chunks])]).astype(np.int32)
    q, q_d = f16(rng.normal(size=(int(cu[-1]), nq, d)))
    lens = np.array(context_lens, np.int32)
    scale = d ** -0.5
    got = ops.prefill_attention(q_d, k_cache_d, v_cache_d, cupy.asarray(cu), tables_d, cupy.asarray(lens), scale)
    assert_close(got, ops.prefill_attention(q, k_cache, v_cache, cu, tables, lens, scale))
