"""Concurrency permits across processes on one Redis (docs/design.md §6, "Concurrency
permits"; issue 21): the bound under load, a holder killed, FIFO across
processes, and what waiting costs the store.

Real processes (multiprocessing, spawn), each with its own client and limiter.
Bounded in count and in time; no timing assertion but the bounds the issue states
(a killed holder's slots come back within ttl + 1 s, never before its ttl).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio

from bucketlimit.redis import AsyncRedisConcurrencyLimiter, RedisConcurrencyLimiter
from tests.support.redis_servers import ServerFactory
from tests.support.threads import wait_until

SPAWN = multiprocessing.get_context("spawn")


def _entry(target: Callable[..., Any], barrier: Any, results: Any, args: tuple[Any, ...]) -> None:
    if barrier is not None:
        barrier.wait()
    try:
        results.put(("ok", target(*args)))
    except BaseException as e:  # reported to the test, which fails with it
        results.put(("error", repr(e)))


def run_processes(
    target: Callable[..., Any], args: list[tuple[Any, ...]], timeout: float
) -> list[Any]:
    """Runs ``target(*a)`` for each ``a`` in its own process, released together."""
    barrier = SPAWN.Barrier(len(args))
    results = SPAWN.Queue()
    processes = [SPAWN.Process(target=_entry, args=(target, barrier, results, a)) for a in args]
    for process in processes:
        process.start()
    try:
        answers = [results.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    errors = [detail for status, detail in answers if status == "error"]
    assert errors == []
    return [detail for _, detail in answers]


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


# -- 8 processes x 16 tasks on limit 10: never more than 10 inside -------------------------

PROCESSES, TASKS, LIMIT = 8, 16, 10
ACQUISITIONS = 100_000
PER_PROCESS = ACQUISITIONS // PROCESSES


def hammer(url: str, quota: int, seconds: float) -> tuple[int, int, int]:
    """16 tasks around a shared counter (INCR on entry, DECR on exit): the
    acquisitions made, the largest count seen inside, the samples above the limit."""

    async def main() -> tuple[int, int, int]:
        client = redis.asyncio.Redis.from_url(url, max_connections=64)
        limiter = AsyncRedisConcurrencyLimiter(client, LIMIT, ttl=60, prefix="hammer:")
        done = most = above = 0
        deadline = time.monotonic() + seconds

        async def task() -> None:
            nonlocal done, most, above
            while done < quota and time.monotonic() < deadline:
                async with await limiter.acquire("shared") as permit:
                    assert permit
                    inside = await client.incr("inside")
                    most = max(most, inside)
                    above += inside > LIMIT
                    await client.decr("inside")
                done += 1

        await asyncio.gather(*(task() for _ in range(TASKS)))
        await limiter.aclose()
        await client.aclose()
        return done, most, above

    return asyncio.run(main())


@pytest.mark.timeout(900)
def test_8_processes_of_16_tasks_never_hold_more_than_the_limit(
    redis_client: redis.Redis, redis_url: str
) -> None:
    results = run_processes(hammer, [(redis_url, PER_PROCESS, 600.0)] * PROCESSES, timeout=800)
    done = sum(r[0] for r in results)
    assert done >= ACQUISITIONS, f"only {done} acquisitions within the time bound"
    assert sum(r[2] for r in results) == 0
    assert max(r[1] for r in results) <= LIMIT
    assert max(r[1] for r in results) >= LIMIT // 2  # they did run side by side
    assert int(redis_client.get("inside") or 0) == 0
    limiter = RedisConcurrencyLimiter(redis_client, LIMIT, ttl=60, prefix="hammer:")
    assert limiter.in_flight("shared") == 0
    assert redis_client.zcard(limiter.redis_key("shared") + b":q") == 0


# -- a holder killed with SIGKILL: its slots come back by their ttl ------------------------

TTL = 2.0


def hold_five(url: str, ready: Any) -> None:
    limiter = RedisConcurrencyLimiter(redis.Redis.from_url(url), 5, ttl=TTL, prefix="killed:")
    asked = time.monotonic()
    permits = [limiter.try_acquire("k") for _ in range(5)]
    assert all(permits)
    ready.put((asked, time.monotonic()))
    time.sleep(600)  # killed long before


@pytest.mark.timeout(60)
def test_a_process_killed_holding_5_permits_frees_them_by_their_ttl(
    redis_client: redis.Redis, redis_url: str
) -> None:
    ready = SPAWN.Queue()
    holder = SPAWN.Process(target=hold_five, args=(redis_url, ready))
    holder.start()
    try:
        asked, granted = ready.get(timeout=30)
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        holder.join(10)
    finally:
        if holder.is_alive():
            holder.kill()
    limiter = RedisConcurrencyLimiter(redis_client, 5, ttl=TTL, prefix="killed:")
    assert not limiter.try_acquire("k")  # its permits are still held
    # Waiters, told by nobody, notice each expiry on the store's clock: all five
    # slots come back, none before the dead holder's ttl, each within ttl + 1 s.
    for _ in range(5):
        permit = limiter.acquire("k", timeout=TTL + 5)
        at = time.monotonic()
        assert permit
        assert asked + TTL <= at, "granted before the dead holder's ttl"
        assert at <= granted + TTL + 1.0, "not granted within ttl + 1 s"
    assert not limiter.try_acquire("k")
    assert limiter.in_flight("k") == 5


# -- FIFO across processes: grants in the order the requests reached the server ------------

WAITERS = 6


def wait_in_line(url: str, index: int) -> int:
    client = redis.Redis.from_url(url)
    limiter = RedisConcurrencyLimiter(client, 1, ttl=60, prefix="fifo:")
    with limiter.acquire("k", timeout=60) as permit:
        assert permit
        client.rpush("granted", index)
        return permit.token


@pytest.mark.timeout(120)
def test_processes_are_granted_in_the_order_their_requests_reached_the_server(
    redis_client: redis.Redis, redis_url: str
) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=60, prefix="fifo:")
    queue_key = limiter.redis_key("k") + b":q"
    held = limiter.try_acquire("k")
    results = SPAWN.Queue()
    processes = []
    try:
        for index in range(WAITERS):
            process = SPAWN.Process(
                target=_entry, args=(wait_in_line, None, results, (redis_url, index))
            )
            process.start()
            processes.append(process)
            # The next one starts once this one's request is queued on the server:
            # the order they reached it is the order they were started in.
            wait_until(lambda: redis_client.zcard(queue_key) == len(processes), "queued", 60)
        held.release()
        answers = [results.get(timeout=60) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert all(status == "ok" for status, _ in answers), answers
    assert [int(i) for i in redis_client.lrange("granted", 0, -1)] == list(range(WAITERS))
    tokens = sorted(token for _, token in answers)
    assert len(set(tokens)) == WAITERS
    assert tokens[0] > held.token


# -- waiting costs the store (almost) nothing ------------------------------------------------

WAITING_PROCESSES, WAITING_TASKS, WAIT = 4, 4, 4.0


def wait_out(url: str, timeout: float) -> tuple[int, int]:
    """WAITING_TASKS tasks waiting ``timeout`` seconds for a key that never frees:
    refusals, and the commands this process sent."""

    async def main() -> tuple[int, int]:
        client = redis.asyncio.Redis.from_url(url, max_connections=32)
        # processes=1: the script calls counted are the waiters' own, no heartbeat.
        limiter = AsyncRedisConcurrencyLimiter(client, 2, ttl=60, prefix="idle:", processes=1)
        permits = await asyncio.gather(
            *(limiter.acquire("k", timeout=timeout) for _ in range(WAITING_TASKS))
        )
        await limiter.aclose()
        await client.aclose()
        return sum(not p for p in permits), limiter.stats()["store_calls"]

    return asyncio.run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wakeups", [True, False], ids=["woken by the store", "without pub/sub"])
def test_waiting_costs_at_most_two_commands_a_second_per_waiter(
    redis_server_factory: ServerFactory, wakeups: bool
) -> None:
    """Waiters of a key held for longer than they wait: with the store's wake-ups
    they ask only at their start, once their subscription is heard and at their
    end; where pub/sub is refused (an ACL without SUBSCRIBE) they ask every 0.75 s.
    Measured with INFO commandstats: script calls per waiter and second."""
    server = redis_server_factory.start()
    admin = server.client()
    url = server.url
    if not wakeups:
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "nosub", "on", ">pw", "~*", "&*", "+@all", "-subscribe"
        )
        url = f"redis://nosub:pw@127.0.0.1:{server.port}/0"
    holders = RedisConcurrencyLimiter(admin, 2, ttl=60, prefix="idle:")
    assert holders.try_acquire("k")
    assert holders.try_acquire("k")
    admin.config_resetstat()
    results = run_processes(wait_out, [(url, WAIT)] * WAITING_PROCESSES, timeout=60)
    calls = script_calls(admin)
    waiters = WAITING_PROCESSES * WAITING_TASKS
    assert sum(refused for refused, _ in results) == waiters  # nobody was granted
    per_waiter_second = calls / (waiters * WAIT)
    assert per_waiter_second <= 2.0, per_waiter_second
    if wakeups:
        # Each: queue, one question once its subscription is heard, give up.
        assert calls <= 3 * waiters + WAITING_PROCESSES
    print(f"{per_waiter_second:.2f} script calls per waiter and waiting second ({calls} calls)")
    admin.close()
