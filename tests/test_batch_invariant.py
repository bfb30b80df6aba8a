"""Batch-invariant mode (EngineConfig.batch_invariant, CPU; on by default for an int8 KV
cache): a token's result is bitwise the same whatever else is in the step and however its
sequence was scheduled (batched, one at a time, chunked, preempted), so int8 KV caches
quantize the same values and greedy runs agree exactly, not only to rounding
(docs/int8-kv.md, "Schedules")."""
import dataclasses
import functools

import numpy as np
import pytest
from test_disagg import cluster, serve, tiny_config, workload
from test_equivalence import CHAT, CONFIGS, run, shared_prefix_prompts

from nano import invariant, ops, shard
from nano.chat.template import render as render_chat
from nano.config import KEY_SCHEMES, EngineConfig
from nano.engine import LLMEngine
from nano.errors import NanoError
from nano.kv_cache import KVCache
from nano.model import ForwardBatch
from nano.telemetry.metrics import metrics_of
from nano.tokenizer import Tokenizer

POOLS = [("auto", None)] + [("int8", s) for s in KEY_SCHEMES]
# Engine arguments of each pool's runs: float32 with the flag, int8 as it comes (no flag).
RUNS = {"float32 --batch-invariant": dict(kv_cache_dtype="auto", batch_invariant=True),
        **{f"int8 {s}": dict(kv_cache_dtype="int8", kv_int8_keys=s) for s in KEY_SCHEMES}}


@pytest.fixture(scope="module")
def default_engine_model(default_model):
    """The default model's weights as the engine stores them, loaded once for the file."""
    return LLMEngine(EngineConfig(device="cpu", num_blocks=4)).runner.model


@pytest.mark.parametrize("name", ["qkv", "o_proj", "gate_up", "down", "lm_head"])
def test_a_linear_row_is_the_same_in_any_product(default_engine_model, name):
    """Each of the default model's weights as the engine stores it: rows of a product of M
    rows, wherever they sit, are bitwise those of a 64-row product."""
    model = default_engine_model
    weight = model.lm_head if name == "lm_head" else getattr(model.layers[0], name)
    x = np.random.default_rng(0).normal(size=(64, weight.shape[1])).astype(np.float32)
    full = invariant.invariant_linear(x, weight)  # (64, N)
    for m in (1, 3, 7, 16, 40):
        for lo in (0, 64 - m):
            np.testing.assert_array_equal(invariant.invariant_linear(x[lo:lo + m], weight), full[lo:lo + m],
                                          err_msg=f"{m} rows at {lo}")


def test_the_row_wise_ops_do_not_depend_on_the_other_rows():
    rng = np.random.default_rng(1)
    x, res = rng.normal(size=(2, 40, 576)).astype(np.float32)
    w = rng.normal(size=576).astype(np.float32)
    gate_up = rng.normal(size=(40, 3072)).astype(np.float32)
    logits = rng.normal(size=(40, 4096)).astype(np.float32)
    params = [np.zeros(40, np.float32), np.zeros(40, np.int32), np.ones(40, np.float32),
              np.full(40, -np.inf, np.float32), np.arange(40, dtype=np.uint64), np.zeros(40, np.int32)]
    all_rows = (ops.add_rms_norm(x, res, w, 1e-5), ops.silu_mul(gate_up), ops.gelu_tanh_mul(gate_up),
                ops.sample(logits, *params))
    for rows in (slice(0, 1), slice(7, 8), slice(3, 10), slice(39, 40)):
        some = (ops.add_rms_norm(x[rows], res[rows], w, 1e-5), ops.silu_mul(gate_up[rows]),
                ops.gelu_tanh_mul(gate_up[rows]),
                ops.sample(logits[rows], *(p[rows] for p in params)))
        for got, want in zip(some, all_rows):
            for g, a in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,)))):
                np.testing.assert_array_equal(g, a[rows])


# Attention on the default model's shapes; three sequences of 100, 150 and 9 tokens, so that
# a row of the first one is also summed over eight blocks and more in a batch with the second.
NQ, NKV, D, BS = 9, 3, 64, 16
LENGTHS = (100, 150, 9)
POSITIONS = (5, 15, 16, 63, 99)  # query rows of sequence 0


def random_pool(kv_dtype, scheme, rng):
    pool = KVCache(np, 1, 20, NKV, BS, D, np.float32, kv_dtype, scheme)
    if kv_dtype == "int8":
        pool.data[...] = rng.integers(-127, 128, pool.data.shape)
        pool.scales[...] = rng.uniform(1e-3, 2e-2, pool.scales.shape)
    else:
        pool.data[...] = rng.normal(size=pool.data.shape)
    return pool


def attention(cache, parts, num_decodes, window=None):
    """The model's attention in batch-invariant mode over parts [(table, positions, q rows)],
    the first num_decodes of one row each -> their rows, concatenated."""
    width = max(len(t) for t, _, _ in parts)
    tables = np.array([list(t) + [-1] * (width - len(t)) for t, _, _ in parts], np.int32)
    batch = ForwardBatch(input_ids=None, positions=np.concatenate([p for _, p, _ in parts]), slot_mapping=None,
                         num_decodes=num_decodes, context_lens=np.array([p[-1] + 1 for _, p, _ in parts]),
                         block_tables=tables, logits_indices=None,
                         cu_seqlens_q=np.cumsum([0] + [len(p) for _, p, _ in parts[num_decodes:]]))
    return invariant.BATCH_INVARIANT.attention(np.concatenate([q for _, _, q in parts]), cache, batch, D ** -0.5, window)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("kv_dtype, scheme", POOLS)
def test_an_attention_row_is_the_same_in_any_schedule(kv_dtype, scheme, window):
    """A row of sequence 0 by decode (alone, or among longer and shorter sequences' decodes
    and a prefill), by a whole prefill and by a chunk of it, is bitwise the same, with a
    sliding window too; in the decodes, the cache past the row's position holds other values
    (not yet written)."""
    rng = np.random.default_rng(2)
    pool = random_pool(kv_dtype, scheme, rng)
    blocks = rng.permutation(20)
    tables = [blocks[:7], blocks[7:17], blocks[17:18]]
    q = [rng.normal(size=(n, NQ, D)).astype(np.float32) for n in LENGTHS]
    whole = attention(pool.layer(0), [(tables[0], np.arange(100), q[0])], 0, window)
    other = [(tables[i], np.array([LENGTHS[i] - 1]), q[i][-1:]) for i in (1, 2)]
    for p in POSITIONS:
        row = (tables[0], np.array([p]), q[0][p:p + 1])
        chunk = (tables[0], np.arange(max(0, p - 5), p + 1), q[0][max(0, p - 5):p + 1])
        got = {"chunk": attention(pool.layer(0), [chunk], 0, window)[-1],
               "chunk among decodes": attention(pool.layer(0), other + [chunk], 2, window)[-1]}
        later = random_pool(kv_dtype, scheme, rng)  # the cache a decode at p sees: later slots unwritten
        kept = np.ones((20, BS), bool)  # (block, offset): the slots that hold the same as in pool
        kept[tables[0]] = (np.arange(7 * BS) <= p).reshape(7, BS)
        for new, old in zip(later.block_arrays(), pool.block_arrays()):
            np.copyto(new, old, where=kept[:, None, :].reshape(20, 1, BS, *[1] * (new.ndim - 5)))
        got["decode"] = attention(later.layer(0), [row], 1, window)[0]
        got["decode among others"] = attention(later.layer(0), [other[0], row, other[1]], 3, window)[1]
        for name, out in got.items():
            np.testing.assert_array_equal(out, whole[p], err_msg=f"row {p}, {name}")


@pytest.fixture(scope="module")
def batched_run(tiny_model):
    """pool -> the batched run's sequences, which every schedule of that pool is held to:
    made once per pool, not once per schedule."""
    return functools.cache(lambda pool: run(tiny_model, shared_prefix_prompts(512, np.random.default_rng(1)), 24,
                                            **RUNS[pool])[1])


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "default"])
@pytest.mark.parametrize("pool", RUNS)
def test_every_schedule_gives_the_same_tokens_and_logits(tiny_model, batched_run, pool, name):
    """Greedy runs of the tiny model, each scheduling feature against the batched run:
    the same tokens and bitwise the same logits, in float32 and in int8."""
    prompts = shared_prefix_prompts(512, np.random.default_rng(1))
    batched = batched_run(pool)
    engine, seqs = run(tiny_model, prompts, 24, **RUNS[pool], **CONFIGS[name])
    assert engine.runner.model.ops is invariant.BATCH_INVARIANT
    if name.startswith("preempt"):
        assert sum(metrics_of(engine).preemptions.values()) > 0
    for b, s in zip(batched, seqs):
        assert s.output_token_ids == b.output_token_ids
        np.testing.assert_array_equal(np.stack(s.logits), np.stack(b.logits))


def test_the_default_model_int8_batched_and_one_at_a_time_agree(default_model):
    """Where the default mode parts at near-ties (docs/int8-kv.md), this one does not."""
    tok = Tokenizer(default_model)
    prompts = [tok.encode(render_chat(tok, p)) for p in CHAT]
    args = RUNS["int8 rotate"]
    _, batched = run(default_model, prompts, 16, **args)
    _, alone = run(default_model, prompts, 16, max_num_seqs=1, **args)
    for b, a in zip(batched, alone):
        assert a.output_token_ids == b.output_token_ids
        np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))


def test_int8_without_the_mode_parts_from_the_batched_run(tiny_model):
    """--no-batch-invariant: int8 at the float pass's speed, its rounding batch-dependent
    again (one sequence at a time, the logits are not bitwise the batched run's)."""
    prompts = shared_prefix_prompts(512, np.random.default_rng(1))
    args = dict(RUNS["int8 rotate"], batch_invariant=False)
    engine, batched = run(tiny_model, prompts, 24, **args)
    _, alone = run(tiny_model, prompts, 24, max_num_seqs=1, **args)
    assert engine.runner.model.ops is not invariant.BATCH_INVARIANT
    assert any(not np.array_equal(np.stack(a.logits), np.stack(b.logits)) for a, b in zip(alone, batched))
    assert run(tiny_model, prompts[:1], 1)[0].runner.model.ops is not invariant.BATCH_INVARIANT  # float32: off unless asked


def test_batch_invariant_mode_is_refused_on_a_gpu(tiny_model, monkeypatch):
    """Where the device comes out a GPU (given, or auto): refused before anything is loaded."""
    monkeypatch.setattr(shard, "select_device", lambda device: "gpu")
    with pytest.raises(NanoError, match="^--batch-invariant is CPU-only$"):
        LLMEngine(EngineConfig(model=str(tiny_model), batch_invariant=True))


@pytest.mark.parametrize("pool", [name for name in RUNS if name.startswith("int8")])
def test_disaggregated_serving_gives_one_engines_logits_at_a_time(tiny_model, pool):
    """Prefill on one instance, decode on two (tests/test_disagg.py's in-process cluster),
    int8: bitwise the logits of one engine serving one sequence at a time."""
    config = tiny_config(tiny_model, **RUNS[pool])
    prompts, params = workload(3)
    params = [dataclasses.replace(p, return_logits=True) for p in params]
    results = serve(cluster([config], [config, config]), prompts, params)
    alone = LLMEngine(dataclasses.replace(config, max_num_seqs=1)).generate(prompts, params)
    for r, a in zip(results, alone):
        assert r.output_token_ids == a.output_token_ids
        np.testing.assert_array_equal(np.stack(r.logits), np.stack(a.logits))
