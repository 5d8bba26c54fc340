"""Shared test configuration: hypothesis profiles, and the ``redis`` marker given to
every test of tests/redis and every other test that uses a server fixture, so that
``-m "not redis"`` leaves out the tests that need a redis-server or valkey-server.

No Redis here: tests/core runs without importing a Redis client. The layers that
need Redis (tests/redis, tests/web, tests/docs) get its fixtures from their own
conftest.py.

``BUCKETLIMIT_HYPOTHESIS=thorough pytest`` runs the property tests with many
more examples; the default profile keeps the suite fast.
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

# The helpers' asserts report like the tests' own (as when redis_servers was a plugin).
pytest.register_assert_rewrite(
    "tests.support", "tests.web.problem", "tests.web.sf", "tests.web.exchange"
)

settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("BUCKETLIMIT_HYPOTHESIS", "default"))


#: The fixtures of tests/support/redis_servers.py that start a server.
SERVER_FIXTURES = frozenset(
    {
        "redis_server",
        "redis_server_factory",
        "redis_cluster",
        "valkey_server",
        "valkey_server_factory",
    }
)


REDIS_TESTS = Path(__file__).parent / "redis"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(REDIS_TESTS) or SERVER_FIXTURES.intersection(
            getattr(item, "fixturenames", ())
        ):
            item.add_marker(pytest.mark.redis)
