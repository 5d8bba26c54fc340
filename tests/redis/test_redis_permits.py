"""RedisConcurrencyLimiter and AsyncRedisConcurrencyLimiter in one process, on real
servers (docs/design.md §6 "Concurrency permits", docs/redis.md "Concurrency").

Where a single process could tell, they answer as the in-process
``ConcurrencyLimiter`` does: each scenario here runs on both, on ManualClocks kept in
step, and compares (random traces are in test_redis_permit_parity.py). Then what is
Redis's own: the store's clock, tokens from the key's counter, the keys and their
TTLs, waiting woken by the store, cancellation, bad input, clusters and Valkey.
Several processes are in test_redis_permit_processes.py, store faults in
test_redis_permit_faults.py.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.cluster import RedisCluster
from redis.crc import key_slot

import bucketlimit
from bucketlimit import ConcurrencyLimiter, Decision, TokenBucketLimiter
from bucketlimit.redis import (
    AsyncRedisConcurrencyLimiter,
    AsyncRedisPermit,
    AsyncRedisReservation,
    AsyncRedisTokenBucketLimiter,
    RedisConcurrencyLimiter,
    RedisPermit,
    RedisReservation,
    RedisTokenBucketLimiter,
    acquire_all,
    acquire_all_async,
    allow_all,
    reserve_all,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import RedisServer
from tests.support.threads import run_threads, wait_until

pytestmark = pytest.mark.interpreters


def script_calls(client: redis.Redis) -> int:
    """EVALSHA and EVAL commands the server ran since its last CONFIG RESETSTAT."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


class Pair:
    """An in-process limiter and a Redis one, each on its own ManualClock: a scenario
    runs on both and they must answer alike, their clocks moving alike."""

    def __init__(self, client: redis.Redis, limit: int, ttl: float) -> None:
        self.clocks = (ManualClock(), ManualClock())
        self.local = ConcurrencyLimiter(limit, ttl=ttl, clock=self.clocks[0])
        self.redis = RedisConcurrencyLimiter(client, limit, ttl=ttl, clock=self.clocks[1])

    def both(self) -> Iterator[tuple[Any, ManualClock]]:
        yield self.local, self.clocks[0]
        yield self.redis, self.clocks[1]

    def advance(self, seconds: float) -> None:
        for clock in self.clocks:
            clock.advance(seconds)


def test_at_most_limit_per_key_as_in_process(redis_client: redis.Redis) -> None:
    pair = Pair(redis_client, 2, 10)
    answers = []
    for limiter, _ in pair.both():
        first, second, third = (limiter.try_acquire("k") for _ in range(3))
        other = limiter.try_acquire("other")
        first.release()
        fourth = limiter.try_acquire("k")
        answers.append(
            (
                [p.decision for p in (first, second, third, other, fourth)],
                [bool(p) for p in (first, second, third, other, fourth)],
                limiter.in_flight("k"),
                first.valid(),
                fourth.valid(),
            )
        )
        assert third.token == 0
        assert 0 < first.token < second.token < fourth.token
    assert answers[0] == answers[1]
    decisions = answers[1][0]
    assert decisions[0] == Decision(True, 0.0, 1, 10.0, 2)
    assert decisions[2] == Decision(False, 10.0, 0, 10.0, 2)
    # The first token of a key on a clock at 0: the server's time, where a counter
    # the store lost starts again, so that no token is ever granted twice.
    seconds, micros = redis_client.time()
    assert pair.redis.try_acquire("fresh").token >= seconds * 1_000_000 + micros


def test_release_acts_once_and_a_refusal_holds_nothing(redis_client: redis.Redis) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=60)
    held = limiter.try_acquire("k")
    refused = limiter.try_acquire("k")
    assert isinstance(held, RedisPermit)
    refused.release()
    assert limiter.in_flight("k") == 1
    held.release()
    replacement = limiter.try_acquire("k")
    held.release()  # a second release frees nothing of the replacement's
    assert limiter.in_flight("k") == 1
    assert replacement.valid()
    assert not held.valid()
    assert not refused.valid()
    assert not refused.renew()
    assert not held.renew()
    stats = limiter.stats()
    assert (stats["granted"], stats["refused"], stats["released"]) == (2, 1, 1)
    assert repr(held) == f"RedisPermit(key='k', token={held.token}, granted=True, released=True)"
    assert repr(refused) == "RedisPermit(key='k', token=0, granted=False, released=False)"


def test_expiry_and_renewal_as_in_process(redis_client: redis.Redis) -> None:
    pair = Pair(redis_client, 1, 10)
    seen = []
    for limiter, clock in pair.both():
        old = limiter.try_acquire("k")
        clock.advance(9.999999)
        valid_before = old.valid()
        busy = limiter.try_acquire("k").decision
        clock.advance(0.000001)
        after = (old.valid(), limiter.in_flight("k"))
        new = limiter.try_acquire("k")
        old.release()  # expired: frees nothing of the new holder's
        renewed_old = old.renew()
        clock.advance(8)
        renewed = new.renew()
        clock.advance(9.5)
        still = new.valid()
        clock.advance(0.5)
        seen.append((valid_before, busy, after, renewed_old, renewed, still, new.valid()))
        assert new.token > old.token  # a store fencing on tokens rejects the old holder
    assert seen[0] == seen[1]
    assert seen[1] == (
        True,
        Decision(False, 0.000001, 0, 0.000001, 1),
        (False, 0),
        False,
        True,
        True,
        False,
    )


def test_an_expired_slot_goes_to_the_waiter_with_a_larger_token(
    redis_client: redis.Redis,
) -> None:
    pair = Pair(redis_client, 1, 10)
    seen = []
    for limiter, clock in pair.both():
        stale = limiter.try_acquire("k")
        clock.advance(4)
        # The waiter sleeps on the clock (ManualClock.sleep advances it) until the
        # only moment a slot is sure to free: the expiry.
        fresh = limiter.acquire("k")
        stale.release()
        seen.append((bool(fresh), clock.now, fresh.decision, fresh.valid(), limiter.in_flight("k")))
        assert fresh.token > stale.token
    assert seen[0] == seen[1] == [(True, 10.0, Decision(True, 0.0, 0, 10.0, 1), True, 1)][0]


def test_acquire_refuses_when_its_timeout_passes_holding_nothing(
    redis_client: redis.Redis,
) -> None:
    pair = Pair(redis_client, 1, 10)
    seen = []
    for limiter, clock in pair.both():
        limiter.try_acquire("k")
        refused = limiter.acquire("k", timeout=3)
        at_three = clock.now
        zero = limiter.acquire("k", timeout=0)
        granted = limiter.acquire("k", timeout=7)  # reached exactly as the slot frees
        seen.append(
            (
                bool(refused),
                refused.token,
                refused.decision,
                at_three,
                bool(zero),
                zero.decision,
                bool(granted),
                clock.now,
            )
        )
    assert seen[0] == seen[1]
    assert seen[1][:4] == (False, 0, Decision(False, 7.0, 0, 7.0, 1), 3.0)
    assert seen[1][6:] == (True, 10.0)
    stats = pair.redis.stats()
    assert (stats["waiting"], stats["granted"], stats["refused"]) == (0, 2, 2)


def test_a_permit_is_a_context_manager_sync_and_async(redis_client: redis.Redis) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=60)
    with limiter.acquire("k") as permit:
        assert permit
        assert limiter.in_flight("k") == 1
    assert limiter.in_flight("k") == 0
    with pytest.raises(KeyError), limiter.try_acquire("k"):
        raise KeyError("the body failed: released all the same")
    assert limiter.in_flight("k") == 0

    async def main() -> None:
        async with await limiter.acquire_async("k") as held:
            assert held
            assert limiter.in_flight("k") == 1
            with limiter.try_acquire("k") as refused:  # a refusal's exit does nothing
                assert not refused
            assert limiter.in_flight("k") == 1
        assert limiter.in_flight("k") == 0

    asyncio.run(main())


def test_the_asyncio_limiter_answers_alike(redis_url: str, redis_client: redis.Redis) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        clock = ManualClock()
        limiter = AsyncRedisConcurrencyLimiter(client, 1, ttl=5, clock=clock)
        local = ConcurrencyLimiter(1, ttl=5, clock=ManualClock())
        try:
            first = await limiter.acquire("k")
            assert isinstance(first, AsyncRedisPermit)
            second = await limiter.acquire("k")  # the clock's sleep_async: 5 s, at once
            refused = await limiter.acquire_async("k", timeout=1)
            expected = [
                await local.acquire_async("k"),
                await local.acquire_async("k"),
                await local.acquire_async("k", timeout=1),
            ]
            got = [first, second, refused]
            assert [p.decision for p in got] == [p.decision for p in expected]
            assert clock.now == 6.0
            assert second.token > first.token
            assert not await first.valid()
            assert await second.valid()
            assert await limiter.in_flight("k") == 1
            async with await limiter.try_acquire("other") as held:
                assert await held.renew()
                assert await limiter.in_flight("other") == 1
            assert await limiter.in_flight("other") == 0
            await second.release()
            assert not await second.renew()
            await limiter.check()
        finally:
            await client.aclose()

    asyncio.run(main())


def test_properties_repr_stats_and_keys(redis_client: redis.Redis) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 3, ttl=0.5)
    assert (limiter.limit, limiter.ttl, limiter.on_store_error) == (3, 0.5, "local")
    assert limiter.prefix == "bucketlimit:permits:3:500000us:"
    assert (
        repr(limiter)
        == "RedisConcurrencyLimiter(limit=3, ttl=0.5, prefix='bucketlimit:permits:3:500000us:')"
    )
    assert RedisConcurrencyLimiter(redis_client, 1).ttl == 60.0
    assert limiter.redis_key("a:b") == b"bucketlimit:permits:3:500000us:{a%3Ab}:a%3Ab"
    assert limiter.client is redis_client
    permit = limiter.try_acquire("k")
    base = limiter.redis_key("k")
    # Every key of a permit expires: a holder that died leaves nothing for ever.
    assert 0 < redis_client.pttl(base) <= 1_500
    assert 0 < redis_client.pttl(base + b":h") <= 1_500
    permit.release()
    stats = limiter.stats()
    assert stats == {
        "granted": 1,
        "refused": 0,
        "released": 1,
        "abandoned": 0,
        "store_calls": stats["store_calls"],
        "script_loads": stats["script_loads"],
        "store_errors": 0,
        "fallback_decisions": 0,
        "lost_releases": 0,
        "breaker_openings": 0,
        "breaker_open": 0,
        "waiting": 0,
        "wakeups": 0,
    }
    assert stats["store_calls"] >= 2
    limiter.check()


def test_tokens_grow_across_a_key_forgotten_and_a_store_that_lost_it(
    redis_client: redis.Redis,
) -> None:
    """On the server's clock a token is at least the server's time in µs, so it grows
    even when the key's counter is gone (expired, a restart without persistence)."""
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=60)
    first = limiter.try_acquire("k")
    seconds, micros = redis_client.time()
    assert first.token <= seconds * 1_000_000 + micros
    first.release()
    redis_client.flushall()  # the store lost everything
    second = limiter.try_acquire("k")
    assert second.token > first.token


# -- waiting: FIFO, woken by the store, cancel-safe ---------------------------------------


def queued(client: redis.Redis, limiter: RedisConcurrencyLimiter, key: str) -> int:
    """The waiters queued for ``key`` on the server (the layout docs/redis.md gives)."""
    return int(client.zcard(limiter.redis_key(key) + b":q"))


def test_threads_are_granted_in_arrival_order(redis_client: redis.Redis) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=60)
    held = limiter.try_acquire("k")
    order: list[int] = []
    threads = []
    for i in range(6):

        def wait(i: int = i) -> None:
            with limiter.acquire("k", timeout=30) as permit:
                assert permit
                order.append(i)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        threads.append(thread)
        # The next one starts once this one is queued on the server.
        wait_until(lambda: queued(redis_client, limiter, "k") == len(threads), "queued")
    held.release()
    for thread in threads:
        thread.join(30)
    assert order == list(range(6))
    assert limiter.in_flight("k") == 0
    stats = limiter.stats()
    # Each release handed the slot on with a message: no waiter asked the store for it.
    assert stats["wakeups"] >= 5
    assert stats["waiting"] == 0


def test_a_waiter_notices_an_expiry_nobody_reported(redis_client: redis.Redis) -> None:
    """A holder that died tells nobody: the waiter asks when the slot is sure to be
    free, on the store's clock."""
    ttl = 0.5
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=ttl)
    gone = limiter.try_acquire("k")
    started = time.monotonic()
    permit = limiter.acquire("k", timeout=60)  # a hang guard: it frees in 0.5 s
    waited = time.monotonic() - started
    assert permit, "the waiter never noticed the expiry"
    assert permit.token > gone.token, "the token is not larger than the dead holder's"
    assert waited >= ttl - 0.1, f"granted {waited:.3f} s after asking, before the ttl {ttl} s"
    assert not gone.valid(), "the dead holder's permit is still valid"


def test_32_threads_never_hold_more_than_the_limit(redis_client: redis.Redis) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 5, ttl=60)
    lock = threading.Lock()
    inside = most = 0

    def work(_: int) -> int:
        nonlocal inside, most
        done = 0
        for _ in range(20):
            with limiter.acquire("k", timeout=60) as permit:
                assert permit
                with lock:
                    inside += 1
                    most = max(most, inside)
                with lock:
                    inside -= 1
                done += 1
        return done

    done = sum(run_threads(32, work))
    assert done == 32 * 20, f"{done} acquisitions of {32 * 20}"
    assert 1 <= most <= 5, f"{most} holders inside at once, limit 5"
    assert limiter.in_flight("k") == 0


@pytest.mark.timeout(90)
def test_tasks_with_cancels_and_wait_for_timeouts_leak_no_permit(redis_url: str) -> None:
    rng = random.Random(21)
    inside = most = 0

    async def main() -> tuple[list[Any], int, dict[str, int]]:
        client = redis.asyncio.Redis.from_url(redis_url, max_connections=400)
        limiter = AsyncRedisConcurrencyLimiter(client, 5, ttl=600)

        async def worker(timeout: float | None) -> str:
            nonlocal inside, most
            permit = await limiter.acquire("k", timeout=timeout)
            if not permit:
                return "timed out"
            async with permit:
                inside += 1
                most = max(most, inside)
                try:
                    for _ in range(rng.randint(0, 3)):
                        await asyncio.sleep(0)
                finally:
                    inside -= 1
            return "done"

        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Future[str]] = []
        for i in range(300):
            if i % 5 == 1:
                tasks.append(
                    asyncio.ensure_future(asyncio.wait_for(worker(None), rng.random() / 20))
                )
            elif i % 5 == 2:
                task = asyncio.create_task(worker(None))
                loop.call_later(rng.random() / 20, task.cancel)
                tasks.append(task)
            elif i % 5 == 3:
                tasks.append(asyncio.create_task(worker(rng.random() / 20)))
            else:
                tasks.append(asyncio.create_task(worker(None)))
            if i % 20 == 0:
                await asyncio.sleep(0)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # The rests of cancelled waits run on: wait until they have left.
        for _ in range(500):
            if limiter.stats()["waiting"] == 0 and await limiter.in_flight("k") == 0:
                break
            await asyncio.sleep(0.02)
        held = await limiter.in_flight("k")
        counted = limiter.stats()
        stats = {"waiting": counted["waiting"], "granted": counted["granted"]}
        stats |= {"released": counted["released"], "abandoned": counted["abandoned"]}
        stats["queued"] = int(await client.zcard(limiter.redis_key("k") + b":q"))
        await client.aclose()
        return list(results), held, stats

    results, held, stats = asyncio.run(main())
    assert results.count("done") >= 120  # the 120 patient ones, and some others
    assert all(
        r in ("done", "timed out") or isinstance(r, (asyncio.CancelledError, asyncio.TimeoutError))
        for r in results
    ), {type(r) for r in results}
    assert 1 <= most <= 5
    assert held == 0
    assert (stats["waiting"], stats["queued"]) == (0, 0)
    # Every grant was released by its holder, or given back by a waiter cancelled
    # after it was handed the slot (nothing expired: ttl 600 s).
    assert 0 <= stats["granted"] - stats["released"] <= stats["abandoned"]


def test_a_cancelled_waiter_handed_a_permit_gives_it_to_the_next(redis_url: str) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = AsyncRedisConcurrencyLimiter(client, 1, ttl=600)
        held = await limiter.try_acquire("k")
        first = asyncio.create_task(limiter.acquire("k"))
        second = asyncio.create_task(limiter.acquire("k"))
        while await client.zcard(limiter.redis_key("k") + b":q") < 2:
            await asyncio.sleep(0.01)
        await held.release()  # hands the slot to the first ...
        first.cancel()  # ... which is cancelled before it runs again (or while it waits)
        with pytest.raises(asyncio.CancelledError):
            await first
        permit = await asyncio.wait_for(second, 10)
        assert await permit.valid()
        assert await limiter.in_flight("k") == 1
        await permit.release()
        assert limiter.stats()["abandoned"] == 1
        await client.aclose()

    asyncio.run(main())


def test_a_sync_limiter_waits_in_async_code(redis_client: redis.Redis) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=60)

    async def main() -> None:
        held = limiter.try_acquire("k")
        waiting = asyncio.create_task(limiter.acquire_async("k", timeout=20))
        while limiter.stats()["waiting"] == 0:
            await asyncio.sleep(0.01)
        cancelled = asyncio.create_task(limiter.acquire_async("k"))
        deadline = time.monotonic() + 30
        while limiter.stats()["waiting"] < 2:  # cancelled while it waits, not before
            assert time.monotonic() < deadline, "the second never waited"
            await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        held.release()  # woken by the listener thread, through the loop
        permit = await asyncio.wait_for(waiting, 10)
        assert permit.valid()
        permit.release()

    asyncio.run(main())
    wait_until(lambda: limiter.stats()["waiting"] == 0, "the cancelled wait left")
    assert limiter.in_flight("k") == 0


# -- bad input: TypeError / ValueError, nothing sent ---------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"limit": 0}, ValueError),
        ({"limit": -1}, ValueError),
        ({"limit": 2**32}, ValueError),
        ({"limit": 1.0}, TypeError),
        ({"limit": True}, TypeError),
        ({"limit": "5"}, TypeError),
        ({"limit": None}, TypeError),
        ({"limit": 1, "ttl": 0}, ValueError),
        ({"limit": 1, "ttl": -1.0}, ValueError),
        ({"limit": 1, "ttl": math.nan}, ValueError),
        ({"limit": 1, "ttl": math.inf}, ValueError),
        ({"limit": 1, "ttl": 4e-7}, ValueError),
        ({"limit": 1, "ttl": 1e12}, ValueError),  # beyond the script's exact range
        ({"limit": 1, "ttl": "60"}, TypeError),
        ({"limit": 1, "ttl": True}, TypeError),
        ({"limit": 1, "ttl": None}, TypeError),
        ({"limit": 1, "clock": "monotonic"}, TypeError),
        ({"limit": 1, "prefix": 5}, TypeError),
        ({"limit": 1, "prefix": "a{b"}, ValueError),
        ({"limit": 1, "hash_tag": "tenant"}, TypeError),
        ({"limit": 1, "on_store_error": "locl"}, ValueError),
        ({"limit": 1, "on_store_error": 1}, TypeError),
        ({"limit": 1, "processes": 0}, ValueError),
        ({"limit": 1, "processes": 1.5}, TypeError),
        ({"limit": 1, "retry_interval": -1}, ValueError),
        ({"limit": 1, "retry_interval": "1"}, TypeError),
    ],
)
def test_bad_configuration(
    redis_client: redis.Redis, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error) as raised:
        RedisConcurrencyLimiter(redis_client, **kwargs)
    assert type(raised.value) is error
    redis_client.config_resetstat()
    with pytest.raises(error):
        RedisConcurrencyLimiter.from_url("redis://127.0.0.1:1/0", **kwargs)


def test_a_client_of_the_other_kind_is_a_type_error(
    redis_client: redis.Redis, redis_url: str
) -> None:
    with pytest.raises(TypeError, match="AsyncRedisConcurrencyLimiter"):
        RedisConcurrencyLimiter(redis.asyncio.Redis.from_url(redis_url), 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RedisConcurrencyLimiter for blocking clients"):
        AsyncRedisConcurrencyLimiter(redis_client, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RedisConcurrencyLimiter.from_url(redis_url, 1.5)  # type: ignore[arg-type]


BAD_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any], type[Exception]]] = [
    ("try_acquire", (5,), {}, TypeError),
    ("try_acquire", (b"k",), {}, TypeError),
    ("try_acquire", ("",), {}, ValueError),
    ("try_acquire", ("\ud800",), {}, ValueError),
    ("try_acquire", ("x" * (bucketlimit.MAX_KEY_BYTES + 1),), {}, ValueError),
    ("acquire", (None,), {}, TypeError),
    ("acquire", ("",), {}, ValueError),
    ("acquire", ("k",), {"timeout": -1}, ValueError),
    ("acquire", ("k",), {"timeout": math.nan}, ValueError),
    ("acquire", ("k",), {"timeout": "1"}, TypeError),
    ("acquire", ("k",), {"timeout": True}, TypeError),
    ("in_flight", (1,), {}, TypeError),
    ("in_flight", ("",), {}, ValueError),
]


@pytest.mark.parametrize(("name", "args", "kwargs", "error"), BAD_CALLS)
def test_bad_calls_raise_and_send_nothing(
    redis_client: redis.Redis,
    redis_url: str,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
) -> None:
    limiter = RedisConcurrencyLimiter(redis_client, 1, ttl=60)
    held = limiter.try_acquire("k")
    before = limiter.stats()
    redis_client.config_resetstat()
    with pytest.raises(error) as raised:
        getattr(limiter, name)(*args, **kwargs)
    assert type(raised.value) is error
    assert script_calls(redis_client) == 0
    assert limiter.stats() == before
    assert held.valid()
    assert not limiter.try_acquire("k")

    async def on_async() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        aio = AsyncRedisConcurrencyLimiter(client, 1, ttl=60)
        with pytest.raises(error):
            await getattr(aio, name)(*args, **kwargs)
        await client.aclose()

    asyncio.run(on_async())


# -- permits with rate and tokens: the *_all calls, one script -----------------------------


class Limits:
    """A tenant's three limits on Redis, one client, one clock: requests a minute,
    tokens a minute and requests in flight; and their in-process twins on a clock of
    their own, kept in step."""

    def __init__(self, client: redis.Redis, inflight: int = 1, ttl: float = 30) -> None:
        self.clock, self.local_clock = ManualClock(), ManualClock()
        # One process, fixed: the commands counted are the calls' own (no heartbeat).
        one: dict[str, Any] = {"clock": self.clock, "processes": 1}
        self.rpm = RedisTokenBucketLimiter(client, 60, 60, per=60, **one)
        self.tpm = RedisTokenBucketLimiter(client, 90_000, 90_000, per=60, **one)
        self.inflight = RedisConcurrencyLimiter(client, inflight, ttl=ttl, **one)
        lc = self.local_clock
        self.local = (
            TokenBucketLimiter(60, 60, per=60, clock=lc),
            TokenBucketLimiter(90_000, 90_000, per=60, clock=lc),
            ConcurrencyLimiter(inflight, ttl=ttl, clock=lc),
        )

    def checks(self, tokens: int, key: str = "org") -> list[Any]:
        return [(self.rpm, key, 1), (self.tpm, key, tokens), (self.inflight, key)]

    def local_checks(self, tokens: int, key: str = "org") -> list[Any]:
        rpm, tpm, inflight = self.local
        return [(rpm, key, 1), (tpm, key, tokens), (inflight, key)]

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.local_clock.advance(seconds)


def tokens_left(limiter: Any, key: str) -> int:
    probe = limiter.peek(key)
    return int(probe.remaining) + (1 if probe.allowed else 0)


def test_a_combined_acquire_is_one_evalsha(redis_client: redis.Redis) -> None:
    limits = Limits(redis_client, inflight=5, ttl=120)
    limits.inflight.in_flight("warm-up")  # the script is loaded
    redis_client.config_resetstat()
    request = acquire_all(limits.checks(3_500))
    stats = redis_client.info("commandstats")
    assert stats["cmdstat_evalsha"]["calls"] == 1
    assert "cmdstat_eval" not in stats
    assert isinstance(request, RedisReservation)
    assert request
    assert limits.inflight.in_flight("org") == 1
    request.settle([1, 1_200, 1])  # tokens back and the permit released, one script
    assert script_calls(redis_client) == 3
    assert limits.inflight.in_flight("org") == 0
    assert tokens_left(limits.tpm, "org") == 90_000 - 1_200
    # The same through the top-level router.
    again = bucketlimit.acquire_all(limits.checks(1))
    assert again
    again.cancel()
    assert limits.inflight.in_flight("org") == 0


def test_allow_all_takes_the_permit_with_the_tokens_all_or_nothing(
    redis_client: redis.Redis,
) -> None:
    limits = Limits(redis_client)
    seen = []
    sides: list[tuple[Any, Any]] = [
        (limits.checks, limits.tpm),
        (limits.local_checks, limits.local[1]),
    ]
    for checks, tpm in sides:
        held = bucketlimit.allow_all(checks(3_500))
        (permit,) = held.permits
        refused = bucketlimit.allow_all(checks(3_500))
        assert bucketlimit.allow_all([(tpm, "other", 90_000)])
        short = bucketlimit.allow_all(checks(1, key="other"))
        seen.append(
            (
                bool(held),
                permit.valid(),
                [c[2] for c in held.checks],
                bool(refused),
                refused.permits,
                refused.decision,
                bool(short),
                short.decision,
            )
        )
        held.settle(2_000)
        assert not permit.valid()
        held.cancel()
        refused.cancel()
    assert seen[0] == seen[1]
    assert seen[0][5] == Decision(False, 30.0, 0, 30.0, 1)
    # settle(2_000): one used for every check, so the request bucket is charged too.
    assert tokens_left(limits.tpm, "org") == tokens_left(limits.local[1], "org") == 88_000
    assert tokens_left(limits.rpm, "org") == tokens_left(limits.local[0], "org")
    assert limits.inflight.in_flight("org") == 0
    assert limits.inflight.in_flight("other") == 0


def test_reserve_all_never_queues_for_a_permit(redis_client: redis.Redis) -> None:
    limits = Limits(redis_client, ttl=10)
    first = reserve_all([(limits.tpm, "org", 90_000), (limits.inflight, "org")])
    assert first
    later = reserve_all([(limits.inflight, "org"), (limits.tpm, "org", 1)], max_wait=None)
    assert not later
    assert (later.decision.retry_after, later.delay) == (10.0, 10.0)
    assert tokens_left(limits.tpm, "org") == 0
    first.cancel()
    assert limits.inflight.in_flight("org") == 0
    assert tokens_left(limits.tpm, "org") == 90_000
    # A free permit, tokens in 2 s: the permit lives its ttl from then.
    assert allow_all([(limits.tpm, "org", 90_000)])
    spent = reserve_all([(limits.tpm, "org", 3_000), (limits.inflight, "x")])
    assert spent.delay == 2.0
    (permit,) = spent.permits
    limits.advance(11.999999)
    assert permit.valid()
    limits.advance(0.000001)
    assert not permit.valid()
    with pytest.raises(ValueError, match=r"for a reservation of 2 checks"):
        spent.settle([1, 2, 3])


def test_acquire_all_waits_for_the_permit_holding_no_tokens_then_for_the_tokens(
    redis_client: redis.Redis,
) -> None:
    client = redis_client
    tpm = RedisTokenBucketLimiter(client, 100, 100, per=1)
    inflight = RedisConcurrencyLimiter(client, 1, ttl=60)
    held = inflight.try_acquire("org")
    got: list[Any] = []
    thread = threading.Thread(
        target=lambda: got.append(acquire_all([(tpm, "org", 50), (inflight, "org")], timeout=30)),
        daemon=True,
    )
    thread.start()
    wait_until(lambda: inflight.stats()["waiting"] == 1, "it waits for the permit")
    # It holds no tokens while it waits for the permit.
    assert tokens_left(tpm, "org") == 100
    assert allow_all([(tpm, "org", 80)])
    held.release()
    thread.join(30)
    (request,) = got
    assert request
    assert tokens_left(tpm, "org") <= 70  # 20 left, then it took 50 (refilled a little)
    assert inflight.in_flight("org") == 1
    request.cancel()
    assert inflight.in_flight("org") == 0


def test_acquire_all_refused_by_its_timeout_holds_nothing(redis_client: redis.Redis) -> None:
    limits = Limits(redis_client, ttl=10)
    seen = []
    for checks, conc, clock in (
        (limits.checks, limits.inflight, limits.clock),
        (limits.local_checks, limits.local[2], limits.local_clock),
    ):
        blocker = conc.try_acquire("org")
        refused = bucketlimit.acquire_all(checks(3_500), timeout=3)
        seen.append(
            (
                bool(refused),
                refused.decision,
                refused.permits,
                clock.now,
                tokens_left(checks(1)[1][0], "org"),
            )
        )
        blocker.release()
    assert seen[0] == seen[1]
    assert seen[0][1] == Decision(False, 7.0, 0, 7.0, 1)
    assert limits.inflight.in_flight("org") == 0


def test_a_cancelled_acquire_all_async_spends_nothing_and_holds_nothing(redis_url: str) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        tpm = AsyncRedisTokenBucketLimiter(client, 100, 1)
        inflight = AsyncRedisConcurrencyLimiter(client, 1, ttl=60)
        held = await inflight.try_acquire("org")
        waiting = asyncio.create_task(acquire_all_async([(tpm, "org", 50), (inflight, "org")]))
        while inflight.stats()["waiting"] == 0:
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await held.release()
        for _ in range(200):
            if inflight.stats()["waiting"] == 0:
                break
            await asyncio.sleep(0.01)
        assert await inflight.in_flight("org") == 0
        assert (await tpm.peek("org")).remaining == 99
        # And a granted one through the router, released by its reservation.
        request = await bucketlimit.acquire_all_async([(tpm, "org", 10), (inflight, "org")])
        assert isinstance(request, AsyncRedisReservation)
        assert request
        assert [await p.valid() for p in request.permits] == [True]
        await request.settle([5, 1])
        assert await inflight.in_flight("org") == 0
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("check", "error"),
    [
        (lambda conc: (conc, "k", 2), ValueError),
        (lambda conc: (conc, "k", 0), ValueError),
        (lambda conc: (conc, "k", 1.0), TypeError),
        (lambda conc: (conc, "k", True), TypeError),
        (lambda conc: (conc, 5), TypeError),
        (lambda conc: (conc, ""), ValueError),
        (lambda conc: (ConcurrencyLimiter(1), "k"), TypeError),
        (lambda conc: "not a check", TypeError),
    ],
)
def test_bad_combined_checks_send_nothing(
    redis_client: redis.Redis, check: Any, error: type[Exception]
) -> None:
    tpm = RedisTokenBucketLimiter(redis_client, 10, 1)
    inflight = RedisConcurrencyLimiter(redis_client, 1, ttl=60)
    redis_client.config_resetstat()
    for call in (allow_all, reserve_all, acquire_all, bucketlimit.allow_all):
        with pytest.raises(error):
            call([(tpm, "k", 1), (inflight, "j"), check(inflight)])
    assert script_calls(redis_client) == 0
    with pytest.raises(ValueError, match="twice"):
        allow_all([(inflight, "k"), (inflight, "k")])
    other = RedisConcurrencyLimiter(redis.Redis(connection_pool=redis_client.connection_pool), 1)
    with pytest.raises(ValueError, match="same client"):
        allow_all([(tpm, "k"), (other, "k")])
    with pytest.raises(TypeError):
        allow_all([(tpm, "k"), (AsyncRedisConcurrencyLimiter(redis.asyncio.Redis(), 1), "k")])
    assert script_calls(redis_client) == 0
    assert inflight.in_flight("j") == 0
    assert tokens_left(tpm, "k") == 10


# -- a cluster: a key's permits in one slot ---------------------------------------------


def acquire_into(limiter: RedisConcurrencyLimiter, got: list[RedisPermit]) -> None:
    got.append(limiter.acquire("k", timeout=20))


def handed_on_twice(client: Any, limiter: RedisConcurrencyLimiter) -> None:
    """A holder and two waiters in turn, each queued on the server before the slot is
    released to it: the second is woken by the store's message (the listener heard
    by then), and a token grows with each grant."""
    held = limiter.try_acquire("k")
    tokens = [held.token]
    for _ in range(2):
        got: list[RedisPermit] = []
        thread = threading.Thread(target=acquire_into, args=(limiter, got), daemon=True)
        thread.start()
        wait_until(lambda: int(client.zcard(limiter.redis_key("k") + b":q")) == 1, "queued")
        held.release()
        thread.join(20)
        (held,) = got
        assert held
        tokens.append(held.token)
    held.release()
    assert tokens == sorted(set(tokens))
    assert limiter.stats()["wakeups"] >= 1
    assert limiter.in_flight("k") == 0


def test_a_cluster_keeps_each_keys_permits_in_one_slot(redis_cluster_client: RedisCluster) -> None:
    client = redis_cluster_client
    limiter = RedisConcurrencyLimiter(client, 1, ttl=60)
    handed_on_twice(client, limiter)
    slots = {key_slot(limiter.redis_key("k") + suffix) for suffix in (b"", b":h", b":q", b":g")}
    assert len(slots) == 1
    # The calls over several: keys of one tag in one script; across slots, an error
    # before anything is sent.
    tag = lambda key: key.split("/")[0]  # noqa: E731
    tenant = RedisConcurrencyLimiter(client, 2, ttl=60, prefix="t:", hash_tag=tag)
    tpm = RedisTokenBucketLimiter(client, 100, 1, prefix="tpm:", hash_tag=tag)
    request = allow_all([(tpm, "acme/alice", 5), (tenant, "acme/bob")])
    assert request
    request.cancel()
    with pytest.raises(ValueError, match="one hash slot"):
        allow_all([(tpm, "acme/alice", 5), (tenant, "globex/bob")])
    assert tenant.in_flight("globex/bob") == 0
    assert tokens_left(tpm, "acme/alice") == 100


@pytest.mark.parametrize("library", ["redis-py", "valkey-py"])
def test_valkey(valkey_server: RedisServer, library: str) -> None:
    import valkey
    import valkey.asyncio

    admin = valkey_server.client()
    admin.flushall()
    admin.close()
    client: Any = (
        redis.Redis(port=valkey_server.port)
        if library == "redis-py"
        else valkey.Valkey(port=valkey_server.port)
    )
    try:
        limiter = RedisConcurrencyLimiter(client, 1, ttl=60)
        handed_on_twice(client, limiter)
        limiter.check()
    finally:
        client.close()

    async def main() -> None:
        aio: Any = (
            redis.asyncio.Redis(port=valkey_server.port)
            if library == "redis-py"
            else valkey.asyncio.Valkey(port=valkey_server.port)
        )
        limiter = AsyncRedisConcurrencyLimiter(aio, 1, ttl=60)
        held = await limiter.try_acquire("k")
        waiting = asyncio.create_task(limiter.acquire("k", timeout=20))
        while await aio.zcard(limiter.redis_key("k") + b":q") == 0:
            await asyncio.sleep(0.01)
        await held.release()
        permit = await asyncio.wait_for(waiting, 20)
        assert permit
        assert permit.token > held.token
        await permit.release()
        assert await limiter.in_flight("k") == 0
        await limiter.check()
        await aio.aclose()

    asyncio.run(main())
