"""A rank that stops, or a step that never ends, must not hang the run: within
--stall-timeout the server's /health answers 503 and waiting clients get an error, then
the job ends with one line and a non-zero exit (nano/telemetry/watchdog.py). The ranks
are stopped with SIGSTOP, as a wedged device or a lost host would leave them."""
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from test_tp import ROOT, TIMEOUT, have_mpi, mpirun, rank_pid

needs_mpi = pytest.mark.skipif(not have_mpi(), reason="needs mpi4py and mpirun")
STALL = 6.0  # --stall-timeout of these runs, seconds: above any step of theirs, even on a busy machine
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def mpi_job(ranks: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([mpirun(), "-n", str(ranks), "--allow-run-as-root", "--oversubscribe", sys.executable,
                             "run.py", "--stall-timeout", str(STALL), *args],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ended_with_one_line(job: subprocess.Popen, within: float, message: str) -> None:
    _, stderr = job.communicate(timeout=within)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert job.returncode != 0 and len(errors) == 1 and message in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]


def test_a_step_that_never_ends_ends_the_process():
    """One process, no MPI: the watchdog alone ends it (a thread cannot sys.exit a process);
    the first step, however long, is not timed."""
    code = ("import time; from nano.telemetry.watchdog import Watchdog\n"
            f"w = Watchdog({STALL / 3})\n"
            "with w.step():\n    time.sleep(1.5 * w.timeout)\n"   # the first, untimed: compiling, say
            "print('first step done', flush=True)\n"
            "with w.step():\n    time.sleep(60)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 1 and "error: a step has run for over 2 s" in proc.stderr, proc.stderr
    assert "first step done" in proc.stdout
    assert time.monotonic() - start < 2.5 * STALL / 3 + 5


@contextmanager
def stopping(job: subprocess.Popen):
    """The job, and a list for the pids the test SIGSTOPs in it: resumed, and the job
    killed, at the end whatever happened."""
    stopped = []
    try:
        yield stopped
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if job.poll() is None:
            job.kill()


def stop_rank(job: subprocess.Popen, rank: int, stopped: list) -> None:
    stopped.append(rank_pid(job.pid, rank))
    os.kill(stopped[-1], signal.SIGSTOP)


def once_stepping(job: subprocess.Popen, metrics) -> None:
    """Wait until the run's metrics file shows steps."""
    deadline = time.monotonic() + TIMEOUT
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)


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
        assert any("a step has run for over 6 s" in line for line in lines), lines[-3:]
        ended_with_one_line(job, STALL + 15, "a step has run for over 6 s (--stall-timeout)")


@needs_mpi
@pytest.mark.parametrize("mode,message", [
    (["--tp", "2"], "a step has run for over 6 s (--stall-timeout)"),
    (["--disagg", "1:1"], "the decode instance on rank 1 has sent nothing for 6 s"),
])
def test_a_stopped_rank_ends_the_offline_run(tmp_path, mode, message):
    """--tp: rank 0 waits in the step's all-reduce; --disagg: the router hears nothing."""
    metrics = tmp_path / "m.jsonl"
    job = mpi_job(2, *mode, "--bench", "--num-seqs", "4", "--input-len", "16", "--output-len", "1000",
                  "--metrics-file", str(metrics))
    with stopping(job) as stopped:
        once_stepping(job, metrics)
        stop_rank(job, 1, stopped)
        ended_with_one_line(job, STALL + 15, message)
