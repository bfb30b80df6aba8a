"""Shared fixtures (the real default model, a tiny random model, the dense reference) and the
`gpu` marker: gpu-marked tests run only where CuPy sees a CUDA device."""
import shutil
import sys
import tempfile

import pytest

from nano import default_model as fetcher
from nano.weights import resolve_model
from reference import DenseLlama, make_random_model


TEMP = tempfile.gettempdir()  # this process's, fixed now: the fixture below changes TMPDIR


@pytest.fixture(autouse=True)
def own_tmpdir(monkeypatch):
    """Each test's subprocesses get a TMPDIR of their own. Open MPI's mpirun keeps its session in
    $TMPDIR/ompi.<its pid>, which one killed by a test leaves behind; a later mpirun given the
    same pid (pids wrap at 32,768 on these machines, within one run of the suite) then fails to
    start ("The PMIx server's listener thread failed to start"). Short, for Unix socket paths."""
    path = tempfile.mkdtemp(prefix="t", dir=TEMP)
    monkeypatch.setenv("TMPDIR", path)
    yield
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def default_model():
    fetcher.ensure()
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_dense(default_model):
    return DenseLlama(default_model)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_dense(tiny_model):
    return DenseLlama(tiny_model)


def have_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device
        return False


def pytest_collection_modifyitems(config, items):
    if have_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """How much of cuda/ ran on the CPU emulator (tests/cuda_host) in this run."""
    emulator = sys.modules.get("cuda_host.emulator")
    if not emulator or not emulator.launches:
        return
    passed = terminalreporter.stats.get("passed", [])
    cases = sum("[emulator" in r.nodeid for r in passed)
    checks = sum(r.nodeid.startswith("tests/test_cuda_host.py") for r in passed)
    unlaunched = sorted(set(emulator.compiled) - set(emulator.launches))
    listed = ", ".join(unlaunched[:4]) + (f" and {len(unlaunched) - 4} more" if len(unlaunched) > 4 else "")
    terminalreporter.write_line(
        f"cuda_host emulator: {cases} kernel test cases and {checks} emulator checks passed; "
        f"{sum(emulator.launches.values())} launches of {len(emulator.launches)} kernels, each in "
        f"{len(emulator.ORDERS)} thread orders; compiled but never launched: {listed or 'none'}")
