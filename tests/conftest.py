"""Shared fixtures (the real default model, a tiny random model, the dense reference), the
`gpu` marker (gpu-marked tests run only where CuPy sees a CUDA device), the `slow` marker (the
tests `-m "not slow"` leaves out), and parallel workers (pytest-xdist) for a plain run."""
import os
import shutil
import sys
import tempfile

import pytest

from nano import default_model as fetcher
from nano.weights import resolve_model
from reference import DenseLlama, make_random_model


# Workers a plain `pytest` starts where pytest-xdist is installed: one per core, at least two,
# since many tests wait on a subprocess (mpirun, run.py, a server) while the other runs.
WORKERS = int(os.environ.get("NANO_TEST_WORKERS", max(2, os.cpu_count() or 1)))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Runs a whole-suite run (no paths named: README's command, `-m "not slow"`) on WORKERS
    processes, unless the command line chose (-n N, -n 0, -p no:xdist) or pytest-xdist is
    missing (a GPU machine's bare Python). A run of named files stays one process, which
    starts at once. This hook comes before xdist's own, which turns numprocesses into
    workers; an xdist worker runs it too, and must stay one process."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.args_source == pytest.Config.ArgsSource.ARGS
            or config.option.numprocesses is not None or config.option.collectonly or WORKERS < 2):
        return
    config.option.numprocesses = WORKERS
    if config.option.dist == "no":
        config.option.dist = "loadgroup"  # tests marked xdist_group(name) share one worker


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


# What the emulator compiled and launched in the xdist workers, summed here in the controller.
worker_emulators = {"compiled": set(), "launches": {}}


def pytest_sessionfinish(session):
    """An xdist worker hands what its emulator compiled and launched to the controller."""
    emulator = sys.modules.get("cuda_host.emulator")
    if emulator and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["emulator"] = {"compiled": sorted(emulator.compiled),
                                                   "launches": dict(emulator.launches)}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller keeps a finished worker's emulator counts (an xdist hook)."""
    done = getattr(node, "workeroutput", {}).get("emulator")
    if done:
        worker_emulators["compiled"].update(done["compiled"])
        for name, n in done["launches"].items():
            worker_emulators["launches"][name] = worker_emulators["launches"].get(name, 0) + n


def pytest_terminal_summary(terminalreporter):
    """How much of cuda/ ran on the CPU emulator (tests/cuda_host) in this run, in this process
    or in its xdist workers."""
    emulator = sys.modules.get("cuda_host.emulator")
    compiled, launches = set(worker_emulators["compiled"]), dict(worker_emulators["launches"])
    if emulator:
        compiled |= emulator.compiled
        for name, n in emulator.launches.items():
            launches[name] = launches.get(name, 0) + n
    if not launches:
        return
    from cuda_host.emulator import ORDERS
    passed = terminalreporter.stats.get("passed", [])
    cases = sum("[emulator" in r.nodeid for r in passed)
    checks = sum(r.nodeid.startswith("tests/test_cuda_host.py") for r in passed)
    unlaunched = sorted(compiled - set(launches))
    listed = ", ".join(unlaunched[:4]) + (f" and {len(unlaunched) - 4} more" if len(unlaunched) > 4 else "")
    terminalreporter.write_line(
        f"cuda_host emulator: {cases} kernel test cases and {checks} emulator checks passed; "
        f"{sum(launches.values())} launches of {len(launches)} kernels, each in "
        f"{len(ORDERS)} thread orders; compiled but never launched: {listed or 'none'}")
