"""A stalled step ends the run instead of hanging it.

A rank that stops (SIGSTOP, a wedged device, a lost host) leaves the others waiting in a
collective forever, spinning; a thread stepping the engine can wedge too. Whoever drives
the steps times each one (`with watchdog.step(): engine.step()`); one still running after
--stall-timeout seconds means no progress is possible. Then the driver is told (on_stall:
the server turns /health to 503 and gives every waiting client an error), and after a
grace period for those errors to reach the clients one line is printed and every rank
ends. Between steps (nothing to do) nothing is timed: an idle engine is not a stalled one;
nor is a driver's first step, which on a GPU compiles kernels (NVRTC) and captures graphs.

Legitimate steps are far shorter than the default bound: a 2,048-token prefill of the
default model takes ~5 s on a 2-core CPU; raise it for large models on slow machines."""
import sys
import threading
import time
from contextlib import contextmanager

from nano import parallel

DEFAULT_STALL_TIMEOUT = 30.0  # seconds a step may take before the run is ended
GRACE = 2.0                   # seconds between telling the driver and ending the run


class Watchdog:
    """Times the steps of one driver; timeout None: times nothing (a run in one process
    whose steps nothing else can stall, such as the benchmarks' policy comparisons)."""

    def __init__(self, timeout: float | None, on_stall=None):
        self.timeout, self.on_stall = timeout, on_stall
        self.started: float | None = None  # time.monotonic() when the step in flight began
        self.steps = 0                     # steps finished
        if timeout:
            threading.Thread(target=self._watch, name="nano-watchdog", daemon=True).start()

    @contextmanager
    def step(self):
        self.started = time.monotonic() if self.steps else None
        try:
            yield
        finally:
            self.started = None
            self.steps += 1

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            started = self.started
            if started is not None and time.monotonic() - started > self.timeout:
                break
        message = (f"a step has run for over {self.timeout:g} s (--stall-timeout): a rank or the "
                   f"engine stopped making progress")
        if self.on_stall:
            self.on_stall(message)
            time.sleep(GRACE)
        print(f"error: {message}", file=sys.stderr, flush=True)
        parallel.abort_all(1)
