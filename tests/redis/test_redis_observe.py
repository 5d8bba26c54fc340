"""observe() over Redis: the script's ``observe`` against the in-process limiter on one
ManualClock (the pattern of test_redis_parity.py), the asyncio class, and what an
observe does when the store fails."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from typing import Any

import pytest
import redis
import redis.asyncio
from hypothesis import given
from hypothesis import strategies as st

from bucketlimit import TokenBucketLimiter
from bucketlimit.redis import RedisTokenBucketLimiter, StoreUnavailableError
from bucketlimit.testing import ManualClock
from tests.redis.test_redis_parity import (
    Config,
    PinnedAsyncRedisLimiter,
    PinnedRedisLimiter,
    _config,
    _prefix,
    trace_settings,
)

MICROS = 1_000_000
waits = st.one_of(
    st.none(), st.just(math.inf), st.integers(0, 30 * MICROS).map(lambda us: us / 1e6)
)
reports = st.tuples(
    st.just("observe"),
    st.sampled_from(["a", "b"]),
    st.integers(0, 20_000),  # remaining
    st.one_of(st.none(), st.integers(0, 20_000)),  # limit
    waits,  # reset_after
    waits,  # retry_after
    st.one_of(st.none(), st.integers(-5 * MICROS, MICROS)),  # at, relative to now
)
spends = st.tuples(
    st.sampled_from(["allow", "reserve", "charge", "peek"]),
    st.sampled_from(["a", "b"]),
    st.floats(0, 1),
)
steps = st.tuples(st.just("wait"), st.one_of(st.integers(0, 2_000), st.integers(0, 10 * MICROS)))
traces = st.lists(st.one_of(reports, reports, spends, steps), min_size=1, max_size=30)


def replay(config: Config, start: int, trace: list[Any], remote: Any, clock: ManualClock) -> Any:
    """Yields (what Redis answered, or a coroutine of it; what the in-process one did)."""
    local = TokenBucketLimiter(config.capacity, config.rate, clock, per=config.per)
    for step in trace:
        if step[0] == "wait":
            clock.advance(step[1] / MICROS)
        elif step[0] == "observe":
            _, key, remaining, limit, reset, hold, at = step
            words = {"limit": limit, "reset_after": reset, "retry_after": hold}
            if at is not None:
                words["at"] = clock.now + at / MICROS
            yield remote.observe(key, remaining, **words), local.observe(key, remaining, **words)
        else:
            op, key, fraction = step
            cost = max(1, round(fraction * config.capacity))
            if op == "reserve":
                yield remote.reserve(key, cost), local.reserve(key, cost)
            else:
                yield getattr(remote, op)(key, cost), getattr(local, op)(key, cost)


def same(remote: Any, local: Any) -> None:
    if hasattr(local, "delay"):  # a reservation
        assert (remote.decision, remote.delay) == (local.decision, local.delay)
    else:
        assert remote == local


@trace_settings
@given(config=_config(), start=st.integers(-(10**12), 10**12), trace=traces)
def test_observe_parity(
    redis_client: redis.Redis, config: Config, start: int, trace: list[Any]
) -> None:
    clock = ManualClock(start=start / MICROS)
    remote = PinnedRedisLimiter(
        redis_client, config.capacity, config.rate, clock, per=config.per, prefix=_prefix(0)
    )
    for got, want in replay(config, start, trace, remote, clock):
        same(got, want)


def test_async_observe_parity(redis_url: str) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        clock = ManualClock(1_000)
        remote = PinnedAsyncRedisLimiter(client, 110, 11, clock, prefix="async-observe:")
        trace = [
            ("observe", "a", 0, 100, 10.0, None, None),
            ("wait", 3 * MICROS),
            ("allow", "a", 0.1),
            ("observe", "a", 50, 100, 5.0, None, -MICROS),
            ("observe", "a", 0, None, None, 2.5, None),
            ("reserve", "a", 0.05),
        ]
        try:
            for got, want in replay(Config(110, 11, 1), 0, trace, remote, clock):
                same(await got, want)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_report_with_the_stores_clock_bounds_the_shared_bucket(
    redis_client: redis.Redis,
) -> None:
    one = RedisTokenBucketLimiter(redis_client, 100, 10, prefix="store-clock:")
    other = RedisTokenBucketLimiter(redis_client, 100, 10, prefix="store-clock:")
    assert one.observe("org", 30).remaining == 30
    assert other.peek("org").remaining == 29  # every worker sees it
    # Made two seconds ago (time.monotonic()): 20 more by now, so nothing changes.
    assert other.observe("org", 30, at=time.monotonic() - 2).remaining == 30
    held = other.observe("org", 0, retry_after=3)
    assert not held.allowed
    assert 2.9 < held.retry_after <= 3.0
    assert not one.reserve("org", max_wait=2.5)


def test_a_holds_end_makes_a_token_in_the_store_too(redis_client: redis.Redis) -> None:
    clock = ManualClock(1_000)
    rph = RedisTokenBucketLimiter(redis_client, 100, 100, clock, per=3600, prefix="hold-end:")
    held = rph.observe("org", 0, limit=100, reset_after=3600, retry_after=1)
    assert held.retry_after == 1.0, "the hold delayed the key beyond its end"
    clock.advance(1)
    assert rph.allow("org")
    assert rph.peek("org").retry_after == 36.0  # then the bucket's own pace


def test_bad_input_is_refused_before_anything_is_sent(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 100, 10, prefix="bad:")
    with pytest.raises(ValueError, match="remaining must be an int from 0"):
        limiter.observe("org", -1)
    with pytest.raises(TypeError, match="reset_after must be an int, float"):
        limiter.observe("org", 1, reset_after="1s")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="at must be a reading"):
        limiter.observe("org", 1, at="now")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key must be a str"):
        limiter.observe(1, 1)  # type: ignore[arg-type]
    assert limiter.stats()["store_calls"] == 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_without_the_store_a_report_is_not_applied_and_the_policy_answers() -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    local = RedisTokenBucketLimiter.from_url(
        url, 100, 10, on_store_error="local", prefix="x:", processes=1
    )
    d = local.observe("org", 0)
    assert d.degraded
    assert d.allowed
    raising = RedisTokenBucketLimiter.from_url(url, 100, 10, on_store_error="raise", prefix="y:")
    with pytest.raises(redis.ConnectionError):
        raising.observe("org", 0)
    with pytest.raises(StoreUnavailableError):
        raising.observe("org", 0)  # the breaker skips the store now
