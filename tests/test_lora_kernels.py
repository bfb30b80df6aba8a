"""cuda/lora.cu (nano/lora/kernels.py's add_lora) against its NumPy reference, ops.add_lora,
on the GPU and the emulator (tests/test_kernels.py's fixtures and tolerances): decode rows
(BGMV, a slot each) and prefill chunks (SGMV, a slot per chunk, longer and shorter than a
block's 16 rows) in one step, odd ranks and widths that are multiples of neither a warp nor a block's 8
columns, rows without an adapter left bitwise as they were, a step without any adapter, and
a decode step replayed from a CUDA graph after its slots changed, in float16 and bfloat16.
Every slot holds a different adapter with a scale other than 1, so a row reading another
slot's weights, or its scale left out, fails."""
from types import SimpleNamespace

import numpy as np
import pytest

from test_kernels import (assert_close, assert_close_bf16, bf16, cupy, f16,  # noqa: F401
                          poisoned, rng)  # (fixtures)
from nano import ops
from nano.lora import kernels as lora_kernels

SCALES = np.float32([0.5, 2.0, 1.75, 0.25])
# dtype -> (rounding: (float32 copy, device array), the closeness check for its roundoff)
DTYPES = {"float16": (f16, assert_close), "bfloat16": (bf16, assert_close_bf16)}


def case(cupy, rng, decode_slots, chunks, r, k, n, dtype="float16"):
    """A step: decode rows with their slots, prefill chunks as (rows, slot); random pools of
    len(SCALES) adapters of rank r. Returns (reference inputs, kernel inputs)."""
    rounded = DTYPES[dtype][0]
    slots = np.int32(list(decode_slots) + [s for _, s in chunks])
    cu = np.int32(np.cumsum([0] + [rows for rows, _ in chunks]))
    tokens = len(decode_slots) + int(cu[-1])
    x, x_d = rounded(cupy, rng.normal(size=(tokens, k)))
    y, y_d = rounded(cupy, rng.normal(size=(tokens, n)))
    a, a_d = rounded(cupy, rng.normal(size=(len(SCALES), r, k)) / np.sqrt(k))
    b, b_d = rounded(cupy, rng.normal(size=(len(SCALES), n, r)) / np.sqrt(r))
    batch = SimpleNamespace(num_decodes=len(decode_slots), cu_seqlens_q=cu, lora_slots=slots)
    batch_d = SimpleNamespace(num_decodes=len(decode_slots), cu_seqlens_q=cupy.asarray(cu),
                              lora_slots=cupy.asarray(slots))
    return ((y, x, (a, b, SCALES), batch),
            (y_d, x_d, (a_d, b_d, cupy.asarray(SCALES)), batch_d))


def rows_without_adapter(batch):
    chunks = np.concatenate([np.ones(batch.num_decodes, np.int64), np.diff(batch.cu_seqlens_q)])
    return np.repeat(batch.lora_slots, chunks) < 0


@pytest.mark.parametrize("decode_slots, chunks", [
    ([0, -1, 2, 1, 3, 2, -1], []),                              # decode rows alone (BGMV)
    ([], [(5, 1), (20, -1), (37, 0), (1, 3)]),                  # prefill chunks alone (SGMV)
    ([3, 1, -1], [(17, 2), (4, 0), (16, -1), (33, 1)]),         # both in one step
])
@pytest.mark.parametrize("r, k, n", [(3, 37, 45), (5, 64, 24), (16, 136, 200), (48, 72, 9)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_lora(cupy, rng, decode_slots, chunks, r, k, n, dtype):
    ref, dev = case(cupy, rng, decode_slots, chunks, r, k, n, dtype)
    before = cupy.asnumpy(dev[0]).copy()
    want = ops.add_lora(ref[0].copy(), *ref[1:])
    got = lora_kernels.add_lora(*dev)
    assert got is dev[0]  # in place
    DTYPES[dtype][1](cupy, got, want)
    untouched = rows_without_adapter(ref[3])
    np.testing.assert_array_equal(cupy.asnumpy(got)[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_without_adapters_changes_nothing(cupy, rng, dtype):
    _, dev = case(cupy, rng, [-1, -1], [(19, -1), (3, -1)], 5, 40, 24, dtype)
    before = cupy.asnumpy(dev[0]).copy()
    np.testing.assert_array_equal(cupy.asnumpy(lora_kernels.add_lora(*dev)), before)


def test_shapes_that_do_not_match_are_refused(cupy, rng):
    _, (y, x, (a, b, scales), batch) = case(cupy, rng, [0], [], 3, 37, 45)
    with pytest.raises(ValueError, match="add_lora: x"):
        lora_kernels.add_lora(y, x[:, :36], (a, b, scales), batch)
    with pytest.raises(TypeError, match="scales must be float32"):
        lora_kernels.add_lora(y, x, (a, b, scales.astype(cupy.float16)), batch)
    with pytest.raises(TypeError, match="a must be float16, got uint16"):  # bfloat16 A, float16 y
        lora_kernels.add_lora(y, x, (a.view(cupy.uint16), b, scales), batch)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_step_replays_from_a_cuda_graph_with_new_slots(cupy, rng, dtype):
    """Launch shapes come from array shapes: captured once, a replay reads the slots it is
    given then, as a decode graph's static input buffer changes from step to step."""
    ref, (y, x, lora, batch) = case(cupy, rng, [0, -1, 2, 1], [], 5, 64, 40, dtype)
    y0 = cupy.asnumpy(y).copy()
    stream, pool = cupy.cuda.Stream(non_blocking=True), cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        lora_kernels.add_lora(y, x, lora, batch)
        graph = stream.end_capture()
    for slots in ([0, -1, 2, 1], [3, 3, -1, 0]):
        y.set(y0)
        batch.lora_slots.set(np.int32(slots))
        graph.launch()
        cupy.cuda.Device().synchronize()
        want = ops.add_lora(ref[0].copy(), ref[1], ref[2], SimpleNamespace(
            num_decodes=4, cu_seqlens_q=ref[3].cu_seqlens_q, lora_slots=np.int32(slots)))
        DTYPES[dtype][1](cupy, y, want)
