"""Each CUDA kernel against its NumPy reference in nano/ops.py, on two backends: the GPU
(`gpu` marker, skipped without one) and the CPU emulator in tests/cuda_host (every run; it
also checks barriers, shuffles, bounds and thread-order independence, see its shim.h).

Inputs are drawn in float32, rounded to float16, and both sides see the same rounded
values: the reference runs the ops on them as float32 NumPy arrays, the kernel on float16
CuPy arrays. What remains is the kernel's float16 output rounding (relative 2^-11 ~ 4.9e-4)
and float32 accumulation order, hence:

  F16_MAX_ERR   max |got - ref| / max(1, max |ref|) <= 4e-3   (a few float16 ulps at the
                largest magnitude; ~8x the rounding of one output)
  F16_NORM_ERR  ||got - ref|| / ||ref|| <= 2e-3                 (rounding averages out)

int8 KV caches (nano/kv_cache.py) are compared with the same two constants. The reference
attends over the same int8 values and float16 scales in float32; the kernels do not round
anything more than the float16 path does, but for q and p' = p * scale_v, which the decode
kernel puts in 15-bit fixed point for its exact integer products (relative 2^-16 ~ 1.5e-5
of the largest element: ~30x below one float16 output rounding), and prefill's int8 -> half
staging is exact. So the float16 bounds hold with the same margin (observed ~3e-4 max).
The int8 cache writes (rope_store_kvcache) are compared dequantized: the kernel's rotated
K may differ from NumPy's in the last float32 bit (FMA contraction on the GPU), which can
move a scale by one float16 rounding (<= 2^-10 relative) and a value by one quantization
step, so |got - ref| <= scale + 127 * |scale difference| per element; untouched slots keep
their bits.

Copies (embedding, float16 V-cache writes, swaps of any pool) and greedy sampling must match
exactly; sampled tokens must match except on near-ties (see test_sample_matches_reference).
The cuBLAS GEMM (kernels.linear) is also compared with cupy.matmul: both accumulate in float32
and round once, so LINEAR_ERR = 2e-3 relative to max |ref| (a few float16 ulps). On the
emulator it runs nano/cublas.py against the stand-in libcublas (tests/cuda_host/cublas.cpp).
The pools past 2^31 elements per layer (the end of the file) check the kernels' 64-bit
indexing of the KV pool.
Buffers the kernels allocate are poisoned with NaN (float) or -7 (signed int) first, so an
element a kernel forgets to write fails the comparison.
"""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cupy")  # nano/kernels.py imports it, also to run on the emulator
from cuda_host import cupy_stub, emulator  # noqa: E402
from nano import kernels, ops, shard  # noqa: E402
from nano.kv_cache import LayerKV  # noqa: E402

HUGE_BYTES = 2**30
F16_MAX_ERR = 4e-3
F16_NORM_ERR = 2e-3
LINEAR_ERR = 2e-3


@pytest.fixture(scope="module", params=[pytest.param("gpu", marks=pytest.mark.gpu), "emulator"])
def cupy(request):
    """The array module the kernels run on: CuPy on the GPU, or the emulator's stand-in."""
    if request.param == "gpu":
        import cupy
        yield cupy
        return
    reason = emulator.unavailable()
    if reason:
        pytest.skip(reason)
    with cupy_stub.emulating(kernels) as stub:
        yield stub


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, cupy):
    """Make cupy.empty / empty_like (used by nano.kernels for outputs) return poisoned memory."""
    empty, empty_like = cupy.empty, cupy.empty_like

    def poison(a):
        # uint16 holds bfloat16 bits, of which 0xFFFF is a NaN
        if (a.dtype.kind in "fi" or a.dtype == np.uint16) and a.nbytes < HUGE_BYTES:
            # not the cuBLAS workspace, nor a pool past 2^31 elements, of which a case touches
            # only the blocks it uses
            a.fill({"f": np.nan, "i": -7, "u": 0xFFFF}[a.dtype.kind])
        return a

    monkeypatch.setattr(cupy, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(cupy, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def f16(cupy, x):
    """Round to float16 and return (float32 copy for the reference, CuPy float16 for the kernel)."""
    x = np.asarray(x).astype(np.float16)
    return x.astype(np.float32), cupy.asarray(x)


def assert_close(cupy, got, ref):
    got = cupy.asnumpy(got).astype(np.float32)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "kernel left unwritten (NaN) or non-finite elements"
    err = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
    norm_err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= F16_MAX_ERR and norm_err <= F16_NORM_ERR, (err, norm_err)


# ---------------------------------------------------------------- layers

def test_embedding(cupy, rng):
    table, table_d = f16(cupy, rng.normal(size=(1000, 136)))
    ids = rng.integers(0, 1000, size=37).astype(np.int32)
    got = kernels.embedding(cupy.asarray(ids), table_d)
    np.testing.assert_array_equal(cupy.asnumpy(got).astype(np.float32), ops.embedding(ids, table))


@pytest.mark.parametrize("tokens, hidden", [(1, 576), (33, 960), (7, 4104)])
def test_rms_norm(cupy, rng, tokens, hidden):
    x, x_d = f16(cupy, rng.normal(size=(tokens, hidden)))
    w, w_d = f16(cupy, rng.uniform(0.5, 1.5, size=hidden))
    assert_close(cupy, kernels.rms_norm(x_d, w_d, 1e-5), ops.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(cupy, rng, with_residual):
    x, x_d = f16(cupy, rng.normal(size=(29, 576)))
    r, r_d = f16(cupy, rng.normal(size=(29, 576))) if with_residual else (None, None)
    w, w_d = f16(cupy, rng.uniform(0.5, 1.5, size=576))
    out, res = kernels.add_rms_norm(x_d, r_d, w_d, 1e-5)
    ref_out, ref_res = ops.add_rms_norm(x, r, w, 1e-5)
    assert_close(cupy, res, ref_res)
    assert_close(cupy, out, ref_out)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(cupy, rng, bias):
    x, x_d = f16(cupy, rng.normal(size=(19, 192)) / 8)
    w, w_d = f16(cupy, rng.normal(size=(72, 192)) / 8)
    b, b_d = f16(cupy, rng.normal(size=72)) if bias else (None, None)
    assert_close(cupy, kernels.linear(x_d, w_d, b_d), ops.linear(x, w, b))


@pytest.mark.parametrize("tokens, k, n", [(1, 576, 1536), (7, 136, 40), (33, 2048, 8200), (300, 72, 24)])
def test_cublas_linear_matches_cupy_matmul(cupy, rng, tokens, k, n):
    """Odd shapes (T not a multiple of 8, N not a multiple of 16) and a strided x (a column
    slice of a wider array, as the model's QKV views are)."""
    wide, wide_d = f16(cupy, rng.normal(size=(tokens, k + 24)) / 8)
    x_d = wide_d[:, 8:8 + k]
    w, w_d = f16(cupy, rng.normal(size=(n, k)) / 8)
    got = cupy.asnumpy(kernels.linear(x_d, w_d)).astype(np.float32)
    ref = cupy.asnumpy(cupy.matmul(cupy.ascontiguousarray(x_d), w_d.T)).astype(np.float32)
    assert np.abs(got - ref).max() <= LINEAR_ERR * np.abs(ref).max()
    assert_close(cupy, kernels.linear(x_d, w_d), ops.linear(wide[:, 8:8 + k], w))


def rope_table(d, positions=4096):
    inv_freq = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    angles = np.arange(positions)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def qk_norms(cupy, rng, with_norm, d):
    """(reference args, kernel args) for rope_store_kvcache's per-head q/k RMSNorm (Qwen3):
    q_norm, k_norm (d,) far from 1 and from each other, and eps; none without it."""
    if not with_norm:
        return (), ()
    (q_norm, q_norm_d), (k_norm, k_norm_d) = (f16(cupy, rng.uniform(low, low + 1.5, size=d)) for low in (0.2, 0.6))
    return (q_norm, k_norm, 1e-6), (q_norm_d, k_norm_d, 1e-6)


def heads_of_many_scales(rng, tokens, heads, d):
    """(tokens, heads * d) normal values, each head's row scaled by its own factor in [0.05, 5]:
    an RMSNorm of each head is far from the identity."""
    return (rng.normal(size=(tokens, heads, d)) * rng.uniform(0.05, 5, size=(tokens, heads, 1))).reshape(tokens, -1)


@pytest.mark.parametrize("nq, nkv, d", [(9, 3, 64), (32, 8, 128), (4, 1, 128), (5, 1, 32), (4, 1, 256)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_store_kvcache_on_strided_views(cupy, rng, nq, nkv, d, with_norm):
    """q, k, v are views into one fused QKV output, as the model produces them; slot -1
    tokens are rotated (q) but write nothing. One KV head (a TP rank's share, or MQA): CuPy
    gives the length-1 heads axis of k and v the row stride. With the q/k norm, each q and k
    head is RMS-normalized with its weight first."""
    tokens, num_blocks, block_size = 21, 6, 16
    qkv, qkv_d = f16(cupy, heads_of_many_scales(rng, tokens, nq + 2 * nkv, d))
    norms, norms_d = qk_norms(cupy, rng, with_norm, d)
    before = qkv_d.copy()
    positions = rng.integers(0, 4096, size=tokens).astype(np.int32)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[[0, 7, 20]] = -1
    cos_sin = rope_table(d)
    k_cache, k_cache_d = f16(cupy, rng.normal(size=(num_blocks, nkv, block_size, d)))
    v_cache, v_cache_d = f16(cupy, rng.normal(size=(num_blocks, nkv, block_size, d)))

    def split(a):
        return (a[:, :nq * d].reshape(tokens, nq, d), a[:, nq * d:(nq + nkv) * d].reshape(tokens, nkv, d),
                a[:, (nq + nkv) * d:].reshape(tokens, nkv, d))

    ref_q = ops.rope_store_kvcache(*split(qkv), positions, cos_sin, LayerKV(k_cache, v_cache), slots, *norms)
    got_q = kernels.rope_store_kvcache(*split(qkv_d), cupy.asarray(positions), cupy.asarray(cos_sin),
                                   LayerKV(k_cache_d, v_cache_d), cupy.asarray(slots), *norms_d)
    assert_close(cupy, got_q, ref_q)
    assert_close(cupy, k_cache_d, k_cache)  # untouched slots too: they keep their random values
    np.testing.assert_array_equal(cupy.asnumpy(v_cache_d).astype(np.float32), v_cache)
    assert cupy.array_equal(qkv_d, before)  # inputs are not modified


def assert_quantized_close(cupy, got_values, got_scales, ref_values, ref_scales):
    """int8 cache rows against the reference's: scales within one float16 rounding, dequantized
    values within one quantization step (see the module docstring)."""
    got_values, got_scales = cupy.asnumpy(got_values), cupy.asnumpy(got_scales).astype(np.float32)
    ref_scales = ref_scales.astype(np.float32)
    assert got_values.dtype == np.int8 and got_values.min() >= -127
    assert np.isfinite(got_scales).all()
    np.testing.assert_allclose(got_scales, ref_scales, rtol=2 ** -10, atol=0)
    step = ref_scales + 127 * np.abs(got_scales - ref_scales)
    error = np.abs(got_values * got_scales[..., None] - ref_values * ref_scales[..., None])
    assert (error <= step[..., None] * (1 + 1e-6)).all(), error.max()
    return (got_values != ref_values).mean()  # the fraction of values one step off


@pytest.mark.parametrize("nq, nkv, d", [(9, 3, 64), (32, 8, 128), (4, 1, 128), (4, 1, 256)])
@pytest.mark.parametrize("scheme", ["token", "rotate"])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_store_kvcache_int8(cupy, rng, nq, nkv, d, scheme, with_norm):
    """int8 cache: K and V quantized per (token, KV head) as ops.quantize does, after the q/k
    norm (if any), RoPE and the key scheme's change of basis (Hadamard rotation under
    "rotate"; q comes back with the same change); slot -1 tokens write nothing, and every
    other slot keeps its bits. Also a float16 cache under each key scheme."""
    tokens, num_blocks, block_size = 21, 6, 16
    qkv, qkv_d = f16(cupy, heads_of_many_scales(rng, tokens, nq + 2 * nkv, d) * 2)
    norms, norms_d = qk_norms(cupy, rng, with_norm, d)
    qkv[3, nq * d:] = 0  # a token whose K and V are all zero: scale 0, values 0
    qkv_d[3, nq * d:] = 0
    positions = rng.integers(0, 4096, size=tokens).astype(np.int32)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[[0, 7, 20]] = -1
    cos_sin = rope_table(d)
    shape = (num_blocks, nkv, block_size, d)
    data = [rng.integers(-127, 128, size=shape).astype(np.int8) for _ in range(2)]
    scales = [rng.uniform(0.01, 0.1, size=shape[:3]).astype(np.float16) for _ in range(2)]
    rotate = scheme == "rotate"
    ref = LayerKV(*(a.copy() for a in data + scales), rotate)
    dev = LayerKV(*(cupy.asarray(a) for a in data + scales), rotate)

    def split(a):
        return (a[:, :nq * d].reshape(tokens, nq, d), a[:, nq * d:(nq + nkv) * d].reshape(tokens, nkv, d),
                a[:, (nq + nkv) * d:].reshape(tokens, nkv, d))

    ref_q = ops.rope_store_kvcache(*split(qkv), positions, cos_sin, ref, slots, *norms)
    got_q = kernels.rope_store_kvcache(*split(qkv_d), cupy.asarray(positions), cupy.asarray(cos_sin), dev,
                                   cupy.asarray(slots), *norms_d)
    assert_close(cupy, got_q, ref_q)
    for got_values, got_scales, ref_values, ref_scales in ((dev.k, dev.k_scale, ref.k, ref.k_scale),
                                                          (dev.v, dev.v_scale, ref.v, ref.v_scale)):
        off = assert_quantized_close(cupy, got_values, got_scales, ref_values, ref_scales)
        assert off < 0.01, off  # one step off only where float rounding order decides
    assert (cupy.asnumpy(dev.k_scale)[slots[3] // block_size, :, slots[3] % block_size] == 0).all()
    if rotate:  # float16 cache: K stored in the scheme's basis
        k_cache, k_cache_d = f16(cupy, rng.normal(size=shape))
        v_cache, v_cache_d = f16(cupy, rng.normal(size=shape))
        ref_q = ops.rope_store_kvcache(*split(qkv), positions, cos_sin,
                                       LayerKV(k_cache, v_cache, None, None, rotate), slots, *norms)
        got_q = kernels.rope_store_kvcache(*split(qkv_d), cupy.asarray(positions), cupy.asarray(cos_sin),
                                       LayerKV(k_cache_d, v_cache_d, None, None, rotate),
                                       cupy.asarray(slots), *norms_d)
        assert_close(cupy, got_q, ref_q)
        assert_close(cupy, k_cache_d, k_cache)
        np.testing.assert_array_equal(cupy.asnumpy(v_cache_d).astype(np.float32), v_cache)


def test_int8_cache_checks(cupy, rng):
    """Bad int8 caches are refused before any launch, with the reason."""
    q = cupy.asarray(np.zeros((2, 4, 96), np.float16))
    k = cupy.asarray(np.zeros((3, 1, 16, 96), np.int8))
    s = cupy.asarray(np.zeros((3, 1, 16), np.float16))
    tables, lens = cupy.asarray(np.zeros((2, 1), np.int32)), cupy.asarray(np.ones(2, np.int32))
    with pytest.raises(ValueError, match="int8 KV cache supports head_dim"):
        kernels.paged_attention(q, LayerKV(k, k, s, s), tables, lens, 0.1)
    with pytest.raises(ValueError, match="int8 KV cache supports head_dim"):
        kernels.rope_store_kvcache(q, q[:, :1], q[:, :1], cupy.asarray(np.zeros(2, np.int32)),
                               cupy.asarray(rope_table(96, 8)), LayerKV(k, k, s, s),
                               cupy.asarray(np.zeros(2, np.int32)))
    q = cupy.asarray(np.zeros((2, 4, 64), np.float16))
    k = cupy.asarray(np.zeros((3, 1, 16, 64), np.int8))
    with pytest.raises(ValueError, match="needs k_scale"):
        kernels.paged_attention(q, LayerKV(k, k), tables, lens, 0.1)
    with pytest.raises(ValueError, match="v_scale must be contiguous"):
        kernels.paged_attention(q, LayerKV(k, k, s, s[:, :, :8]), tables, lens, 0.1)
    with pytest.raises(TypeError, match="k_scale must be float16"):
        kernels.paged_attention(q, LayerKV(k, k, s.astype(np.float32), s), tables, lens, 0.1)
    half = cupy.asarray(np.zeros((3, 1, 16, 64), np.float16))
    with pytest.raises(ValueError, match="float16 KV cache has no scales"):
        kernels.paged_attention(q, LayerKV(half, half, s, s), tables, lens, 0.1)


def z(cupy, shape, dtype=np.float16):
    return cupy.asarray(np.zeros(shape, dtype))


def paged_call(cupy, q_shape, k, v=None, block_size=16):
    """kernels.paged_attention on zeros: q of q_shape, K and V of k's shape (or those given)."""
    k = z(cupy, k) if isinstance(k, tuple) else k
    cache = LayerKV(k, k if v is None else v)
    return kernels.paged_attention(z(cupy, q_shape), cache, z(cupy, (1, 1), np.int32), z(cupy, 1, np.int32), 0.1)


def rope_call(cupy, q, k, v, cache, norms=()):
    """kernels.rope_store_kvcache of two tokens; q, k, v views of arrays of zeros (or shapes);
    q_norm, k_norm arrays of zeros of the shapes and dtypes norms gives, if any."""
    q, k, v = (z(cupy, a) if isinstance(a, tuple) else a for a in (q, k, v))
    d = cache.k.shape[3]
    return kernels.rope_store_kvcache(q, k, v, z(cupy, 2, np.int32), cupy.asarray(rope_table(d, 8)), cache,
                                  z(cupy, 2, np.int32), *(z(cupy, *n) for n in norms), *([1e-6] if norms else []))


def cache_of(cupy, shape, rotate=False):
    return LayerKV(z(cupy, shape), z(cupy, shape), k_rotate=rotate)


BAD_CALLS = {  # what -> (the call, the error, its message): refused before any launch
    "k and v of other dtypes": (lambda c: paged_call(c, (1, 4, 64), (3, 2, 16, 64), z(c, (3, 2, 16, 64), np.float32)),
                                TypeError, "KV cache must be float16 or int8"),
    "a cache that is not 4-D": (lambda c: paged_call(c, (1, 4, 64), (3, 2, 1024)), ValueError,
                                "must be \\(num_blocks, nkv, block_size, head_dim\\)"),
    "a strided cache": (lambda c: paged_call(c, (1, 4, 64), z(c, (6, 2, 16, 64))[::2]), ValueError,
                        "KV caches must be contiguous"),
    "q and cache head dims": (lambda c: paged_call(c, (1, 4, 128), (3, 2, 16, 64)), ValueError,
                              "q has head_dim 128, the cache 64"),
    "a GQA group of 9": (lambda c: paged_call(c, (1, 18, 64), (3, 2, 16, 64)), ValueError, "query heads per KV head"),
    "a block size of 12": (lambda c: paged_call(c, (1, 4, 64), (3, 2, 12, 64)), ValueError, "power-of-two block size"),
    "a hidden size of 12": (lambda c: kernels.rms_norm(z(c, (2, 12)), z(c, 12), 1e-5), ValueError, "multiple of 8"),
    "a head dim of 40": (lambda c: rope_call(c, (2, 4, 40), (2, 2, 40), (2, 2, 40), cache_of(c, (3, 2, 16, 40))),
                         ValueError, "multiple of 16"),
    "q with strided elements": (lambda c: rope_call(c, z(c, (2, 4, 128))[:, :, ::2], (2, 2, 64), (2, 2, 64),
                                                    cache_of(c, (3, 2, 16, 64))),
                                ValueError, "q needs contiguous, 16-byte aligned rows"),
    "k and v rows of other strides": (lambda c: rope_call(c, (2, 4, 64), z(c, (2, 4, 64))[:, :2], (2, 2, 64),
                                                          cache_of(c, (3, 2, 16, 64))),
                                      ValueError, "the same row stride"),
    "heads the cache does not have": (lambda c: rope_call(c, (2, 4, 64), (2, 2, 64), (2, 2, 64),
                                                          cache_of(c, (3, 1, 16, 64))),
                                      ValueError, "do not match the cache"),
    "a Hadamard rotation of 48 dims": (lambda c: rope_call(c, (2, 4, 48), (2, 2, 48), (2, 2, 48),
                                                           cache_of(c, (3, 2, 16, 48), rotate=True)),
                                       ValueError, "power-of-two head_dim"),
    "a q/k norm of 48 dims": (lambda c: rope_call(c, (2, 4, 48), (2, 2, 48), (2, 2, 48), cache_of(c, (3, 2, 16, 48)),
                                                  [(48,), (48,)]),
                              ValueError, "the q/k norm need a power-of-two head_dim"),
    "a q/k norm of another size": (lambda c: rope_call(c, (2, 4, 64), (2, 2, 64), (2, 2, 64),
                                                       cache_of(c, (3, 2, 16, 64)), [(64,), (32,)]),
                                   ValueError, "k_norm must be contiguous \\(64,\\)"),
    "a float32 q/k norm": (lambda c: rope_call(c, (2, 4, 64), (2, 2, 64), (2, 2, 64), cache_of(c, (3, 2, 16, 64)),
                                               [((64,), np.float32), ((64,), np.float32)]),
                           TypeError, "q_norm must be float16"),
    "staging of another dtype": (lambda c: kernels.scatter_blocks(z(c, (1, 2, 4, 8)), z(c, 1, np.int32),
                                                              z(c, (1, 2, 1, 8), np.float32)),
                                 TypeError, "staging must be float16"),
    "staging of another shape": (lambda c: kernels.scatter_blocks(z(c, (1, 2, 4, 8)), z(c, 1, np.int32),
                                                              z(c, (1, 2, 2, 8))),
                                 ValueError, "do not match 1 blocks"),
    "a strided pool": (lambda c: kernels.gather_blocks(z(c, (1, 2, 8, 8))[:, :, ::2], z(c, 1, np.int32)),
                       ValueError, "must be contiguous"),
    "a block of one byte": (lambda c: kernels.gather_blocks(z(c, (1, 2, 4, 1), np.int8), z(c, 1, np.int32)),
                            ValueError, "cannot move in 2-byte units"),
}


@pytest.mark.parametrize("what", BAD_CALLS)
def test_bad_arguments_are_refused_before_any_launch(cupy, what):
    call, error, message = BAD_CALLS[what]
    with pytest.raises(error, match=message):
        call(cupy)


def test_empty_batches_launch_nothing(cupy):
    """No sequence, no token: the attention wrappers return empty outputs (a grid of zero
    blocks is an invalid launch)."""
    cache = cache_of(cupy, (3, 2, 16, 64))
    q, none, no_tables = z(cupy, (0, 4, 64)), z(cupy, 0, np.int32), z(cupy, (0, 1), np.int32)
    assert kernels.paged_attention(q, cache, no_tables, none, 0.1).shape == (0, 4, 64)
    assert kernels.prefill_attention(q, cache, z(cupy, 1, np.int32), no_tables, none, 0.1).shape == (0, 4, 64)


def test_linear_on_a_column_strided_x(cupy, rng):
    """x's elements not contiguous (every other column): copied first, as cuBLAS needs."""
    wide, wide_d = f16(cupy, rng.normal(size=(5, 128)) / 8)
    w, w_d = f16(cupy, rng.normal(size=(24, 64)) / 8)
    assert_close(cupy, kernels.linear(wide_d[:, ::2], w_d), ops.linear(wide[:, ::2], w))


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("tokens, inter", [(17, 1544), (3, 2048)])  # 2048: Gemma 3 270M's
def test_gated_mul(cupy, rng, op, tokens, inter):
    gate_up, gate_up_d = f16(cupy, rng.normal(size=(tokens, 2 * inter)) * 3)
    assert_close(cupy, getattr(kernels, op)(gate_up_d), getattr(ops, op)(gate_up))


# ---------------------------------------------------------------- sampling

def sample_args(rows, temperature, top_k, top_p, rng, min_p=0.0):
    with np.errstate(divide="ignore"):
        log_min_p = np.full(rows, np.log(np.float32(min_p)), np.float32)
    return (np.full(rows, temperature, np.float32), np.full(rows, top_k, np.int32),
            np.full(rows, top_p, np.float32), log_min_p, rng.integers(0, 2**63, rows).astype(np.uint64),
            rng.integers(0, 5000, rows).astype(np.int32))


def test_sample_greedy_ties_go_to_lowest_index(cupy, rng):
    logits = rng.normal(size=(5, 128256)).astype(np.float16)
    logits[1, [70000, 900, 128255]] = 30.0  # tie: lowest index wins
    logits[2, -1] = 30.0                    # maximum in the last column
    logits[3, :] = -60000.0                 # all equal
    logits[4, 0] = 30.0                     # first column
    args = sample_args(5, 0.0, 3, 0.5, rng)
    got = cupy.asnumpy(kernels.sample(cupy.asarray(logits), *map(cupy.asarray, args)))
    np.testing.assert_array_equal(got, ops.sample(logits.astype(np.float32), *args))
    np.testing.assert_array_equal(got, [logits[0].argmax(), 900, 128255, 0, 0])


@pytest.mark.parametrize("vocab", [49152, 128256, 1000])
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, -1, 1.0, 0), (0.7, -1, 1.0, 0.05), (1.0, 40, 1.0, 0), (0.8, -1, 0.9, 0), (0.6, 50, 0.95, 0.2), (1.3, 1, 1.0, 0),
])
def test_sample_matches_reference(cupy, rng, vocab, temperature, top_k, top_p, min_p):
    """Same algorithm, same float32 inputs: identical tokens, except where two allowed
    tokens' noisy scores are within float32 rounding (logf/expf vs NumPy, ~1 ulp) or a
    nucleus boundary is within summation-order rounding. With 64 random rows such cases
    have probability ~1e-4, so we allow at most one mismatching row. The emulator, which
    runs each row's 1024 threads in three orders on the CPU, takes 16 of them."""
    rows = 64 if cupy.__name__ == "cupy" else 16
    logits = (3 * rng.normal(size=(rows, vocab))).astype(np.float16)
    args = sample_args(rows, temperature, top_k, top_p, rng, min_p)
    got = cupy.asnumpy(kernels.sample(cupy.asarray(logits), *map(cupy.asarray, args)))
    ref = ops.sample(logits.astype(np.float32), *args)
    assert (got != ref).sum() <= 1, np.flatnonzero(got != ref)


@pytest.mark.parametrize("vocab", [49152, 1001])
def test_edit_and_mask_logits_match_reference(cupy, rng, vocab):
    """The logits processors' ops on fresh float16 logits: sparse edits (penalties, shifts,
    bans) and allowed-token bitmasks on some rows; the other rows stay as they were."""
    logits = (3 * rng.normal(size=(6, vocab))).astype(np.float16)
    rows = np.repeat(np.int32([0, 2, 5]), 40)
    tokens = np.concatenate([rng.choice(vocab, 40, replace=False) for _ in range(3)]).astype(np.int32)
    biases = rng.normal(size=120).astype(np.float32)
    penalties = rng.uniform(0.5, 2.0, 120).astype(np.float32)
    shifts = np.where(rng.random(120) < 0.1, -np.inf, rng.normal(size=120)).astype(np.float32)
    want = ops.edit_logits(logits.astype(np.float32), rows, tokens, biases, penalties, shifts)
    got = kernels.edit_logits(cupy.asarray(logits), *map(cupy.asarray, (rows, tokens, biases, penalties, shifts)))
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float32), want, rtol=2e-3, atol=2e-3)
    masks = rng.integers(-2**31, 2**31, size=(3, (vocab + 31) // 32)).astype(np.int32)
    want = ops.mask_logits(logits.astype(np.float32), np.int32([4, 0, 1]), masks).astype(np.float16)
    got = kernels.mask_logits(cupy.asarray(logits), cupy.asarray(np.int32([4, 0, 1])), cupy.asarray(masks))
    np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_sample_pinned_draws(cupy):
    """The same bits as the NumPy reference on the pinned draws (literal tokens)."""
    from test_sampler import PINNED_ARGS, PINNED_LOGITS, PINNED_TOKENS
    logits = cupy.asarray(PINNED_LOGITS.astype(np.float16))
    got = kernels.sample(logits, *map(cupy.asarray, PINNED_ARGS))
    np.testing.assert_array_equal(cupy.asnumpy(got), PINNED_TOKENS)


# ---------------------------------------------------------------- cache

@pytest.mark.parametrize("pool", ["float16", "int8", "scales-16", "scales-2", "scales-1"])
def test_swap_round_trip_is_bitwise(cupy, rng, pool):
    """Every pool of nano/kv_cache.py: float16 or int8 K/V data (L, 2, nb, nkv, bs, d), and
    float16 scales (L, 2, nb, nkv, bs), whose block is 64 bytes at block size 16 (16-byte
    copies) but 8 or 4 at block sizes 2 and 1 (2-byte copies)."""
    layers, num_blocks, nkv, d = 3, 20, 2, 64
    block_size = int(pool.split("-")[1]) if pool.startswith("scales") else 16
    shape = (layers, 2, num_blocks, nkv, block_size) + (() if pool.startswith("scales") else (d,))
    if pool == "int8":
        kv = rng.integers(-128, 128, size=shape).astype(np.int8)
    else:
        kv = rng.normal(size=shape).astype(np.float16)
    kv_d = cupy.asarray(kv)
    src = np.array([3, 11, 0, 19, 7], np.int32)
    dst = np.array([4, 1, 15, 8, 12], np.int32)
    staging = kernels.gather_blocks(kv_d, cupy.asarray(src))
    assert staging.dtype == kv.dtype
    np.testing.assert_array_equal(cupy.asnumpy(staging).view(np.uint8), kv[:, :, src].view(np.uint8))
    kernels.scatter_blocks(kv_d, cupy.asarray(dst), staging)
    expected = kv.copy()
    expected[:, :, dst] = kv[:, :, src]
    np.testing.assert_array_equal(cupy.asnumpy(kv_d).view(np.uint8), expected.view(np.uint8))


# ---------------------------------------------------------------- attention

CACHE_DTYPES = ["float16", "int8"]


def make_cache(cupy, rng, context_lens, nkv, d, block_size, dtype="float16"):
    """A KV cache holding each sequence's context in shuffled physical blocks: returns
    (LayerKV, block tables) for the reference and for the kernels. float16: random values.
    int8: ops.quantize of random values, then the scales times random factors (0.25-4) so
    that rows differ in magnitude, and 2% of them 0 (a row of zeros)."""
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + 3  # a few blocks nobody owns
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(context_lens), max(needed)), -1, np.int32)
    start = 0
    for i, n in enumerate(needed):
        tables[i, :n] = ids[start:start + n]
        start += n
    shape = (num_blocks, nkv, block_size, d)
    if dtype == "float16":
        k_cache, k_cache_d = f16(cupy, rng.normal(size=shape))
        v_cache, v_cache_d = f16(cupy, rng.normal(size=shape))
        return (LayerKV(k_cache, v_cache), tables), (LayerKV(k_cache_d, v_cache_d), cupy.asarray(tables))
    arrays = []
    for _ in range(2):
        values, scales = ops.quantize(rng.normal(size=shape).astype(np.float32))
        scales = (scales * rng.uniform(0.25, 4, size=scales.shape) * (rng.random(scales.shape) > 0.02))
        arrays += [values, scales.astype(np.float16)]
    ref = LayerKV(arrays[0], arrays[2], arrays[1], arrays[3])
    return (ref, tables), (LayerKV(*(cupy.asarray(a) for a in (ref.k, ref.v, ref.k_scale, ref.v_scale))),
                           cupy.asarray(tables))


# Groups 3, 1, 4, 8, 3, 8, 4: the last is Gemma 3 270M's (4 query heads on 1 KV head of 256 dims).
HEADS = [(9, 3, 64), (8, 8, 64), (32, 8, 128), (64, 8, 128), (12, 4, 128), (24, 3, 64), (4, 1, 256)]


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("nq, nkv, d", HEADS)
@pytest.mark.parametrize("context_lens, block_size", [
    ([1], 16),                                  # a single token
    ([8200], 16),                               # long context: split-KV path
    ([1, 17, 64, 100, 333], 16),                # mixed lengths, partial last blocks
    ([250, 3, 129], 32),                        # another power-of-two block size
    ([5, 70, 2], 1),                            # block_size 1
])
def test_paged_attention(cupy, rng, nq, nkv, d, context_lens, block_size, dtype):
    (cache, tables), (cache_d, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, block_size, dtype)
    q, q_d = f16(cupy, rng.normal(size=(len(context_lens), nq, d)))
    lens = np.array(context_lens, np.int32)
    scale = d ** -0.5
    got = kernels.paged_attention(q_d, cache_d, tables_d, cupy.asarray(lens), scale)
    assert_close(cupy, got, ops.paged_attention(q, cache, tables, lens, scale))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_paged_attention_many_sequences_no_split(cupy, rng, dtype):
    """Enough sequences to fill the GPU: one partition per (sequence, KV head)."""
    nq, nkv, d, block_size = 9, 3, 64, 16
    context_lens = rng.integers(1, 600, size=120).tolist()
    assert kernels.decode_partitions(120 * nkv, 600 * 2, 132)[0] == 1
    (cache, tables), (cache_d, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, block_size, dtype)
    q, q_d = f16(cupy, rng.normal(size=(len(context_lens), nq, d)))
    lens = np.array(context_lens, np.int32)
    got = kernels.paged_attention(q_d, cache_d, tables_d, cupy.asarray(lens), 0.125)
    assert_close(cupy, got, ops.paged_attention(q, cache, tables, lens, 0.125))


@pytest.mark.parametrize("d", kernels.HEAD_DIMS)
def test_paged_attention_int8_underflowing_tile(cupy, rng, d):
    """int8 cache, one key far above all others: in keys 64-127 (the tile after its own; at
    head dim 256, whose tiles are 32 keys, the third and fourth), every weight p is ~e^-80, so
    p * scale_v (the decode kernel's p') is ~1e-36, below FIXED15 / FLT_MAX: a fixed-point
    step computed from it would be inf, and inf or NaN converted to int. Such a tile adds
    nothing. 8 query heads on 2 KV heads, contexts 300 (split-KV) and 70; the
    sanitizer run (tests/test_cuda_host.py) catches the conversion."""
    nq, nkv, block_size, key, gap = 8, 2, 16, 5, 80.0
    context_lens = [300, 70]
    (cache, tables), (cache_d, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, block_size, "int8")
    scale = d ** -0.5
    group = nq // nkv

    def keys(i, h):  # sequence i's dequantized keys of KV head h, and their v scales
        rows = [(tables[i, t // block_size], t % block_size) for t in range(context_lens[i])]
        return (np.stack([cache.k[b, h, o] * np.float32(cache.k_scale[b, h, o]) for b, o in rows]),
                np.array([cache.v_scale[b, h, o] for b, o in rows], np.float32))

    q = np.zeros((len(context_lens), nq, d), np.float32)
    for i in range(len(context_lens)):
        b, o = tables[i, key // block_size], key % block_size
        cache.k_scale[b, :, o] = 0.5  # a key far larger than the others, on both sides
        cache_d.k_scale[b, :, o] = cupy.asarray(np.full(nkv, 0.5, np.float16))
        for h in range(nkv):
            k = keys(i, h)[0]
            direction = k[key] / np.linalg.norm(k[key])
            margin = k[key] @ direction - (k[64:128] @ direction).max()  # the second tile's best key
            q[i, h * group:(h + 1) * group] = gap / (scale * margin) * direction
    q, q_d = f16(cupy, q)
    for i in range(len(context_lens)):  # the case described above: 0 < p' < 1e-34 in the second tile
        for h in range(nkv):
            k, v_scale = keys(i, h)
            s = k @ q[i, h * group] * scale
            p = np.exp(s[64:128] - s.max()) * v_scale[64:128]
            assert 0 < p.max() < 1e-34, p.max()
    lens = np.array(context_lens, np.int32)
    got = kernels.paged_attention(q_d, cache_d, tables_d, cupy.asarray(lens), scale)
    assert_close(cupy, got, ops.paged_attention(q, cache, tables, lens, scale))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("nq, nkv, d", HEADS)
@pytest.mark.parametrize("chunks", [
    [(1, 1)],                               # (chunk length, context length): one token
    [(37, 37), (50, 300), (1, 90)],         # full prefill, mid-sequence chunk, 1-token chunk
    [(64, 64), (130, 1000), (21, 21)],      # exact tile, long chunk deep into the sequence
])
def test_prefill_attention(cupy, rng, nq, nkv, d, chunks, dtype):
    block_size = 16
    context_lens = [ctx for _, ctx in chunks]
    (cache, tables), (cache_d, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, block_size, dtype)
    cu = np.concatenate([[0], np.cumsum([n for n, _ in chunks])]).astype(np.int32)
    q, q_d = f16(cupy, rng.normal(size=(int(cu[-1]), nq, d)))
    lens = np.array(context_lens, np.int32)
    scale = d ** -0.5
    got = kernels.prefill_attention(q_d, cache_d, cupy.asarray(cu), tables_d, cupy.asarray(lens), scale)
    assert_close(cupy, got, ops.prefill_attention(q, cache, cu, tables, lens, scale))


# Sliding windows (ops.py: the query at position p sees keys p - W + 1 .. p): shorter and longer
# than the context, the window's first key at a block edge and off one.
WINDOW_HEADS = [(9, 3, 64), (8, 8, 64), (64, 8, 128), (4, 1, 256)]  # groups 3, 1, 8, 4 (Gemma 3 270M)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("nq, nkv, d", WINDOW_HEADS)
@pytest.mark.parametrize("context_lens, block_size, window", [
    ([1, 16, 17, 40, 100, 333], 16, 16),    # first keys 0, 0, 1, 24, 84, 317: on and off block edges
    ([33, 48, 100, 5], 16, 17),             # 17, 32 (an edge), 84, 0
    ([8200, 8192, 1000], 16, 2496),         # split-KV, many partitions from 5704, 5696 (an edge) and 0
    ([300, 64], 16, 1000),                  # longer than every context: all keys
    ([250, 3, 129], 32, 1),                 # one key: the query's own
    ([5, 70, 2], 1, 7),                     # block_size 1
    ([1000, 512, 513, 528, 2000], 16, 512), # Gemma 3's window: 488, 0, 1, 16 and 1488 (edges)
])
def test_paged_attention_window(cupy, rng, nq, nkv, d, context_lens, block_size, window, dtype):
    (cache, tables), (cache_d, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, block_size, dtype)
    q, q_d = f16(cupy, rng.normal(size=(len(context_lens), nq, d)))
    lens = np.array(context_lens, np.int32)
    if context_lens[0] == 8200:
        assert kernels.decode_partitions(len(context_lens) * nkv, window, 132)[0] >= 8
    got = kernels.paged_attention(q_d, cache_d, tables_d, cupy.asarray(lens), d ** -0.5, window)
    assert_close(cupy, got, ops.paged_attention(q, cache, tables, lens, d ** -0.5, window))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("nq, nkv, d", WINDOW_HEADS)
@pytest.mark.parametrize("chunks, window", [
    ([(37, 37), (50, 300), (1, 90)], 16),      # (chunk length, context length): a block's width
    ([(64, 64), (130, 1000), (21, 21)], 45),   # off tile and block edges
    ([(40, 40), (7, 300)], 1),                 # one key: the query's own
    ([(50, 300), (20, 20)], 500),              # longer than every context: all keys
    ([(530, 530), (40, 1100)], 512),           # Gemma 3's window, inside a chunk and deep in one
])
def test_prefill_attention_window(cupy, rng, nq, nkv, d, chunks, window, dtype):
    context_lens = [ctx for _, ctx in chunks]
    (cache, tables), (cache_d, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, 16, dtype)
    cu = np.concatenate([[0], np.cumsum([n for n, _ in chunks])]).astype(np.int32)
    q, q_d = f16(cupy, rng.normal(size=(int(cu[-1]), nq, d)))
    lens = np.array(context_lens, np.int32)
    got = kernels.prefill_attention(q_d, cache_d, cupy.asarray(cu), tables_d, cupy.asarray(lens), d ** -0.5, window)
    assert_close(cupy, got, ops.prefill_attention(q, cache, cu, tables, lens, d ** -0.5, window))


def poisoned_before(cupy, cache, tables, first_keys):
    """The device cache with every key and value before first_keys[i] of sequence i NaN (an
    int8 cache's scales: its values cannot be): a kernel that reads one, even to mask it out,
    returns NaN (a masked value's weight is 0, and 0 * NaN is NaN)."""
    block_size = cache.k.shape[2]
    arrays = [a.copy() for a in (cache.k, cache.v, cache.k_scale, cache.v_scale) if a is not None]
    for table, first in zip(tables, first_keys):
        for t in range(first):
            for a in arrays[-2:]:  # float16: K and V; int8: their scales
                a[table[t // block_size], :, t % block_size] = np.nan
    if cache.k_scale is None:
        return LayerKV(*(cupy.asarray(a.astype(np.float16)) for a in arrays))
    return LayerKV(*(cupy.asarray(a) for a in arrays))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_attention_reads_nothing_before_the_window(cupy, rng, dtype, monkeypatch):
    """With the keys and values before each window NaN, both kernels return finite outputs equal
    to the reference over the clean cache: decode from the window's first key (ctx - W), with
    and without split-KV; prefill from its chunk's first query's (ctx - n - W + 1). Decode's
    partitions are chosen for the W keys it reads, not for the context (one, not several)."""
    chosen, choose = [], kernels.decode_partitions
    monkeypatch.setattr(kernels, "decode_partitions", lambda *args: chosen.append(choose(*args)) or chosen[-1])
    nq, nkv, d, window = 8, 2, 64, 20
    decode_lens, chunks = [300, 37, 64, 3000], [(50, 300), (37, 37), (20, 100)]
    context_lens = decode_lens + [ctx for _, ctx in chunks]
    (cache, tables), (_, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, 16, dtype)
    firsts = [max(0, ctx - window) for ctx in decode_lens] + [max(0, ctx - n - window + 1) for n, ctx in chunks]
    poisoned = poisoned_before(cupy, cache, tables, firsts)
    scale = d ** -0.5
    q, q_d = f16(cupy, rng.normal(size=(len(decode_lens), nq, d)))
    for seqs in (slice(0, 3), slice(3, 4)):  # no split; one long context, split
        lens = np.array(decode_lens[seqs], np.int32)
        got = kernels.paged_attention(q_d[seqs], poisoned, tables_d[seqs], cupy.asarray(lens), scale, window)
        assert_close(cupy, got, ops.paged_attention(q[seqs], cache, tables[seqs], lens, scale, window))
    assert choose(nkv, 3000, 132)[0] > 1 and [parts for parts, _ in chosen] == [1, 1]
    cu = np.concatenate([[0], np.cumsum([n for n, _ in chunks])]).astype(np.int32)
    q, q_d = f16(cupy, rng.normal(size=(int(cu[-1]), nq, d)))
    lens = np.array([ctx for _, ctx in chunks], np.int32)
    got = kernels.prefill_attention(q_d, poisoned, cupy.asarray(cu), tables_d[4:], cupy.asarray(lens), scale, window)
    assert_close(cupy, got, ops.prefill_attention(q, cache, cu, tables[4:], lens, scale, window))


def test_a_gpu_shard_runs_the_kernels(cupy):
    """shard.op_set's choice on a GPU is kernels.CUDA, every op of which is a kernel: none is
    left at its NumPy default. The LoRA product's kernel is nano/lora's: the core's set has none,
    and an adapter pool on a GPU gives the model's op set nano/lora/kernels.py's."""
    from nano.lora import kernels as lora_kernels
    from nano.lora.pool import AdapterPool
    assert shard.op_set("gpu", invariant=False) is kernels.CUDA
    members = {f.name: getattr(kernels.CUDA, f.name) for f in dataclasses.fields(ops.OpSet) if f.type is not bool}
    assert {name for name, op in members.items() if op is None} == {"add_lora"}
    defined_in = {name: getattr(op, "func", op).__module__ for name, op in members.items() if op is not None}
    assert {name: module for name, module in defined_in.items() if module != kernels.__name__} == {}
    with_lora = AdapterPool.op_set(SimpleNamespace(device=SimpleNamespace(kind="gpu")), kernels.CUDA)
    assert with_lora.add_lora is lora_kernels.add_lora
    assert dataclasses.replace(with_lora, add_lora=None) == kernels.CUDA


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("decodes, chunks", [(2, []), (0, [(5, 5), (20, 40)]), (2, [(5, 5), (20, 40)])])
def test_step_attention(cupy, rng, decodes, chunks, window):
    """The CUDA set's attention on a step of decode rows, of prefill chunks, or of both (decode
    rows first): every row as ops.attention computes it, over all keys or a sliding window."""
    nq, nkv, d = 4, 2, 64
    lens = [37, 300][:decodes] + [ctx for _, ctx in chunks]
    (cache, tables), (cache_d, _) = make_cache(cupy, rng, lens, nkv, d, 16)
    cu = np.concatenate([[0], np.cumsum([n for n, _ in chunks])]).astype(np.int32)
    q, q_d = f16(cupy, rng.normal(size=(decodes + int(cu[-1]), nq, d)))
    batch = SimpleNamespace(num_decodes=decodes, cu_seqlens_q=cu, block_tables=tables,
                            context_lens=np.array(lens, np.int32))
    batch_d = SimpleNamespace(num_decodes=decodes, **{name: cupy.asarray(getattr(batch, name))
                                                      for name in ("cu_seqlens_q", "block_tables", "context_lens")})
    assert_close(cupy, kernels.attention(q_d, cache_d, batch_d, d ** -0.5, window),
                 ops.attention(q, cache, batch, d ** -0.5, window))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("d", kernels.HEAD_DIMS)
@pytest.mark.parametrize("group", kernels.GROUPS)
def test_every_attention_instantiation(cupy, rng, d, group, dtype):
    """Each template instance nano/kernels.py compiles (head dim x GQA group x cache type),
    decode with and without split-KV and a prefill chunk starting mid-sequence; the cases
    above cover some."""
    nkv, block_size = 2, 16
    nq = nkv * group
    decode_lens, chunks = [1, 37, 300], [(5, 5), (20, 40)]
    (cache, tables), (cache_d, tables_d) = make_cache(
        cupy, rng, decode_lens + [ctx for _, ctx in chunks], nkv, d, block_size, dtype)
    scale = d ** -0.5
    q, q_d = f16(cupy, rng.normal(size=(len(decode_lens), nq, d)))
    lens = np.array(decode_lens, np.int32)
    got = kernels.paged_attention(q_d, cache_d, tables_d[:3], cupy.asarray(lens), scale)
    assert_close(cupy, got, ops.paged_attention(q, cache, tables[:3], lens, scale))
    got = kernels.paged_attention(q_d[2:], cache_d, tables_d[2:3], cupy.asarray(lens[2:]), scale)
    assert_close(cupy, got, ops.paged_attention(q[2:], cache, tables[2:3], lens[2:], scale))
    cu = np.array([0, 5, 25], np.int32)
    q, q_d = f16(cupy, rng.normal(size=(25, nq, d)))
    lens = np.array([ctx for _, ctx in chunks], np.int32)
    got = kernels.prefill_attention(q_d, cache_d, cupy.asarray(cu), tables_d[3:], cupy.asarray(lens), scale)
    assert_close(cupy, got, ops.prefill_attention(q, cache, cu, tables[3:], lens, scale))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_bench_kernels_calls(cupy, dtype):
    """tests/bench_kernels.py (GPU only: it times) builds its inputs with decode_inputs and
    prefill_inputs; the same calls, small, against the reference here, so that the benchmark's
    arguments are checked on every run."""
    import bench_kernels

    def host(cache):
        return LayerKV(*(None if a is None else cupy.asnumpy(a).astype(np.float32 if a.dtype == np.float16 and
                                                                    a.ndim == 4 else a.dtype)
                         for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)))

    q_d, cache_d, tables_d, lens_d = bench_kernels.decode_inputs(2, 100, 9, 3, 64, dtype, xp=cupy)
    got = kernels.paged_attention(q_d, cache_d, tables_d, lens_d, 0.125)
    q, tables, lens = (cupy.asnumpy(a) for a in (q_d, tables_d, lens_d))
    assert_close(cupy, got, ops.paged_attention(q.astype(np.float32), host(cache_d), tables, lens, 0.125))
    row = 64 * 2 if dtype == "float16" else 64 + 2  # bytes of one K (or V) row: halfs, or int8 + scale
    assert bench_kernels.kv_bytes(2, 100, 3, 64, dtype) == 2 * 2 * 100 * 3 * row  # K and V, 2 sequences
    q_d, cache_d, cu_d, tables_d, lens_d = bench_kernels.prefill_inputs(2, 40, 9, 3, 64, dtype, xp=cupy)
    got = kernels.prefill_attention(q_d, cache_d, cu_d, tables_d, lens_d, 0.125)
    q, cu, tables, lens = (cupy.asnumpy(a) for a in (q_d, cu_d, tables_d, lens_d))
    assert_close(cupy, got, ops.prefill_attention(q.astype(np.float32), host(cache_d), cu, tables, lens, 0.125))


# ---------------------------------------------------------------- pools past 2^31 elements

HUGE_BLOCKS = 2**20 + 4  # of 2 KV heads x 16 tokens x 64 dims: 2^31 + 8192 elements per layer's K


def huge_cache(cupy, rng, context_lens, dtype):
    """make_cache's contents in the last blocks of a layer's pool of HUGE_BLOCKS blocks (a
    float16 K is 4 GiB; on the emulator a sparse mapping, of which only those blocks are ever
    touched), so that every element index the kernels compute is past 2^31. Returns the small
    pool and tables for the reference, and the huge pool and its tables."""
    (ref, tables), (small, _) = make_cache(cupy, rng, context_lens, 2, 64, 16, dtype)
    offset = HUGE_BLOCKS - ref.k.shape[0]

    def huge(a):
        if a is None:
            return None
        out = cupy.empty((HUGE_BLOCKS, *a.shape[1:]), a.dtype)
        out[offset:] = a
        return out
    huge_tables = np.where(tables >= 0, tables + offset, -1).astype(np.int32)
    return (ref, tables), (LayerKV(*(huge(a) for a in (small.k, small.v, small.k_scale, small.v_scale))),
                           cupy.asarray(huge_tables), offset)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_attention_over_a_pool_past_2_31_elements(cupy, rng, dtype):
    """Decode (one sequence split into partitions, one not) and prefill (a chunk deep into its
    sequence) read blocks whose first element is past 2^31."""
    (cache, tables), (huge, huge_tables, _) = huge_cache(cupy, rng, [40, 300, 20, 100], dtype)
    q, q_d = f16(cupy, rng.normal(size=(2, 4, 64)))
    lens = np.array([40, 300], np.int32)
    got = kernels.paged_attention(q_d, huge, huge_tables[:2], cupy.asarray(lens), 0.125)
    assert_close(cupy, got, ops.paged_attention(q, cache, tables[:2], lens, 0.125))
    cu, lens = np.array([0, 20, 50], np.int32), np.array([20, 100], np.int32)
    q, q_d = f16(cupy, rng.normal(size=(50, 4, 64)))
    got = kernels.prefill_attention(q_d, huge, cupy.asarray(cu), huge_tables[2:], cupy.asarray(lens), 0.125)
    assert_close(cupy, got, ops.prefill_attention(q, cache, cu, tables[2:], lens, 0.125))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_cache_writes_into_a_pool_past_2_31_elements(cupy, rng, dtype):
    """rope_store_kvcache writes slots in the last blocks (float16 K and V, or int8 with scales)."""
    tokens, nq, nkv, d = 9, 4, 2, 64
    (cache, _), (huge, _, offset) = huge_cache(cupy, rng, [48], dtype)
    slots = rng.permutation(48)[:tokens].astype(np.int32)
    qkv, qkv_d = f16(cupy, rng.normal(size=(tokens, nq + 2 * nkv, d)))
    positions = rng.integers(0, 64, size=tokens).astype(np.int32)
    cos_sin = rope_table(d, 64)

    def split(a):
        return a[:, :nq], a[:, nq:nq + nkv], a[:, nq + nkv:]
    ref_q = ops.rope_store_kvcache(*split(qkv), positions, cos_sin, cache, slots)
    got_q = kernels.rope_store_kvcache(*split(qkv_d), cupy.asarray(positions), cupy.asarray(cos_sin), huge,
                                   cupy.asarray(slots + offset * 16))
    assert_close(cupy, got_q, ref_q)
    if dtype == "int8":
        assert_quantized_close(cupy, huge.k[offset:], huge.k_scale[offset:], cache.k, cache.k_scale)
        assert_quantized_close(cupy, huge.v[offset:], huge.v_scale[offset:], cache.v, cache.v_scale)
    else:
        assert_close(cupy, huge.k[offset:], cache.k)
        np.testing.assert_array_equal(cupy.asnumpy(huge.v[offset:]).astype(np.float32), cache.v)


@pytest.mark.parametrize("dtype", [np.float16, np.int8])
def test_swaps_in_a_pool_past_2_31_elements(cupy, dtype):
    """gather_blocks and scatter_blocks on a whole pool (one layer, K and V: past 2^32 elements),
    blocks among its last."""
    pool = cupy.empty((1, 2, HUGE_BLOCKS, 2, 16, 64), dtype)
    values = np.arange(2 * 8 * 2048).astype(dtype).reshape(1, 2, 8, 2, 16, 64)
    pool[:, :, -8:] = cupy.asarray(values)
    src = np.array([HUGE_BLOCKS - 1, HUGE_BLOCKS - 8, HUGE_BLOCKS - 5], np.int32)
    staging = kernels.gather_blocks(pool, cupy.asarray(src))
    np.testing.assert_array_equal(cupy.asnumpy(staging), values[:, :, src - HUGE_BLOCKS + 8])
    dst = np.array([HUGE_BLOCKS - 2, HUGE_BLOCKS - 3, HUGE_BLOCKS - 4], np.int32)
    kernels.scatter_blocks(pool, cupy.asarray(dst), staging)
    np.testing.assert_array_equal(cupy.asnumpy(pool[:, :, dst]), values[:, :, src - HUGE_BLOCKS + 8])


# ---------------------------------------------------------------- bfloat16
# bfloat16 runs hold its bits in uint16 arrays (nano/device.py BFLOAT16). The tolerances are
# derived, not loosened: F16_MAX_ERR and F16_NORM_ERR are 8u and 4u for float16's unit
# roundoff u = 2^-11 (11 bits of precision); bfloat16 has 8 bits, u = 2^-8, so 8u = 3.1e-2
# and 4u = 1.6e-2. As for float16, inputs are rounded first and both sides see the same
# values; what remains is the kernel's one rounding of each output to bfloat16.
ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def to_bfloat16(x) -> np.ndarray:
    """float32 -> bfloat16 bits by the carry trick: add 0x7fff plus the lowest kept bit, drop
    the low 16 bits (round to nearest even); NaN becomes CUDA's canonical 0x7fff."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FFF), rounded)


def widen(x) -> np.ndarray:
    """bfloat16 bits -> float32, exactly."""
    return (np.asarray(x).astype(np.uint32) << 16).view(np.float32)


def bf16(cupy, x):
    """Round to bfloat16: (float32 copy for the reference, CuPy bits for the kernel)."""
    bits = to_bfloat16(x)
    return widen(bits), cupy.asarray(bits)


def assert_close_bf16(cupy, got, ref):
    got = widen(cupy.asnumpy(got))
    assert got.shape == ref.shape and np.isfinite(got).all()
    err = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
    norm_err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    u = ROUNDOFF["bfloat16"]
    assert err <= 8 * u and norm_err <= 4 * u, (err, norm_err)


@pytest.mark.parametrize("op", ["embedding", "rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul",
                                "linear", "linear_bias"])
def test_bfloat16_layers(cupy, rng, op):
    """Each per-token kernel's bfloat16 instance; embedding exactly (Gemma 3's sqrt(640)
    scale rounded to bfloat16 first, 25.25, as its checkpoints' code rounds it)."""
    x, x_d = bf16(cupy, rng.normal(size=(13, 640)))
    w, w_d = bf16(cupy, rng.uniform(0.5, 1.5, size=640))
    if op == "embedding":
        ids = rng.integers(0, 13, size=9).astype(np.int32)
        np.testing.assert_array_equal(cupy.asnumpy(kernels.embedding(cupy.asarray(ids), x_d)), to_bfloat16(x[ids]))
        got = kernels.embedding(cupy.asarray(ids), x_d, 640 ** 0.5)
        np.testing.assert_array_equal(cupy.asnumpy(got), to_bfloat16(x[ids] * np.float32(25.25)))
    elif op == "rms_norm":
        assert_close_bf16(cupy, kernels.rms_norm(x_d, w_d, 1e-6), ops.rms_norm(x, w, 1e-6))
    elif op == "add_rms_norm":
        r, r_d = bf16(cupy, rng.normal(size=x.shape))
        out, res = kernels.add_rms_norm(x_d, r_d, w_d, 1e-6)
        np.testing.assert_array_equal(cupy.asnumpy(res), to_bfloat16(x + r))  # one rounding of the sum
        assert_close_bf16(cupy, out, ops.rms_norm(widen(to_bfloat16(x + r)), w, 1e-6))
    elif op in ("silu_mul", "gelu_tanh_mul"):
        assert_close_bf16(cupy, getattr(kernels, op)(x_d), getattr(ops, op)(x))
    else:
        wt, wt_d = bf16(cupy, rng.normal(size=(72, 640)) / 8)
        b, b_d = bf16(cupy, rng.normal(size=72)) if op == "linear_bias" else (None, None)
        assert_close_bf16(cupy, kernels.linear(x_d, wt_d, b_d), ops.linear(x, wt, b))


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8"])
def test_bfloat16_rope_store_kvcache(cupy, rng, cache_dtype):
    """q, k, v as views of one bfloat16 QKV output, the q/k norms on; a bfloat16 cache (K
    close, V exact) or an int8 one (quantized from the float32 values, as for float16)."""
    nq, nkv, d, tokens, num_blocks, block_size = 8, 2, 64, 11, 3, 16
    qkv, qkv_d = bf16(cupy, heads_of_many_scales(rng, tokens, nq + 2 * nkv, d))
    (qn, qn_d), (kn, kn_d) = (bf16(cupy, rng.uniform(low, low + 1.5, size=d)) for low in (0.2, 0.6))
    positions = rng.integers(0, 4096, size=tokens).astype(np.int32)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    cos_sin = rope_table(d)
    shape = (num_blocks, nkv, block_size, d)
    if cache_dtype == "int8":
        cache = LayerKV(*(np.zeros(s, t) for s, t in [(shape, np.int8)] * 2 + [(shape[:3], np.float16)] * 2))
    else:
        cache = LayerKV(*(widen(to_bfloat16(rng.normal(size=shape))) for _ in range(2)))
    cache_d = LayerKV(*(None if a is None else cupy.asarray(to_bfloat16(a) if a.dtype == np.float32 else a)
                        for a in (cache.k, cache.v, cache.k_scale, cache.v_scale)))

    def split(a):
        return (a[:, :nq * d].reshape(tokens, nq, d), a[:, nq * d:(nq + nkv) * d].reshape(tokens, nkv, d),
                a[:, (nq + nkv) * d:].reshape(tokens, nkv, d))

    ref_q = ops.rope_store_kvcache(*split(qkv), positions, cos_sin, cache, slots, qn, kn, 1e-6)
    got_q = kernels.rope_store_kvcache(*split(qkv_d), cupy.asarray(positions), cupy.asarray(cos_sin), cache_d,
                                       cupy.asarray(slots), qn_d, kn_d, 1e-6)
    assert_close_bf16(cupy, got_q, ref_q)
    if cache_dtype == "int8":
        assert_quantized_close(cupy, cache_d.k, cache_d.k_scale, cache.k, cache.k_scale)
        assert_quantized_close(cupy, cache_d.v, cache_d.v_scale, cache.v, cache.v_scale)
    else:
        assert_close_bf16(cupy, cache_d.k, cache.k)
        np.testing.assert_array_equal(cupy.asnumpy(cache_d.v), to_bfloat16(cache.v))


def bf16_cache(cupy, rng, context_lens, nkv, d, block_size, cache_dtype):
    """make_cache's tables and int8 cache, or a bfloat16 one of random values."""
    (cache, tables), (cache_d, tables_d) = make_cache(cupy, rng, context_lens, nkv, d, block_size,
                                                      "int8" if cache_dtype == "int8" else "float16")
    if cache_dtype == "bfloat16":
        pairs = [bf16(cupy, rng.normal(size=cache.k.shape)) for _ in range(2)]
        cache, cache_d = LayerKV(pairs[0][0], pairs[1][0]), LayerKV(pairs[0][1], pairs[1][1])
    return (cache, tables), (cache_d, tables_d)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("nq, nkv, d", [(9, 3, 64), (4, 1, 256)])
def test_bfloat16_attention(cupy, rng, nq, nkv, d, cache_dtype):
    """Decode (one partition and split-KV) and prefill attention, bfloat16 q and out, over a
    bfloat16 or int8 cache, with a sliding window too."""
    context_lens = [1, 17, 300]
    (cache, tables), (cache_d, tables_d) = bf16_cache(cupy, rng, context_lens, nkv, d, 16, cache_dtype)
    lens, scale = np.array(context_lens, np.int32), d ** -0.5
    q, q_d = bf16(cupy, rng.normal(size=(3, nq, d)))
    for window in (None, 40):
        got = kernels.paged_attention(q_d, cache_d, tables_d, cupy.asarray(lens), scale, window)
        assert_close_bf16(cupy, got, ops.paged_attention(q, cache, tables, lens, scale, window))
        got = kernels.paged_attention(q_d[2:], cache_d, tables_d[2:], cupy.asarray(lens[2:]), scale, window)
        assert_close_bf16(cupy, got, ops.paged_attention(q[2:], cache, tables[2:], lens[2:], scale, window))
    cu = np.int32([0, 1, 18, 68])  # chunks of 1, 17 (whole prompts) and 50 of 300
    q, q_d = bf16(cupy, rng.normal(size=(68, nq, d)))
    got = kernels.prefill_attention(q_d, cache_d, cupy.asarray(cu), tables_d, cupy.asarray(lens), scale, 40)
    assert_close_bf16(cupy, got, ops.prefill_attention(q, cache, cu, tables, lens, scale, 40))


def test_bfloat16_sampling(cupy, rng):
    """Greedy and seeded draws on bfloat16 logits equal the reference's on the same values,
    and the logits processors' edits round once to bfloat16."""
    logits, logits_d = bf16(cupy, 3 * rng.normal(size=(4, 1001)))
    params = (np.float32([0, 0.8, 1.0, 0.7]), np.int32([0, 50, 0, 0]), np.float32([1, 1, 0.9, 1]),
              np.float32([-np.inf] * 3 + [np.log(0.05)]), np.uint64([1, 2, 3, 4]), np.int32([0, 5, 9, 2]))
    got = kernels.sample(logits_d, *(cupy.asarray(p) for p in params))
    np.testing.assert_array_equal(cupy.asnumpy(got), ops.sample(logits, *params))
    rows, tokens = np.int32([0, 3, 3]), np.int32([5, 7, 1000])
    edits = (np.float32([1.5, -2, 0]), np.float32([1.2, 1.3, 1]), np.float32([0, 0.5, -np.inf]))
    want = ops.edit_logits(logits.copy(), rows, tokens, *edits)
    kernels.edit_logits(logits_d, cupy.asarray(rows), cupy.asarray(tokens), *(cupy.asarray(e) for e in edits))
    np.testing.assert_array_equal(cupy.asnumpy(logits_d), to_bfloat16(want))
    masks = rng.integers(-2**31, 2**31, size=(2, 32), dtype=np.int64).astype(np.int32)
    want = ops.mask_logits(want, np.int32([1, 2]), masks)
    kernels.mask_logits(logits_d, cupy.asarray(np.int32([1, 2])), cupy.asarray(masks))
    np.testing.assert_array_equal(cupy.asnumpy(logits_d), to_bfloat16(want))


def test_bfloat16_and_float16_do_not_mix(cupy):
    """A float16 q over a bfloat16 cache, or a float32 x, is refused before any launch."""
    q = cupy.asarray(np.zeros((1, 4, 64), np.float16))
    cache = LayerKV(*(cupy.asarray(np.zeros((2, 1, 16, 64), np.uint16)) for _ in range(2)))
    with pytest.raises(TypeError, match="KV cache must be float16 or int8"):
        kernels.paged_attention(q, cache, cupy.asarray(np.zeros((1, 2), np.int32)), cupy.asarray(np.int32([1])), 1.0)
    with pytest.raises(TypeError, match="x must be float16, got float32"):
        kernels.rms_norm(cupy.asarray(np.zeros((1, 8), np.float32)), cupy.asarray(np.zeros(8, np.uint16)), 1e-6)


def test_a_module_holds_one_element_type(cupy):
    """A run compiles only its own element type's instances: one module per source and type,
    and the swap kernels, which name no type, in a module of their own."""
    if not hasattr(kernels._module("layers.cu", "__half"), "_kernels"):
        pytest.skip("the emulator's modules list the instances they compiled")
    for source, t in (("layers.cu", "__half"), ("cache.cu", "__nv_bfloat16"), ("cache.cu", None)):
        compiled = sorted(kernels._module(source, t)._kernels)
        assert compiled == sorted(e for e in kernels._TEMPLATES[source] if kernels._type_of(e) == t)
