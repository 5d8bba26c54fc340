"""The real redis-server fixtures (tests/support/redis_servers.py) for this layer."""

# (tests.web's helpers are registered for assert rewriting in the root conftest:
# another layer's tests may import them first, e.g. tests/upstream.)
from tests.support.redis_servers import *  # noqa: F403
