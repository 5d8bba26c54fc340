"""Defects found by attacking the Redis limiters, each held by a test on real servers.

Each test reproduces what failed (the figures are in its comment) and checks the
behaviour that holds now: exact counts, no degraded answer from a healthy store,
no error a caller could not have expected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
import redis
import redis.asyncio

from bucketlimit.redis import (
    AsyncRedisConcurrencyLimiter,
    AsyncRedisTokenBucketLimiter,
    LeasePolicy,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import RedisServer

QUOTA = 100_000
THREADS = 8


def spent(url: str, prefix: str) -> int:
    """What the store's bucket of key "k" has spent of the quota (rate 0)."""
    with RedisTokenBucketLimiter.from_url(url, QUOTA, 0, prefix=prefix, processes=1) as probe:
        peek = probe.peek("k")  # what an allow would answer: remaining after a token
        return QUOTA - peek.remaining - peek.allowed


# -- close() while other threads and tasks call the limiter ------------------------------


@pytest.mark.parametrize("lease", [False, True], ids=["plain", "leasing"])
def test_close_lets_the_other_threads_calls_land_and_then_refuses_new_ones(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, lease: bool
) -> None:
    # Before: close() cut the commands of the other threads in flight on a healthy
    # store: 6 to 8 of 8 threads got ValueError("I/O operation on closed file.") and
    # others answered from the local share, logging "the store failed"; admitted plus
    # what the bucket still held came to 105,665-200,000 of 100,000.
    caplog.set_level(logging.INFO, logger="bucketlimit")
    prefix = f"close-{lease}:"
    policy: Any = LeasePolicy(period=0.05, max_wait=0.05) if lease else False
    limiter = RedisTokenBucketLimiter.from_url(
        redis_server.url, QUOTA, 0, prefix=prefix, lease=policy, timeout=5
    )
    admitted = [0] * THREADS
    errors: list[BaseException] = []
    degraded: list[Any] = []
    calling = threading.Semaphore(0)  # released by each thread after its 25th call

    def call(index: int) -> None:
        calls = 0
        while True:
            calls += 1
            if calls == 25:
                calling.release()
            try:
                decision = limiter.allow("k")
            except RuntimeError:  # closed: what a call after close() is told
                return
            except BaseException as error:
                errors.append(error)
                return
            if decision.degraded:
                degraded.append(decision)
            admitted[index] += decision.allowed

    threads = [threading.Thread(target=call, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for _ in threads:  # every thread is calling
        assert calling.acquire(timeout=30), "a thread never made 25 calls"
    limiter.close()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a call never returned"
    assert errors == [], "a call in flight was cut by close()"
    assert degraded == [], "a healthy store's call answered without it"
    assert not [r for r in caplog.records if "the store failed" in r.getMessage()]
    assert spent(redis_server.url, prefix) == sum(admitted), (
        f"admitted {sum(admitted)}, the store spent {spent(redis_server.url, prefix)}: "
        "a lease given back at close returns what it did not use"
    )


def test_aclose_lets_the_other_tasks_calls_land_and_then_refuses_new_ones(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the asyncio class answered the tasks in flight from the local share
    # ("the store failed") once aclose() had closed the client under them.
    caplog.set_level(logging.INFO, logger="bucketlimit")

    async def main() -> tuple[int, list[BaseException], int]:
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            redis_server.url, QUOTA, 0, prefix="aclose:", timeout=5
        )
        admitted = degraded = 0
        errors: list[BaseException] = []

        async def call() -> None:
            nonlocal admitted, degraded
            while True:
                try:
                    decision = await limiter.allow("k")
                except RuntimeError:
                    return
                except BaseException as error:
                    errors.append(error)
                    return
                admitted += decision.allowed
                degraded += decision.degraded

        tasks = [asyncio.create_task(call()) for _ in range(THREADS)]
        while admitted < 200:  # every task is calling (each call yields to the loop)
            await asyncio.sleep(0)
        await limiter.aclose()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return admitted, errors, degraded

    admitted, errors, degraded = asyncio.run(main())
    assert errors == []
    assert degraded == 0, "a healthy store's call answered without it"
    assert not [r for r in caplog.records if "the store failed" in r.getMessage()]
    assert spent(redis_server.url, "aclose:") == admitted


def test_a_closed_limiter_says_so(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1, prefix="closed:", processes=1)
    assert limiter.allow("k")
    limiter.close()
    with pytest.raises(
        RuntimeError, match=r"RedisTokenBucketLimiter\(prefix='closed:'\) is closed"
    ):
        limiter.allow("k")
    redis_client.ping()  # a client the user gave stays theirs, open


# -- fencing tokens on a limiter given a clock ---------------------------------------------


def test_fencing_tokens_never_repeat_on_a_clock_when_the_store_lost_the_key(
    redis_client: redis.Redis,
) -> None:
    # Before: on a ManualClock the counter of a lost key restarted from the clock's
    # time, so the same three tokens were granted again after the key was deleted.
    clock = ManualClock()
    limiter = RedisConcurrencyLimiter(redis_client, 3, ttl=60, clock=clock, processes=1)
    first = [limiter.try_acquire("k").token for _ in range(3)]
    redis_client.flushall()  # the store lost every key (a restart without persistence)
    again = [limiter.try_acquire("k").token for _ in range(3)]
    assert all(first), first
    assert min(again) > max(first), f"tokens {again} after the loss, {first} before"
    assert again == sorted(again)


# -- a full connection pool is not an outage ---------------------------------------------------


def test_asyncio_waiters_filling_their_pool_never_pass_the_limit(redis_server: RedisServer) -> None:
    # Before: 120 tasks on a plain redis.asyncio.Redis (a pool of 100 connections that
    # raises MaxConnectionsError when full) were answered "without the store" from
    # the local share while the store's permits were held: 5 in flight for a limit
    # of 3, on a healthy server. Now a call waits for a free connection.
    async def main() -> tuple[int, int, int]:
        client = redis.asyncio.Redis(port=redis_server.port)
        assert client.connection_pool.max_connections == 100  # redis-py's default
        limiter = AsyncRedisConcurrencyLimiter(client, 3, ttl=60, prefix="pool-full:", processes=1)
        inside = most = degraded = 0

        async def task() -> None:
            nonlocal inside, most, degraded
            permit = await limiter.acquire("k", timeout=60)
            assert permit, permit.decision
            degraded += permit.decision.degraded
            async with permit:
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.001)
                inside -= 1

        await asyncio.gather(*(task() for _ in range(120)))
        granted = limiter.stats()["granted"]
        await client.aclose()
        return most, degraded, granted

    most, degraded, granted = asyncio.run(main())
    assert most <= 3, f"{most} in flight for a limit of 3"
    assert degraded == 0, "a full pool answered by the policy on a healthy store"
    assert granted == 120
