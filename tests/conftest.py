import os
import sys

import pytest

# Tests import helpers as top-level modules (`from rank_pool import ...`), and the ranks
# unpickle task functions by module name, so tests/ must be importable by name.
sys.path.insert(0, os.path.dirname(__file__))

from rank_pool import get_pool, shutdown_all  # noqa: E402


@pytest.fixture
def rank_pool():
    """get_pool(world_size) -> a RankPool shared by the whole session."""
    return get_pool


def pytest_sessionfinish(session, exitstatus):
    shutdown_all()
