"""BLAS threads follow the cores other processes and threads leave free
(nano/cpu_setup.BlasThreads): one thread per core the steps can have, measured between
steps."""
import threading
import time

import pytest

from nano import cpu_setup
from nano.cpu_setup import BlasThreads

threadpoolctl = pytest.importorskip("threadpoolctl")


class Readings:
    """Stand-in for /proc/stat: each call moves the clock on by a second, in which the stepping
    thread got `ours` CPU seconds and `idle` core-seconds of the process's cores were idle."""

    def __init__(self):
        self.now, self.idle, self.ours = 0.0, 0.0, 0.0

    def __call__(self):
        return self.now, self.idle, self.ours

    def second(self, ours: float, idle: float):
        self.now, self.idle, self.ours = self.now + 1.0, self.idle + idle, self.ours + ours


def blas_threads() -> int:
    return min(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")


@pytest.fixture
def chooser(monkeypatch):
    monkeypatch.setattr(cpu_setup, "USER_THREADS", False)
    readings = Readings()
    b = BlasThreads(readings)
    b.cores = b.threads = 4  # as on a 4-core machine, whatever this one has
    with threadpoolctl.threadpool_limits(limits=blas_threads()):  # restored after the test
        yield b, readings


def test_threads_follow_the_free_cores(chooser):
    b, readings = chooser
    readings.second(ours=0.25, idle=0.1)  # four threads shared one core: other work has the rest
    b.choose()
    assert b.threads == 1 and blas_threads() == 1
    readings.second(ours=1.0, idle=2.9)   # it went away: three cores idle beside the step's
    b.choose()
    assert b.threads == 4 and blas_threads() == 4
    readings.second(ours=0.7, idle=0.0)   # four threads had 2.8 cores: three
    b.choose()
    assert b.threads == 3


def test_no_measurement_within_the_check_interval(chooser):
    b, readings = chooser
    readings.now += 0.1                   # a tenth of a second: too short to tell
    readings.ours += 0.1
    b.choose()
    assert b.threads == 4


def test_the_users_own_thread_count_is_kept(monkeypatch):
    monkeypatch.setattr(cpu_setup, "USER_THREADS", True)
    readings = Readings()
    b = BlasThreads(readings)
    readings.second(ours=1.0, idle=0.0)
    before = blas_threads()
    b.choose()
    assert blas_threads() == before


def test_another_thread_of_the_process_counts_as_load():
    """A server's event loop or grammar compile takes a core from BLAS as another process does:
    the CPU the readings give as the steps' own is the calling thread's alone."""
    spinning = threading.Event()

    def spin():
        end = time.process_time() + 0.6
        spinning.set()
        while time.process_time() < end:
            pass
    first, process_before = cpu_setup._usage(), time.process_time()
    other = threading.Thread(target=spin)
    other.start()
    spinning.wait()
    other.join()
    last = cpu_setup._usage()
    assert time.process_time() - process_before >= 0.3  # the other thread's CPU
    assert last[2] - first[2] < 0.15                    # none of it the caller's
