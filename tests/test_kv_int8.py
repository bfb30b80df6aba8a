"""The int8 KV cache on the CPU path (nano/kv_cache.py): its quantizer and key schemes, its
bytes and blocks, and the engine's scheduling features on an int8 pool.

Scheduling must not change what an int8 pool computes beyond rounding: each token is
quantized once, from its own K/V, so a schedule changes only the float32 order of the
sums that made K/V (a value within ~1e-6 of a rounding boundary may land one int8 step
over, and one such step moved the tiny model's logits by 2.8e-3 of their scale). Hence
logits within INT8_SCHEDULE_TOL of the unconstrained int8 run's, relative to the logit
scale, and the same greedy tokens but at a near-tie (reference.assert_greedy_runs_agree);
a block losing its scales in a swap or a prefix hit moves them by far more. Against full
precision, int8 logits are within INT8_VS_FULL_TOL (the quantization error itself).
"""
import numpy as np
import pytest
from test_equivalence import CONFIGS, shared_prefix_prompts

from nano import ops
from nano.bench.capacity import capacity_report
from nano.config import KEY_SCHEMES, EngineConfig, ModelConfig
from nano.engine import LLMEngine
from nano.kv_cache import KVCache, bytes_per_token
from nano.telemetry.metrics import Metrics, metrics_of
from nano.tp import rope_cos_sin
from nano.runner import ModelRunner
from nano.sequence import SamplingParams
from nano.weights import open_model
from reference import assert_greedy_runs_agree

INT8_SCHEDULE_TOL = 1e-2
INT8_VS_FULL_TOL = 5e-2


def run(model_dir, prompts, **engine_args):
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **engine_args))
    Metrics.attach(engine)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, return_logits=True)
    return engine, engine.generate(prompts, params)


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(512, np.random.default_rng(1))


@pytest.fixture(scope="module")
def int8_runs(tiny_model, prompts):
    """The unconstrained run of each key scheme, and the full-precision one."""
    runs = {s: run(tiny_model, prompts, kv_cache_dtype="int8", kv_int8_keys=s)[1] for s in KEY_SCHEMES}
    runs["full"] = run(tiny_model, prompts)[1]
    return runs


@pytest.mark.parametrize("scheme", KEY_SCHEMES)
def test_int8_is_close_to_full_precision(int8_runs, scheme):
    assert_greedy_runs_agree(int8_runs["full"], int8_runs[scheme], INT8_VS_FULL_TOL)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "default"])
@pytest.mark.parametrize("scheme", KEY_SCHEMES)
def test_scheduling_features_on_an_int8_pool(tiny_model, prompts, int8_runs, name, scheme):
    """Prefix caching (hits reuse quantized blocks), chunked prefill, swap (scales travel
    with their blocks) and recompute give the unconstrained run's tokens."""
    engine, seqs = run(tiny_model, prompts, kv_cache_dtype="int8", kv_int8_keys=scheme, **CONFIGS[name])
    assert engine.runner.kv_cache.data.dtype == np.int8
    assert_greedy_runs_agree(int8_runs[scheme], seqs, INT8_SCHEDULE_TOL)
    m = metrics_of(engine)
    if name in ("preempt_swap", "preempt_recompute"):
        assert set(m.preemptions) == {name.removeprefix("preempt_")}
    if name in ("chunked_prefill", "preempt_auto_chunked"):
        assert m.prefix_hits > 0


def test_swap_moves_blocks_with_their_scales(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache_dtype="int8", num_blocks=10))
    runner: ModelRunner = engine.runner
    rng = np.random.default_rng(0)
    cache = runner.kv_cache
    cache.data[...] = rng.integers(-127, 128, cache.data.shape)
    cache.scales[...] = rng.random(cache.scales.shape)
    before = [a[:, :, [2, 7]].copy() for a in (cache.data, cache.scales)]
    runner.swap([(2, 0), (7, 1)], [])
    cache.data.fill(0)
    cache.scales.fill(0)
    runner.swap([], [(0, 5), (1, 3)])
    for a, saved in zip((cache.data, cache.scales), before):
        np.testing.assert_array_equal(a[:, :, [5, 3]], saved)


def test_quantize_round_trip_and_zero_rows():
    x = np.random.default_rng(0).normal(size=(50, 3, 64)).astype(np.float32)
    x[4, 1] = 0
    values, scales = ops.quantize(x)
    assert values.dtype == np.int8 and scales.dtype == np.float16
    assert np.abs(values).max() == 127 and not values[4, 1].any() and scales[4, 1] == 0
    rows = np.abs(values).max(axis=-1)          # one scale per (token, head): every nonzero row reaches 127
    assert (rows[scales > 0] == 127).all() and (scales > 0).sum() == 50 * 3 - 1
    step = scales.astype(np.float32)[..., None]
    assert np.all(np.abs(values * step - x) <= 0.5 * step + 1e-3 * np.abs(x))


@pytest.mark.parametrize("scheme", KEY_SCHEMES)
def test_values_and_their_scales_are_written_at_their_slots(scheme):
    """Each token's V goes, quantized with its own scale per KV head, to its slot; a slot
    of -1 (already cached) is left alone."""
    rng = np.random.default_rng(1)
    t, nkv, d, bs = 5, 2, 16, 4
    cfg = ModelConfig.from_hf(dict(hidden_size=2 * nkv * d, intermediate_size=8, num_hidden_layers=1,
                                   num_attention_heads=2 * nkv, num_key_value_heads=nkv, vocab_size=8))
    q, k, v = (rng.normal(size=(t, n, d)).astype(np.float32) for n in (2 * nkv, nkv, nkv))
    v[1, 0] *= 30                                # one large (token, head) row
    cache = KVCache(np, 1, 3, nkv, bs, d, np.float32, "int8", scheme).layer(0)
    slots = np.array([9, 10, 2, -1, 3], np.int32)   # blocks 2, 2, 0, skipped, 0
    ops.rope_store_kvcache(q, k, v, np.arange(t), rope_cos_sin(cfg, 8), cache, slots)
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        b, o = divmod(int(slot), bs)
        scale = cache.v_scale[b, :, o].astype(np.float32)
        np.testing.assert_allclose(scale, np.abs(v[i]).max(axis=-1) / 127, rtol=1e-3)
        np.testing.assert_allclose(cache.v[b, :, o] * scale[:, None], v[i], atol=0.51 * scale.max())
    untouched = np.ones((3, bs), bool)
    untouched.flat[slots[slots >= 0]] = False
    assert not np.moveaxis(cache.v_scale, 1, -1)[untouched].any()
    assert not np.moveaxis(cache.k_scale, 1, -1)[untouched].any()


@pytest.mark.parametrize("scheme", KEY_SCHEMES)
def test_a_tokens_int8_row_does_not_depend_on_the_rest_of_the_step(scheme):
    """Each token is rotated and quantized from its own K alone: written in a step of 37
    tokens or alone, its int8 K and V, their scales and its returned q are bitwise the
    same. (One product over all the step's rows would not be: OpenBLAS rounds a row
    differently by the number of rows and its place among them.)"""
    rng = np.random.default_rng(2)
    t, nq, nkv, d, bs = 37, 6, 3, 64, 8
    cfg = ModelConfig.from_hf(dict(hidden_size=nq * d, intermediate_size=8, num_hidden_layers=1,
                                   num_attention_heads=nq, num_key_value_heads=nkv, vocab_size=8))
    cos_sin = rope_cos_sin(cfg, t)
    q, k, v = (rng.normal(size=(t, n, d)).astype(np.float32) for n in (nq, nkv, nkv))

    def write(tokens):  # a fresh pool holding just these tokens, at slots = their positions
        pool = KVCache(np, 1, -(-t // bs), nkv, bs, d, np.float32, "int8", scheme)
        q_out = ops.rope_store_kvcache(q[tokens], k[tokens], v[tokens], tokens, cos_sin, pool.layer(0),
                                       tokens.astype(np.int32))
        return q_out, pool

    q_all, step = write(np.arange(t))
    for i in range(t):
        q_one, alone = write(np.array([i]))
        block, offset = divmod(i, bs)
        np.testing.assert_array_equal(q_one[0], q_all[i])
        for one, all_ in ((alone.data, step.data), (alone.scales, step.scales)):  # K and V of layer 0
            np.testing.assert_array_equal(one[0, :, block, :, offset], all_[0, :, block, :, offset])


def test_key_schemes_keep_q_dot_k():
    """K is stored in the scheme's basis and q returned in the matching one: q.k is what
    the unquantized rotated q and k would give, up to the int8 step."""
    rng = np.random.default_rng(0)
    t, nq, nkv, d, bs = 6, 4, 2, 64, 8
    cfg = ModelConfig.from_hf(dict(hidden_size=nq * d, intermediate_size=8, num_hidden_layers=1,
                                   num_attention_heads=nq, num_key_value_heads=nkv, vocab_size=8))
    cos_sin = rope_cos_sin(cfg, 32)
    q, k, v = (rng.normal(size=(t, n, d)).astype(np.float32) for n in (nq, nkv, nkv))
    k[..., 5] *= 20  # an outlier channel
    positions, slots = np.arange(t), np.arange(t, dtype=np.int32)
    full = KVCache(np, 1, 1, nkv, bs, d, np.float32, "auto").layer(0)
    q_full = ops.rope_store_kvcache(q, k, v, positions, cos_sin, full, slots)
    exact = np.einsum("thd,hsd->hts", q_full[:, ::2], full.k[0, :, :t])  # heads 0, 2 use KV heads 0, 1
    errors = {}
    for scheme in KEY_SCHEMES:
        cache = KVCache(np, 1, 1, nkv, bs, d, np.float32, "int8", scheme).layer(0)
        q_s = ops.rope_store_kvcache(q, k, v, positions, cos_sin, cache, slots)
        keys = cache.k[0, :, :t] * cache.k_scale[0, :, :t, None].astype(np.float32)
        got = np.einsum("thd,hsd->hts", q_s[:, ::2], keys)
        errors[scheme] = np.abs(got - exact).max() / np.abs(exact).max()
    assert all(e < 2e-2 for e in errors.values()), errors
    assert errors["rotate"] < errors["token"], errors


def test_bytes_per_token_of_the_default_model_shape(default_model):
    model = open_model(str(default_model), tokenizer=False).config
    assert bytes_per_token(model, 3, "auto", 4) == 46_080
    assert bytes_per_token(model, 3, "auto", 2) == 23_040
    assert bytes_per_token(model, 3, "int8", 4) == bytes_per_token(model, 3, "int8", 2) == 11_880


def test_int8_plan_and_engine_agree_on_the_blocks(tiny_model):
    plans = {}
    for dtype in ("auto", "int8"):
        config = EngineConfig(model=str(tiny_model), device="cpu", kv_cache_memory=10**7, kv_cache_dtype=dtype)
        plans[dtype] = capacity_report(config)
        engine = LLMEngine(config)
        assert engine.block_manager.num_blocks == plans[dtype].num_blocks
        assert sum(a.nbytes for a in engine.runner.kv_cache.block_arrays()) <= 10**7
    # head_dim 16: 18 bytes per (token, head) against 64 in float32
    assert plans["int8"].num_blocks == pytest.approx(64 / 18 * plans["auto"].num_blocks, rel=0.01)
