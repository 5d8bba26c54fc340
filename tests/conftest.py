"""Shared test configuration: hypothesis profiles.

No Redis here: tests/core runs without importing a Redis client. The layers that
need Redis (tests/redis, tests/web, tests/docs) get its fixtures from their own
conftest.py.

``BUCKETLIMIT_HYPOTHESIS=thorough pytest`` runs the property tests with many
more examples; the default profile keeps the suite fast.
"""

import os

import pytest
from hypothesis import settings

# The helpers' asserts report like the tests' own (as when redis_servers was a plugin).
pytest.register_assert_rewrite(
    "tests.support", "tests.web.problem", "tests.web.sf", "tests.web.exchange"
)

settings.register_profile("default", max_examples=60, deadline=None)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("BUCKETLIMIT_HYPOTHESIS", "default"))
