"""A stalled engine ends the run instead of hanging it; a slow one is left to finish.

A step is judged by whether it is still computing, never by how long it takes: on a busy
machine a legitimate 2,048-token prefill can take tens of seconds. In one process, whoever
drives the steps (`with watchdog.step(): engine.step()`) has its thread's CPU time read
(time.pthread_getcpuclockid) every quarter of the timeout, at most a second apart: while it
advances, the step is computing; a thread that has used no CPU for --stall-timeout seconds
is blocked (a deadlock, a wait for what never comes) and the run is ended. Between steps
(nothing to do) nothing is judged: an idle engine is not a stalled one; nor is a driver's
first step, which on a GPU compiles kernels (NVRTC) and captures graphs. A GPU kernel that
never ends is not caught this way: by default CUDA spins on the CPU while it waits.

Under MPI the CPU says nothing (a rank waiting in a collective for a stopped one spins), so
there the ranks' heartbeats judge (heartbeat.py) and a driver only hands them its on_stall.
Either way the driver is told first (on_stall: the server turns /health to 503 and gives
every waiting client an error), then after a grace period for those errors to reach the
clients one line is printed and every rank ends, with exit status 1."""
import os
import sys
import threading
import time
from contextlib import contextmanager

from nano.fleet.world import started, world
from nano.telemetry.launcher import launcher_stderr, watch_after_abort

DEFAULT_STALL_TIMEOUT = 30.0  # seconds a step may go without CPU (MPI: a rank without a heartbeat)
GRACE = 2.0                   # seconds between telling the drivers and ending the run
drivers = []                  # under MPI: each driver's on_stall, for the heartbeats to call


def end_stalled(message: str, on_stall=()) -> None:
    """Tell the drivers, give their clients GRACE seconds, then end every rank with one line."""
    for tell in on_stall:
        tell(message)
    if on_stall:
        time.sleep(GRACE)
    sys.stderr.flush()
    os.write(launcher_stderr(), f"error: {message}\n".encode())
    abort_all(1)


def alone() -> bool:
    """Whether this process is the whole run (no other MPI rank to end on an error)."""
    return world().world == 1


def abort_all(code: int) -> None:
    """End this process and every other rank now, from any thread (sys.exit would end only
    the calling thread, and not the ranks waiting for this one)."""
    group = started()
    if group is None or group.world == 1:
        os._exit(code)
    time.sleep(0.2)  # for mpirun to pass the last line on before it prints its own abort notice
    watch_after_abort()  # a launcher that cannot reach another host would wait on (launcher.py)
    group.comm.Abort(code)


class Stillness:
    """How long a thread has gone without using CPU, from samples of (wall time, its CPU time
    or None between steps). A gap between two samples of over half the timeout is time this
    whole process was stopped (SIGSTOP, a suspended VM) or starved: not the thread's doing."""

    def __init__(self, timeout: float, now: float):
        self.timeout = timeout
        self.sampled, self.cpu, self.since = now, None, now  # the last sample; when the CPU time last moved

    def still(self, now: float, cpu: float | None) -> float:
        """Seconds the thread has been still, after this sample."""
        if cpu is None or cpu != self.cpu or now - self.sampled > self.timeout / 2:
            self.since = now
        self.sampled, self.cpu = now, cpu
        return now - self.since


class Watchdog:
    """Judges the steps of one driver; timeout None: nothing (a run in one process whose
    steps nothing else can stall, such as the benchmarks' policy comparisons)."""

    def __init__(self, timeout: float | None, on_stall=None):
        self.timeout, self.on_stall = timeout, on_stall
        self.clock: int | None = None  # the stepping thread's CPU clock while a timed step runs
        self.steps = 0                 # steps finished
        self.closed = False
        if timeout and alone():
            threading.Thread(target=self._watch, name="nano-watchdog", daemon=True).start()
        elif on_stall and not alone():
            drivers.append(on_stall)

    def close(self) -> None:
        """Stop judging once the driver's steps are over: the watching thread ends and the
        heartbeats forget on_stall, so nothing here keeps the driver (and its engine) alive."""
        self.closed = True
        if self.on_stall in drivers:
            drivers.remove(self.on_stall)

    @contextmanager
    def step(self):
        self.clock = time.pthread_getcpuclockid(threading.get_ident()) if self.steps else None
        try:
            yield
        finally:
            self.clock = None
            self.steps += 1

    def _cpu(self) -> float | None:
        clock = self.clock
        try:
            return None if clock is None else time.clock_gettime(clock)
        except OSError:  # the step ended and its thread with it since clock was read
            return None

    def _watch(self) -> None:
        stillness = Stillness(self.timeout, time.monotonic())
        while stillness.still(time.monotonic(), self._cpu()) <= self.timeout:
            time.sleep(min(1.0, self.timeout / 4))
            if self.closed:
                return
        end_stalled(f"a step has used no CPU for {self.timeout:g} s (--stall-timeout): the engine is "
                    f"blocked, not computing", [self.on_stall] if self.on_stall else [])
