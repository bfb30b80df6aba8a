"""CI check, no GPU needed: every CUDA kernel compiles for sm_90 through NVRTC without
warnings, uses no local memory (no spilled registers, no local arrays), and prefill attention
keeps to its tile plan (shared memory, registers) and runs on tensor cores (HMMA in the SASS
of its cubin, for every instance: each head dim, group, element type and cache type)."""
import re

import pytest

pytest.importorskip("cupy")
import kernel_resources  # noqa: E402  (needs CuPy, not a GPU)
from nano import kernels  # noqa: E402

PREFILL = "prefill_attention.cu"
SM90_REGISTERS = 65536       # per SM, allocated per thread in steps of 8
SM90_SHARED = 228 * 1024     # per SM, of which 1 KB per block is the system's
STATIC_SHARED = 48 * 1024    # per block without an opt-in to dynamic shared memory


@pytest.fixture(scope="module")
def builds():
    """Every file, compiled once with ptxas's report, as CuPy compiles it (-ftz=true)."""
    return kernel_resources.compile_all("sm_90", ("-ftz=true", "--ptxas-options=-v"))


def test_every_kernel_compiles_without_warnings(builds):
    assert set(builds) == set(kernels._TEMPLATES)
    noisy = {name: b.log for name, b in builds.items() if "warning" in b.log.lower()}
    assert not noisy, "NVRTC warnings:\n" + "\n".join(f"--- {n}\n{log}" for n, log in noisy.items())


def test_no_kernel_uses_local_memory(builds):
    """A spilled register or a local array lives in local memory, an uncached round trip
    through L1 and DRAM on every use; none of the kernels is designed to need it."""
    found = {kernel: r.local_bytes for b in builds.values()
             for kernel, r in kernel_resources.resources(b.log).items()}
    assert len(found) >= sum(len(t) for t in kernels._TEMPLATES.values())
    assert {kernel: n for kernel, n in found.items() if n} == {}


def prefill_plan(d: int, int8: bool) -> tuple[int, int]:
    """(threads, static shared bytes) of prefill attention's tile plan at head dim d, as
    cuda/prefill_attention.cu describes it: a warp per 16 query rows (kernels.PREFILL_ROWS),
    KEYS keys per tile, rows of d + 8 16-bit elements in the tile buffer (q, then K and V;
    over q unless Q stays there, at head dim 256), and per warp S (16 x (KEYS + 4) floats) and
    P (16 x (KEYS + 8) 16-bit elements); KEYS block ids and, int8, 2 x KEYS float scales. The
    plan is the same for float16 and bfloat16."""
    rows = kernels.PREFILL_ROWS[d]
    keys = {64: 64, 128: 32, 256: 16}[d]
    q_rows = rows if d == 256 else 0
    tile = max(rows, q_rows + 2 * keys) * (d + 8) * 2
    scratch = rows * ((keys + 4) * 4 + (keys + 8) * 2)
    return 2 * rows, tile + scratch + keys * 4 + (2 * keys * 4 if int8 else 0)


def test_prefill_attention_keeps_its_tile_plan(builds):
    """Each instance's shared memory is its plan's, within the 48 KB of static shared memory,
    and its registers and shared memory leave room for 8 warps per SM (the latency hiding
    the plan counts on: 2 blocks of 4 warps, or 4 of 2 at head dim 256)."""
    found = kernel_resources.resources(builds[PREFILL].log)
    assert set(found) == set(kernels._TEMPLATES[PREFILL])
    for kernel, r in found.items():
        d, _, _, cache = kernel.split("<")[1].rstrip(">").split(", ")
        threads, shared = prefill_plan(int(d), cache == "int8_t")
        assert r.shared_bytes == shared <= STATIC_SHARED, (kernel, r)
        by_registers = SM90_REGISTERS // (-(-r.registers // 8) * 8 * threads)
        by_shared = SM90_SHARED // (r.shared_bytes + 1024)
        assert min(by_registers, by_shared) * threads // 32 >= 8, (kernel, r)


def test_prefill_attention_runs_on_tensor_cores(builds):
    """Every instance multiplies on tensor cores with float32 accumulators: HMMA ... .F32 in
    its SASS (cuobjdump of NVRTC's cubin). A CUDA-core loop (FFMA / HFMA2 only) fails here."""
    assert kernel_resources.cuobjdump(), "no cuobjdump: pip install -r requirements.txt"
    code = kernel_resources.sass(builds[PREFILL].cubin)
    assert set(code) == set(kernels._TEMPLATES[PREFILL])
    assert [kernel for kernel, text in code.items() if not re.search(r"\bHMMA\.[\w.]*F32\b", text)] == []


def test_split_kv_choice():
    sms = 132
    # Enough (sequence, KV head) blocks to fill the GPU: no split.
    assert kernels.decode_partitions(256 * 3, 16384, sms) == (1, 16384)
    # Short contexts are never split.
    assert kernels.decode_partitions(3, 128, sms) == (1, 128)
    # One sequence, long context: whole tiles, at least two per partition, covering it all.
    parts, size = kernels.decode_partitions(3, 16384, sms)
    assert parts > 1 and size % kernels.DECODE_TILE == 0 and size >= 2 * kernels.DECODE_TILE
    assert parts * size >= 16384 > (parts - 1) * size
