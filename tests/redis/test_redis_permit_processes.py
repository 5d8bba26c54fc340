"""Concurrency permits across processes on one Redis (docs/design.md §6, "Concurrency
permits"): the bound under load, a holder killed, FIFO across
processes, and what waiting costs the store.

Real processes (tests/support/processes.py), each with its own client and limiter.
Bounded in count; no assertion on time but the correctness the contract states (a
killed holder's slots come back, never before its ttl). How fast (acquisitions a
second; how long after the ttl a dead holder's slots come back) is
benches/scenario_figures.py's.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio

from bucketlimit.redis import AsyncRedisConcurrencyLimiter, RedisConcurrencyLimiter
from tests.support.processes import CONTEXT, run_processes
from tests.support.redis_servers import ServerFactory
from tests.support.threads import wait_until


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


# -- 8 processes x 16 tasks on limit 10: never more than 10 inside -------------------------

PROCESSES, TASKS, LIMIT = 8, 16, 10
#: Enough for 128 tasks to contend for 10 slots many times over; the rate they reach
#: is benches/scenario_figures.py's (at 100,000 acquisitions), never asserted here.
ACQUISITIONS = 3_200


@dataclass(frozen=True)
class Hammered:
    """What the processes of :func:`hammer_one_key` saw."""

    done: int  # acquisitions made (each process its quota)
    most: int  # the largest count of holders a task saw inside
    above: int  # samples above the limit
    seconds: float  # from the release of the processes to the last answer


def hammer(url: str, quota: int) -> tuple[int, int, int]:
    """16 tasks around a shared counter (INCR on entry, DECR on exit) until this
    process made ``quota`` acquisitions: the acquisitions made, the largest count
    seen inside, the samples above the limit."""

    async def main() -> tuple[int, int, int]:
        client = redis.asyncio.Redis.from_url(url, max_connections=64)
        limiter = AsyncRedisConcurrencyLimiter(client, LIMIT, ttl=60, prefix="hammer:")
        started = done = most = above = 0

        async def task() -> None:
            nonlocal started, done, most, above
            while started < quota:
                started += 1
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


def hammer_one_key(url: str, processes: int, acquisitions: int) -> Hammered:
    """``processes`` processes of 16 tasks acquiring one key of limit 10 until they
    made ``acquisitions`` in all (the test; benches/scenario_figures.py times it)."""
    started = time.monotonic()
    results = run_processes(hammer, [(url, acquisitions // processes)] * processes, timeout=800)
    return Hammered(
        done=sum(r[0] for r in results),
        most=max(r[1] for r in results),
        above=sum(r[2] for r in results),
        seconds=time.monotonic() - started,
    )


@pytest.mark.timeout(300)  # a hang guard: a few seconds idle
def test_8_processes_of_16_tasks_never_hold_more_than_the_limit(
    redis_client: redis.Redis, redis_url: str
) -> None:
    run = hammer_one_key(redis_url, PROCESSES, ACQUISITIONS)
    assert run.done == ACQUISITIONS, "every task made its acquisitions, none refused"
    assert run.above == 0, f"{run.above} samples saw more than {LIMIT} holders inside"
    assert run.most <= LIMIT, f"{run.most} holders inside at once, limit {LIMIT}"
    assert run.most >= LIMIT // 2, f"at most {run.most} inside at once: they never overlapped"
    assert int(redis_client.get("inside") or 0) == 0, "every holder left the counter"
    limiter = RedisConcurrencyLimiter(redis_client, LIMIT, ttl=60, prefix="hammer:")
    assert limiter.in_flight("shared") == 0, "a permit was never released"
    assert redis_client.zcard(limiter.redis_key("shared") + b":q") == 0, "a waiter stayed queued"


# -- a holder killed with SIGKILL: its slots come back by their ttl ------------------------

TTL = 1.0


def hold_five(url: str, ready: Any) -> None:
    limiter = RedisConcurrencyLimiter(redis.Redis.from_url(url), 5, ttl=TTL, prefix="killed:")
    asked = time.monotonic()
    permits = [limiter.try_acquire("k") for _ in range(5)]
    assert all(permits)
    ready.put(asked)
    time.sleep(600)  # killed long before


@dataclass(frozen=True)
class Killed:
    """A holder of 5 permits killed: when it asked for them (``time.monotonic()``, one
    clock for every process of the machine), whether the slots were all held before
    the kill, and when each of 5 waiters was granted one."""

    asked: float
    held: bool
    granted: list[float]


def kill_a_holder_of_five(url: str) -> Killed:
    """The test's scenario (benches/scenario_figures.py prints how long after the ttl
    the slots came back)."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    limiter = RedisConcurrencyLimiter(client, 5, ttl=TTL, prefix="killed:")
    ready = CONTEXT.Queue()
    holder = CONTEXT.Process(target=hold_five, args=(url, ready))
    holder.start()
    try:
        asked = ready.get(timeout=60)
        # Read at once, a round trip after the grant: well within the ttl.
        held = limiter.in_flight("k") == 5 and not limiter.try_acquire("k")
        holder.kill()  # SIGKILL
        holder.join(10)
    finally:
        if holder.is_alive():
            holder.kill()
    # Waiters, told by nobody, notice each expiry on the store's clock. The timeout is
    # a hang guard: the slots are free a ttl after the grant.
    granted = []
    for _ in range(5):
        permit = limiter.acquire("k", timeout=60)
        granted.append(time.monotonic())
        assert permit, "a waiter was refused: the dead holder's slot never came back"
    assert not limiter.try_acquire("k"), "a sixth permit besides the five waiters'"
    assert limiter.in_flight("k") == 5
    limiter.close()
    client.close()
    return Killed(asked, held, granted)


@pytest.mark.timeout(60)
def test_a_process_killed_holding_5_permits_frees_them_by_their_ttl(redis_url: str) -> None:
    run = kill_a_holder_of_five(redis_url)
    assert run.held, "the holder's five permits were not all held before it was killed"
    # All five slots came back (the waiters were granted), none before the ttl.
    early = [at - run.asked for at in run.granted if at < run.asked + TTL]
    assert early == [], f"granted {early} s after the dead holder asked, before its ttl {TTL} s"


# -- FIFO across processes: grants in the order the requests reached the server ------------

WAITERS = 6


def wait_in_line(url: str, index: int, go: Any) -> int:
    client = redis.Redis.from_url(url)
    limiter = RedisConcurrencyLimiter(client, 1, ttl=60, prefix="fifo:")
    assert go.wait(60), "never told to queue"
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
    gos = [CONTEXT.Event() for _ in range(WAITERS)]

    errors: list[BaseException] = []

    def queued(n: int) -> bool:
        return int(redis_client.zcard(queue_key)) == n

    def line_up() -> None:
        try:
            for index, go in enumerate(gos):
                go.set()
                # The next one queues once this one's request is queued on the server:
                # the order they reached it is the order they were told to go in.
                wait_until(functools.partial(queued, index + 1), "queued", 60)
        except BaseException as error:  # raised below, in the test's thread
            errors.append(error)
        held.release()

    helper = threading.Thread(target=line_up)
    helper.start()
    try:
        tokens = run_processes(
            wait_in_line, [(redis_url, i, go) for i, go in enumerate(gos)], 120, together=False
        )
    finally:
        helper.join(60)
    if errors:
        raise errors[0]
    assert [int(i) for i in redis_client.lrange("granted", 0, -1)] == list(range(WAITERS)), (
        "granted in another order than they queued"
    )
    tokens = sorted(tokens)
    assert len(set(tokens)) == WAITERS, f"fencing tokens {tokens} not all distinct"
    assert tokens[0] > held.token, "a waiter's token is not above the earlier holder's"


# -- waiting costs the store (almost) nothing ------------------------------------------------

WAITING_PROCESSES, WAITING_TASKS, WAIT = 4, 4, 1.0
#: Without the store's wake-ups a waiter asks every 0.75 s (docs/redis.md, "Concurrency").
POLL = 0.75


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
def test_waiting_costs_a_bounded_number_of_commands_per_waiter(
    redis_server_factory: ServerFactory, wakeups: bool
) -> None:
    """Waiters of a key held for longer than they wait: with the store's wake-ups
    they ask only at their start, once their subscription is heard and at their
    end; where pub/sub is refused (an ACL without SUBSCRIBE) they ask at their start,
    at most once every 0.75 s of their wait, and at their end. Counted with INFO
    commandstats: script calls (a slower machine only asks less)."""
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
    refused = sum(refused for refused, _ in results)
    assert refused == waiters, f"{waiters - refused} of {waiters} waiters were granted"
    # With wake-ups, each: queue, one question once its subscription is heard, give
    # up (and one per process besides); without, a question every POLL between.
    polls = 1 if wakeups else math.floor(WAIT / POLL)
    bound = waiters * (2 + polls) + (WAITING_PROCESSES if wakeups else 0)
    assert calls <= bound, f"{calls} script calls from {waiters} waiters of {WAIT} s, over {bound}"
    admin.close()
