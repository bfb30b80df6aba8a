"""The watcher a rank starts before MPI_Abort (nano/telemetry/launcher.py): a launcher still
running after the grace is ended as three Ctrl-C would end prterun, then killed; one that ends
the job itself, or a process that only took its pid, is left alone. The launchers here are
stand-ins: the real one, cut off from another host, is tests/test_multihost.py's."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

from test_tp import ROOT

from nano.telemetry import launcher

# A launcher in Python: ignores (counts) the first SIGTERMs, exits with status 1 on the
# `last`-th, else waits forever, as prterun does on a host it cannot reach.
LAUNCHER = """
import signal, sys, time
terms, last = 0, int(sys.argv[1])
def on_term(*_):
    global terms
    terms += 1
    if terms == last:
        sys.exit(1)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def start(last: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(last)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # its handler is in place
    return proc


def watch(proc: subprocess.Popen, grace: float) -> tuple[bool, list[str], float]:
    said, begin = [], time.monotonic()
    ended = launcher.end_if_stuck(proc.pid, launcher.start_time(proc.pid), grace, said.append)
    return ended, said, time.monotonic() - begin


def test_a_launcher_still_running_after_the_grace_ends_on_the_third_sigterm():
    proc = start(last=3)
    try:
        ended, said, seconds = watch(proc, grace=0.3)
        assert ended and proc.wait(timeout=5) == 1, proc.returncode  # not killed: three SIGTERMs, none lost
        assert 0.3 <= seconds < 2, seconds
        assert len(said) == 1 and "is still waiting 0.3 s after MPI_Abort, on a host it cannot reach" in said[0]
    finally:
        proc.kill()


def test_a_launcher_that_outlasts_the_sigterms_is_killed():
    proc = start(last=0)  # never exits on SIGTERM
    try:
        ended, _, seconds = watch(proc, grace=0.2)
        assert ended and proc.wait(timeout=5) == -signal.SIGKILL
        assert seconds < 0.2 + launcher.KILL_AFTER + 1.5, seconds
    finally:
        proc.kill()


def test_a_launcher_that_ends_the_job_itself_and_a_new_process_on_its_pid_are_left_alone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    ended, said, seconds = watch(proc, grace=5)
    assert not ended and not said and seconds < 3 and proc.wait() == 0
    proc = start(last=1)
    try:
        assert not launcher.end_if_stuck(proc.pid, "1", 0.2, print)  # started at another time: another process
        assert proc.poll() is None
    finally:
        proc.kill()


def test_a_rank_under_a_stuck_prterun_has_it_ended_by_a_watcher_of_its_own(tmp_path):
    """End to end: a shell named prterun (its /proc exe) starts a "rank" that starts the
    watcher and exits, as an aborting rank does, then waits on as if for a host it cannot
    reach: the watcher, in a session of its own, says why on prterun's stderr and ends it (a
    shell's trap runs once for signals that come during one command: it exits on the first)."""
    prterun = tmp_path / "prterun"
    shutil.copy(shutil.which("sh"), prterun)
    rank = "from nano.telemetry import launcher; import os; p = launcher.watch_after_abort(0.3); " \
           "print(os.getsid(p.pid) != os.getsid(0))"
    script = textwrap.dedent(f"""
        trap 'exit 1' TERM
        {sys.executable} -c '{rank}'
        while :; do sleep 0.05; done
    """)
    begin = time.monotonic()
    proc = subprocess.run([str(prterun), "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=20)
    assert proc.stdout == "True\n", proc.stderr  # the watcher's own session: the rank's kill misses it
    assert proc.returncode == 1, proc.stderr
    assert "prterun is still waiting 0.3 s after MPI_Abort, on a host it cannot reach" in proc.stderr
    assert time.monotonic() - begin < 10


def test_no_watcher_without_an_open_mpi_launcher():
    assert launcher.launcher(os.getpid()) is None and launcher.watch_after_abort() is None
