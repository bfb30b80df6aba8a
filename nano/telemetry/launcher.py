"""Open MPI's launcher as a rank sees it on its own host: where the rank's last line reaches
the user, and the launcher's end after the rank has aborted the job.

MPI_Abort asks mpirun (prterun) to end the job: it kills the ranks of its own host, orders
every daemon (prted) to kill theirs, and waits until each has done so. A daemon on a host
cut off never answers, and PRRTE sets that wait no limit: mpirun, and the user's shell with
it, would wait until TCP gives up on the connection (net.ipv4.tcp_retries2: a quarter of an
hour) or the link returns. TCP keepalives do not end it sooner, since they probe only an idle
connection, and the order to the lost daemon is data still waiting for its acknowledgement.
The daemon on the far side of the cut waits the same way for mpirun.

So a rank about to abort first starts a watcher (this file run as a program) in a session of
its own, which the launcher's kill of the rank and its process group does not reach. If the
launcher that started the rank is still running GRACE seconds later, the watcher says why on
the launcher's stderr and ends it as three Ctrl-C would: prterun's third SIGTERM kills its
ranks, removes its session directory and exits with status 1; prted ends on its first. A
launcher still there a second later is killed. Where the launcher ends the job itself, as it
does when every host answers, the watcher sees it go and does nothing. Only this rank's host's
processes are read (its /proc): no rank needs another host's.

Run as a program: launcher.py PID START GRACE (START: the launcher's start time, field 22 of
/proc/PID/stat, so that a process given the pid later is left alone).
"""
import os
import signal
import subprocess
import sys
import time

LAUNCHERS = ("prterun", "prted")  # Open MPI 5's mpirun and its daemon on each host
GRACE = 3.0                        # seconds the launcher gets to end the job after MPI_Abort
SIGTERMS = 3                       # prterun ends forcibly on its third SIGTERM, SIGINT or SIGHUP
KILL_AFTER = 1.0                   # seconds a SIGTERM may stay unhandled, or the launcher
                                   # take to end after the last, before SIGKILL


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (field 3, at index 0), or None once the
    process has ended or is a zombie (ended, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields


def start_time(pid: int) -> str | None:
    fields = stat(pid)
    return fields[19] if fields else None  # field 22: clock ticks after boot


def launcher(pid: int) -> int | None:
    """pid's parent, if it is Open MPI's launcher (prterun or prted)."""
    fields = stat(pid)
    parent = int(fields[1]) if fields else 0
    try:
        return parent if os.path.basename(os.readlink(f"/proc/{parent}/exe")) in LAUNCHERS else None
    except OSError:  # no parent left, or not ours to read
        return None


def launcher_stderr() -> int:
    """Where a rank's last line reaches the user: under Open MPI's mpirun, which stops passing
    on the ranks' output the moment it gets a signal, and cannot pass on those of a host cut off
    from it, the stderr of the launcher that started this rank (prterun, which mpirun is, or on
    another host the daemon prted, whose stderr is its ssh's). A prted that went into the
    background has its stderr on /dev/null: the prted that started it has the ssh's. Else
    this process's own stderr."""
    pid = launcher(os.getpid())
    try:
        while pid:
            if os.readlink(f"/proc/{pid}/fd/2") != os.devnull:
                return os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_APPEND)
            pid = launcher(pid)
    except OSError:  # its stderr out of reach
        pass
    return sys.stderr.fileno()


def watch_after_abort(grace: float = GRACE) -> subprocess.Popen | None:
    """Start the watcher over this rank's launcher, about to be asked to abort the job; None
    where no Open MPI launcher started this rank (a single process, Slurm's srun)."""
    pid = launcher(os.getpid())
    start = start_time(pid) if pid else None
    if start is None:
        return None
    # Never this rank's own stderr: the launcher counts the rank ended only once every copy
    # of its output pipes is closed.
    stderr = launcher_stderr()
    try:
        return subprocess.Popen([sys.executable, "-I", __file__, str(pid), start, str(grace)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                                stderr=subprocess.DEVNULL if stderr == sys.stderr.fileno() else stderr)
    finally:
        if stderr != sys.stderr.fileno():
            os.close(stderr)


def pending(pid: int, sig: int) -> bool:
    """Whether sig has been sent to pid and not yet handled (/proc/PID/status's masks)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except OSError:  # ended
        return False
    return any(mask >> (sig - 1) & 1 for mask in masks)


def wait(condition, seconds: float) -> bool:
    """Whether condition() comes true within seconds."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def end_if_stuck(pid: int, start: str, grace: float, say=print) -> bool:
    """Wait up to grace seconds for the launcher pid (started at start) to end; if it has not,
    say so, end it, and return True."""
    def gone() -> bool:
        return start_time(pid) != start

    try:
        name = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:  # ended already
        return False
    if wait(gone, grace):
        return False
    say(f"{name} is still waiting {grace:g} s after MPI_Abort, on a host it cannot reach: ending it "
        f"as three Ctrl-C would")
    try:
        for _ in range(SIGTERMS):
            if gone():
                return True
            os.kill(pid, signal.SIGTERM)
            # the next one only once this one is handled: a signal already pending swallows another
            wait(lambda: gone() or not pending(pid, signal.SIGTERM), KILL_AFTER)
        if not wait(gone, KILL_AFTER):
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass
    return True


if __name__ == "__main__":
    end_if_stuck(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), lambda line: print(line, file=sys.stderr))
