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


# A worker's resident memory peaks near 7 GB over the whole suite (docs/testing.md): each
# worker a plain run starts needs this much of the memory available when it starts.
WORKER_MEMORY = 10 * 2**30


def default_workers() -> int:
    """Workers for a whole-suite run: one per core, as many as the available memory holds."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 1
    return max(1, min(len(os.sched_getaffinity(0)), available // WORKER_MEMORY))


# Workers a plain `pytest` starts where pytest-xdist is installed; NANO_TEST_WORKERS chooses.
WORKERS = int(os.environ.get("NANO_TEST_WORKERS") or default_workers())

# The mpirun ranks the tests start share the cores with each other and with the other workers:
# a rank that waits in a collective yields its core, as Open MPI does by itself only where it
# sees more ranks than cores. Polling instead took a --tp 2 run of the default model from 10 s
# of CPU to 21 s, and the other worker's tests waited for the core it spun on.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Runs a whole-suite run (no paths named: README's command, `-m "not slow"`) on WORKERS
    processes, unless the command line chose (-n N, -n 0, -p no:xdist) or pytest-xdist is
    missing (a GPU machine's bare Python). A run of named files stays one process, which
    starts at once. This hook comes before xdist's own, which turns numprocesses into
    workers; an xdist worker runs it too, stays one process and keeps the groups if the
    controller chose them (pytest_configure_node sends the choice)."""
    if hasattr(config, "workerinput"):
        config.option.loadgroup = config.workerinput.get("loadgroup", config.option.loadgroup)
        return
    if (not config.pluginmanager.hasplugin("xdist")
            or config.args_source == pytest.Config.ArgsSource.ARGS
            or config.option.numprocesses is not None or config.option.collectonly or WORKERS < 2):
        return
    config.option.numprocesses = WORKERS
    if config.option.dist == "no":
        config.option.dist = "loadgroup"  # tests marked xdist_group(name) share one worker
        # Work goes out in collection order, which pytest_collection_modifyitems makes longest
        # first; xdist's own reorder (the groups with most tests first) would undo that.
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tells a worker whether to keep the groups: an xdist worker reads its options from the
    command line again, where a plain run named none, so it would not see loadgroup chosen above."""
    node.workerinput["loadgroup"] = node.config.option.dist == "loadgroup"


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


# The slow tests, left out by `pytest -m "not slow"` (docs/testing.md): whole files (mpirun
# ranks, the emulated engine, every kernel compiled, the lab's experiments), tests by function
# name (the default model's long runs, servers under load, sanitizer builds), and tests by a
# module fixture that costs a minute (deadline's simulated policy matrices). Kept here, not on
# the tests, so that the list is one place to read and tune; a name here that its file lacks
# stops the run, so a renamed test is not quietly moved into the fast tier.
SLOW_FILES = {"test_tp.py", "test_lora_tp.py", "test_dp.py", "test_disagg.py", "test_stall.py", "test_multihost.py",
              "test_engine_emulated.py", "test_kernels_compile.py", "test_server_speculative.py", "test_lab.py",
              "test_lab_b.py"}
SLOW_TESTS = {
    "test_batch_invariant.py": {"test_the_default_model_int8_batched_and_one_at_a_time_agree",
                                "test_every_schedule_gives_the_same_tokens_and_logits"},
    "test_cuda_host.py": {"test_kernels_under_address_and_undefined_behaviour_sanitizers",
                          "test_sanitizers_catch_a_read_before_the_start", "test_injected_bug_is_caught",
                          "test_checks_pass_unchanged"},
    "test_equivalence.py": {"test_default_model_matches_dense"},
    "test_families.py": {"test_tp2", "test_prefix_cache_hits", "test_batched_with_other_requests_in_both_spellings"},
    "test_kernels.py": {"test_sample_matches_reference", "test_prefill_attention_window", "test_prefill_attention",
                        "test_paged_attention", "test_paged_attention_window"},
    "test_kv_int8.py": {"test_scheduling_features_on_an_int8_pool"},
    "test_server.py": {"test_serving_under_tp2_gives_the_one_rank_tokens",
                       "test_a_few_hundred_concurrent_requests_all_complete",
                       "test_health_stays_fast_while_the_engine_is_saturated"},
    "test_server_abuse.py": {"test_a_signal_ends_open_streams_cleanly_within_the_grace_period"},
    "test_server_api.py": {"test_every_status_the_server_sends_is_documented_and_every_documented_one_is_sent",
                           "test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk",
                           "test_bodies_built_from_the_request_schemas_are_served",
                           "test_the_log_level_flag_sets_what_the_server_logs"},
    "test_server_fields.py": {"test_every_field_is_honoured_or_refused_by_name"},
    "test_server_responses.py": {"test_a_forced_choice_gives_function_calls_whole_and_streamed",
                                 "test_every_field_is_honoured_or_refused_by_name",
                                 "test_a_json_schema_format_answers_json_valid_against_it",
                                 "test_the_stream_is_openais_events_in_order_and_its_text_the_responses"},
    "test_server_tools.py": {"test_a_forced_choice_gets_valid_calls_whole_and_streamed"},
    "test_speculative.py": {"test_default_model_and_a_stop_token_inside_an_accepted_run",
                            "test_sampling_keeps_the_target_distribution", "test_grammars_and_controls_check_the_drafts"},
    "test_stress.py": {"test_stress_invariants"},
    "test_weights.py": {"test_safetensors_equal_gguf_dequantized"},
}
SLOW_FIXTURES = {"policy_matrix", "cpu_shaped_matrix"}


def is_slow(item) -> bool:
    file = item.path.name
    if file in SLOW_FILES or set(item.fixturenames) & SLOW_FIXTURES:
        return True
    names = SLOW_TESTS.get(file, set())
    missing = sorted(n for n in names if not hasattr(item.module, n))
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names tests {file} lacks: {missing}")
    return getattr(item, "originalname", item.name) in names


def shares_a_module_fixture(item) -> bool:
    """Whether the test uses a fixture built once per file (a server, a matrix of simulated
    runs, one rank's tokens): xdist's loadgroup then runs that file's tests on one worker, which
    builds it once, not once on each worker."""
    info = getattr(item, "_fixtureinfo", None)
    return bool(info) and any(d.scope in ("module", "class") for defs in info.name2fixturedefs.values()
                              for d in defs)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the slow tests, and the tests of a file that share a module fixture, before `-m`
    selects and before xdist's loadgroup reads the marks. An xdist worker then orders the run
    longest first, the groups with a slow test and the slow tests, each file's group ahead
    of its single tests, then the rest, so that the workers end together on short tests
    instead of one waiting while the other runs a long test it picked up last. A group's tests
    keep their order, which its shared fixture may rely on."""
    slow = pytest.mark.slow
    slow_groups = set()
    for item in items:
        if isinstance(item, pytest.Function) and is_slow(item):
            item.add_marker(slow)
        if shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
            if "slow" in item.keywords:
                slow_groups.add(item.path.name)
    if hasattr(config, "workerinput"):  # the workers' common order is the order work is sent in
        items.sort(key=lambda item: ("slow" not in item.keywords and item.path.name not in slow_groups,
                                     "xdist_group" not in item.keywords))
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
