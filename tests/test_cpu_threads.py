"""BLAS threads follow the cores other processes leave free (nano/cpu_setup.BlasThreads):
one thread per core this process can have, measured between steps."""
import pytest

from nano import cpu_setup
from nano.cpu_setup import BlasThreads

threadpoolctl = pytest.importorskip("threadpoolctl")


class Readings:
    """Stand-in for /proc/stat: each call moves the clock on by a second, in which this
    process got `ours` core-seconds and `idle` core-seconds of its cores were idle."""

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
    readings.second(ours=1.0, idle=0.1)   # two threads shared one core: another process has the rest
    b.choose()
    assert b.threads == 1 and blas_threads() == 1
    readings.second(ours=1.0, idle=2.9)   # it went away: three cores idle beside ours
    b.choose()
    assert b.threads == 4 and blas_threads() == 4
    readings.second(ours=2.9, idle=0.0)   # a quarter of a core short of three: three
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
