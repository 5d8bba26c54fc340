"""``bucketlimit.metrics`` over the Redis limiters: decisions, degraded answers,
store errors and the breaker, from a real redis-server and from a store that
is down, compared with each limiter's ``stats()`` after a threaded trace."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
import redis
from prometheus_client import CollectorRegistry
from redis.backoff import NoBackoff
from redis.retry import Retry

from bucketlimit.metrics import LimiterMetrics
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
)
from tests.support.redis_servers import free_port

pytestmark = pytest.mark.redis

THREADS = 4
CALLS = 50


def test_redis_metrics_match_stats_with_one_store_up_and_one_down(
    redis_client: redis.Redis,
) -> None:
    down_client = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    limiters = LimiterMetrics()
    up = limiters.add("up", RedisTokenBucketLimiter(redis_client, 30, 1, prefix="metrics-up:"))
    # The default policy answers from a local bucket while the store is down;
    # a long retry_interval keeps the breaker open for the whole test.
    down = limiters.add(
        "down", RedisTokenBucketLimiter(down_client, 30, 1, retry_interval=60, prefix="m-down:")
    )
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    seen: Counter[tuple[str, bool, bool]] = Counter()
    lock = threading.Lock()

    def client(n: int) -> None:
        mine: Counter[tuple[str, bool, bool]] = Counter()
        for i in range(CALLS):
            for name, limiter in (("up", up), ("down", down)):
                decision = limiter.allow(f"user-{(n + i) % 3}")
                mine[name, decision.allowed, decision.degraded] += 1
        with lock:
            seen.update(mine)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    down_client.close()

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    for policy, limiter in (("up", up), ("down", down)):
        stats = limiter.stats()
        allowed = seen[policy, True, False] + seen[policy, True, True]
        refused = seen[policy, False, False] + seen[policy, False, True]
        degraded = seen[policy, True, True] + seen[policy, False, True]
        assert (stats["allowed"], stats["refused"]) == (allowed, refused)
        assert allowed + refused == THREADS * CALLS
        assert stats["fallback_decisions"] == degraded
        decisions = "bucketlimit_decisions_total"
        assert value(decisions, policy=policy, outcome="allowed") == stats["allowed"]
        assert value(decisions, policy=policy, outcome="refused") == stats["refused"]
        # Additive outcomes: allowed and refused are every decision once; the
        # degraded ones are a metric of their own, not a third outcome.
        assert value(decisions, policy=policy, outcome="degraded") is None
        assert value("bucketlimit_degraded_decisions_total", policy=policy) == degraded
        for name, count in (
            ("store_errors", stats["store_errors"]),
            ("store_calls", stats["store_calls"]),
            ("script_loads", stats["script_loads"]),
            ("breaker_openings", stats["breaker_openings"]),
            ("refusal_cache_hits", stats["refusal_cache_hits"]),
            ("lost_refunds", stats["lost_refunds"]),
        ):
            assert value(f"bucketlimit_{name}_total", policy=policy) == count
        # A Redis limiter holds its buckets in the store: no keys gauge.
        assert value("bucketlimit_keys", policy=policy) is None

    # The store that answers: exact decisions, 30 tokens for 3 keys (3 x 30 at
    # most, with a little refill), nothing degraded, the breaker closed.
    assert seen["up", True, True] == seen["up", False, True] == 0
    assert 90 <= up.stats()["allowed"] <= 100
    assert value("bucketlimit_breaker_open", policy="up") == 0
    assert value("bucketlimit_breaker_openings_total", policy="up") == 0
    # The store that is down: every answer degraded, one outage, breaker open.
    assert down.stats()["fallback_decisions"] == THREADS * CALLS
    assert down.stats()["store_errors"] >= 1
    assert value("bucketlimit_breaker_openings_total", policy="down") == 1
    assert value("bucketlimit_breaker_open", policy="down") == 1
    # Reserved from this process's share while the store is down, a cancel gives
    # back to that share: no refund is lost (tests/redis/test_redis_reservations.py
    # counts those that are).
    down.reserve("user-0").cancel()
    assert value("bucketlimit_lost_refunds_total", policy="down") == 0


def test_every_command_is_timed_once_sync_and_asyncio(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """``store_round_trip_seconds``: one observation per command sent once the
    limiter is measured, by the blocking and the asyncio limiter, the token bucket
    and the concurrency limiter."""
    limiters = LimiterMetrics()
    tokens = limiters.add("tokens", RedisTokenBucketLimiter(redis_client, 5, 1, prefix="rt-t:"))
    permits = limiters.add("permits", RedisConcurrencyLimiter(redis_client, 2, prefix="rt-p:"))
    for _ in range(7):
        tokens.allow("k")
    with permits.acquire("k"):
        pass

    tokens_async = limiters.add(
        "tokens_async", AsyncRedisTokenBucketLimiter.from_url(redis_url, 5, 1, prefix="rt-a:")
    )

    async def asyncio_calls() -> None:
        for _ in range(7):
            await tokens_async.allow("k")
        await tokens_async.aclose()

    asyncio.run(asyncio_calls())
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    for name, limiter in limiters.items():
        sent = limiter.stats()["store_calls"]
        assert isinstance(sent, int)
        assert sent > 0
        timed = registry.get_sample_value(
            "bucketlimit_store_round_trip_seconds_count", {"policy": name}
        )
        assert timed == sent, f"{name}: each of the {sent} commands timed once"
    assert tokens_async.stats()["store_calls"] >= 7
