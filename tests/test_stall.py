"""A stopped rank, or a step blocked without computing, must not hang the run; a slow step
that computes must not end it. In one process the stepping thread's CPU time judges
(nano/telemetry/watchdog.py); under mpirun every rank's heartbeat, from the first
collective on (nano/telemetry/heartbeat.py). A stall ends the job with one line and exit
status 1, after the server's /health turns 503 and its waiting clients get an error. The
ranks are stopped with SIGSTOP, as a wedged device or a lost host would leave them. And
SIGTERM to mpirun (what Slurm and Kubernetes send) ends the run with one line, a server's
open streams with an error event and [DONE]."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_tp import ROOT, TIMEOUT, have_mpi, mpirun, rank_pid

from nano.telemetry.heartbeat import Monitor
from nano.telemetry.watchdog import Stillness

needs_mpi = pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpirun")
STALL = 6.0  # --stall-timeout of these runs, seconds: above any pause of theirs, even on a busy machine
SILENT = "has sent nothing for 6 s: stopped, wedged or cut off (--stall-timeout)"
HOST = socket.gethostname()  # every rank's here: one machine
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


# ---- the judgements, on a given clock ---------------------------------------------------------
def test_a_silent_rank_is_named_once_by_the_lowest_rank_that_hears_the_others():
    """Four ranks, rank 1 silent from t=0: past the timeout rank 0 alone says so; past twice
    the timeout (rank 0 stuck as well, say) any rank does."""
    monitors = {r: Monitor(r, [p for p in range(4) if p != r], STALL, now=0) for r in (0, 2, 3)}
    for m in monitors.values():
        m.hosts = {1: "node-b"}
    for t in range(1, 16):
        said = {r: m.tick(t, [(p, False) for p in monitors if p != r]) for r, m in monitors.items()}
        if t <= STALL:
            assert set(said.values()) == {None}, t
        elif t <= 2 * STALL:
            assert said == {0: "rank 1 on node-b " + SILENT, 2: None, 3: None}, t
        else:
            assert said[2] == said[3] == "rank 1 on node-b " + SILENT, t


def test_a_rank_that_said_goodbye_is_no_longer_watched():
    m = Monitor(0, [1, 2], STALL, now=0)
    assert m.tick(1, [(2, False), (2, True), (1, False)]) is None
    assert [m.tick(t, [(1, False)]) for t in range(2, 20)] == [None] * 18


def test_a_rank_that_was_itself_stopped_blames_no_one():
    """A gap in its own ticks far past their period is time this rank did not run: its
    peers' silence then is not theirs. A peer that does stop is found afterwards."""
    m = Monitor(0, [1], STALL, now=0)
    assert m.tick(1, [(1, False)]) is None
    assert m.tick(31) is None  # stopped for 30 s, nothing heard yet
    assert m.tick(32, [(1, False)]) is None
    assert [m.tick(t) for t in range(33, 40)] == [None] * 6 + ["rank 1 on a host not yet heard from " + SILENT]


def test_stillness_is_time_without_cpu_not_time_this_process_was_stopped():
    s = Stillness(STALL, now=0)
    assert [s.still(1, 10.0), s.still(2, 10.5)] == [0, 0]   # a step computing
    assert [s.still(3, 10.5), s.still(5, 10.5)] == [1, 3]   # blocked
    assert [s.still(20, 10.5), s.still(21, 10.5)] == [0, 1]  # a 15 s gap: the process was stopped
    assert s.still(22, None) == 0                             # between steps


# ---- one process --------------------------------------------------------------------------------
def test_a_closed_watchdog_lets_its_driver_go():
    """A driver whose steps are over (a stopped server's engine thread) is held by nothing the
    watchdog made: its watching thread ends and on_stall is not kept in the drivers' list."""
    from nano.telemetry import watchdog

    class Driver:
        def on_stall(self, error):
            pass

    driver = Driver()
    freed = weakref.ref(driver)
    before = set(threading.enumerate())
    w = watchdog.Watchdog(0.2, driver.on_stall)
    (watcher,) = set(threading.enumerate()) - before
    w.close()
    watcher.join(timeout=5)
    assert not watcher.is_alive()
    del w, driver
    assert freed() is None and not watchdog.drivers


def test_one_process_a_computing_step_runs_on_a_resumed_one_too_a_blocked_one_ends_it():
    """The watchdog alone, no model: the first step is not judged (on a GPU it compiles);
    a step of twice the timeout's CPU is a slow step, not a stall, even with the process
    stopped in the middle for three times the timeout; a step blocked without CPU ends the
    process (a thread cannot sys.exit it) with one line and exit status 1."""
    timeout = STALL / 4
    code = ("import time; from nano.telemetry.watchdog import Watchdog\n"
            f"w = Watchdog({timeout})\n"
            f"with w.step():\n    time.sleep({1.2 * timeout})\n"
            "with w.step():\n    print('computing', flush=True)\n"
            f"    end = time.thread_time() + {2 * timeout}\n"
            "    while time.thread_time() < end:\n        pass\n"
            "print('slow step done', flush=True)\n"
            "with w.step():\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "computing\n"
        time.sleep(0.3)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3 * timeout)
        proc.send_signal(signal.SIGCONT)
        start = time.monotonic()
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stdout == "slow step done\n", stderr
    assert proc.returncode == 1 and stderr == (f"error: a step has used no CPU for {timeout:g} s (--stall-timeout): "
                                               "the engine is blocked, not computing\n"), stderr
    assert time.monotonic() - start < 2 * timeout + 4 + 5


# ---- under mpirun ---------------------------------------------------------------------------------
def mpi_job(ranks: int, *args: str, stall: float = STALL) -> subprocess.Popen:
    return subprocess.Popen([mpirun(), "-n", str(ranks), "--allow-run-as-root", "--oversubscribe", sys.executable,
                             "run.py", "--stall-timeout", str(stall), *args],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ended_with_one_line(job: subprocess.Popen, within: float, message: str, status: int | None = 1) -> None:
    """The job ends with the one error line and exit status (None: any but 0), no traceback."""
    _, stderr = job.communicate(timeout=within)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}"] and "Traceback" not in stderr, stderr[-3000:]
    # one host: mpirun ends the job itself, and the ranks' watchers (telemetry/launcher.py) stay silent
    assert "on a host it cannot reach" not in stderr, stderr[-3000:]
    assert job.returncode == status if status is not None else job.returncode != 0, stderr[-3000:]


@contextmanager
def stopping(job: subprocess.Popen):
    """The job, and a list for the pids the test SIGSTOPs in it: resumed, and the job
    killed, at the end whatever happened."""
    stopped = []
    try:
        yield stopped
    finally:
        for pid in stopped:
            resume(pid)
        if job.poll() is None:
            job.kill()


def stop_rank(job: subprocess.Popen, rank: int, stopped: list) -> None:
    stopped.append(rank_pid(job.pid, rank))
    os.kill(stopped[-1], signal.SIGSTOP)


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # ended with the job
        pass


def steps(job: subprocess.Popen, metrics: Path, enough) -> None:
    """Wait until the run's metrics file's step lines satisfy enough(lines)."""
    deadline = time.monotonic() + TIMEOUT
    while not (metrics.exists() and enough([json.loads(s) for s in metrics.read_text().splitlines()[:-1]])):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)


def loading_weights(job: subprocess.Popen, rank: int) -> None:
    """Wait until the rank has mapped the model's weights: it is loading them."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        try:
            if "safetensors" in Path(f"/proc/{rank_pid(job.pid, rank)}/maps").read_text():
                return
        except (AssertionError, OSError):  # not started yet
            time.sleep(0.02)


@needs_mpi
def test_a_stopped_rank_under_serve_tp2_turns_health_503_and_ends_the_job():
    pytest.importorskip("fastapi")
    from test_server import free_port, httpx, wait_healthy
    port = free_port()
    job = mpi_job(2, "--serve", "--tp", "2", "--port", str(port), "--kv-cache-memory", "300MB")
    with stopping(job) as stopped:
        url = wait_healthy(job, port, TIMEOUT)
        lines = []

        def read_stream():
            body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    lines.extend(r.iter_lines())
            except httpx.HTTPError:  # the server ends after the error event
                pass
        reader = threading.Thread(target=read_stream)
        reader.start()
        while len(lines) < 4:  # generating: a step is in flight on both ranks most of the time
            time.sleep(0.05)
        stop_rank(job, 1, stopped)
        start = time.monotonic()
        while httpx.get(url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() - start < STALL + 3, "/health still 200"
            time.sleep(0.2)
        reader.join(timeout=15)
        assert any(f"engine failed: rank 1 on {HOST} " + SILENT in line for line in lines), lines[-3:]
        ended_with_one_line(job, STALL + 15, f"rank 1 on {HOST} " + SILENT)


@needs_mpi
@pytest.mark.parametrize("mode,rank,when", [
    (["--tp", "2"], 1, "loading"),
    (["--disagg", "1:1"], 0, "stepping"),
], ids=["tp2 rank 1 loading", "disagg router stepping, resumed"])
def test_a_stopped_rank_is_named_from_the_first_collective_on(tmp_path, mode, rank, when):
    """Stopped while loading its weights (the other rank waits in a start-up collective), or
    the router itself stopped mid-run past the timeout, then resumed: the other rank names
    the stopped one and ends the job, exit status 1; the resumed router blames no one."""
    metrics = tmp_path / "m.jsonl"
    job = mpi_job(2, *mode, "--bench", "--num-seqs", "4", "--input-len", "16", "--output-len", "1000",
                  "--metrics-file", str(metrics))
    with stopping(job) as stopped:
        if when == "loading":
            loading_weights(job, rank)
        else:
            steps(job, metrics, lambda lines: len(lines) >= 3)
        stop_rank(job, rank, stopped)
        if when == "stepping":
            time.sleep(STALL * 1.5)
            resume(stopped[-1])
        ended_with_one_line(job, STALL + 15, f"rank {rank} on {HOST} " + SILENT)


@needs_mpi
def test_tp2_a_step_longer_than_the_timeout_is_no_stall_and_sigterm_ends_the_run_with_one_line(tmp_path):
    """Two 2,000-token prefill steps, each far over a 2 s --stall-timeout: both ranks compute
    and their heartbeats go on. Then SIGTERM to mpirun, which passes it on to the ranks and
    kills them 0.25 s later: one line says so (mpirun no longer passes the ranks' output on
    then: rank 0 writes to mpirun's own stderr), and a non-zero exit status."""
    metrics = tmp_path / "m.jsonl"
    job = mpi_job(2, "--tp", "2", "--bench", "--num-seqs", "2", "--input-len", "2000", "--output-len", "1000",
                  "--max-num-batched-tokens", "2048", "--metrics-file", str(metrics), stall=2)
    try:
        steps(job, metrics, lambda lines: sum(s["step_time"] > 2 for s in lines) >= 2)
        job.send_signal(signal.SIGTERM)
        ended_with_one_line(job, 15, "terminated (SIGTERM)", status=None)
    finally:
        if job.poll() is None:
            job.kill()


@needs_mpi
def test_sigterm_to_mpirun_under_serve_dp2_ends_open_streams_with_an_error_and_done(tiny_model):
    """mpirun kills every rank 0.25 s after passing SIGTERM on, so under mpirun the server
    ends its open streams at once: an error event, then [DONE], never a cut stream."""
    pytest.importorskip("fastapi")
    from test_server import free_port, httpx, wait_healthy
    port = free_port()
    job = mpi_job(2, "--serve", "--dp", "2", "--port", str(port), "--model", str(tiny_model), "--num-blocks", "256")
    try:
        url = wait_healthy(job, port, TIMEOUT)
        # 500: the tiny model's context (512) holds it beside the prompt; more is a 400, as in vLLM
        body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for n, line in enumerate(lines) if n >= 4)
            job.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and "the server is shutting down" in rest[-2], rest[-3:]
        job.communicate(timeout=15)
    finally:
        if job.poll() is None:
            job.kill()
