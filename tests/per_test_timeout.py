"""`pytest -p tests.per_test_timeout --test-timeout SECONDS`: a test still running after that
long fails (SIGALRM raises in it, with its traceback), so that one slow or hung test costs
itself, not the rest of the run. For the GPU machine, whose Python has no pytest-timeout.
A hang inside one C call (a kernel that never ends) returns to Python only when the call
does: the time limit of the whole step (tests/device_check.sh) is the backstop for that."""
import signal

import pytest


class Expired(Exception):
    pass


def pytest_addoption(parser):
    parser.addoption("--test-timeout", type=float, default=0.0, help="seconds a test may run (0: no limit)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The limit covers a test's setup (its fixtures: a model built, a CPU reference run), call
    and teardown."""
    seconds = item.config.getoption("--test-timeout")
    if seconds:
        def expire(signum, frame):
            raise Expired(f"{item.nodeid} ran past --test-timeout {seconds:g} s")
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
