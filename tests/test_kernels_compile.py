"""CI check, no GPU needed: every CUDA kernel compiles for sm_90 through NVRTC without warnings."""
import pytest

pytest.importorskip("cupy")
from kernel_resources import compile_all  # noqa: E402  (needs CuPy, not a GPU)
from nano import kernels  # noqa: E402


def test_every_kernel_compiles_without_warnings():
    logs = compile_all("sm_90")
    assert set(logs) == set(kernels.SOURCES)
    noisy = {name: log for name, log in logs.items() if "warning" in log.lower()}
    assert not noisy, "NVRTC warnings:\n" + "\n".join(f"--- {n}\n{log}" for n, log in noisy.items())


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
