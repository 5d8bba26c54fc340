"""The real redis-server fixtures (tests/support/redis_servers.py) for this layer."""

import pytest

# The helpers' asserts report like the tests' own.
pytest.register_assert_rewrite("tests.web.problem", "tests.web.sf")

from tests.support.redis_servers import *  # noqa: E402, F403
