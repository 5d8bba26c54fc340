"""The real redis-server fixtures (tests/support/redis_servers.py) for this layer."""

from tests.support.redis_servers import *  # noqa: F403
