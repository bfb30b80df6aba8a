"""The CUDA host emulator (tests/cuda_host) itself: its CUDA semantics are right, and it
catches the kernel bugs it claims to. Each injected bug is a one-place edit of a copy of
cuda/; the same small checks pass on the unchanged sources (test_checks_pass_unchanged), so
each failure is the bug's doing. tests/test_kernels.py runs the full kernel cases on it."""
import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupy")  # nano/kernels.py imports it
from test_kernels import (assert_close, assert_quantized_close, f16, make_cache, rope_table,  # noqa: E402
                          to_bfloat16, widen)

from cuda_host import cupy_stub, emulator  # noqa: E402
from nano import cublas, kernels, ops  # noqa: E402
from nano.graphs import DecodeGraphs  # noqa: E402
from nano.kv_cache import LayerKV  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

if emulator.unavailable():
    pytest.skip(emulator.unavailable(), allow_module_level=True)


@pytest.fixture
def cp():
    with cupy_stub.emulating(kernels) as stub:
        yield stub


def build(code: str) -> emulator.Module:
    """A test kernel, compiled with the options nano/kernels.py uses."""
    return emulator.Module(code, kernels._options())


# ---------------------------------------------------------------- CUDA semantics

def test_half_conversions_round_to_nearest_even(cp):
    """float -> half -> float through the kernels' intrinsics (single and paired), against
    NumPy (IEEE round to nearest even): every half value, ties, subnormals, overflow, NaN."""
    module = build(textwrap.dedent("""
        #include <cuda_fp16.h>
        extern "C" __global__ void round_trip(const float* x, float* y, unsigned short* bits, int n) {
            const int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i >= n) return;
            const __half h = __float2half(x[i]);
            bits[i] = __half_as_ushort(h);
            y[i] = __half2float(h);
            const float2 pair = __half22float2(__floats2half2_rn(x[i], -x[i]));  // paired versions
            y[n + i] = pair.x;
            y[2 * n + i] = pair.y;
        }"""))
    halves = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves)]
    ties = (finite[:-1].astype(np.float64) + np.diff(finite.astype(np.float64)) / 2).astype(np.float32)
    rng = np.random.default_rng(1)
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.concatenate([halves, ties, rng.normal(0, 1e4, 20000), rng.normal(0, 1e-6, 20000),
                            [7e4, -7e4, 65519.99, 65520.0, np.inf, -np.inf]]).astype(np.float32)
        want = x.astype(np.float16)
    x_d, y_d, bits_d = cp.asarray(x), cp.empty(3 * x.size, cp.float32), cp.empty(x.size, cp.uint16)
    module.get_function("round_trip")(((x.size + 255) // 256,), (256,), (x_d, y_d, bits_d, np.int32(x.size)))
    nan = np.isnan(x)  # CUDA makes every NaN the canonical 0x7fff; NumPy keeps the payload
    np.testing.assert_array_equal(cp.asnumpy(bits_d)[~nan], want.view(np.uint16)[~nan])
    assert (cp.asnumpy(bits_d)[nan] == 0x7FFF).all()
    y = cp.asnumpy(y_d).reshape(3, x.size)
    np.testing.assert_array_equal(y, [want.astype(np.float32), want.astype(np.float32),
                                      -want.astype(np.float32)])


def nearest_bfloat16(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 x by search, not by the carry trick test_kernels.py and the
    emulator use: of the two bfloat16 values around x (its truncation and the next one up in
    magnitude), the nearer in float64, a tie to the even bits; past the largest, infinity."""
    bits = x.view(np.uint32)
    low = (bits >> 16).astype(np.uint32)
    high = low + 1

    def value(b):  # past the largest finite value, 2^128: the step IEEE rounding measures to
        finite = (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return np.where((b & 0x7FFF) == 0x7F80, np.copysign(2.0**128, finite), finite)
    with np.errstate(invalid="ignore"):
        d_low, d_high = np.abs(x - value(low)), np.abs(value(high) - x)
    take_high = (d_high < d_low) | ((d_high == d_low) & (low % 2 == 1))
    return np.where(np.isnan(x), 0x7FFF, np.where(take_high, high, low)).astype(np.uint16)


def test_bfloat16_conversions_round_to_nearest_even(cp):
    """float -> bfloat16 -> float through the kernels' intrinsics (single and paired) and
    test_kernels.to_bfloat16, against nearest_bfloat16: every bfloat16 value, the ties between
    neighbours (even and odd), one float32 step either side of them, subnormals, overflow,
    NaN (canonical 0x7fff), and widening exact."""
    module = build(textwrap.dedent("""
        #include <cuda_bf16.h>
        extern "C" __global__ void round_trip(const float* x, float* y, __nv_bfloat16* bits, int n) {
            const int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i >= n) return;
            const __nv_bfloat16 b = __float2bfloat16_rn(x[i]);
            bits[i] = b;
            y[i] = __bfloat162float(b);
            const float2 pair = __bfloat1622float2(__floats2bfloat162_rn(x[i], -x[i]));
            y[n + i] = pair.x;
            y[2 * n + i] = pair.y;
        }"""))
    every = np.arange(65536, dtype=np.uint32) << 16
    values = every.view(np.float32)
    finite = np.sort(values[np.isfinite(values)].astype(np.float64))
    ties = (finite[:-1] + np.diff(finite) / 2).astype(np.float32)  # exact in float32
    steps = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    rng = np.random.default_rng(2)
    with np.errstate(invalid="ignore"):  # NaN payloads cast
        x = np.concatenate([values, ties, steps, rng.normal(0, 1e4, 20000), rng.normal(0, 1e-39, 2000),
                            [3.39e38, 3.4e38, -3.4e38, 3.4028235e38, np.inf, -np.inf]]).astype(np.float32)
    want = nearest_bfloat16(x)
    assert (want[np.isin(x, ties) & (want % 2 == 1)].size == 0)  # ties went to the even bits
    np.testing.assert_array_equal(to_bfloat16(x), want)
    x_d, y_d, bits_d = cp.asarray(x), cp.empty(3 * x.size, cp.float32), cp.empty(x.size, cp.uint16)
    module.get_function("round_trip")(((x.size + 255) // 256,), (256,), (x_d, y_d, bits_d, np.int32(x.size)))
    np.testing.assert_array_equal(cp.asnumpy(bits_d), want)
    wide = widen(want)
    np.testing.assert_array_equal(cp.asnumpy(y_d).reshape(3, x.size), [wide, wide, -wide])


SHUFFLES = textwrap.dedent("""
    extern "C" __global__ void shuffles(int* out, int width) {
        const int lane = threadIdx.x;
        out[0 * 32 + lane] = __shfl_sync(0xffffffff, lane * 10, 5, width);
        out[1 * 32 + lane] = __shfl_up_sync(0xffffffff, lane * 10, 3, width);
        out[2 * 32 + lane] = __shfl_down_sync(0xffffffff, lane * 10, 3, width);
        out[3 * 32 + lane] = __shfl_xor_sync(0xffffffff, lane * 10, 9, width);
    }""")


@pytest.mark.parametrize("width", [32, 16, 8, 1])
def test_shuffles_follow_ptx_lane_arithmetic(cp, width):
    """Expected values from the CUDA programming guide's definitions, per segment of `width` lanes."""
    out = cp.empty((4, 32), cp.int32)
    build(SHUFFLES).get_function("shuffles")((1,), (32,), (out, np.int32(width)))
    lane = np.arange(32)
    base, pos = lane - lane % width, lane % width
    expect = np.stack([
        base + 5 % width,
        np.where(pos >= 3, lane - 3, lane),
        np.where(pos + 3 < width, lane + 3, lane),
        np.where((lane ^ 9) < base + width, lane ^ 9, lane),
    ]) * 10
    np.testing.assert_array_equal(cp.asnumpy(out), expect)


WMMA = textwrap.dedent("""
    #include <mma.h>
    namespace wmma = nvcuda::wmma;
    // D = A B + C for one 16 x 16 x 16 tile per warp, B read column-major (B^T's rows) or
    // row-major, through shared memory as the attention kernel does; offset misaligns A.
    extern "C" __global__ void mma(const __half* a, const __half* b, const float* c, float* d,
                                   int b_col_major, int offset) {
        __shared__ __align__(32) __half s_a[16 * 24 + 16];
        for (int i = threadIdx.x; i < 256; i += 32) s_a[i / 16 * 24 + i % 16] = a[i];
        __syncwarp();
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
        wmma::load_matrix_sync(fa, s_a + offset, 24);
        wmma::load_matrix_sync(fc, c, 16, wmma::mem_row_major);
        if (b_col_major) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
            wmma::load_matrix_sync(fb, b, 16);
            wmma::mma_sync(fc, fa, fb, fc);
        } else {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
            wmma::load_matrix_sync(fb, b, 16);
            wmma::mma_sync(fc, fa, fb, fc);
        }
        for (int i = 0; i < fc.num_elements; i++) fc.x[i] *= 2.0f;
        wmma::store_matrix_sync(d, fc, 16, wmma::mem_col_major);
    }""")


@pytest.mark.parametrize("element", ["__half", "__nv_bfloat16"])
@pytest.mark.parametrize("b_col_major", [0, 1])
def test_wmma_multiplies_tiles_in_float32(cp, b_col_major, element):
    """The WMMA stand-in (tests/cuda_host/include/mma.h): D = A B + C from half or bfloat16
    tiles with float32 sums, whatever layout B is read in, an element-wise operation on the
    accumulator, D stored column-major; a pointer that is not 32-byte aligned is an error, as
    on a GPU."""
    rng = np.random.default_rng(0)
    if element == "__half":
        a, b = (rng.normal(size=(16, 16)).astype(np.float16) for _ in range(2))
        a_bits, b_bits = a, b
    else:  # bfloat16 bits in uint16 arrays; a and b the values they hold
        a_bits, b_bits = (to_bfloat16(rng.normal(size=(16, 16))) for _ in range(2))
        a, b = widen(a_bits), widen(b_bits)
    c = rng.normal(size=(16, 16)).astype(np.float32)
    d = cp.empty(256, cp.float32)
    kernel = build(WMMA.replace("__half", element)).get_function("mma")
    b_stored = b_bits.T if b_col_major else b_bits
    args = (cp.asarray(a_bits.ravel()), cp.asarray(np.ascontiguousarray(b_stored).ravel()), cp.asarray(c.ravel()), d,
            np.int32(b_col_major))
    kernel((1,), (32,), (*args, np.int32(0)))
    expect = 2 * (a.astype(np.float32) @ b.astype(np.float32) + c)
    np.testing.assert_allclose(cp.asnumpy(d).reshape(16, 16).T, expect, rtol=1e-6, atol=1e-5)
    with pytest.raises(emulator.EmulatorError, match="not 32-byte aligned"):
        kernel((1,), (32,), (*args, np.int32(8)))


DYNAMIC = textwrap.dedent("""
    // Block sum through dynamic shared memory: one float per thread.
    extern "C" __global__ void block_sum(const float* x, float* out, int overrun) {
        extern __shared__ __align__(16) float partial[];
        partial[threadIdx.x + overrun] = x[blockIdx.x * blockDim.x + threadIdx.x];
        __syncthreads();
        for (int half = blockDim.x / 2; half > 0; half /= 2) {
            if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
    }""")


def test_dynamic_shared_memory(cp):
    """extern __shared__ gets the bytes the launch asks for; a write past them is reported."""
    x = np.arange(3 * 128, dtype=np.float32)
    out = cp.empty(3, cp.float32)
    kernel = build(DYNAMIC).get_function("block_sum")
    kernel((3,), (128,), (cp.asarray(x), out, np.int32(0)), shared_mem=128 * 4)
    np.testing.assert_array_equal(cp.asnumpy(out), x.reshape(3, 128).sum(axis=1))
    with pytest.raises(emulator.EmulatorError, match="past the 512 bytes the launch requested"):
        kernel((3,), (128,), (cp.asarray(x), out, np.int32(1)), shared_mem=128 * 4)


def test_argument_types_are_checked(cp):
    """A C parameter is int but the launch passes int64 (CuPy would pass 8 bytes silently)."""
    out = cp.empty((4, 32), cp.int32)
    with pytest.raises(emulator.EmulatorError, match="'width' is i4 in C, got int64"):
        build(SHUFFLES).get_function("shuffles")((1,), (32,), (out, np.int64(32)))
    with pytest.raises(emulator.EmulatorError, match="'out' points to i4 in C, got a float32 array"):
        build(SHUFFLES).get_function("shuffles")((1,), (32,), (cp.empty(128, cp.float32), np.int32(32)))


def test_a_misaligned_array_is_an_error(cp):
    """A GPU faults ("misaligned address") on an 8-byte load from an address that is not a
    multiple of 8: here, seeds viewed as uint64 from 4 bytes into a packed uint32 buffer, as
    a sampler packing its row arrays with the seeds after an odd number of 4-byte rows did."""
    packed = cp.zeros(7, cp.uint32)
    rows = (cp.ones(1, cp.float32), cp.full(1, -1, cp.int32), cp.ones(1, cp.float32), cp.zeros(1, cp.float32))
    with pytest.raises(emulator.EmulatorError, match="'seeds': a uint64 array at an address not a multiple of 8"):
        kernels.sample(cp.zeros((1, 64), cp.float16), *rows, packed[1:3].view(cp.uint64), cp.zeros(1, cp.int32))
    kernels.sample(cp.zeros((1, 64), cp.float16), *rows, packed[2:4].view(cp.uint64), cp.zeros(1, cp.int32))


@pytest.mark.parametrize("cache_type", ["__half", "int8_t"])
def test_launch_bounds_are_checked(cp, cache_type):
    name = f"paged_attention_kernel<64, 3, __half, {cache_type}>"
    with pytest.raises(emulator.EmulatorError, match=f"exceeds {name}'s __launch_bounds__"):
        module = cp.RawModule(code=(REPO / "cuda" / "paged_attention.cu").read_text(),
                              options=kernels._options(), name_expressions=[name])
        cache = cp.empty(8, cp.float16 if cache_type == "__half" else cp.int8)
        args = [cp.empty(8, cp.float16)] + [cp.empty(8, cp.float32)] * 3 + [cp.empty(8, cp.float16)] \
            + [cache] * 2 + [cp.empty(8, cp.float16)] * 2 + [cp.empty(8, cp.int32)] * 3 \
            + [np.int32(1)] * 4 + [np.float32(1)]
        module.get_function(name)((1, 1, 1), (256,), args)


# ---------------------------------------------------------------- floating point as NVRTC does it

MULTIPLY_ADD = textwrap.dedent("""
    extern "C" __global__ void multiply_add(const float* a, const float* b, const float* c, float* out) {
        out[threadIdx.x] = a[threadIdx.x] * b[threadIdx.x] + c[threadIdx.x];
    }""")


@pytest.mark.parametrize("options, fused, flushed", [
    (("-ftz=true",), True, True),     # what CuPy compiles (cp.RawModule adds -ftz=true)
    ((), True, False),                # NVRTC's defaults: --fmad=true, -ftz=false
    (("--fmad=false",), False, False),
])
def test_multiply_adds_fuse_and_subnormals_flush_as_nvrtc_compiles(cp, options, fused, flushed):
    """a * b + c in one rounding (an FMA, as NVRTC contracts it by default): (1 + 2^-12)^2 -
    (1 + 2^-11) is 2^-24 fused, 0 rounded twice. Under -ftz=true a float32 subnormal result
    (1e-30 * 1e-10) is 0, and so is a subnormal operand (1e-40 * 1e10), as on the GPU."""
    one = np.float32(1 + 2**-12)
    a = np.array([one, 1e-30, 1e-40], np.float32)
    b = np.array([one, 1e-10, 1e10], np.float32)
    c = np.array([-(1 + 2**-11), 0, 0], np.float32)
    out = cp.empty(3, cp.float32)
    module = emulator.Module(MULTIPLY_ADD, (*kernels._options(), *options))
    module.get_function("multiply_add")((1,), (3,), (cp.asarray(a), cp.asarray(b), cp.asarray(c), out))
    exact = [2.0**-24, np.float32(1e-30) * np.float32(1e-10), np.float32(1e-40) * np.float32(1e10)]
    np.testing.assert_array_equal(cp.asnumpy(out), [exact[0] if fused else 0.0, *([0.0] * 2 if flushed else exact[1:])])


def test_raw_modules_compile_as_cupy_does(cp):
    """CuPy adds -ftz=true to every RawModule it compiles; so does the stand-in."""
    assert cp.RawModule(code=MULTIPLY_ADD, options=kernels._options()).ftz


# ---------------------------------------------------------------- CuPy's rules

def test_device_arrays_follow_cupys_rules(cp):
    """No implicit device-to-host conversion, no host arrays among device operands, NumPy's
    functions run on the device, `a[...] = host` refused, host arrays refused by kernels."""
    d = cp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    host = np.ones(3, np.float32)
    for implicit in (np.asarray, np.array, lambda x: np.zeros((2, 3), np.float32).__setitem__(Ellipsis, x),
                     lambda x: np.testing.assert_array_equal(x, 0)):
        with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
            implicit(d)
    for mixed in (lambda: d + host, lambda: host * d, lambda: np.add(d, host),
                  lambda: cp.concatenate([d, host[None]]), lambda: np.maximum(d, host, out=d)):
        with pytest.raises(TypeError, match="Unsupported type"):
            mixed()
    for on_device in (np.exp(d), np.concatenate([d, d]), d.max(axis=1), d[cp.asarray(np.array([1, 0]))]):
        assert isinstance(on_device, cp.ndarray)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        d[...] = np.zeros((2, 3), np.float32)
    d[np.array([1])] = np.full((1, 3), 7, np.float32)  # advanced indexing copies host values in, as CuPy does
    np.testing.assert_array_equal(d.get(), [[0, 1, 2], [7, 7, 7]])
    with pytest.raises(emulator.EmulatorError, match="a NumPy \\(host\\) array"):
        build(MULTIPLY_ADD).get_function("multiply_add")((1,), (2,), (d, d, host, d))


# ---------------------------------------------------------------- CUDA graphs

AXPY = textwrap.dedent("""
    extern "C" __global__ void axpy(const float* x, float* y, float a) {
        y[threadIdx.x] = a * x[threadIdx.x] + y[threadIdx.x];
    }""")


def capture(cp, work):
    """work() captured on a stream of its own, its allocations from a pool: (graph, its result)."""
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        result = work()
        return stream.end_capture(), result, pool


def test_graphs_record_launches_and_replay_them_on_the_captured_pointers(cp):
    """Nothing runs while capturing; each replay runs the kernel and the array operation again
    on the same memory, so they see what was written there since."""
    axpy = build(AXPY).get_function("axpy")
    x, y = cp.asarray(np.arange(4, dtype=np.float32)), cp.zeros(4, cp.float32)

    def work():
        axpy((1,), (4,), (x, y, np.float32(2)))
        return y * 10  # a new array from the graph's pool, written by each replay
    graph, z, _ = capture(cp, work)
    assert not y.get().any()
    graph.launch()
    np.testing.assert_array_equal(y.get(), [0, 2, 4, 6])
    np.testing.assert_array_equal(z.get(), [0, 20, 40, 60])
    x.set(np.ones(4, np.float32))
    graph.launch()
    np.testing.assert_array_equal(y.get(), [2, 4, 6, 8])
    np.testing.assert_array_equal(z.get(), [20, 40, 60, 80])


def test_a_replay_that_reaches_freed_memory_is_a_stale_pointer(cp):
    """x is allocated outside the graph's pool and freed after the capture: on a GPU its memory
    goes back to the default pool and the replay reads whatever is there next."""
    axpy = build(AXPY).get_function("axpy")
    x, y = cp.asarray(np.arange(4, dtype=np.float32)), cp.zeros(4, cp.float32)
    graph, _, _ = capture(cp, lambda: axpy((1,), (4,), (x, y, np.float32(2))))
    graph.launch()
    del x
    gc.collect()
    with pytest.raises(emulator.EmulatorError, match="reaches 'x', whose memory was freed after the capture"):
        graph.launch()


def allocate_outside_the_pool(cp, d):
    with cp.cuda.using_allocator():  # the default allocator
        cp.empty(4)


@pytest.mark.parametrize("failure", ["raises", "synchronises"])
def test_a_failing_capture_is_ended_and_its_own_error_reported(cp, monkeypatch, failure):
    """DecodeGraphs' capture: the warm-up pass runs, the captured one raises, or reads a value
    back to the host (which also invalidates the capture, so that ending it raises too); the
    stream leaves capture mode and the forward pass's own error is the one raised."""
    monkeypatch.setitem(sys.modules, "cupy", cp)  # graphs.py imports cupy where it captures

    class Model:
        passes = 0

        def forward(self, batch, kv_cache):
            self.passes += 1
            logits = cp.zeros((1, 8), cp.float16)
            if self.passes == 2 and failure == "raises":
                raise ValueError("the captured pass failed")
            if self.passes == 2:
                logits.get()
            return logits
    graphs = DecodeGraphs(Model(), None, max_num_seqs=1, max_blocks=2)
    one = np.int32([1])
    error = ValueError if failure == "raises" else cp.cuda.runtime.CUDARuntimeError
    with pytest.raises(error, match="captured pass failed|cudaErrorStreamCaptureUnsupported"):
        graphs.prepare(one, one - 1, one - 1, one, np.int32([[0]]), one - 2)
    assert not graphs.stream.is_capturing() and not graphs.captured


REFUSED_WHILE_CAPTURING = {
    ".get()": lambda cp, d: d.get(),
    ".set()": lambda cp, d: d.set(np.zeros(4, np.float32)),
    "int()": lambda cp, d: int(d[0]),
    "a host-to-device copy": lambda cp, d: cp.asarray(np.zeros(4, np.float32)),
    "stream.synchronize()": lambda cp, d: cp.cuda.get_current_stream().synchronize(),
    "Device().synchronize()": lambda cp, d: cp.cuda.Device().synchronize(),
    "an allocation outside the pool": allocate_outside_the_pool,
}


@pytest.mark.parametrize("what", REFUSED_WHILE_CAPTURING)
def test_capture_refuses_host_synchronisation_and_foreign_allocations(cp, what):
    """Each is refused when it happens, and the capture is invalidated (end_capture raises)."""
    d = cp.zeros(4, cp.float32)
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorStreamCaptureUnsupported"):
            REFUSED_WHILE_CAPTURING[what](cp, d)
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            stream.end_capture()


# ---------------------------------------------------------------- the cuBLAS stand-in

def gemm(lib, handle, transa, transb, m, n, k, a, lda, b, ldb, c, ldc, alpha=1.0, beta=0.0, atype=cublas.R_16F):
    return lib.cublasGemmEx(handle.ptr, transa, transb, m, n, k, ctypes.byref(ctypes.c_float(alpha)),
                            a.data.ptr, atype, lda, b.data.ptr, cublas.R_16F, ldb,
                            ctypes.byref(ctypes.c_float(beta)), c.data.ptr, cublas.R_16F, ldc,
                            cublas.COMPUTE_32F, cublas.GEMM_DEFAULT)


def column_major(cp, rng, rows, cols, ld):
    """A (rows x cols) float16 matrix stored column-major with leading dimension ld: the device
    array (cols, ld), and the matrix as float32."""
    stored = rng.normal(size=(cols, ld)).astype(np.float16)
    return cp.asarray(stored), stored[:, :rows].T.astype(np.float32)


@pytest.mark.parametrize("transa, transb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_cublas_standin_computes_cublas_gemm(cp, transa, transb):
    """C = alpha op(A) op(B) + beta C, column-major, each operand with padding past its rows
    (a leading dimension larger than needed), against NumPy; the padding is left alone."""
    lib, handle, rng = cublas._library(), cublas.handle(0), np.random.default_rng(0)
    m, n, k = 5, 7, 9
    a_rows, a_cols = (m, k) if transa == cublas.OP_N else (k, m)
    b_rows, b_cols = (k, n) if transb == cublas.OP_N else (n, k)
    a, a_host = column_major(cp, rng, a_rows, a_cols, a_rows + 3)
    b, b_host = column_major(cp, rng, b_rows, b_cols, b_rows + 2)
    c, c_host = column_major(cp, rng, m, n, m + 1)
    before = c.get()
    op = lambda x, t: x.T if t == cublas.OP_T else x  # noqa: E731
    assert gemm(lib, handle, transa, transb, m, n, k, a, a_rows + 3, b, b_rows + 2, c, m + 1, 1.5, 0.5) == 0
    want = 1.5 * op(a_host, transa) @ op(b_host, transb) + 0.5 * c_host
    got = c.get()
    np.testing.assert_allclose(got[:, :m].T.astype(np.float32), want, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(got[:, m:], before[:, m:])


def test_cublas_standin_checks_arguments_as_cublas_does(cp):
    """cuBLAS's status codes: a leading dimension below the rows (INVALID_VALUE 7), a type it
    does not compute (NOT_SUPPORTED 15); and the stand-in's own: an operand that does not fit
    in its device array (EXECUTION_FAILED 13, the reason in gemm_errors)."""
    lib, handle, rng = cublas._library(), cublas.handle(0), np.random.default_rng(0)
    a, _ = column_major(cp, rng, 8, 8, 8)
    assert gemm(lib, handle, cublas.OP_N, cublas.OP_N, 8, 8, 8, a, 7, a, 8, a, 8) == 7
    assert gemm(lib, handle, cublas.OP_T, cublas.OP_N, 8, 8, 8, a, 8, a, 8, a, 8, atype=0) == 15
    assert gemm(lib, handle, cublas.OP_N, cublas.OP_N, 8, 8, 8, a, 8, a, 9, a, 8) == 13
    assert "operand B (142 bytes" in cp.gemm_errors[-1] and "not inside one device allocation" in cp.gemm_errors[-1]


def test_a_gemm_past_its_operands_is_an_error_not_a_crash(cp):
    """nano/cublas.py's linear into an output one row short: the stand-in refuses it, and
    nano raises cuBLAS's status."""
    x, w = (cp.asarray(np.ones(shape, np.float16)) for shape in ((4, 64), (8, 64)))
    with pytest.raises(RuntimeError, match="cublasGemmEx failed: cuBLAS status 13"):
        cublas.handle(0).linear(x, w, cp.empty((3, 8), cp.float16))
    assert "operand C" in cp.gemm_errors[-1]


def test_the_toolkit_headers_not_found_is_a_clear_error(cp, monkeypatch):
    """nano/kernels.py looks for cuda_fp16.h in the CUDA toolkit, then the nvidia wheels."""
    monkeypatch.setitem(sys.modules, "nvidia", None)
    with pytest.raises(RuntimeError, match="cuda_fp16.h not found"):
        kernels._options.__wrapped__()


def test_cublas_gemms_are_captured_with_a_workspace_of_ours(cp):
    """A GEMM on a capturing stream is recorded and runs on replay; without a workspace set
    after cublasSetStream_v2 it is refused (cuBLAS would cudaMalloc one during the capture)."""
    lib, handle, rng = cublas._library(), cublas.handle(0), np.random.default_rng(0)
    a, a_host = column_major(cp, rng, 4, 4, 4)
    c = cp.zeros((4, 4), cp.float16)

    def work(workspace):
        lib.cublasSetStream_v2(handle.ptr, cp.cuda.get_current_stream().ptr)
        if workspace:
            lib.cublasSetWorkspace_v2(handle.ptr, handle.workspace.ptr, cublas.WORKSPACE_BYTES)
        return gemm(lib, handle, cublas.OP_N, cublas.OP_N, 4, 4, 4, a, 4, a, 4, c, 4)
    _, status, _ = capture(cp, lambda: work(False))
    assert status == 13 and "own workspace" in cp.gemm_errors[-1]
    graph, status, _ = capture(cp, lambda: work(True))
    assert status == 0 and not c.get().any()
    graph.launch()
    np.testing.assert_allclose(c.get().T.astype(np.float32), a_host @ a_host, rtol=2e-3, atol=2e-3)
    handle.stream = None  # the handle's next GEMM sets its stream again


def declared_kinds(text: str, function: str) -> str:
    """A function's parameters in a C header, as the kinds ctypes passes: p a pointer, z a
    size_t, i an int or an enum (4 bytes)."""
    params = re.search(rf"cublasStatus_t CUBLASWINAPI {function}\(([^)]*)\);", text).group(1).split(",")
    return "".join("p" if "*" in p or p.split()[0] in ("cublasHandle_t", "cudaStream_t")
                   else "z" if p.split()[0] == "size_t" else "i" for p in params)


def test_nano_cublas_agrees_with_the_published_header(cp):
    """nano/cublas.py's ctypes prototypes (the kind of each argument, in order) and enum values
    against cublas_api.h and library_types.h, as the nvidia-cublas wheel installs them."""
    lib = cublas._library()
    header = emulator.cublas_header()
    text = header.read_text() + (header.parent / "library_types.h").read_text()

    def kind(t):
        return "p" if issubclass(t, ctypes.c_void_p | ctypes._Pointer) else {ctypes.c_int: "i", ctypes.c_size_t: "z"}[t]
    for name in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasGemmEx"):
        assert "".join(map(kind, getattr(lib, name).argtypes)) == declared_kinds(text, name), name
    for constant, value in [("CUBLAS_OP_N", cublas.OP_N), ("CUBLAS_OP_T", cublas.OP_T), ("CUDA_R_16F", cublas.R_16F),
                            ("CUDA_R_16BF", cublas.R_16BF),
                            ("CUBLAS_COMPUTE_32F", cublas.COMPUTE_32F), ("CUBLAS_GEMM_DEFAULT", cublas.GEMM_DEFAULT)]:
        assert re.search(rf"\b{constant}\s*=\s*{value}\s*,", text), constant


# ---------------------------------------------------------------- injected bugs

def check_paged(cp, rng, dtype="float16"):
    """Decode attention without split (many sequences would be slow; 5 odd lengths) and with
    split-KV (one sequence of 300 tokens: 3 partitions on 132 SMs)."""
    for context_lens in ([1, 17, 64, 100, 33], [300]):
        (cache, tables), (cache_d, tables_d) = make_cache(cp, rng, context_lens, 3, 64, 16, dtype)
        q, q_d = f16(cp, rng.normal(size=(len(context_lens), 9, 64)))
        lens = np.array(context_lens, np.int32)
        got = kernels.paged_attention(q_d, cache_d, tables_d, cp.asarray(lens), 0.125)
        assert_close(cp, got, ops.paged_attention(q, cache, tables, lens, 0.125))


def check_prefill(cp, rng, dtype="float16"):
    chunks = [(37, 37), (50, 300), (1, 90)]
    (cache, tables), (cache_d, tables_d) = make_cache(cp, rng, [c for _, c in chunks], 3, 64, 16, dtype)
    cu = np.concatenate([[0], np.cumsum([n for n, _ in chunks])]).astype(np.int32)
    q, q_d = f16(cp, rng.normal(size=(int(cu[-1]), 9, 64)))
    lens = np.array([c for _, c in chunks], np.int32)
    got = kernels.prefill_attention(q_d, cache_d, cp.asarray(cu), tables_d, cp.asarray(lens), 0.125)
    assert_close(cp, got, ops.prefill_attention(q, cache, cu, tables, lens, 0.125))


def check_layers(cp, rng):
    x, x_d = f16(cp, rng.normal(size=(5, 576)))
    w, w_d = f16(cp, rng.uniform(0.5, 1.5, size=576))
    assert_close(cp, kernels.rms_norm(x_d, w_d, 1e-5), ops.rms_norm(x, w, 1e-5))
    gate_up, gate_up_d = f16(cp, rng.normal(size=(3, 2 * 72)))
    assert_close(cp, kernels.silu_mul(gate_up_d), ops.silu_mul(gate_up))
    gate_up, gate_up_d = f16(cp, rng.normal(size=(5, 2 * 72)))
    assert_close(cp, kernels.gelu_tanh_mul(gate_up_d), ops.gelu_tanh_mul(gate_up))


def check_sample(cp, rng):
    logits = (3 * rng.normal(size=(3, 1000))).astype(np.float16)
    args = (np.full(3, 0.8, np.float32), np.int32([40, 40, -1]), np.float32([0.9, 0.9, 1.0]),
            np.float32([-np.inf, np.log(0.3), np.log(0.1)]), np.array([1, 2, 3], np.uint64),
            np.array([0, 5, 9], np.int32))
    got = cp.asnumpy(kernels.sample(cp.asarray(logits), *map(cp.asarray, args)))
    np.testing.assert_array_equal(got, ops.sample(logits.astype(np.float32), *args))


def check_edit_and_mask_logits(cp, rng):
    """The logits processors' two ops on a poisoned copy of odd-sized logits: the listed
    (row, token) edits and the masked tokens change, nothing else."""
    vocab = 1001  # not a multiple of 32 or 256: the last mask word and block are partial
    logits = (3 * rng.normal(size=(4, vocab))).astype(np.float16)
    rows = np.int32([0, 0, 2, 3, 3])
    tokens = np.int32([5, 1000, 7, 0, 999])
    biases = np.float32([0.0, 3.0, -2.5, 0.0, 1.0])
    penalties = np.float32([1.3, 2.0, 0.8, 1.0, 1.5])
    shifts = np.float32([0.5, -1.0, 0.0, -np.inf, 2.0])
    want = ops.edit_logits(logits.astype(np.float32), rows, tokens, biases, penalties, shifts)
    got = kernels.edit_logits(cp.asarray(logits), *map(cp.asarray, (rows, tokens, biases, penalties, shifts)))
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float32), want, rtol=2e-3, atol=2e-3)
    masks = rng.integers(-2**31, 2**31, size=(2, (vocab + 31) // 32)).astype(np.int32)
    want = ops.mask_logits(logits.astype(np.float32), np.int32([3, 1]), masks)
    got = kernels.mask_logits(cp.asarray(logits), cp.asarray(np.int32([3, 1])), cp.asarray(masks))
    np.testing.assert_array_equal(cp.asnumpy(got).astype(np.float32), want.astype(np.float16).astype(np.float32))


def check_rope_int8(cp, rng):
    """Quantizing cache writes with the Hadamard key rotation: 5 tokens (one skipped), 3 KV
    heads of 64."""
    tokens, nq, nkv, d, block_size = 5, 9, 3, 64, 16
    qkv, qkv_d = f16(cp, rng.normal(size=(tokens, nq + 2 * nkv, d)))
    slots = np.array([3, -1, 17, 40, 8], np.int32)
    positions = rng.integers(0, 64, size=tokens).astype(np.int32)
    shape = (4, nkv, block_size, d)
    ref = LayerKV(np.zeros(shape, np.int8), np.zeros(shape, np.int8), np.zeros(shape[:3], np.float16),
                  np.zeros(shape[:3], np.float16), True)
    dev = LayerKV(*(cp.asarray(a) for a in (ref.k, ref.v, ref.k_scale, ref.v_scale)), True)
    split = (lambda a: (a[:, :nq], a[:, nq:nq + nkv], a[:, nq + nkv:]))
    cos_sin = rope_table(d, 64)
    got = kernels.rope_store_kvcache(*split(qkv_d), cp.asarray(positions), cp.asarray(cos_sin), dev, cp.asarray(slots))
    assert_close(cp, got, ops.rope_store_kvcache(*split(qkv), positions, cos_sin, ref, slots))
    assert_quantized_close(cp, dev.k, dev.k_scale, ref.k, ref.k_scale)
    assert_quantized_close(cp, dev.v, dev.v_scale, ref.v, ref.v_scale)


CHECKS = {"paged": check_paged, "prefill": check_prefill, "layers": check_layers, "sample": check_sample,
          "logits": check_edit_and_mask_logits,
          "paged_int8": lambda cp, rng: check_paged(cp, rng, "int8"),
          "prefill_int8": lambda cp, rng: check_prefill(cp, rng, "int8"), "rope_int8": check_rope_int8}

# (what, file, text, replacement, check that runs it, what the emulator must say; None: a
# wrong result is enough). common.cuh's helpers run inside the attention and layer kernels.
BUGS = [
    ("tile bound off by one", "common.cuh",
     "(int)threadIdx.x < rows && logical < max_blocks", "(int)threadIdx.x <= rows && logical < max_blocks",
     "paged", None),
    ("missing __syncthreads", "common.cuh",
     "    }\n    __syncthreads();\n    const int block_size", "    }\n    const int block_size",
     "paged", "differs between thread orders|invalid memory access"),
    ("wrong shuffle width", "common.cuh",
     "__shfl_xor_sync(0xffffffff, value, o)", "__shfl_xor_sync(0xffffffff, value, o, 16)", "paged", None),
    ("wrong block-table index", "common.cuh", "table[logical]", "table[logical + 1]", "prefill", None),
    ("dropped causal mask", "prefill_attention.cu",
     "key <= last_visible && key > last_visible - window", "key > last_visible - window", "prefill", None),
    ("P tile read at the wrong key index", "prefill_attention.cu", "&p_tile[k * 16]", "&p_tile[0]",
     "prefill", None),
    ("softmax sum not rescaled", "prefill_attention.cu", "row_sum = row_sum * alpha + sum;",
     "row_sum = row_sum + sum;", "prefill", None),
    ("alpha read before the pair wrote it", "prefill_attention.cu",
     "= alpha;  // alpha's row\n        __syncwarp();", "= alpha;  // alpha's row\n", "prefill",
     "differs between thread orders"),
    ("uninitialised shared memory", "paged_attention.cu", "        s_sum[threadIdx.x] = 0.0f;\n", "",
     "paged", "differs between thread orders"),
    ("barrier inside a branch", "common.cuh",
     "if (lane == 0) shared[warp] = value;\n    __syncthreads();",
     "if (lane == 0) {\n        shared[warp] = value;\n        __syncthreads();\n    }",
     "layers", "deadlock|divergent"),
    ("shuffle skipped by half a warp", "paged_attention.cu",
     "sum = warp_reduce(sum, Sum());", "if (lane < 16) sum = warp_reduce(sum, Sum());",
     "paged", "different warp operations"),
    ("shuffle mask leaves out the caller", "sampling.cu",
     "const float v = __shfl_xor_sync(0xffffffff, best, o);",
     "const float v = __shfl_xor_sync(0x0000ffff, best, o);", "sample", "leaves out its own lane"),
    ("mask bits read from the wrong end of their word", "sampling.cu", ">> (t % 32)", ">> (31 - t % 32)",
     "logits", None),
    ("read past the end of an input", "layers.cu", "if (i8 >= n8) return;", "if (i8 > n8) return;",
     "layers", "past the end of argument 'gate_up'"),
    ("GELU constant with a zero too many", "layers.cu", "0.044715f", "0.0044715f", "layers", None),
    ("int8 split sums added without a barrier", "decode_paths.cuh",
     "            __syncthreads();\n        }\n        if (mine == SPLITS - 1) {",
     "        }\n        if (mine == SPLITS - 1) {", "paged_int8", "differs between thread orders"),
    ("int8 scale over half a head", "cache.cu", "for (int o = 1; o < pieces; o <<= 1) m = ",
     "for (int o = 1; o < pieces / 2; o <<= 1) m = ", "rope_int8", None),
    ("rotation butterfly with the wrong lane", "cache.cu",
     "const float o1 = __shfl_xor_sync(0xffffffff, r1[j], o);",
     "const float o1 = __shfl_xor_sync(0xffffffff, r1[j], o ^ 1);", "rope_int8", None),
]


def attention_instances(shapes: set) -> dict:
    """nano/kernels.py's template instances with only the attention kernels of the given
    (head dim, group) shapes, both cache types: a build for tests that launch no others
    compiles a few of the 48 instances an element type has of each attention source."""
    return {name: [e for e in exprs if "attention_kernel" not in e or any(f"<{d}, {g}," in e for d, g in shapes)]
            for name, exprs in kernels._TEMPLATES.items()}


@pytest.fixture
def cuda_copy(tmp_path, monkeypatch):
    """A copy of cuda/ that nano/kernels.py compiles from; returns a function that edits it."""
    shutil.copytree(REPO / "cuda", tmp_path / "cuda")
    monkeypatch.setattr(kernels, "CUDA_DIR", tmp_path / "cuda")
    # The copy is built afresh for each test: only the instances the checks launch (float16;
    # attention at head dim 64, group 3, both cache types), not all of them.
    monkeypatch.setattr(kernels, "_TEMPLATES", {name: [e for e in exprs if "bfloat16" not in e]
                                                for name, exprs in attention_instances({(64, 3)}).items()})

    def edit(name, text, replacement):
        path = tmp_path / "cuda" / name
        source = path.read_text()
        assert source.count(text) == 1, f"the bug's anchor text is not unique in {name}: {text!r}"
        path.write_text(source.replace(text, replacement))
    return edit


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_checks_pass_unchanged(cuda_copy, cp, name):
    CHECKS[name](cp, np.random.default_rng(0))


def test_a_copy_of_the_sources_reuses_their_build(cuda_copy, monkeypatch):
    """A build's key is the text that goes into it, not the folder it was read from: an
    unchanged copy of cuda/ loads the library the same sources built, so that each injected
    bug builds only the modules its edit changes."""
    def library():
        with cupy_stub.emulating(kernels):
            return kernels._module("layers.cu", "__half")._lib._name
    copied = library()
    monkeypatch.setattr(kernels, "CUDA_DIR", REPO / "cuda")
    assert library() == copied


@pytest.mark.parametrize("what, name, text, replacement, check, message", BUGS, ids=[b[0] for b in BUGS])
def test_injected_bug_is_caught(cuda_copy, what, name, text, replacement, check, message):
    cuda_copy(name, text, replacement)
    with cupy_stub.emulating(kernels) as cp:  # after the edit: compiles the edited copy
        with pytest.raises((emulator.EmulatorError, AssertionError)) as caught:
            CHECKS[check](cp, np.random.default_rng(0))
    if message:
        assert caught.type is emulator.EmulatorError, caught.value
        assert caught.match(message)


# ---------------------------------------------------------------- sanitizers

def sanitizer_env() -> dict:
    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.skip("g++ has no AddressSanitizer runtime (libasan)")
    return {**os.environ, "LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0",
            "UBSAN_OPTIONS": "print_stacktrace=1", "NANO_CUDA_HOST_SANITIZE": "1",
            "NANO_CUDA_HOST_ORDERS": "0", "PYTHONPATH": str(REPO)}


# One case of each kernel family and launch shape, small enough for ASan's slowdown, and the
# attention instances those cases launch (head dim, group): the build compiles only these.
SANITIZED = ("emulator and (embedding or rms_norm or gated_mul or rope or swap or greedy"
             " or (sample_matches and 1000 and 0.6) or (paged_attention and 9-3-64)"
             " or (prefill_attention and 12-4-128) or int8_underflowing_tile or (edit_and_mask and 1001))")
SANITIZED_ATTENTION = {(64, 3), (128, 3), (64, 4), (128, 4), (256, 4)}


def test_kernels_under_address_and_undefined_behaviour_sanitizers():
    """tests/test_kernels.py's emulated cases again (a smaller set), built with
    -fsanitize=address,undefined,float-cast-overflow: out-of-bounds on either side of a buffer,
    misaligned vector loads, integer overflow, shifts, floats (inf, NaN) converted to int. One
    thread order: the plain runs cover the orders; -s, so that a report (it ends the process)
    reaches stderr. ASan's build of all 48 float16 instances of an attention source took minutes; a
    launch of an instance left out would fail the run."""
    args = ["-q", "-s", "-p", "no:cacheprovider", str(REPO / "tests" / "test_kernels.py"), "-k", SANITIZED]
    script = (f"import sys, pytest; from nano import kernels; "
              f"kernels._TEMPLATES = {attention_instances(SANITIZED_ATTENTION)!r}; sys.exit(pytest.main({args!r}))")
    done = subprocess.run([sys.executable, "-c", script],
                          env=sanitizer_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    print(done.stdout.splitlines()[-1] if done.stdout else "")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


def test_sanitizers_catch_a_read_before_the_start(tmp_path):
    """The guard page only sits after a buffer; in sanitizer runs the bytes before it are
    poisoned too. Bug: gather_blocks reads block - 1, i.e. before the pool for block 0."""
    shutil.copytree(REPO / "cuda", tmp_path / "cuda")
    cache = tmp_path / "cuda" / "cache.cu"
    text = "in + (lk * num_blocks + block) * chunk"
    assert cache.read_text().count(text) == 1
    cache.write_text(cache.read_text().replace(text, "in + (lk * num_blocks + block - 1) * chunk"))
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO / 'tests')!r})
        from pathlib import Path
        import numpy as np
        from cuda_host import cupy_stub
        from nano import kernels
        kernels.CUDA_DIR = Path({str(tmp_path / 'cuda')!r})
        with cupy_stub.emulating(kernels) as cp:
            kv = cp.asarray(np.ones((1, 2, 4, 1, 16, 64), np.float16))
            kernels.gather_blocks(kv, cp.asarray(np.array([0, 2], np.int32)))
        print("no error")""")
    done = subprocess.run([sys.executable, "-c", script], env=sanitizer_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "no error" not in done.stdout
    assert "AddressSanitizer: use-after-poison" in done.stderr, done.stderr[-3000:]
    assert "in void gather_blocks<uint4>(" in done.stderr  # the report points at the kernel's source line
