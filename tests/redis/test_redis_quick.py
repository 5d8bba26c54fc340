"""The common allow (``buckets.Allow``: an int cost, the breaker closed, no refusal
remembered, no heartbeat due) is answered without a flow's generators; everything
else goes through ``buckets.decide``. These tests hold the two routes equal on a real
server, through the public API: the same trace is sent twice, on two prefixes, once
with plain ``int`` costs (the common allow) and once with costs that are
``__index__`` objects (which only the general route takes), and every answer, every
counter and every stored bucket must agree."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from bucketlimit import Decision
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    RedisTokenBucketLimiter,
    StoreUnavailableError,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import ServerFactory, free_port

pytestmark = pytest.mark.interpreters

_prefixes = iter(range(10**9))


class Cost:
    """A cost the common allow does not take (not an ``int``): the general route's."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


Step = tuple[str, int, float]
steps = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 5), st.sampled_from([0, 0.25, 1.5])),
    min_size=1,
    max_size=40,
)


def pair(client: Any, cls: Any, clock: Any, **options: Any) -> tuple[Any, Any]:
    n = next(_prefixes)
    return (
        cls(client, 5, 2, clock, prefix=f"quick-{n}:", **options),
        cls(client, 5, 2, clock, prefix=f"general-{n}:", **options),
    )


def since(before: Any, limiter: Any) -> dict[str, int]:
    """What a limiter counted since ``before`` (the script may be loaded by the other
    limiter of a pair, which shares it: each pair starts after one warm-up call)."""
    return {name: value - before[name] for name, value in limiter.stats().items()}


def warmed(*limiters: Any) -> list[Any]:
    for limiter in limiters:
        limiter.peek("warm-up")
    return [limiter.stats() for limiter in limiters]


def stored(client: redis.Redis, limiter: Any, keys: list[str]) -> list[bytes | None]:
    return [client.get(limiter.redis_key(key)) for key in keys]  # type: ignore[misc]


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=steps)
def test_the_common_allow_answers_as_the_general_route(
    redis_client: redis.Redis, trace: list[Step]
) -> None:
    clock = ManualClock()
    common, general = pair(redis_client, RedisTokenBucketLimiter, clock)
    one, other = warmed(common, general)
    for key, cost, advance in trace:
        assert common.allow(key, cost) == general.allow(key, Cost(cost))
        clock.advance(advance)
    assert since(one, common) == since(other, general)
    assert stored(redis_client, common, ["a", "b", "c"]) == stored(
        redis_client, general, ["a", "b", "c"]
    )


def test_on_the_servers_clock_with_the_refusal_cache(redis_client: redis.Redis) -> None:
    # Rate 0: no answer depends on when the server ran it. The refusal cache fills on
    # the first refusal; from then on both routes answer from it alike.
    n = next(_prefixes)
    common = RedisTokenBucketLimiter(redis_client, 5, 0, prefix=f"quick-{n}:")
    general = RedisTokenBucketLimiter(redis_client, 5, 0, prefix=f"general-{n}:")
    one, other = warmed(common, general)
    for cost in [1, 2, 1, 3, 1, 1, 5, 1]:
        assert common.allow("k", cost) == general.allow("k", Cost(cost))
    assert since(one, common) == since(other, general)
    assert common.stats()["refusal_cache_hits"] > 0


def test_a_script_lost_by_the_server_is_sent_whole_by_both(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    common, general = pair(redis_client, RedisTokenBucketLimiter, clock, processes=1)
    for i in range(6):
        redis_client.script_flush()
        answer = common.allow("k", 1 + i % 2)
        redis_client.script_flush()
        assert answer == general.allow("k", Cost(1 + i % 2))
        clock.advance(0.5)
    stats = common.stats()
    assert stats == general.stats()
    assert stats["script_loads"] == 6
    assert stats["store_calls"] == 12  # each: EVALSHA, NOSCRIPT, then EVAL


@pytest.mark.parametrize("policy", ["local", "open", "closed"])
def test_a_store_that_fails_answers_alike(policy: Any) -> None:
    dead = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    clock = ManualClock()
    common, general = pair(dead, RedisTokenBucketLimiter, clock, on_store_error=policy)
    for cost in [1, 2, 1]:
        answer = common.allow("k", cost)
        assert answer.degraded
        assert answer == general.allow("k", Cost(cost))
    assert common.stats() == general.stats()
    dead.close()


def test_a_skipped_store_raises_alike_under_raise() -> None:
    # The first call fails on the store and opens the breaker; the next ones are
    # skipped (StoreUnavailableError), which the common allow answers without a flow.
    dead = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    common, general = pair(dead, RedisTokenBucketLimiter, ManualClock(), on_store_error="raise")
    for cost, error in [
        (1, redis.ConnectionError),
        (2, StoreUnavailableError),
        (1, StoreUnavailableError),
    ]:
        with pytest.raises(error):
            common.allow("k", cost)
        with pytest.raises(error):
            general.allow("k", Cost(cost))
    assert common.stats() == general.stats()
    assert common.stats()["fallback_decisions"] == 0
    dead.close()


def test_a_corrupt_bucket_is_refused_alike(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    common, general = pair(redis_client, RedisTokenBucketLimiter, clock)
    one, other = warmed(common, general)
    for limiter in (common, general):
        redis_client.set(limiter.redis_key("k"), b"not a bucket")
    refused = common.allow("k")
    assert refused == general.allow("k", Cost(1))
    assert not refused
    assert refused.degraded
    assert since(one, common) == since(other, general)


def test_the_asyncio_class_answers_alike(redis_url: str) -> None:
    async def main() -> tuple[list[Decision], list[Decision], Any, Any]:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            clock = ManualClock()
            common, general = pair(client, AsyncRedisTokenBucketLimiter, clock, batching=False)
            await common.peek("warm-up")
            await general.peek("warm-up")
            before = [common.stats(), general.stats()]
            left, right = [], []
            for key, cost in [("a", 1), ("a", 4), ("a", 1), ("b", 5), ("a", 2)]:
                left.append(await common.allow(key, cost))
                right.append(await general.allow(key, Cost(cost)))
                clock.advance(0.25)
            return left, right, since(before[0], common), since(before[1], general)
        finally:
            await client.aclose()

    left, right, one, other = asyncio.run(main())
    assert left == right
    assert one == other


def test_a_batch_of_common_allows_answers_as_the_general_route(
    redis_server_factory: ServerFactory,
) -> None:
    # The asyncio class's shared round trips carry both kinds alike.
    server = redis_server_factory.start()

    async def main() -> tuple[list[Decision], list[Decision]]:
        client = redis.asyncio.Redis(port=server.port)
        try:
            clock = ManualClock()
            common, general = pair(client, AsyncRedisTokenBucketLimiter, clock)
            await common.peek("warm-up")
            await general.peek("warm-up")
            one, other = common.stats(), general.stats()
            costs = [1, 2, 1, 1, 3, 1, 2, 1]
            left = await asyncio.gather(*(common.allow("k", c) for c in costs))
            right = await asyncio.gather(*(general.allow("k", Cost(c)) for c in costs))
            assert since(one, common) == since(other, general)
            return list(left), list(right)
        finally:
            await client.aclose()

    left, right = asyncio.run(main())
    assert left == right
