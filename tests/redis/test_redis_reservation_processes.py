"""Reservations across real processes and on Redis Cluster (docs/redis.md, "Waiting
your turn"): FIFO in the order the server ran the scripts, the token bucket's
schedule at the times the tokens are used, refusals that neither wait nor spend,
and requests + tokens in one atomic call.

Processes are real (tests/support/processes.py), released together by a barrier.
Times are compared on the machine's wall clock, the clock the server's TIME reads:
the tokens handed out are recorded after each waiter's sleep, so a late wake-up
only makes them later.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster

import bucketlimit
from bucketlimit._redis.keys import key_slot
from bucketlimit.redis import RedisReservation, RedisTokenBucketLimiter
from bucketlimit.testing import ManualClock
from tests.redis.test_redis_keys import tenant
from tests.support.processes import run_processes
from tests.support.redis_servers import RedisClusterNodes

CAPACITY, RATE = 20, 2_000
PROCESSES, CALLS = 8, 100
# The wall clock's float seconds carry about 0.2 µs at today's epoch and the
# server counts whole µs: the granularity allowed, nothing else.
GRANULARITY = 1e-5


def acquire_many(url: str, prefix: str, calls: int) -> list[float]:
    """``calls`` acquire() of one token on one key; the wall-clock time at which
    each was handed its token."""
    limiter = RedisTokenBucketLimiter(redis.Redis.from_url(url), CAPACITY, RATE, prefix=prefix)
    handed = []
    for _ in range(calls):
        decision = limiter.acquire("shared")
        assert decision.allowed
        handed.append(time.time())
    return handed


@pytest.mark.timeout(120)
def test_eight_processes_acquire_in_the_token_buckets_schedule(redis_url: str) -> None:
    prefix = f"acquire-{time.time_ns()}:"
    start = time.time()  # before any process made its first reservation
    results = run_processes(acquire_many, [(redis_url, prefix, CALLS)] * PROCESSES)
    # Every call admitted; each process served in its own call order.
    assert all(len(handed) == CALLS for handed in results), "a call was refused"
    assert all(handed == sorted(handed) for handed in results), "out of a process's call order"
    # The k-th token handed out (k from 1) never before start + (k - capacity)/rate.
    every = sorted(t for handed in results for t in handed)
    for k, at in enumerate(every, start=1):
        early = start + (k - CAPACITY) / RATE - at
        assert early <= GRANULARITY, f"token {k} handed out {early:.6f} s before its schedule"


def refuse_without_waiting(url: str, prefix: str, calls: int) -> list[Any]:
    """acquire() with a small timeout on a bucket deep in debt: every call refused,
    and none of them sleeps (time.sleep is watched)."""
    limiter = RedisTokenBucketLimiter(redis.Redis.from_url(url), CAPACITY, RATE, prefix=prefix)
    slept: list[Any] = []
    real = time.sleep
    time.sleep = slept.append  # this process's own (acquire sleeps with time.sleep)
    try:
        decisions = [limiter.acquire("deep", timeout=0.01) for _ in range(calls)]
    finally:
        time.sleep = real
    return [slept, [(d.allowed, d.retry_after > 1) for d in decisions]]


@pytest.mark.timeout(60)
def test_refusals_return_at_once_and_spend_nothing(
    redis_client: redis.Redis, redis_url: str
) -> None:
    prefix = f"refuse-{time.time_ns()}:"
    limiter = RedisTokenBucketLimiter(redis_client, CAPACITY, RATE, prefix=prefix)
    assert limiter.reserve("deep", CAPACITY)
    assert not limiter.charge("deep", 5_000)  # 2.5 s of debt
    before = redis_client.get(limiter.redis_key("deep"))
    results = run_processes(refuse_without_waiting, [(redis_url, prefix, 20)] * 4)
    for slept, decisions in results:
        assert slept == [], "a refusal never sleeps"
        assert decisions == [(False, True)] * 20
    assert redis_client.get(limiter.redis_key("deep")) == before, "refusals wrote nothing"


# -- requests + tokens in one atomic call, 4 processes ------------------------------

RPM, TPM = 60, 20_000


def spend_requests_and_tokens(url: str, prefix: str, seed: int) -> list[tuple[int, bool]]:
    client = redis.Redis.from_url(url)
    rpm = RedisTokenBucketLimiter(client, RPM, 0, prefix=prefix + "rpm:")
    tpm = RedisTokenBucketLimiter(client, TPM, 0, prefix=prefix + "tpm:")
    rng = random.Random(seed)
    spent = []
    for i in range(60):
        tokens = rng.randint(1, 1_500)
        if i % 3:
            decision = bucketlimit.allow_all([(rpm, "org", 1), (tpm, "org", tokens)])
        else:
            reservation = bucketlimit.reserve_all(
                [(rpm, "org", 1), (tpm, "org", tokens)], max_wait=0.5
            )
            assert isinstance(reservation, RedisReservation)
            decision = reservation.decision
        spent.append((tokens, decision.allowed))
    return spent


@pytest.mark.timeout(60)
def test_requests_and_tokens_in_one_call_across_four_processes(
    redis_client: redis.Redis, redis_url: str
) -> None:
    prefix = f"rpm-tpm-{time.time_ns()}:"
    results = run_processes(spend_requests_and_tokens, [(redis_url, prefix, s) for s in range(4)])
    admitted = [tokens for spent in results for tokens, allowed in spent if allowed]
    assert 0 < len(admitted) <= RPM, f"{len(admitted)} requests admitted, limit {RPM}"
    assert sum(admitted) <= TPM, f"{sum(admitted)} tokens admitted, limit {TPM}"
    refused_by_tokens = [t for spent in results for t, allowed in spent if not allowed]
    assert refused_by_tokens, "the token limit refused some"
    # Nobody was charged for a refusal by the other limit: the buckets hold
    # exactly what the admitted calls left (rate 0: nothing refills).
    rpm = RedisTokenBucketLimiter(redis_client, RPM, 0, prefix=prefix + "rpm:")
    tpm = RedisTokenBucketLimiter(redis_client, TPM, 0, prefix=prefix + "tpm:")
    requests_left, tokens_left = RPM - len(admitted), TPM - sum(admitted)
    if requests_left < RPM:
        assert rpm.peek("org", RPM).remaining == requests_left
    if requests_left:
        assert rpm.peek("org", requests_left).allowed
    if requests_left < RPM:
        assert not rpm.peek("org", requests_left + 1).allowed
    if tokens_left:
        assert tpm.peek("org", tokens_left).allowed
    assert not tpm.peek("org", tokens_left + 1).allowed


# -- Redis Cluster --------------------------------------------------------------------


def test_reserve_all_with_a_shared_tag_on_a_cluster(
    redis_cluster: RedisClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    redis_cluster.flush()
    clock = ManualClock()
    options: dict[str, Any] = {"hash_tag": tenant, "processes": 1}  # no heartbeat key
    users = RedisTokenBucketLimiter(redis_cluster_client, 2, 1, clock, prefix="u:", **options)
    tenants = RedisTokenBucketLimiter(redis_cluster_client, 3, 1, clock, prefix="t:", **options)
    delays = []
    for user in ["ann", "ann", "ann", "bob"]:
        reservation = bucketlimit.reserve_all([(users, f"acme/{user}", 1), (tenants, "acme", 1)])
        assert reservation
        delays.append(reservation.delay)
    assert delays[:3] == [0.0, 0.0, 1.0]
    assert delays[3] == 1.0
    last = bucketlimit.reserve_all([(users, "acme/cid", 1), (tenants, "acme", 1)])
    assert last.delay == 2.0
    last.cancel()  # the last waiter: one script over both buckets
    assert bucketlimit.reserve_all([(users, "acme/cid"), (tenants, "acme")]).delay == 2.0
    slots = {key_slot(key) for key in redis_cluster_client.scan_iter()}
    assert slots == {key_slot(b"acme")}
    # Across slots: refused before anything is sent.
    world = RedisTokenBucketLimiter(redis_cluster_client, 4, 1, clock, prefix="w:")
    calls = world.stats()["store_calls"] + users.stats()["store_calls"]
    with pytest.raises(ValueError, match="hash slot"):
        bucketlimit.reserve_all([(users, "globex/ann"), (world, "all")])
    with pytest.raises(ValueError, match="hash slot"):
        bucketlimit.acquire_all([(users, "globex/ann"), (world, "all")])
    assert world.stats()["store_calls"] + users.stats()["store_calls"] == calls
    assert users.peek("globex/ann", 2).allowed
