import os
import sys

import pytest

# The helper modules (harness, collective_cases, ...) live in tests/support and are
# imported by name from every folder of tests; spawned ranks get this sys.path too.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))

from harness import Ranks, pyddp_segments  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def no_leaked_segments():
    """Every module leaves /dev/shm as it found it."""
    before = set(pyddp_segments())
    yield
    leaked = set(pyddp_segments()) - before
    assert not leaked, f"pyddp shared-memory segments left in /dev/shm: {sorted(leaked)}"


@pytest.fixture(scope="module")
def two():
    """Two ranks for a module's tests (a module may define its own, with a setup)."""
    pool = Ranks(2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def three():
    """Three ranks for a module's tests."""
    pool = Ranks(3)
    yield pool
    pool.close()
