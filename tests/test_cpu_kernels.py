"""Which OpenBLAS kernels nano asks for (nano/cpu_setup.configure): Zen's AVX2 ones on Zen 4
only, where AVX-512 runs at half width; OpenBLAS's own choice everywhere else; a value the
user set is never replaced."""
import os

import pytest

from nano import cpu_setup


@pytest.mark.parametrize("vendor, family, flags, kernels", [
    ("AuthenticAMD", "25", {"avx2", "avx512f"}, "Zen"),  # Zen 4
    ("AuthenticAMD", "26", {"avx2", "avx512f"}, None),   # Zen 5: full-width AVX-512
    ("AuthenticAMD", "25", {"avx2"}, None),              # Zen 3: no AVX-512, OpenBLAS picks Zen itself
    ("GenuineIntel", "6", {"avx2", "avx512f"}, None),
])
def test_kernels_by_cpu(monkeypatch, vendor, family, flags, kernels):
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)  # restored after the test
    monkeypatch.setattr(cpu_setup, "_cpu_info", lambda: {"vendor_id": vendor, "cpu family": family, "flags": " ".join(flags)})
    cpu_setup.configure()
    assert os.environ.get("OPENBLAS_CORETYPE") == kernels


def test_the_users_kernels_are_kept(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "SkylakeX")
    monkeypatch.setattr(cpu_setup, "_cpu_info", lambda: {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "avx512f"})
    cpu_setup.configure()
    assert os.environ["OPENBLAS_CORETYPE"] == "SkylakeX"
