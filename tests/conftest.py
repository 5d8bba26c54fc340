"""Shared test configuration: hypothesis profiles.

No Redis here: tests/core runs without importing a Redis client. The layers that
need Redis (tests/redis, tests/web) get its fixtures from their own conftest.py.

``BUCKETLIMIT_HYPOTHESIS=thorough pytest`` runs the property tests with many
more examples; the default profile keeps the suite fast.
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

# The helpers' asserts report like the tests' own (as when redis_servers was a plugin).
pytest.register_assert_rewrite("tests.support")

README_TEST = Path(__file__).with_name("test_readme.py")

settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("BUCKETLIMIT_HYPOTHESIS", "default"))


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Transitional, until tests/test_readme.py moves to tests/docs/ (whose conftest.py
    will take the Redis fixtures in one line, as tests/redis/conftest.py does): that
    file asks for ``redis_url``, so the fixtures load when it is collected, not before."""
    if isinstance(collector, pytest.Module) and collector.path == README_TEST:
        from tests.support import redis_servers

        plugins = collector.config.pluginmanager
        if not plugins.is_registered(redis_servers):
            plugins.register(redis_servers, "tests.support.redis_servers")
