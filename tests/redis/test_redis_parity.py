"""Parity: a Redis limiter and an in-process limiter on one ManualClock answer alike.

The same random traces (keys, costs, steps in whole µs, rates with decimals and
``per``) go through both; every Decision must be identical, for the sync and the
asyncio class, and for ``allow_all`` over two limiters of different
configurations.

One seam: Redis expires a bucket on its own real clock, after the bucket's time
to full "as if both clocks ran alike" (docs/design.md §6). A ManualClock stands still
while real time runs, so a bucket a millisecond from full could expire between
two steps of a trace and answer as full a step early. These tests therefore run
the real script with its smallest TTL raised to ten minutes (``PinnedScript``):
the arithmetic is the same, the keys just live longer than the test. The TTL
itself is tested with the unmodified script in test_redis_limiter.py.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bucketlimit
from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._redis.script import Script
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    RedisTokenBucketLimiter,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import pin_min_ttl

pytestmark = pytest.mark.interpreters

MICROS = 1_000_000


def _pinned_source() -> str:
    source = RedisTokenBucketLimiter._script.source
    pinned = source.replace("local MIN_TTL_MS = 1\n", "local MIN_TTL_MS = 600000\n")
    assert pinned != source, "_redis/scripts.lua no longer has the MIN_TTL_MS line"
    # A key's lease records too (their expiry, on the limiter's clock, is in each
    # record: the key's TTL only collects them).
    lease_ttl = "local ttl = ceil((delay + 2 * period) / 1000)\n"
    assert lease_ttl in pinned, "_redis/scripts.lua no longer has the lease records' TTL line"
    return pinned.replace(lease_ttl, "local ttl = 600000\n")


PinnedScript = Script(_pinned_source())


class PinnedRedisLimiter(RedisTokenBucketLimiter):
    _script = PinnedScript

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(client, *args, **kwargs)
        pin_min_ttl(client)  # the module's twin of the raised line, when it serves


class PinnedAsyncRedisLimiter(AsyncRedisTokenBucketLimiter):
    _script = PinnedScript

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(client, *args, **kwargs)
        pin_min_ttl(client)  # the module's twin of the raised line, when it serves


# -- traces -------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    capacity: int
    rate: float | int
    per: float | int


@dataclass(frozen=True)
class Step:
    """Advance the clock by ``micros``, then call ``op`` on limiter ``which``
    (0 or 1; "all" is allow_all over limiter 0's key and limiter 1's "global")."""

    micros: int
    op: str
    which: int
    key: str
    cost_fraction: float


def _rate() -> st.SearchStrategy[float | int]:
    whole = st.integers(0, 5000)
    decimal = st.tuples(st.integers(0, 50_000), st.integers(1, 4)).map(lambda t: t[0] / 10 ** t[1])
    return st.one_of(whole, decimal)


def _config() -> st.SearchStrategy[Config]:
    per = st.sampled_from([1, 1, 2, 60, 3600, 0.5, 0.25, 7, 1.5, 86400])
    capacity = st.one_of(st.integers(1, 20), st.integers(1, 10_000))
    return st.builds(Config, capacity, _rate(), per).filter(_fits_lua)


def _fits_lua(config: Config) -> bool:
    capacity, p, unit = bucketlimit._core.exact_units(config.capacity, config.rate, per=config.per)
    return (1 + bucketlimit.MAX_DEBT_CAPACITIES) * capacity * unit + p < 2**53


steps = st.lists(
    st.builds(
        Step,
        micros=st.one_of(
            st.just(0), st.integers(0, 2_000), st.integers(0, 10 * MICROS), st.integers(0, 10**10)
        ),
        op=st.sampled_from(["allow", "allow", "allow", "peek", "refund", "reset", "all"]),
        which=st.integers(0, 1),
        key=st.sampled_from(["a", "b", "{a}", "a:b", "%7Ba%7D"]),
        cost_fraction=st.floats(0, 1),
    ),
    min_size=1,
    max_size=40,
)


def _cost(step: Step, *capacities: int) -> int:
    return max(1, round(step.cost_fraction * min(capacities)))


@dataclass
class Pair:
    """An in-process limiter and its Redis twin."""

    local: TokenBucketLimiter
    remote: Any


def replay(
    configs: tuple[Config, Config], start: int, trace: list[Step], make: Any
) -> Iterator[tuple[Any, Decision | None]]:
    """Yields (what Redis answered or a coroutine, what the in-process limiter answered)."""
    clock = ManualClock(start=start / MICROS)
    pairs = [
        Pair(TokenBucketLimiter(c.capacity, c.rate, clock, per=c.per), make(c, clock, i))
        for i, c in enumerate(configs)
    ]
    for step in trace:
        clock.advance(step.micros / MICROS)
        pair = pairs[step.which]
        capacity = pair.local.capacity
        if step.op == "all":
            cost = _cost(step, pairs[0].local.capacity, pairs[1].local.capacity)
            local_checks = [(pairs[0].local, step.key), (pairs[1].local, "global")]
            remote_checks = [(pairs[0].remote, step.key), (pairs[1].remote, "global")]
            yield (
                bucketlimit.allow_all(remote_checks, cost),
                bucketlimit.allow_all(local_checks, cost),
            )
        elif step.op == "reset":
            pair.local.reset(step.key)
            yield pair.remote.reset(step.key), None
        else:
            cost = _cost(step, capacity)
            method = step.op
            yield (
                getattr(pair.remote, method)(step.key, cost),
                getattr(pair.local, method)(step.key, cost),
            )


_prefixes = itertools.count()


def _prefix(i: int) -> str:
    # A fresh prefix per example: examples never see each other's buckets.
    return f"parity-{next(_prefixes)}-{i}:"


trace_settings = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@trace_settings
@given(configs=st.tuples(_config(), _config()), start=st.integers(-(10**12), 10**12), trace=steps)
def test_sync_parity(
    redis_client: redis.Redis, configs: tuple[Config, Config], start: int, trace: list[Step]
) -> None:
    def make(c: Config, clock: ManualClock, i: int) -> PinnedRedisLimiter:
        return PinnedRedisLimiter(
            redis_client, c.capacity, c.rate, clock, per=c.per, prefix=_prefix(i)
        )

    for remote, local in replay(configs, start, trace, make):
        assert remote == local


@trace_settings
@given(configs=st.tuples(_config(), _config()), start=st.integers(-(10**12), 10**12), trace=steps)
def test_async_parity(
    redis_url: str, configs: tuple[Config, Config], start: int, trace: list[Step]
) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:

            def make(c: Config, clock: ManualClock, i: int) -> PinnedAsyncRedisLimiter:
                return PinnedAsyncRedisLimiter(
                    client, c.capacity, c.rate, clock, per=c.per, prefix=_prefix(i)
                )

            for remote, local in replay(configs, start, trace, make):
                assert await remote == local
        finally:
            await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    "config",
    [
        # The edges of the exact range: one unit per µs with the largest capacity,
        # and a huge unit (rate 1/86400 per second) with a large capacity.
        Config((2**53 - 2) // (1001 * MICROS), 1, 1),
        Config(100, 1, 86400),
        Config(1, 4.5e9, 1),
    ],
)
def test_parity_at_the_edges_of_the_exact_range(redis_client: redis.Redis, config: Config) -> None:
    clock = ManualClock()
    local = TokenBucketLimiter(config.capacity, config.rate, clock, per=config.per)
    remote = PinnedRedisLimiter(redis_client, config.capacity, config.rate, clock, per=config.per)
    for cost, micros in [(config.capacity, 0), (1, 1), (1, 999_999), (config.capacity, 10**9)]:
        clock.advance(micros / MICROS)
        assert remote.peek("k", cost) == local.peek("k", cost)
        assert remote.allow("k", cost) == local.allow("k", cost)
        remote.refund("k", 1)
        local.refund("k", 1)


def test_tenth_of_a_second_steps_refill_exactly_one_token(redis_client: redis.Redis) -> None:
    """Rate 10, capacity 1, 0.1 s steps: one token per step, forever, no drift: 1,000
    steps from 0, then 1,000 from a million seconds on (where a float clock would have
    drifted by then). The pinned script: the manual clock outruns real time on
    average, but a machine that stalls 0.1 s between a step's two calls let the empty
    bucket's real-time TTL (0.1 s) expire it, and the second call found it full."""
    clock = ManualClock()
    remote = PinnedRedisLimiter(redis_client, 1, 10, clock, prefix="bucketlimit:")
    local = TokenBucketLimiter(1, 10, clock)
    for start in (0, 1_000_000):
        clock.set(start)
        for step in range(1_000):
            clock.advance(0.1)
            first = remote.allow("k")
            assert first == local.allow("k"), f"step {step} from {start} s"
            assert first.allowed, f"step {step} from {start} s: no token refilled"
            second = remote.allow("k")
            assert second == local.allow("k"), f"step {step} from {start} s"
            assert not second.allowed, f"step {step} from {start} s: two tokens in 0.1 s"
            assert second.retry_after == 0.1, f"step {step} from {start} s: {second}"
    assert redis_client.get("bucketlimit:{k}:k") == b"0 1000100000000", "not the last step's"
