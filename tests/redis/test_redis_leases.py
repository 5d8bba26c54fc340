"""Leases for hot keys (docs/redis.md, "Hot keys: leases"), one process, real
redis-server, time a ManualClock wherever it can be: what a lease is in the store
(an allow or a reservation of n, a record with an expiry, the bucket's cap lowered
while it is out), sizing, giving back (a new lease, close, a period's end), a
lease that dies with its process, the bound on what every caller uses in every
window (a property test over random traces), the shared bucket's own operations on
a leased key, threads, the asyncio class, the failure policies, fork, exit, a
cluster, Valkey and the metrics. The multi-process runs are in
test_redis_lease_processes.py."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, cast

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

import bucketlimit
from bucketlimit import Decision
from bucketlimit.metrics import LimiterMetrics
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    LeasePolicy,
    RedisTokenBucketLimiter,
)
from bucketlimit.testing import ManualClock
from tests.redis.test_redis_parity import PinnedRedisLimiter
from tests.support.redis_servers import RedisServer, ServerFactory

pytestmark = [pytest.mark.redis, pytest.mark.interpreters]

MICROS = 1_000_000
#: A period long on the server's real clock: a ManualClock that stands still while
#: real time runs must not see lease records expire under it (their TTL runs on
#: the server's clock, as a bucket's does: docs/redis.md).
LONG = LeasePolicy(period=60.0, max_wait=0.25)

_prefixes = iter(range(10**9))


def fresh() -> str:
    return f"lease-{next(_prefixes)}:"


def leasing(
    client: Any, capacity: int = 100, rate: float = 10, clock: Any = None, **options: Any
) -> RedisTokenBucketLimiter:
    options.setdefault("prefix", fresh())
    options.setdefault("lease", True)
    # One process, fixed: no heartbeat among the commands counted, and "local" has a
    # share from the first call (tests of the counting pass their own).
    options.setdefault("processes", 1)
    return RedisTokenBucketLimiter(client, capacity, rate, clock, **options)


def plain_twin(limiter: RedisTokenBucketLimiter, clock: Any = None) -> RedisTokenBucketLimiter:
    """The same buckets, without leasing: the shared bucket's exact answers."""
    return RedisTokenBucketLimiter(
        limiter.client, limiter.capacity, limiter.rate, clock, prefix=limiter.prefix
    )


def records(client: Any, limiter: Any, key: str) -> dict[bytes, tuple[int, int]]:
    """The key's lease records: caller -> (units, expiry µs)."""
    raw = cast("dict[bytes, bytes]", client.hgetall(limiter.redis_key(key) + b":leases"))
    return {name: cast("tuple[int, int]", tuple(map(int, v.split()))) for name, v in raw.items()}


def stored(client: redis.Redis, limiter: Any, key: str) -> list[int] | None:
    value = cast("bytes | None", client.get(limiter.redis_key(key)))
    return None if value is None else [int(x) for x in value.split()]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


# -- what a lease is ---------------------------------------------------------------------


def test_a_key_first_gets_the_stores_answer_then_a_lease_sized_from_its_demand(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    limiter = leasing(redis_client, clock=clock)
    assert limiter.lease == LeasePolicy()
    first = limiter.allow("k")
    # A lease of the call's own cost: an allow, the store's answer, no record.
    assert first == Decision(True, 0.0, 99, 0.1, 100)
    assert records(redis_client, limiter, "k") == {}
    # The second call, at the same instant, sees demand far above supply: a lease
    # of this process's share, half the capacity (one process known).
    second = limiter.allow("k")
    assert second == Decision(True, 0.0, 49, 5.1, 100)
    (_name, (units, expiry)), *others = records(redis_client, limiter, "k").items()
    assert others == []
    assert units == 50 * MICROS
    assert expiry == 1000 * MICROS + 2 * MICROS  # twice the period after it starts
    assert stored(redis_client, limiter, "k") == [
        49 * MICROS,
        1000 * MICROS,
        -1,
        50 * MICROS,
        expiry,
    ]
    before = limiter.stats()
    for left in range(48, -1, -1):
        assert limiter.allow("k") == Decision(True, 0.0, left, 5.1, 100)
    stats = limiter.stats()
    # Two calls, the first sent twice (NOSCRIPT: this script was new to the server).
    assert stats["store_calls"] == before["store_calls"] == 3
    assert stats["lease_hits"] == 49
    assert stats["allowed"] == 51
    assert (stats["lease_round_trips"], stats["lease_tokens"]) == (3, 51)


def test_leased_tokens_lower_the_shared_cap_until_given_back(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    limiter = leasing(redis_client, clock=clock)
    exact = plain_twin(limiter, clock)
    limiter.allow("k")
    limiter.allow("k")  # a lease of 50: 49 left in it
    assert exact.peek("k").remaining == 48
    # The shared bucket refills only up to the capacity less what is leased out:
    # the bucket plus the lease never hold more than 100.
    clock.advance(0.5)
    assert exact.peek("k") == Decision(True, 0.0, 49, 5.1, 100)
    assert exact.allow("k", 50) == Decision(True, 0.0, 0, 10.0, 100)
    assert not exact.allow("k")
    limiter.close()  # gives back the 49 unused
    assert records(redis_client, limiter, "k") == {}
    assert exact.peek("k").remaining == 48
    stats = limiter.stats()
    assert (stats["lease_tokens_returned"], stats["lease_tokens_expired"]) == (49, 0)
    assert stored(redis_client, limiter, "k") == [49 * MICROS, 1000_500_000]


def test_close_ends_a_lease_spent_to_its_last_token(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    """A lease with nothing left is still recorded (its tokens lower the cap until
    the record ends): close() ends it, so the bucket refills to its capacity."""
    limiter = leasing(redis_client, clock=clock)
    exact = plain_twin(limiter, clock)
    for _ in range(51):  # the first call's own lease, then a lease of 50, spent
        assert limiter.allow("k")
    assert len(records(redis_client, limiter, "k")) == 1
    assert exact.peek("k").remaining == 48  # 49 held, under a cap of 50
    limiter.close()
    assert records(redis_client, limiter, "k") == {}
    stats = limiter.stats()
    assert (stats["lease_tokens_returned"], stats["lease_tokens_expired"]) == (0, 0)
    clock.advance(1.0)  # 10 tokens of refill, no longer held at the cap of 50
    assert exact.peek("k").remaining == 58


def test_a_lease_past_its_period_goes_back_with_the_next_call(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    limiter = leasing(redis_client, clock=clock)
    exact = plain_twin(limiter, clock)
    limiter.allow("k")
    limiter.allow("k")  # a lease of 50
    for _ in range(30):
        assert limiter.allow("k")
    clock.advance(1.0)  # the period is over: the lease answers no more
    assert exact.peek("k").remaining == 49  # the cap holds its 19 still
    decision = limiter.allow("k")
    # 19 tokens go back; the demand was 31 tokens over the second: a lease of 16,
    # half a period of it.
    assert limiter.stats()["lease_tokens_returned"] == 19
    assert decision == Decision(True, 0.0, 15, 4.7, 100)
    assert exact.peek("k").remaining == 52


def test_a_lease_that_is_never_given_back_holds_its_tokens_until_its_record_expires(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    """A process that dies with a lease (here: a limiter dropped without close)
    under-admits: no one gets its tokens before its record expires, twice the
    period after it started; then the bucket refills into the room."""
    dead = leasing(redis_client, clock=clock)
    dead.allow("k")
    dead.allow("k")  # 50 leased: the bucket holds 49 of its cap of 50
    exact = plain_twin(dead, clock)
    del dead
    for _ in range(19):
        clock.advance(0.1)
        assert exact.peek("k").remaining == 49  # at its cap: refill goes nowhere
    clock.set(1002.0 - 1e-6)
    assert exact.peek("k").remaining == 49, "not one token early"
    assert not exact.peek("k", 51)
    clock.set(1002.5)  # expired at 1002.0: half a second of refill into the room
    assert exact.peek("k") == Decision(True, 0.0, 54, 4.6, 100)
    clock.set(1008.0)
    assert exact.allow("k") == Decision(True, 0.0, 99, 0.1, 100)
    assert records(redis_client, exact, "k") == {}  # the call that wrote removed it


def test_a_short_bucket_makes_the_lease_wait_its_turn(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    limiter = leasing(redis_client, clock=clock, lease=LONG)
    exact = plain_twin(limiter, clock)
    assert exact.allow("k", 100)
    # Empty: the lease waits as a reservation would, as much as max_wait brings.
    refused = limiter.allow("k")
    assert refused == Decision(False, 0.1, 0, 10.1, 100)
    calls = limiter.stats()["store_calls"]
    assert limiter.allow("k") == refused, "answered by the lease, no round trip"
    assert limiter.stats()["store_calls"] == calls
    assert not exact.peek("k")  # FIFO: a plain allow waits behind it
    clock.advance(0.1)
    assert limiter.allow("k") == Decision(True, 0.0, 0, 10.0, 100)
    stats = limiter.stats()
    assert (stats["allowed"], stats["refused"], stats["lease_hits"]) == (1, 2, 1)


def test_the_share_and_the_demand_size_a_lease(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    four = leasing(redis_client, clock=clock, processes=4)
    four.allow("k")
    assert four.allow("k").remaining == 100 // 2 // 4 - 1
    whole = leasing(redis_client, clock=clock, processes=4, lease=LeasePolicy(share=1.0))
    whole.allow("k")
    assert whole.allow("k").remaining == 25 - 1
    # A quiet key keeps the exact path: one call every 10 s is a lease of one token,
    # the call's own, which the store records nowhere.
    quiet = leasing(redis_client, clock=clock)
    for _ in range(3):
        assert quiet.allow("q").remaining == 99
        clock.advance(10)
    assert records(redis_client, quiet, "q") == {}
    assert quiet.stats()["lease_hits"] == 0
    assert LeasePolicy().size(100, 3, 1, 0, -1) == 3
    assert LeasePolicy().size(100, 1, 2, 10**6, 10**6) == 25
    assert LeasePolicy().size(10**6, 1, 1, 600, 10**6) == 300


def test_many_processes_make_leases_of_one_token_the_exact_path(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    """capacity * share / processes below 2: leasing changes nothing."""
    limiter = leasing(redis_client, clock=clock, processes=100)
    for _ in range(5):
        limiter.allow("k")
    assert records(redis_client, limiter, "k") == {}
    assert limiter.stats()["lease_hits"] == 0
    assert plain_twin(limiter, clock).peek("k").remaining == 94


# -- the bound, on random traces ---------------------------------------------------------


@dataclass(frozen=True)
class Step:
    who: int  # which caller: 0-2 lease, 3 does not
    cost: int
    then: str  # "allow" (repeat times), "close", "die"
    micros: int  # the clock moves this much first
    repeat: int


steps = st.lists(
    st.builds(
        Step,
        who=st.integers(0, 3),
        cost=st.sampled_from([1, 1, 1, 2, 5]),
        then=st.sampled_from(["allow"] * 12 + ["close", "die"]),
        micros=st.sampled_from([0, 0, 0, 1, 1_000, 50_000, 400_000, 2_000_000]),
        repeat=st.sampled_from([1, 1, 2, 5, 30]),
    ),
    min_size=1,
    max_size=80,
)
PERIODS = st.sampled_from([LeasePolicy(period=0.5, max_wait=0.25), LONG, LeasePolicy(period=1.0)])


@pytest.mark.timeout(300)
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(trace=steps, policy=PERIODS, capacity=st.sampled_from([10, 40]))
def test_no_window_ever_admits_more_than_capacity_plus_rate_times_its_length(
    redis_url: str, trace: list[Step], policy: LeasePolicy, capacity: int
) -> None:
    """Three leasing callers (dying, closing, renewing) and one that does not share
    a bucket: over every window of the trace, what they were admitted is at most
    capacity + rate * T. Each caller's own count agrees with its leases:
    admitted = leased - returned - expired."""
    client = redis.Redis.from_url(redis_url)
    clock = ManualClock(1000.0)
    prefix, rate = fresh(), 20

    def caller(i: int) -> RedisTokenBucketLimiter:
        lease: Any = policy if i < 3 else False
        # Pinned TTLs: the keys' TTLs run on the server's real clock, which a slow
        # machine runs ahead of the manual one (test_redis_parity.py says why).
        return PinnedRedisLimiter(client, capacity, rate, clock, prefix=prefix, lease=lease)

    callers = [caller(i) for i in range(4)]
    admitted: list[tuple[int, int]] = []  # (µs, cost)
    used = [0] * 4
    try:
        for step in trace:
            clock.advance(step.micros / MICROS)
            limiter = callers[step.who]
            if step.then == "allow" or step.who == 3:
                cost = min(step.cost, capacity)
                for _ in range(step.repeat):
                    if limiter.allow("k", cost):
                        admitted.append((round(clock.now * MICROS), cost))
                        used[step.who] += cost
            elif step.then == "close":
                limiter.close()
                check_accounts(limiter, used[step.who])
            else:  # dies: its leases are never given back
                callers[step.who] = caller(step.who)
                used[step.who] = 0
        for who in range(3):
            callers[who].close()
            check_accounts(callers[who], used[who])
    finally:
        client.close()
    # Every window [a, b] that starts at an admitted call.
    for i, (start, _) in enumerate(admitted):
        total = 0
        for at, cost in admitted[i:]:
            total += cost
            assert total <= capacity + rate * (at - start + 1) / MICROS, (start, at, total)


def check_accounts(limiter: RedisTokenBucketLimiter, used: int) -> None:
    stats = limiter.stats()
    leased = stats["lease_tokens"] - stats["lease_tokens_returned"] - stats["lease_tokens_expired"]
    assert leased == used


# -- the shared bucket's own operations on a leased key --------------------------------


def test_the_shared_buckets_operations_respect_the_leases_out(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    limiter = leasing(redis_client, clock=clock, lease=LONG)
    other = leasing(redis_client, clock=clock, lease=LONG, prefix="other:")
    limiter.allow("k")
    limiter.allow("k")  # 50 leased out, 49 left in the bucket
    # peek answers as allow would, from the lease; refund, charge, reserve,
    # allow_all and allow_many go to the shared bucket, whose cap is 50 while the
    # lease is out.
    assert limiter.peek("k") == Decision(True, 0.0, 48, 5.1, 100)
    assert limiter.peek("k", 50) == Decision(False, 0.1, 49, 5.1, 100), "the bucket's answer"
    assert limiter.stats()["lease_hits"] == 0
    limiter.refund("k", 10)
    assert limiter.peek("k", 50).remaining == 0, "a refund never passes the cap"
    assert limiter.charge("k", 9) == Decision(True, 0.0, 41, 5.9, 100)
    assert bucketlimit.allow_all([(limiter, "k", 41), (other, "k", 1)])
    assert limiter.allow_many([("k", 1), ("j", 1)]) == [
        Decision(False, 0.1, 0, 10.0, 100),
        Decision(True, 0.0, 99, 0.1, 100),
    ]
    reservation = limiter.reserve("k", 2, max_wait=1)
    assert reservation.delay == 0.2
    reservation.cancel()
    # reset makes the shared bucket full again, forgetting what was spent, leases
    # included (docs/redis.md); the next lease call reads their records again.
    limiter.reset("k")
    assert plain_twin(limiter, clock).peek("k").remaining == 99
    limiter.close()
    assert limiter.peek("k").remaining == 98


def test_a_batch_sends_an_allow_of_a_leased_bucket_alone(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    """Group commit (a limiter without leasing sharing round trips) on a key another
    process leases: the batch's script leaves that bucket to the one-key call."""
    leased = leasing(redis_client, clock=clock, lease=LONG)
    leased.allow("k")
    leased.allow("k")
    batching = RedisTokenBucketLimiter(
        redis_client, 100, 10, clock, prefix=leased.prefix, batching=True, processes=1
    )
    before = batching.stats()["store_calls"]
    assert batching.allow_many([("a", 1), ("k", 1), ("b", 1), ("k", 48), ("k", 1)]) == [
        Decision(True, 0.0, 99, 0.1, 100),
        Decision(True, 0.0, 48, 5.2, 100),
        Decision(True, 0.0, 99, 0.1, 100),
        Decision(True, 0.0, 0, 10.0, 100),
        Decision(False, 0.1, 0, 10.0, 100),
    ]
    # One batch (a, k, b, k, k), then each k alone.
    assert batching.stats()["store_calls"] - before == 4
    results: list[bool] = []

    def call() -> None:
        results.append(bool(batching.allow("k")))

    clock.advance(1.0)  # 10 tokens
    threads = [threading.Thread(target=call) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sum(results) == 10


def test_threads_sharing_a_leasing_limiter_spend_exactly_the_quota(
    redis_client: redis.Redis,
) -> None:
    """Rate 0 (a quota), 8 threads: exactly the capacity is admitted, whether from a
    lease or, while another thread renews, from the shared bucket."""
    limiter = leasing(redis_client, capacity=5_000, rate=0)
    counts: list[int] = []

    def spend() -> None:
        mine = refusals = 0
        while refusals < 50:
            if limiter.allow("q"):
                mine += 1
                refusals = 0
            else:
                refusals += 1
        counts.append(mine)

    threads = [threading.Thread(target=spend) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    limiter.close()
    assert sum(counts) == 5_000
    stats = limiter.stats()
    assert stats["allowed"] == 5_000
    assert stats["lease_hits"] > 4_000
    assert plain_twin(limiter).peek("q").remaining == 0


# -- the asyncio class -------------------------------------------------------------------


def test_the_asyncio_class_leases_alike(redis_url: str) -> None:
    async def main() -> tuple[list[Decision], dict[str, int], list[int] | None]:
        client = redis.asyncio.Redis.from_url(redis_url)
        clock = ManualClock(1000.0)
        prefix = fresh()
        limiter = AsyncRedisTokenBucketLimiter(client, 100, 10, clock, prefix=prefix, lease=True)
        answers = [await limiter.allow("k") for _ in range(3)]
        # 50 tasks at once: one renews when the lease runs out, the others meanwhile
        # ask the shared bucket.
        answers += await asyncio.gather(*(limiter.allow("k") for _ in range(50)))
        async with limiter:
            pass  # __aexit__: aclose() gives the lease back
        stats = cast("dict[str, int]", limiter.stats())
        value = await client.get(limiter.redis_key("k"))
        await client.aclose()
        return answers, stats, None if value is None else [int(x) for x in value.split()]

    answers, stats, bucket = asyncio.run(main())
    assert answers[:3] == [
        Decision(True, 0.0, 99, 0.1, 100),
        Decision(True, 0.0, 49, 5.1, 100),
        Decision(True, 0.0, 48, 5.1, 100),
    ]
    # 48 from the lease, 1 from the renewal, and the shared bucket's answer to the
    # task that found the renewal on its way: allowed or not, by the order in which
    # the store ran the two. Nothing lost, nothing made: the rest is in the bucket.
    admitted = sum(map(bool, answers))
    assert admitted in (52, 53)
    assert stats["allowed"] == admitted
    assert bucket is not None
    assert bucket[:2] == [(100 - admitted) * MICROS, 1000 * MICROS]


def test_an_asyncio_refusal_from_a_waiting_lease_still_yields(redis_url: str) -> None:
    async def main() -> int:
        client = redis.asyncio.Redis.from_url(redis_url)
        clock = ManualClock(1000.0)
        limiter = AsyncRedisTokenBucketLimiter(
            client, 10, 1, clock, prefix=fresh(), lease=LONG, batching=False
        )
        assert await limiter.allow("k", 10)
        assert not await limiter.allow("k")  # a lease waits its turn (1 s)
        others = 0

        async def other() -> None:
            nonlocal others
            while True:
                others += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        for _ in range(100):
            assert not await limiter.allow("k")  # answered by the waiting lease
        task.cancel()
        await client.aclose()
        return others

    assert asyncio.run(main()) >= 99


# -- failures ---------------------------------------------------------------------------


def test_leases_keep_serving_while_the_store_is_down_then_the_policy_answers(
    redis_server_factory: ServerFactory, clock: ManualClock
) -> None:
    server = redis_server_factory.start()
    client = redis.Redis(
        port=server.port,
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
        retry=Retry(NoBackoff(), 0),
    )
    limiter = leasing(client, clock=clock, retry_interval=60)
    closed = leasing(client, clock=clock, retry_interval=60, on_store_error="raise")
    for each in (limiter, closed):
        each.allow("k")
        each.allow("k")
    server.stop()
    for _ in range(10):
        assert limiter.allow("k") == Decision(True, 0.0, limiter.allow("k").remaining + 1, 5.1, 100)
    clock.advance(1.0)  # past the period: the next call renews, and cannot
    degraded = limiter.allow("k")
    assert degraded.allowed
    assert degraded.degraded
    stats = limiter.stats()
    assert stats["lease_tokens_expired"] == 29  # 49 - 20: spent, for the store
    assert stats["fallback_decisions"] == 1
    assert stats["breaker_openings"] == 1
    clock.advance(1.0)
    with pytest.raises(redis.ConnectionError):
        closed.allow("k")
    limiter.close()  # nothing to give back; a client you built stays open
    client.close()


def test_a_corrupt_bucket_is_never_an_allow_with_leases(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    limiter = leasing(redis_client, clock=clock)
    limiter.allow("k")
    limiter.allow("k")
    redis_client.hset(limiter.redis_key("k") + b":leases", "someone", "not a lease")
    clock.advance(1.0)
    refused = limiter.allow("k")
    assert not refused.allowed
    assert refused.degraded
    redis_client.set(limiter.redis_key("j"), "1 2 3 4")
    assert limiter.allow("j").degraded


def test_bad_input_is_checked_and_changes_nothing(
    redis_client: redis.Redis, clock: ManualClock
) -> None:
    limiter = leasing(redis_client, clock=clock)
    limiter.allow("k")
    limiter.allow("k")
    before = limiter.stats()
    for key, cost, error in [
        ("", 1, ValueError),
        ("k", 0, ValueError),
        ("k", 101, ValueError),
        ("k", 1.5, TypeError),
        ("k", True, TypeError),
        (3, 1, TypeError),
        ("\ud800", 1, ValueError),
    ]:
        with pytest.raises(error):
            limiter.allow(key, cost)  # type: ignore[arg-type]
    assert limiter.stats() == before
    assert limiter.allow("k").remaining == 48
    for lease, error in [("yes", TypeError), (1, TypeError), (LeasePolicy, TypeError)]:
        with pytest.raises(error, match="lease must be a bool or a LeasePolicy"):
            leasing(redis_client, lease=lease)
    bad: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"period": 0}, ValueError),
        ({"period": -1.0}, ValueError),
        ({"period": math.inf}, ValueError),
        ({"period": math.nan}, ValueError),
        ({"period": 3601}, ValueError),
        ({"period": True}, TypeError),
        ({"period": "1"}, TypeError),
        ({"share": 0}, ValueError),
        ({"share": 1.5}, ValueError),
        ({"share": None}, TypeError),
        ({"max_wait": -0.1}, ValueError),
        ({"max_wait": 2.0}, ValueError),
    ]
    for options, error in bad:
        with pytest.raises(error):
            LeasePolicy(**options)


# -- fork, exit ----------------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="no fork() on Windows")
def test_a_forked_child_starts_with_no_lease(redis_client: redis.Redis, clock: ManualClock) -> None:
    limiter = leasing(redis_client, clock=clock, lease=LONG)
    limiter.allow("k")
    limiter.allow("k")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on
        code = 1
        try:
            first = limiter.allow("k")
            stats = limiter.stats()
            # Its first call is the store's answer (the parent's 49 stay the parent's),
            # its second a lease of its own, recorded beside the parent's.
            ok = first.remaining == 48 and stats["lease_hits"] == 0
            second = limiter.allow("k")
            ok = ok and second.remaining == 47 and len(records(redis_client, limiter, "k")) == 2
            os.write(write, b"ok" if ok else repr((first, stats)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert said == b"ok"
    assert limiter.allow("k").remaining == 48, "the parent's lease is its own"
    limiter.close()
    assert list(records(redis_client, limiter, "k")) != []  # the child's, never given back


EXITING = """
import asyncio, sys
import redis, redis.asyncio
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, LeasePolicy, RedisTokenBucketLimiter
url, prefix, kind = sys.argv[1:]
# A period of an hour: the second lease is the whole share (50) however slowly the
# machine runs the two calls (a lease is half a period of the demand seen).
lease = LeasePolicy(period=3600.0)
if kind == "sync":
    client = redis.Redis.from_url(url)
    limiter = RedisTokenBucketLimiter(client, 100, 0.001, prefix=prefix, lease=lease)
    assert limiter.allow("k") and limiter.allow("k").remaining == 49
else:
    async def main():
        global limiter
        client = redis.asyncio.Redis.from_url(url)
        limiter = AsyncRedisTokenBucketLimiter(client, 100, 0.001, prefix=prefix, lease=lease)
        assert await limiter.allow("k") and (await limiter.allow("k")).remaining == 49
    asyncio.run(main())
print("leased")
"""


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_interpreter_exit_gives_the_leases_back(
    redis_client: redis.Redis, redis_url: str, kind: str
) -> None:
    prefix = fresh()
    done = subprocess.run(
        [sys.executable, "-c", EXITING, redis_url, prefix, kind],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "leased"
    exact = RedisTokenBucketLimiter(redis_client, 100, 0.001, prefix=prefix)
    assert records(redis_client, exact, "k") == {}
    assert exact.peek("k").remaining == 97  # 2 used, 49 back


# -- a cluster, Valkey, metrics ----------------------------------------------------------


def test_leases_on_a_cluster(redis_cluster_client: RedisCluster) -> None:
    clock = ManualClock(1000.0)
    limiters = [leasing(redis_cluster_client, clock=clock, lease=LONG) for _ in range(2)]
    prefix = limiters[0].prefix
    limiters[1] = leasing(redis_cluster_client, clock=clock, lease=LONG, prefix=prefix)
    for key in ("a", "b", "c"):
        for limiter in limiters:
            limiter.allow(key)
            limiter.allow(key)
    exact = RedisTokenBucketLimiter(redis_cluster_client, 100, 10, clock, prefix=prefix)
    for key in ("a", "b", "c"):
        # 1 + 50 by the first, 1 + 48 by the second: the shared bucket is empty.
        assert not exact.peek(key)
        assert len(records(redis_cluster_client, exact, key)) == 2
    for limiter in limiters:
        limiter.close()
    assert [exact.peek(key).remaining for key in ("a", "b", "c")] == [95] * 3


def test_leases_on_valkey(valkey_server: RedisServer) -> None:
    client = valkey_server.client()
    client.flushall()
    clock = ManualClock(1000.0)
    limiter = leasing(client, clock=clock)
    assert limiter.allow("k")
    assert limiter.allow("k").remaining == 49
    assert plain_twin(limiter, clock).peek("k").remaining == 48
    clock.advance(3.0)  # the record expired: the bucket refills into the room
    assert plain_twin(limiter, clock).peek("k").remaining == 59
    client.close()


def test_the_lease_counters_are_metrics(redis_client: redis.Redis, clock: ManualClock) -> None:
    limiters = LimiterMetrics()
    limiter = limiters.add("hot", leasing(redis_client, clock=clock))
    for _ in range(10):
        limiter.allow("k")
    limiter.close()
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    stats = limiter.stats()
    for name in ("lease_hits", "lease_round_trips", "lease_tokens", "lease_tokens_returned"):
        value = registry.get_sample_value(f"bucketlimit_{name}_total", {"policy": "hot"})
        assert value == stats[name] > 0
    assert (
        registry.get_sample_value("bucketlimit_lease_tokens_expired_total", {"policy": "hot"}) == 0
    )
