"""CUDA graphs for decode (nano/graphs.py) against eager steps, on random-weight models in
real shapes (needs a GPU). tests/test_engine_emulated.py runs the same checks on the CPU
emulator, in a small shape.

Graph and eager decode steps are not bitwise equal: a bucket pads the batch (cuBLAS may
pick another kernel for another row count) and block tables have the static width
ceil(max_model_len / block_size) (paged attention may split the context differently).
Both change only float32 accumulation order before a float16 rounding, so we require
logits within LOGIT_TOL = 1e-2 of max |logit|, every greedy token the argmax of its own
logits row, and tokens equal except at a near-tie of the eager run (see
reference.assert_greedy_runs_agree). A replay against an eager run of the very same padded
batch runs the same kernels on the same shapes, so it should be bitwise equal;
SAME_BATCH_TOL = 1e-3 leaves room only for cuBLAS picking another algorithm under capture.
"""
import numpy as np
import pytest

from nano.config import EngineConfig
from nano.engine import LLMEngine
from nano.model import ForwardBatch
from nano.sequence import SamplingParams
from reference import SMOLLM2_135M, assert_greedy_runs_agree, make_random_model

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

LOGIT_TOL = 1e-2
SAME_BATCH_TOL = 1e-3

SHAPES = {
    "smollm2_135m": SMOLLM2_135M,
    "head_dim_128": dict(hidden=1024, layers=4, heads=8, kv_heads=2, intermediate=2816, vocab=32000),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped_model(request, tmp_path_factory):
    shape = SHAPES[request.param]
    return make_random_model(tmp_path_factory.mktemp(request.param), max_pos=2048, dtype="float16",
                             seed=3, **shape), shape["vocab"]


def relative_error(a, b) -> float:
    a, b = (cupy.asnumpy(x).astype(np.float32) for x in (a, b))
    return float(np.abs(a - b).max() / np.abs(b).max())


def check_graphs_keep_greedy_output(model_dir, vocab, kv_cache_dtype, max_tokens=(2, 5, 9, 14, 20, 27, 40)):
    """Requests of different lengths: the batch shrinks 7 -> 1, through every bucket (8, 4, 2, 1
    of max_num_seqs 8), against an eager engine."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, int(rng.integers(5, 80))).tolist() for _ in max_tokens]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, return_logits=True)
              for m in max_tokens]
    runs = {}
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(model=str(model_dir), device="gpu", num_blocks=512,
                                        max_num_seqs=8, enforce_eager=eager, kv_cache_dtype=kv_cache_dtype))
        runs[eager] = engine.generate(prompts, params)
        assert (engine.runner.graphs is None) == eager
    assert sorted(engine.runner.graphs.captured) == engine.runner.graphs.buckets == [1, 2, 4, 8]
    assert_greedy_runs_agree(runs[True], runs[False], LOGIT_TOL)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graphs_do_not_change_greedy_output(shaped_model, kv_cache_dtype):
    check_graphs_keep_greedy_output(*shaped_model, kv_cache_dtype)


def randomize(cache, rng) -> None:
    """Random K/V (float16 normal, or int8 with scales whose products are about as large)."""
    if cache.scales is None:
        cache.data.set(rng.standard_normal(cache.data.shape, np.float32).astype(np.float16))
        return
    cache.data.set(rng.integers(-127, 128, cache.data.shape, np.int8))
    cache.scales.set((rng.random(cache.scales.shape, np.float32) / 64).astype(np.float16))


def pool_error(got: list, want: list) -> float:
    return max(relative_error(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("n", [1, 3, 8, 13, 17])
def test_replay_with_padding_matches_eager(shaped_model, n, kv_cache_dtype):
    check_replay_with_padding(shaped_model[0], n, kv_cache_dtype)


def check_replay_with_padding(model_dir, n, kv_cache_dtype):
    """n decode rows over random KV contents: replay vs (a) eager on the same padded batch
    (SAME_BATCH_TOL) and (b) eager on the n rows alone (LOGIT_TOL); the KV pool (an int8
    one's scales too) gets the same writes, at the n rows' slots only (padding rows write
    nothing)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="gpu", num_blocks=256, max_num_seqs=32,
                                    kv_cache_dtype=kv_cache_dtype))
    runner, graphs = engine.runner, engine.runner.graphs
    cache = runner.kv_cache
    rng = np.random.default_rng(n)
    randomize(cache, rng)

    def snapshot():
        return [a.copy() for a in cache.block_arrays()]

    def restore(saved):
        for a, b in zip(cache.block_arrays(), saved):
            a[...] = b

    bs = runner.block_size
    context = rng.integers(1, 300, n).astype(np.int32)
    blocks = rng.permutation(256).astype(np.int32)
    width = int(-(-context.max() // bs))
    tables = np.full((n, width), -1, np.int32)
    start = 0
    for i, c in enumerate(context):  # distinct blocks per row: no two rows write one slot
        used = -(-int(c) // bs)
        tables[i, :used] = blocks[start:start + used]
        start += used
    positions = context - 1
    slots = tables[np.arange(n), positions // bs] * bs + positions % bs
    ids = rng.integers(3, runner.model.cfg.vocab_size, n).astype(np.int32)
    before = snapshot()

    step = graphs.prepare(ids, positions, slots, context, tables, np.full(len(ids), -1, np.int32))
    assert sorted(graphs.captured) == graphs.buckets  # all at the first decode step, not one as it is needed
    graph_logits = runner.forward(step).copy()
    graph_kv = snapshot()

    restore(before)
    padded = graphs._batch(graphs.captured[step.bucket].inputs, step.bucket)
    padded_logits = runner.model.forward(padded, cache)[:n]
    assert relative_error(graph_logits, padded_logits) <= SAME_BATCH_TOL
    assert pool_error(graph_kv, snapshot()) <= SAME_BATCH_TOL

    restore(before)
    d = cupy.asarray
    alone = ForwardBatch(d(ids), d(positions), d(slots.astype(np.int32)), n, d(context), d(tables),
                         d(np.zeros(1, np.int32)), d(np.arange(n, dtype=np.int32)))
    assert relative_error(graph_logits, runner.model.forward(alone, cache)) <= LOGIT_TOL
    # Another batch shape, so other GEMM kernels: K and V drift as the logits do (LOGIT_TOL), and
    # an int8 value moves that much of its range plus one rounding step (seen on an H200: 2/127)
    assert pool_error(graph_kv, snapshot()) <= LOGIT_TOL + (1 / 127 if kv_cache_dtype == "int8" else 0)

    written = np.zeros(cache.data.shape[2] * bs, bool)
    written[slots] = True
    untouched = cupy.asarray(~written.reshape(-1, bs))  # (num_blocks, block_size)
    for got, old in zip(graph_kv, before):  # (L, 2, num_blocks, nkv, block_size[, d])
        mask = untouched[None, None, :, None, :]
        if got.ndim == 6:
            mask = mask[..., None]
        assert cupy.array_equal(cupy.where(mask, got, 0), cupy.where(mask, old, 0))
