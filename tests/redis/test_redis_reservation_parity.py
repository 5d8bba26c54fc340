"""Parity for reservations: a Redis limiter and an in-process limiter on one
ManualClock give identical decisions and delays on random traces of ``allow``,
``peek``, ``reserve``, ``charge``, ``cancel``, ``settle`` and ``reserve_all`` on
several keys, sync and asyncio (docs/design.md §4). After every give-back the
buckets are compared by a peek, so a give-back that lands differently shows.

The scripts run with their smallest TTL raised (``PinnedScript``, see
test_redis_parity.py): the ManualClock stands still while real time runs.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bucketlimit
from bucketlimit import TokenBucketLimiter
from bucketlimit.testing import ManualClock
from tests.redis.test_redis_parity import (
    Config,
    PinnedAsyncRedisLimiter,
    PinnedRedisLimiter,
    _config,
)

MICROS = 1_000_000


@dataclass(frozen=True)
class Step:
    """Advance the clock by ``micros``, then ``op`` on limiter ``which``'s ``key``.
    ``pick`` chooses an outstanding reservation (cancel, settle); ``fraction`` the
    cost, the used amount of a settle or the max_wait (as a fraction of 2 s)."""

    micros: int
    op: str
    which: int
    key: str
    fraction: float
    pick: int
    bounded: bool


steps = st.lists(
    st.builds(
        Step,
        micros=st.one_of(st.just(0), st.integers(0, 2_000), st.integers(0, 3 * MICROS)),
        op=st.sampled_from(
            ["allow", "peek", "reserve", "reserve", "reserve", "charge", "cancel", "settle", "all"]
        ),
        which=st.integers(0, 1),
        key=st.sampled_from(["a", "b", "c"]),
        fraction=st.floats(0, 1),
        pick=st.integers(0, 1000),
        bounded=st.booleans(),
    ),
    min_size=1,
    max_size=40,
)

_prefixes = itertools.count()


def _prefix(i: int) -> str:
    return f"reserve-parity-{next(_prefixes)}-{i}:"


def _cost(step: Step, capacity: int) -> int:
    return max(1, round(step.fraction * capacity))


def _max_wait(step: Step) -> float | None:
    return round(step.fraction * 2, 6) if step.bounded else None


async def done(answer: Any) -> Any:
    """A sync limiter's answer as it is, an asyncio limiter's awaited."""
    return await answer if inspect.isawaitable(answer) else answer


async def replay(configs: tuple[Config, Config], trace: list[Step], make: Any) -> None:
    """Runs ``trace`` through both and checks every answer. Granted reservations are
    kept in step; cancel and settle pick one of them."""
    clock = ManualClock(start=1000)
    local = [TokenBucketLimiter(c.capacity, c.rate, clock, per=c.per) for c in configs]
    remote = [make(c, clock, i) for i, c in enumerate(configs)]
    held: list[tuple[Any, Any, int, str]] = []  # (remote, local, which, key)
    for step in trace:
        clock.advance(step.micros / MICROS)
        i = step.which
        capacity = local[i].capacity
        if step.op in ("allow", "peek"):
            cost = _cost(step, capacity)
            theirs = await done(getattr(remote[i], step.op)(step.key, cost))
            assert theirs == getattr(local[i], step.op)(step.key, cost)
        elif step.op == "charge":
            cost = max(1, round(step.fraction * 3 * capacity))
            assert await done(remote[i].charge(step.key, cost)) == local[i].charge(step.key, cost)
        elif step.op in ("reserve", "all"):
            wait = _max_wait(step)
            if step.op == "reserve":
                cost = _cost(step, capacity)
                mine = local[i].reserve(step.key, cost, max_wait=wait)
                theirs = await done(remote[i].reserve(step.key, cost, max_wait=wait))
                which = i
            else:
                tokens = max(1, round(step.fraction * local[1].capacity))
                mine = bucketlimit.reserve_all(
                    [(local[0], step.key, 1), (local[1], "global", tokens)], max_wait=wait
                )
                theirs = await done(
                    bucketlimit.reserve_all(
                        [(remote[0], step.key, 1), (remote[1], "global", tokens)], max_wait=wait
                    )
                )
                which = -1
            assert (theirs.decision, theirs.delay, bool(theirs)) == (
                mine.decision,
                mine.delay,
                bool(mine),
            )
            assert [c[1:] for c in theirs.checks] == [c[1:] for c in mine.checks]
            if mine:
                held.append((theirs, mine, which, step.key))
        elif held:
            theirs, mine, which, key = held.pop(step.pick % len(held))
            if step.op == "cancel":
                assert await done(theirs.cancel()) is None
                mine.cancel()
            else:
                used = round(step.fraction * 2 * mine.cost)
                assert await done(theirs.settle(used)) is None
                mine.settle(used)
            # The buckets as they stand afterwards.
            for n, k in [(0, key), (1, "global")] if which == -1 else [(which, key)]:
                assert await done(remote[n].peek(k, 1)) == local[n].peek(k, 1)


trace_settings = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@trace_settings
@given(configs=st.tuples(_config(), _config()), trace=steps)
def test_sync_reservation_parity(
    redis_client: redis.Redis, configs: tuple[Config, Config], trace: list[Step]
) -> None:
    def make(c: Config, clock: ManualClock, i: int) -> PinnedRedisLimiter:
        return PinnedRedisLimiter(
            redis_client, c.capacity, c.rate, clock, per=c.per, prefix=_prefix(i)
        )

    asyncio.run(replay(configs, trace, make))


@trace_settings
@given(configs=st.tuples(_config(), _config()), trace=steps)
def test_async_reservation_parity(
    redis_url: str, configs: tuple[Config, Config], trace: list[Step]
) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:

            def make(c: Config, clock: ManualClock, i: int) -> PinnedAsyncRedisLimiter:
                return PinnedAsyncRedisLimiter(
                    client, c.capacity, c.rate, clock, per=c.per, prefix=_prefix(i)
                )

            await replay(configs, trace, make)
        finally:
            await client.aclose()

    asyncio.run(main())
