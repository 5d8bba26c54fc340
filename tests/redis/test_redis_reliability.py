"""Defects found by attacking the Redis limiters, each held by a test on real servers.

Each test reproduces what failed (the figures are in its comment) and checks the
behaviour that holds now: exact counts, no degraded answer from a healthy store,
no error a caller could not have expected.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
import redis
import redis.asyncio

from bucketlimit._redis.keys import key_slot
from bucketlimit.redis import (
    AsyncRedisConcurrencyLimiter,
    AsyncRedisTokenBucketLimiter,
    LeasePolicy,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
)
from bucketlimit.testing import ManualClock
from tests.redis.test_redis_operations import key_on_node
from tests.support.redis_servers import RedisServer, ServerFactory, command
from tests.support.tcp_proxy import TcpProxy

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
    # A close() that cut the commands of the other threads in flight on a healthy
    # store would give 6 to 8 of 8 threads ValueError("I/O operation on closed file.")
    # and have others answer from the local share, logging "the store failed"; admitted
    # plus what the bucket still held would come to 105,665-200,000 of 100,000.
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
    # aclose() must not close the client under the tasks in flight: they would be
    # answered from the local share ("the store failed").
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


def test_a_limiter_that_closed_its_client_says_so(redis_server: RedisServer) -> None:
    limiter = RedisTokenBucketLimiter.from_url(redis_server.url, 3, 1, prefix="closed:")
    assert limiter.allow("k")
    limiter.close()
    with pytest.raises(RuntimeError, match=r"\(prefix='closed:'\) is closed"):
        limiter.allow("k")


def test_a_limiter_on_a_client_of_yours_goes_on_after_close(redis_client: redis.Redis) -> None:
    # close() gives back the leases; the client stays yours, open, and so does the limiter.
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1, prefix="yours:", processes=1)
    assert limiter.allow("k")
    limiter.close()
    assert limiter.allow("k")
    redis_client.ping()


# -- fencing tokens on a limiter given a clock ---------------------------------------------


def test_fencing_tokens_never_repeat_on_a_clock_when_the_store_lost_the_key(
    redis_client: redis.Redis,
) -> None:
    # On a ManualClock, a counter of a lost key that restarted from the clock's time
    # would grant the same three tokens again after the key is deleted.
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
    # 120 tasks on a plain redis.asyncio.Redis (a pool of 100 connections that raises
    # MaxConnectionsError when full) must not be answered "without the store" from the
    # local share while the store's permits are held: 5 in flight for a limit of 3, on
    # a healthy server. A call waits for a free connection.
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


# -- a wake-up connection that goes silent -------------------------------------------------


TTL = 600.0


def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 30  # a hang guard only
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


def subscribed(admin: redis.Redis) -> bool:
    """Whether a wake-up channel has its subscriber on the server."""
    channels = admin.pubsub_channels("*bucketlimit-wake*")
    return bool(channels) and admin.pubsub_numsub(*channels)[0][1] > 0


class SilentWakeups:
    """The scenario: a limiter through a proxy, one slot. Round 1: a waiter is woken
    by the store's message (the subscription is heard; on a busy machine a waiter
    that queued before the subscription was heard may ask the store first, so the
    round goes again until a grant is told by message). Round 2: a second waiter
    queues, the subscription's connection goes silent (open, delivering nothing),
    the first releases: its grant is published into the silence. The waiters wait
    without a timeout, and nothing expires for 10 minutes: a waiter not told of
    the release would ask again only then (the hang guards are 30 s)."""

    def __init__(self, server: RedisServer, proxy: TcpProxy, prefix: str) -> None:
        self.admin = redis.Redis(port=server.port)
        self.proxy = proxy
        self.url = f"redis://127.0.0.1:{proxy.port}/0"
        self.prefix = prefix
        self.holder = RedisConcurrencyLimiter(self.admin, 1, ttl=TTL, prefix=prefix, processes=1)
        self.held = self.holder.try_acquire("k")
        assert self.held

    def queued(self) -> bool:
        """Whether a waiter is in the key's queue on the store."""
        return int(self.admin.zcard(self.holder.redis_key("k") + b":q")) == 1

    def first_round(self) -> None:
        """Called while the first waiter waits: the subscription is made, then the
        slot released, handed to the waiter."""
        until(self.queued, "the first waiter to queue")
        until(lambda: subscribed(self.admin), "the wake-up subscription")
        self.held.release()

    def silence(self, stats: Any) -> None:
        """Called while the second waiter waits: its wake-ups go silent."""
        until(self.queued, "the second waiter to queue")
        assert self.proxy.black_hole("SUBSCRIBE") == 1


@pytest.mark.timeout(90)
def test_a_waiter_whose_wakeups_go_silent_is_still_handed_a_released_slot(
    redis_server: RedisServer,
) -> None:
    # With its pub/sub connection black-holed (open, delivering nothing) a waiter is
    # never woken by a message: the released slot would sit idle until the old
    # holder's ttl. The listener PINGs a silent subscription, takes an unanswered PING
    # as a lost subscription, subscribes again and has its waiters ask the store.
    with TcpProxy(redis_server.port) as proxy:
        scene = SilentWakeups(redis_server, proxy, "silent-thread:")
        limiter = RedisConcurrencyLimiter.from_url(
            scene.url, 1, ttl=TTL, prefix=scene.prefix, timeout=5, processes=1
        )
        answers: list[Any] = []
        first = threading.Thread(target=lambda: answers.append(limiter.acquire("k")))
        first.start()
        scene.first_round()
        first.join(30)
        deadline = time.monotonic() + 30  # a hang guard only
        while limiter.stats()["wakeups"] == 0:  # told by its own question: again
            assert time.monotonic() < deadline, "no grant was ever told by a message"
            again = threading.Thread(target=lambda: answers.append(limiter.acquire("k")))
            again.start()
            until(scene.queued, "a waiter to queue")
            answers.pop(0).release()
            again.join(30)
        second = threading.Thread(target=lambda: answers.append(limiter.acquire("k")), daemon=True)
        second.start()
        scene.silence(limiter.stats)
        answers[0].release()  # on the command connection, which still works
        second.join(30)
        assert not second.is_alive(), "the release never reached the waiter"
        assert [bool(a) for a in answers] == [True, True]
        answers[1].release()
        limiter.close()


@pytest.mark.timeout(90)
def test_an_asyncio_waiter_whose_wakeups_go_silent_is_still_handed_a_released_slot(
    redis_server: RedisServer,
) -> None:
    # As above, for the asyncio listener (a task).
    with TcpProxy(redis_server.port) as proxy:
        scene = SilentWakeups(redis_server, proxy, "silent-task:")

        async def main() -> list[bool]:
            limiter = AsyncRedisConcurrencyLimiter.from_url(
                scene.url, 1, ttl=TTL, prefix=scene.prefix, timeout=5, processes=1
            )
            first = asyncio.ensure_future(limiter.acquire("k"))
            await asyncio.to_thread(scene.first_round)
            held = await first
            deadline = time.monotonic() + 30  # a hang guard only
            while limiter.stats()["wakeups"] == 0:  # told by its own question: again
                assert time.monotonic() < deadline, "no grant was ever told by a message"
                again = asyncio.ensure_future(limiter.acquire("k"))
                await asyncio.to_thread(until, scene.queued, "a waiter to queue")
                await held.release()
                held = await asyncio.wait_for(again, 30)
            second = asyncio.ensure_future(limiter.acquire("k"))
            await asyncio.to_thread(scene.silence, limiter.stats)
            await held.release()
            try:
                granted = await asyncio.wait_for(second, 30)
            except TimeoutError:
                pytest.fail("the release never reached the waiter")
            await granted.release()
            await limiter.aclose()
            return [bool(held), bool(granted)]

        assert asyncio.run(main()) == [True, True]


# -- a cluster limiter built while the master of slot 0 is down --------------------------


@pytest.mark.timeout(90)
def test_a_cluster_limiter_built_while_slot_zeros_master_is_down_degrades_only_its_keys(
    redis_server_factory: ServerFactory,
) -> None:
    # The clients start by asking COMMAND of the master of slot 0; with it down and
    # retries off, every key could be degraded (48 of 48 answers), healthy masters
    # included, and the asyncio class could open every node's breaker with the dead
    # node's error. docs/redis.md: "with one master of three down only the keys of
    # its slots are degraded".
    cluster = redis_server_factory.cluster()
    cluster.servers[0].kill()  # the master of slots 0-5460
    healthy = cluster.servers[1].url.replace("redis://", "redis+cluster://")
    keys = [key_on_node(node) for node in range(3)]
    options: dict[str, Any] = {"prefix": "bucketlimit:", "processes": 1, "timeout": 1.0}
    with RedisTokenBucketLimiter.from_url(healthy, 100, 0, **options) as limiter:
        answers = [limiter.allow(key) for key in keys * 3]
        assert [a.degraded for a in answers] == [True, False, False] * 3
        assert limiter.stats()["breaker_openings"] == 1

    async def main() -> tuple[list[bool], int]:
        async with AsyncRedisTokenBucketLimiter.from_url(healthy, 100, 0, **options) as limiter:
            answers = [await limiter.allow(key) for key in keys * 3]
            return [a.degraded for a in answers], limiter.stats()["breaker_openings"]

    degraded, openings = asyncio.run(main())
    assert degraded == [True, False, False] * 3
    assert openings == 1, "a healthy node's breaker was charged with the dead node's error"


# -- a batch in a slot being migrated is split at once ----------------------------------------


def rejected_scripts(server: RedisServer) -> int:
    """EVALSHA and EVAL calls the server refused (TRYAGAIN, ASK, MOVED, ...)."""
    with server.client() as client:
        stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("rejected_calls", 0) for name in SCRIPTS)


SCRIPTS = ("evalsha", "eval")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("asyncio_client", [False, True], ids=["group commit", "asyncio"])
def test_a_batch_in_a_migrating_slot_is_refused_once_then_split(
    redis_server_factory: ServerFactory, asyncio_client: bool
) -> None:
    # A batch whose keys a migration has split between two nodes gets TRYAGAIN. Left to
    # the cluster client, it would be sent again and again (16 times, sleeping between)
    # before being split: batched allows would take 830-1,435 ms with a 0.5 s timeout.
    # A batch goes to its node once, without the client's redirections, and the first
    # TRYAGAIN, ASK or MOVED splits it.
    cluster = redis_server_factory.cluster()
    keys = [f"user-{i}" for i in range(4)]
    options: dict[str, Any] = {
        "prefix": "batch:",
        "hash_tag": lambda key: "tenant",
        "processes": 1,
        "batching": True,
        "timeout": 5.0,
    }
    url = cluster.url.replace("redis://", "redis+cluster://")
    sync = RedisTokenBucketLimiter.from_url(url, 100, 0, **options)
    for key in keys:
        assert sync.allow(key)  # every bucket exists: the migration moves two of them
    slot = key_slot(sync.redis_key(keys[0]))
    source = cluster.owner(slot)
    target = next(s for s in cluster.servers if s is not source)
    src, dst = source.client(), target.client()
    src_id, dst_id = command(src, "CLUSTER", "MYID"), command(dst, "CLUSTER", "MYID")
    command(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    moved = [sync.redis_key(key) for key in keys[:2]]
    command(src, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *moved)
    before = rejected_scripts(source) + rejected_scripts(target)
    requests = [(key, 1) for key in keys]
    if asyncio_client:

        async def main() -> list[Any]:
            async with AsyncRedisTokenBucketLimiter.from_url(url, 100, 0, **options) as limiter:
                return await limiter.allow_many(requests)

        answers = asyncio.run(main())
    else:
        answers = sync.allow_many(requests)
    refused = rejected_scripts(source) + rejected_scripts(target) - before
    sync.close()
    src.close()
    dst.close()
    assert [a.remaining for a in answers] == [98] * 4, "each allow charged once, exactly"
    assert not any(a.degraded for a in answers)
    if not asyncio_client:
        # One refusal for the batch, and at most one ASK for each allow sent alone
        # (the client follows it), not the 35 of a batch left to the client's retries.
        # (The asyncio cluster clients lose their ASKING among pooled connections and
        # bounce an allow sent alone up to 16 times before the driver follows the ASK
        # itself: drivers.follow_asks.)
        assert refused <= 1 + len(keys), f"{refused} scripts refused for a batch of {len(keys)}"


# -- a lease that takes what the bucket holds, part of a token left ---------------------------


def test_a_lease_taken_from_a_bucket_holding_part_of_a_token_waits_no_time(
    redis_client: redis.Redis,
) -> None:
    # A lease granted by the waiting branch (the bucket holds less than half of what
    # the lease wants) that leaves part of a token must not answer a negative delay:
    # allow() would raise ValueError('retry_after must be >= 0 ... got -9e-06').
    clock = ManualClock(1000.0)
    options: dict[str, Any] = {"prefix": "partial:", "processes": 1}
    plain = RedisTokenBucketLimiter(redis_client, 100, 10, clock, **options)
    leasing = RedisTokenBucketLimiter(
        redis_client, 100, 10, clock, lease=LeasePolicy(max_wait=0), **options
    )
    assert plain.allow("k", 97).remaining == 3
    clock.advance(0.05)  # 3.5 tokens
    answers = [leasing.allow("k") for _ in range(3)]
    assert all(a.allowed and a.retry_after == 0.0 for a in answers), answers
    leasing.close()
