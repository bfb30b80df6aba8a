"""The suite's own machinery (tests/conftest.py): in a whole-suite run, the tests of a file that
share a module fixture run on one xdist worker, which builds the fixture once."""
import os

import pytest


@pytest.fixture(scope="module")
def shared_by_the_file():
    return os.getpid()


def test_tests_sharing_a_module_fixture_are_one_group(request, shared_by_the_file):
    """xdist's loadgroup sends a group's tests to one worker by the `@group` its worker adds to
    each test's id. Two ways lost the groups without a word: workers that never heard of the
    loadgroup the controller chose, and a pytest whose test ids cannot be changed (9.2)."""
    if not hasattr(request.config, "workerinput"):
        pytest.skip("one process: nothing to group (a whole-suite run uses xdist's workers)")
    chosen = [a for a in request.config.invocation_params.args if a.startswith(("-n", "--numprocesses", "--dist"))]
    if chosen:
        pytest.skip(f"the command line chose how the workers share the tests ({' '.join(chosen)})")
    assert request.config.getvalue("loadgroup")
    assert request.node.nodeid.endswith("@test_suite_setup.py"), request.node.nodeid
