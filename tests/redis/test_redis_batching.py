"""Shared round trips (docs/redis.md, "Shared round trips"; docs/design.md §6).

Allows asked while one of the asyncio limiter's round trips is in flight go together
in the next one (``batching=True``), and ``allow_many`` decides a list in one script:
each answer must be exactly the one the call would get alone, in arrival order. The
traces run the batched limiter concurrently, the unbatched one and the in-process
limiter one call after the other, on one ManualClock (the same ``now`` for a round:
a batch's calls run at one instant), with the script's TTL pinned as in
test_redis_parity.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster

import bucketlimit
from bucketlimit import Decision, RedisLimiterStats, TokenBucketLimiter
from bucketlimit._redis.keys import key_slot
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    RedisTokenBucketLimiter,
)
from bucketlimit.testing import ManualClock
from tests.redis.test_redis_parity import PinnedAsyncRedisLimiter, PinnedRedisLimiter
from tests.support.redis_servers import CLUSTER_SLOTS, RedisClusterNodes, ServerFactory
from tests.support.tcp_proxy import TcpProxy
from tests.support.threads import interrupting_main

pytestmark = pytest.mark.interpreters

MICROS = 1_000_000
KEYS = ["a", "b", "c", "{a}"]
_prefixes = itertools.count()


def _prefix(name: str) -> str:
    return f"batch-{next(_prefixes)}-{name}:"


def url_of(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def bucket(key: str, prefix: str = "bucketlimit:") -> str:
    return f"{prefix}{{{key}}}:{key}"


# -- traces ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """Advance the clock, then ``allows`` concurrently (key, cost fraction), then one
    call that is not an allow, on its own: a peek, an allow_all with a global
    bucket, a reservation (cancelled or kept) or a refund."""

    micros: int
    allows: list[tuple[str, float]]
    then: str
    key: str
    fraction: float


rounds = st.lists(
    st.builds(
        Round,
        micros=st.one_of(st.just(0), st.integers(0, 2_000), st.integers(0, 10 * MICROS)),
        allows=st.lists(st.tuples(st.sampled_from(KEYS), st.floats(0, 1)), min_size=1, max_size=24),
        then=st.sampled_from(["none", "peek", "all", "reserve", "reserve-cancel", "refund"]),
        key=st.sampled_from(KEYS),
        fraction=st.floats(0, 1),
    ),
    min_size=1,
    max_size=12,
)
capacities = st.tuples(st.integers(1, 12), st.sampled_from([0, 1, 3, 1000]))


def _cost(fraction: float, capacity: int) -> int:
    return max(1, round(fraction * capacity))


trace_settings = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=60
)


@pytest.mark.timeout(120)
@trace_settings
@given(config=capacities, trace=rounds)
def test_batched_allows_answer_as_unbatched_and_in_process(
    redis_url: str, config: tuple[int, int], trace: list[Round]
) -> None:
    capacity, rate = config

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        clock = ManualClock(start=1000.0)
        made = []
        for batching in (True, False):
            limiters = (
                PinnedAsyncRedisLimiter(
                    client, capacity, rate, clock, prefix=_prefix("k"), batching=batching
                ),
                PinnedAsyncRedisLimiter(client, 3 * capacity, rate, clock, prefix=_prefix("g")),
            )
            made.append(limiters)
        (batched, batched_global), (alone, alone_global) = made
        local = TokenBucketLimiter(capacity, rate, clock)
        local_global = TokenBucketLimiter(3 * capacity, rate, clock)
        assert batched.batching
        assert not alone.batching
        try:
            for step in trace:
                clock.advance(step.micros / MICROS)
                costs = [(key, _cost(f, capacity)) for key, f in step.allows]
                together = await asyncio.gather(*(batched.allow(k, c) for k, c in costs))
                one_by_one = [await alone.allow(k, c) for k, c in costs]
                expected = [local.allow(k, c) for k, c in costs]
                assert list(together) == one_by_one == expected
                cost = _cost(step.fraction, capacity)
                key = step.key
                if step.then == "peek":
                    assert await batched.peek(key, cost) == await alone.peek(key, cost)
                    assert await alone.peek(key, cost) == local.peek(key, cost)
                elif step.then == "all":
                    got = [
                        await bucketlimit.allow_all([(lim, key), (glob, "all")], cost)
                        for lim, glob in ((batched, batched_global), (alone, alone_global))
                    ]
                    want = bucketlimit.allow_all([(local, key), (local_global, "all")], cost)
                    assert got == [want, want]
                elif step.then.startswith("reserve"):
                    reservations = [await lim.reserve(key, cost) for lim in (batched, alone)]
                    mine = local.reserve(key, cost)
                    for reservation in reservations:
                        assert reservation.decision == mine.decision
                        assert reservation.delay == mine.delay
                        if step.then == "reserve-cancel":
                            await reservation.cancel()
                    if step.then == "reserve-cancel":
                        mine.cancel()
                elif step.then == "refund":
                    await batched.refund(key, cost)
                    await alone.refund(key, cost)
                    local.refund(key, cost)
                # allow_many: the same answers as allows one by one, on the same buckets.
                listed = await batched.allow_many(costs)
                assert listed == [await alone.allow(k, c) for k, c in costs]
                assert listed == [local.allow(k, c) for k, c in costs]
        finally:
            await client.aclose()

    asyncio.run(main())


@trace_settings
@given(config=capacities, trace=rounds)
def test_sync_allow_many_answers_as_allows_one_by_one(
    redis_client: redis.Redis, config: tuple[int, int], trace: list[Round]
) -> None:
    capacity, rate = config
    clock = ManualClock(start=1000.0)
    many = PinnedRedisLimiter(redis_client, capacity, rate, clock, prefix=_prefix("m"))
    alone = PinnedRedisLimiter(redis_client, capacity, rate, clock, prefix=_prefix("o"))
    local = TokenBucketLimiter(capacity, rate, clock)
    for step in trace:
        clock.advance(step.micros / MICROS)
        costs = [(key, _cost(f, capacity)) for key, f in step.allows]
        expected = [local.allow(k, c) for k, c in costs]
        assert many.allow_many(costs) == expected
        assert [alone.allow(k, c) for k, c in costs] == expected


def test_concurrent_allows_share_a_round_trip_in_arrival_order(redis_url: str) -> None:
    # On the server's clock: 40 allows of a bucket of 10 that refills one token an
    # hour, 39 of them in one round trip: exactly 10 allowed, in arrival order.
    async def main() -> tuple[list[Decision], RedisLimiterStats, int]:
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = AsyncRedisTokenBucketLimiter(client, 10, 1, per=3600, prefix="one-instant:")
        try:
            await limiter.check()
            before = limiter.stats()["store_calls"]
            answers = await asyncio.gather(*(limiter.allow("k") for _ in range(40)))
            return list(answers), limiter.stats(), before
        finally:
            await client.aclose()

    answers, stats, before = asyncio.run(main())
    assert [a.allowed for a in answers] == [True] * 10 + [False] * 30
    assert [a.remaining for a in answers[:10]] == list(range(9, -1, -1))
    assert stats["allowed"] == 10
    assert stats["refused"] == 30
    # The first allow alone, then the other 39 together.
    assert stats["store_calls"] - before == 2


def test_allow_many_on_a_sync_limiter_shares_one_script(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 0, prefix="many-sync:")
    limiter.check()
    before = limiter.stats()["store_calls"]
    answers = limiter.allow_many([("a", 1), ("a", 2), ("a", 1), ("b", 3), ("c", 1)])
    assert [a.allowed for a in answers] == [True, True, False, True, True]
    assert [a.remaining for a in answers] == [2, 0, 0, 0, 2]
    assert limiter.stats()["store_calls"] == before + 1
    assert limiter.allow_many([]) == []


def test_a_corrupt_key_in_a_batch_fails_only_its_own_allow(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(
        redis_client, 3, 0, prefix="many-corrupt:", on_store_error="local"
    )
    redis_client.set(bucket("bad", "many-corrupt:"), b"not a bucket")
    redis_client.hset(bucket("hash", "many-corrupt:"), "a", 1)
    answers = limiter.allow_many([("a", 1), ("bad", 1), ("hash", 1), ("a", 1)])
    assert [a.allowed for a in answers] == [True, False, False, True]
    assert [a.degraded for a in answers] == [False, True, True, False]
    assert [a.remaining for a in (answers[0], answers[3])] == [2, 1]
    assert limiter.stats()["store_errors"] == 2
    assert redis_client.get(bucket("bad", "many-corrupt:")) == b"not a bucket"


@pytest.mark.parametrize(
    ("requests", "error"),
    [
        ("ab", TypeError),
        (None, TypeError),
        ([("a", 1), "b"], TypeError),
        ([("a", 1), ("b", 1, 2)], TypeError),
        ([("a", 1), (2, 1)], TypeError),
        ([("a", 1), ("b", 1.5)], TypeError),
        ([("a", 1), ("b", True)], TypeError),
        ([("a", 1), ("b", 0)], ValueError),
        ([("a", 1), ("b", 4)], ValueError),
        ([("a", 1), ("b", -1)], ValueError),
    ],
)
def test_allow_many_rejects_bad_input_before_sending_anything(
    redis_url: str, redis_client: redis.Redis, requests: Any, error: type[Exception]
) -> None:
    prefix = _prefix("bad")
    sync = RedisTokenBucketLimiter(redis_client, 3, 1, prefix=prefix)
    with pytest.raises(error):
        sync.allow_many(requests)
    assert sync.stats()["store_calls"] == 0

    async def main() -> int:
        client = redis.asyncio.Redis.from_url(redis_url)
        limiter = AsyncRedisTokenBucketLimiter(client, 3, 1, prefix=prefix)
        try:
            with pytest.raises(error):
                await limiter.allow_many(requests)
            return limiter.stats()["store_calls"]
        finally:
            await client.aclose()

    assert asyncio.run(main()) == 0
    assert redis_client.exists(bucket("a", prefix)) == 0


def test_batching_is_a_bool_and_off_by_default_for_threads(redis_client: redis.Redis) -> None:
    assert not RedisTokenBucketLimiter(redis_client, 3, 1, prefix="bucketlimit:").batching
    assert RedisTokenBucketLimiter(
        redis_client, 3, 1, batching=True, prefix="bucketlimit:"
    ).batching
    with pytest.raises(TypeError, match="batching must be a bool"):
        RedisTokenBucketLimiter(redis_client, 3, 1, batching=1, prefix="bucketlimit:")  # type: ignore[arg-type]
    assert AsyncRedisTokenBucketLimiter.from_url(
        "redis://127.0.0.1:1/0", 3, 1, prefix="bucketlimit:"
    ).batching
    off = AsyncRedisTokenBucketLimiter.from_url(
        "redis://127.0.0.1:1/0", 3, 1, batching=False, prefix="bucketlimit:"
    )
    assert not off.batching


# -- threads: group commit --------------------------------------------------------------


def test_threads_sharing_round_trips_charge_each_allow_once(
    redis_url: str, redis_client: redis.Redis
) -> None:
    # 8 threads x 50 allows of one bucket of 300 at rate 0: exactly 300 allowed,
    # whichever thread sent which round trip, and fewer round trips than allows.
    limiter = RedisTokenBucketLimiter.from_url(redis_url, 300, 0, prefix="threads:", batching=True)
    limiter.check()
    answers: list[Decision] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        mine = [limiter.allow("k") for _ in range(50)]
        with lock:
            answers.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(answers) == 400
    assert sum(a.allowed for a in answers) == 300
    assert not any(a.degraded for a in answers)
    stats = limiter.stats()
    assert stats["allowed"] == 300
    assert stats["refused"] == 100
    assert redis_client.get(bucket("k", "threads:")).split()[0] == b"0"  # type: ignore[union-attr]


class HeldClient(redis.Redis):
    """Holds its first EVALSHA until ``release`` is set: a round trip in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.first = True

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if self.first and args and args[0] == "EVALSHA":
            self.first = False
            self.entered.set()
            self.release.wait(10)
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


def waiting_on_an_event(thread: threading.Thread) -> bool:
    """Whether ``thread`` is blocked in ``threading.Event.wait`` called by bucketlimit
    (read off its stack): an allow waiting for the next shared round trip."""
    frame = sys._current_frames().get(thread.ident or 0)
    waiting = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wait" and code.co_filename == threading.__file__:
            waiting = True
        elif waiting and code.co_filename.startswith(PACKAGE):
            return True
        frame = frame.f_back
    return False


PACKAGE = os.path.dirname(bucketlimit.__file__)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_a_thread_interrupted_while_it_waits_leaves_no_thread_waiting(
    redis_server: Any, redis_client: redis.Redis
) -> None:
    # A waiting thread hit by KeyboardInterrupt (a real SIGINT to the main thread,
    # which waits in the queue): its allow is not sent, and the next round trip is
    # sent by the next waiter (nobody waits for ever).
    client = HeldClient(host="127.0.0.1", port=redis_server.port)
    limiter = RedisTokenBucketLimiter(client, 10, 0, prefix="interrupted:", batching=True)
    results: dict[str, Any] = {}
    main = threading.main_thread()

    def allow(name: str) -> None:
        results[name] = limiter.allow("k")

    def interrupt_main_when_it_waits() -> None:
        deadline = time.monotonic() + 10
        while not waiting_on_an_event(main) and time.monotonic() < deadline:
            time.sleep(0.001)
        interrupt()

    first = threading.Thread(target=allow, args=("first",))
    first.start()
    assert client.entered.wait(10)  # the first round trip is in flight
    with interrupting_main() as interrupt:
        interrupter = threading.Thread(target=interrupt_main_when_it_waits)
        interrupter.start()
        try:
            results["interrupted"] = limiter.allow("k")  # queued behind the first
        except KeyboardInterrupt as error:
            results["interrupted"] = error
        interrupter.join(10)
    second = threading.Thread(target=allow, args=("second",))
    second.start()
    deadline = time.monotonic() + 10
    while not waiting_on_an_event(second) and time.monotonic() < deadline:
        time.sleep(0.001)  # the second allow waits for the next round trip
    client.release.set()
    for thread in (first, second):
        thread.join(10)
        assert not thread.is_alive()
    assert isinstance(results["interrupted"], KeyboardInterrupt)
    for name in ("first", "second"):
        assert results[name].allowed
        assert not results[name].degraded
    stored = redis_client.get(bucket("k", "interrupted:"))
    assert stored is not None
    assert stored.split()[0] == b"8000000"  # 2 spent, not 3
    assert limiter.stats()["allowed"] == 2
    assert limiter.allow("k").allowed  # and the limiter goes on
    client.close()


# -- failures ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["local", "open", "closed"])
def test_a_batch_to_a_stopped_server_is_answered_by_the_policy_call_by_call(
    redis_server_factory: ServerFactory, policy: Any
) -> None:
    server = redis_server_factory.start()
    requests = [("a", 1), ("b", 2), ("a", 1), ("c", 1)]
    limiter = RedisTokenBucketLimiter.from_url(
        url_of(server.port),
        10,
        1,
        timeout=0.5,
        on_store_error=policy,
        prefix="bucketlimit:",
        processes=1,  # "local" answers from the whole capacity, counted or not
    )
    limiter.check()
    before = limiter.stats()["store_calls"]
    server.stop()
    answers = limiter.allow_many(requests)
    assert len(answers) == 4
    assert all(a.degraded for a in answers)
    assert all(a.allowed for a in answers) == (policy != "closed")
    stats = limiter.stats()
    assert stats["store_errors"] == 4
    assert stats["fallback_decisions"] == 4
    assert stats["store_calls"] == before + 1  # one batch, not resent

    async def main() -> list[Decision]:
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            url_of(server.port), 10, 1, timeout=0.5, on_store_error=policy, prefix="bucketlimit:"
        )
        return await limiter.allow_many(requests)

    assert all(a.degraded for a in asyncio.run(main()))


@pytest.mark.parametrize("retry_interval", [0, 1.0])
def test_a_batch_whose_reply_is_lost_is_never_resent(
    redis_server_factory: ServerFactory, retry_interval: float
) -> None:
    # Rate 0, 100 tokens: the bucket at the server says how many allows ran there.
    # With the breaker on, the allows queued behind the lone call that
    # timed out are not sent at all: its breaker opened while they waited.
    server = redis_server_factory.start()
    admin = server.client()
    with TcpProxy(server.port) as proxy:

        async def main() -> tuple[list[Decision], RedisLimiterStats]:
            # No command on connecting (HELLO, CLIENT SETINFO): the connection made
            # again after the lone call's timeout sends the batch's script first.
            client = redis.asyncio.Redis(
                host="127.0.0.1",
                port=proxy.port,
                socket_timeout=0.3,
                retry=redis.asyncio.retry.Retry(NoBackoff(), 0),
                driver_info=None,
                protocol=2,
            )
            limiter = AsyncRedisTokenBucketLimiter(
                client,
                100,
                0,
                on_store_error="closed",
                prefix="bucketlimit:",
                retry_interval=retry_interval,
            )
            try:
                assert (await limiter.allow("k")).allowed  # the script is loaded
                sent.append(proxy.commands("EVALSHA", "EVAL"))
                proxy.drop_replies = True  # the server runs them; nobody hears back
                # The first alone, the other 10 together after it failed.
                answers = await asyncio.gather(*(limiter.allow("k") for _ in range(11)))
                proxy.drop_replies = False
                return list(answers), limiter.stats()
            finally:
                await limiter.client.aclose()

        sent: list[int] = []
        answers, stats = asyncio.run(main())
        sent.append(proxy.commands("EVALSHA", "EVAL"))
    assert len(answers) == 11
    assert all(a.degraded and not a.allowed for a in answers)
    assert stats["fallback_decisions"] == 11
    stored = admin.get(bucket("k"))
    assert stored is not None
    if retry_interval == 0:  # every call asks the store: the batch went, once
        assert stats["store_errors"] == 11
        assert sent[1] - sent[0] == 2  # the lone call and the batch: neither sent twice
        # Each ran once at the server: 1 + 11 tokens spent, 88 left (10**6 units a token).
        assert int(stored.split()[0]) == 88 * 10**6
    else:  # the breaker opened on the lone call: the batch was never sent
        assert stats["store_errors"] == 1
        assert sent[1] - sent[0] == 1
        assert int(stored.split()[0]) == 98 * 10**6
    admin.close()


def test_allow_many_whose_reply_is_lost_charges_once(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory.start()
    admin = server.client()
    with TcpProxy(server.port) as proxy:
        limiter = RedisTokenBucketLimiter.from_url(
            url_of(proxy.port),
            100,
            0,
            timeout=0.3,
            on_store_error="local",
            processes=2,
            prefix="bucketlimit:",
        )
        limiter.check()
        before = proxy.commands("EVALSHA", "EVAL")
        proxy.drop_next_reply()
        answers = limiter.allow_many([("k", 5), ("k", 7), ("j", 1)])
        assert all(a.degraded for a in answers)
        assert proxy.commands("EVALSHA", "EVAL") == before + 1
    assert int(admin.get(bucket("k")).split()[0]) == 88 * 10**6  # type: ignore[union-attr]
    assert int(admin.get(bucket("j")).split()[0]) == 99 * 10**6  # type: ignore[union-attr]
    admin.close()


# -- cluster ----------------------------------------------------------------------------


def _node_of(nodes: RedisClusterNodes, slot: int) -> int:
    bounds = [0, 5461, 10923, CLUSTER_SLOTS]
    return next(i for i in range(3) if bounds[i] <= slot < bounds[i + 1])


def _script_calls(nodes: RedisClusterNodes) -> list[int]:
    out = []
    for server in nodes.servers:
        client = server.client()
        stats = client.info("commandstats")
        out.append(sum(int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in ("evalsha",)))
        client.close()
    return out


def test_a_batch_over_several_slots_is_split_one_script_per_slot(
    redis_cluster: RedisClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    prefix = _prefix("cluster")
    limiter = RedisTokenBucketLimiter(redis_cluster_client, 2, 1, per=3600, prefix=prefix)
    keys = [f"user-{i}" for i in range(12)]
    requests = [(key, 1) for key in keys + keys[:5] + keys[:3]]
    limiter.allow_many([("warm-" + key, 1) for key in keys])  # the script on every node
    for server in redis_cluster.servers:
        client = server.client()
        client.config_resetstat()
        client.close()
    answers = limiter.allow_many(requests)
    assert [a.allowed for a in answers] == [True] * 17 + [False] * 3
    assert [a.remaining for a in answers] == [1] * 12 + [0] * 8
    slots = {key_slot(bucket(key, prefix).encode()) for key in keys}
    expected = [0, 0, 0]
    for slot in slots:
        expected[_node_of(redis_cluster, slot)] += 1
    assert _script_calls(redis_cluster) == expected
    assert sum(1 for n in expected if n) >= 2  # the keys span several nodes
    for key in keys:
        slot = key_slot(bucket(key, prefix).encode())
        client = redis_cluster.servers[_node_of(redis_cluster, slot)].client()
        assert client.exists(bucket(key, prefix)) == 1, key
        client.close()

    async def main() -> list[bool]:
        nodes = [AsyncClusterNode("127.0.0.1", server.port) for server in redis_cluster.servers]
        # As from_url builds it (docs/redis.md, "Resharding and failover").
        client = AsyncRedisCluster(startup_nodes=nodes, reinitialize_steps=0)
        await client.initialize()
        async_limiter = AsyncRedisTokenBucketLimiter(
            client, 2, 1, per=3600, prefix=prefix, on_store_error="raise"
        )
        try:
            got = await async_limiter.allow_many(requests)
            together = await asyncio.gather(*(async_limiter.allow(k) for k, _ in requests))
            return [a.allowed for a in got + list(together)]
        finally:
            await client.aclose()

    # Empty now but for user-5 .. user-11 (one token each): allowed once, in order.
    assert asyncio.run(main()) == [False] * 5 + [True] * 7 + [False] * 28


def test_an_allow_cancelled_while_it_waits_is_left_out_of_the_batch(
    redis_server_factory: ServerFactory,
) -> None:
    server = redis_server_factory.start()
    admin = server.client()
    with TcpProxy(server.port) as proxy:

        async def main() -> tuple[list[object], RedisLimiterStats]:
            limiter = AsyncRedisTokenBucketLimiter.from_url(
                url_of(proxy.port), 10, 0, timeout=5, on_store_error="raise", prefix="bucketlimit:"
            )
            try:
                assert (await limiter.allow("k")).allowed  # the script is loaded
                proxy.latency = 0.2  # the lone call is surely on its way meanwhile
                scripts = proxy.commands("EVALSHA", "EVAL")
                tasks = [asyncio.ensure_future(limiter.allow("k")) for _ in range(4)]
                await asyncio.sleep(0)  # each has started: one sent, three waiting
                tasks[2].cancel()
                answers = await asyncio.gather(*tasks, return_exceptions=True)
                # The lone call, then one batch of the two still waiting.
                assert proxy.commands("EVALSHA", "EVAL") == scripts + 2
                return list(answers), limiter.stats()
            finally:
                await limiter.client.aclose()

        answers, stats = asyncio.run(main())
    assert isinstance(answers[2], asyncio.CancelledError)
    assert [a.allowed for a in answers if isinstance(a, Decision)] == [True, True, True]
    assert stats["allowed"] == 4
    # 1 + 3 spent at the server: the cancelled one never reached it.
    assert int(admin.get(bucket("k")).split()[0]) == 6 * 10**6  # type: ignore[union-attr]
    admin.close()
