"""Reservations over Redis (docs/redis.md, "Waiting your turn"): the stored bucket,
FIFO, refusals that spend nothing, charges, waiting on the limiter's clock, bad
input, the failure policies, the refusal cache, lost refunds and asyncio
cancellation. Real redis-server; time is a ManualClock wherever it can be."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

import bucketlimit
import bucketlimit.redis
from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit.redis import (
    AsyncRedisReservation,
    AsyncRedisTokenBucketLimiter,
    RedisReservation,
    RedisTokenBucketLimiter,
    StoreUnavailableError,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import ServerFactory, free_port

pytestmark = pytest.mark.interpreters

_prefixes = iter(range(10**9))


def fresh() -> str:
    return f"reserve-{next(_prefixes)}:"


def raw(client: redis.Redis, limiter: Any, key: str) -> bytes | None:
    return cast("bytes | None", client.get(limiter.redis_key(key)))


@pytest.fixture
def dead() -> Iterator[redis.Redis]:
    """A client for a loopback port nothing listens on: every command fails at connect."""
    client = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    yield client
    client.close()


# -- the bucket in the store --------------------------------------------------------


def test_reservations_queue_in_order_and_allow_waits_for_them(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 2, 1, clock, prefix=fresh())
    reservations = [limiter.reserve("k") for _ in range(5)]
    assert all(isinstance(r, RedisReservation) and r for r in reservations)
    assert [r.delay for r in reservations] == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert (reservations[0].key, reservations[0].cost) == ("k", 1)
    assert reservations[0].checks == ((limiter, "k", 1),)
    # allow() sees the debt: refused until every waiter is served.
    refused = limiter.allow("k")
    assert refused == Decision(False, 4.0, 0, 5.0, 2)
    # The debt is stored with its headroom (0: nothing may be given back), and the
    # bucket keeps a TTL until it would be full (never expires while in debt).
    assert raw(redis_client, limiter, "k") == b"-3000000 0 0"
    ttl = redis_client.pttl(limiter.redis_key("k"))
    assert 0 < ttl <= 5000
    clock.advance(4)
    assert limiter.allow("k").allowed


def test_a_bucket_that_never_had_a_waiter_is_stored_as_before(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 5, 1, clock, prefix=fresh())
    assert limiter.allow("k", 2)
    assert limiter.reserve("k", 2).delay == 0.0
    assert raw(redis_client, limiter, "k") == b"1000000 0"
    assert limiter.charge("k", 3) == Decision(False, 2.0, 0, 7.0, 5)
    assert raw(redis_client, limiter, "k") == b"-2000000 0"


def test_a_refused_reservation_spends_nothing(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 1, 1, clock, prefix=fresh())
    assert limiter.allow("k")
    before = raw(redis_client, limiter, "k")
    refused = limiter.reserve("k", max_wait=0.4)
    assert not refused
    assert (refused.delay, refused.decision.retry_after) == (1.0, 0.6)
    assert raw(redis_client, limiter, "k") == before
    refused.cancel()  # nothing to give back
    refused.settle(0)
    assert raw(redis_client, limiter, "k") == before
    clock.advance(0.6)
    granted = limiter.reserve("k", max_wait=0.4)
    assert granted
    assert granted.delay == 0.4
    # max_wait=0 answers as allow.
    other = RedisTokenBucketLimiter(redis_client, 1, 1, clock, prefix=fresh())
    local = TokenBucketLimiter(1, 1, clock)
    for _ in range(2):
        assert other.reserve("x", max_wait=0).decision == local.allow("x")


def test_rate_zero_reserves_only_what_is_there(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 0, ManualClock(), prefix=fresh())
    assert limiter.reserve("k", 3)
    refused = limiter.reserve("k")
    assert not refused
    assert (refused.delay, refused.decision.retry_after) == (math.inf, math.inf)


def test_a_thousand_one_token_reservations_queue_on_capacity_one(
    redis_client: redis.Redis,
) -> None:
    """The debt bound, 1,000 capacities (docs/design.md §4; tests/core has its 10,000
    reservations on capacity 10): a round trip each, so capacity 1 here."""
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 1, 1, clock, prefix=fresh())
    delays = [limiter.reserve("k").delay for _ in range(1_001)]
    assert delays == sorted(delays), "a later reservation is ready before an earlier one"
    assert delays[-1] == 1_000.0, f"the last waits {delays[-1]} s, not the bound's 1,000 s"
    beyond = limiter.reserve("k")
    assert not beyond, "past the debt bound"
    assert beyond.decision.retry_after == 1.0, f"{beyond.decision}: not a second until it fits"
    # A charge stops at the bound.
    deep = limiter.charge("j", 2**64 - 1)
    assert deep == Decision(False, 1_000.0, 0, 1_001.0, 1)
    assert raw(redis_client, limiter, "j") == b"-1000000000 0", "not 1,000 tokens owed"


def test_cancel_and_settle_act_once(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 10, 1, clock, prefix=fresh())
    estimate = limiter.reserve("k", 8)
    estimate.settle(13)  # used more than reserved: 5 more charged, debt allowed
    assert limiter.peek("k") == Decision(False, 4.0, 0, 13.0, 10)
    estimate.settle(0)
    estimate.cancel()
    assert limiter.peek("k") == Decision(False, 4.0, 0, 13.0, 10)
    last = limiter.reserve("j", 6)
    last.settle(2)  # 4 back: 8 tokens
    assert limiter.peek("j", 8).allowed
    assert not limiter.peek("j", 9).allowed
    limiter.reserve("j", 8).cancel()
    assert limiter.peek("j", 8).allowed
    assert not limiter.peek("j", 9).allowed


def test_the_last_waiter_gives_back_and_an_earlier_one_cannot(redis_client: redis.Redis) -> None:
    """docs/design.md §4, "Giving back": capacity 1, rate 1/s; r1 now, r2 at 1 s, r3
    at 2 s; cancelling r2 must not let a newcomer use its token alongside r3."""
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 1, 1, clock, prefix=fresh())
    r1, r2, r3 = (limiter.reserve("k") for _ in range(3))
    assert [r.delay for r in (r1, r2, r3)] == [0.0, 1.0, 2.0]
    r2.cancel()
    assert limiter.reserve("k").delay == 3.0, "r2's token stays spent: r4 waits behind r3"
    # The last waiter's give-back is undone exactly.
    last = limiter.reserve("k")
    assert last.delay == 4.0
    last.cancel()
    assert limiter.reserve("k").delay == 4.0


def test_reserve_all_takes_per_bucket_costs_all_or_nothing(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    rpm = RedisTokenBucketLimiter(redis_client, 2, 1, clock, prefix=fresh())
    tpm = RedisTokenBucketLimiter(redis_client, 100, 10, clock, prefix=fresh())
    assert bucketlimit.reserve_all([(rpm, "org", 1), (tpm, "org", 100)]).delay == 0.0
    both = bucketlimit.reserve_all([(rpm, "org", 1), (tpm, "org", 50)])
    assert isinstance(both, RedisReservation)
    assert both
    assert both.delay == 5.0
    assert both.checks == ((rpm, "org", 1), (tpm, "org", 50))
    refused = bucketlimit.reserve_all([(rpm, "org", 1), (tpm, "org", 10)], max_wait=1)
    assert not refused
    assert refused.delay == 6.0
    assert refused.decision.retry_after == 5.0
    assert not rpm.peek("org").allowed
    assert tpm.peek("org").retry_after == 5.1
    both.cancel()  # the last waiter of tpm; rpm never waited: it gets its token back
    assert rpm.peek("org").allowed
    assert not rpm.peek("org", 2).allowed
    assert tpm.peek("org", 1).retry_after == 0.1
    assert bucketlimit.acquire_all([(rpm, "org", 1), (tpm, "org", 50)]).allowed
    assert clock.now == 5.0, "acquire_all waited on the clock for the longest delay"
    assert bucketlimit.allow_all([(rpm, "o2", 1), (tpm, "o2", 30)]).allowed
    assert tpm.peek("o2", 70).allowed
    assert not tpm.peek("o2", 71).allowed
    with pytest.raises(ValueError, match="twice"):
        bucketlimit.reserve_all([(rpm, "x"), (rpm, "x")])
    mixed: list[Any] = [(rpm, "x"), (TokenBucketLimiter(1, 1), "x")]
    with pytest.raises(TypeError, match="mix"):
        bucketlimit.reserve_all(mixed)
    four: list[Any] = [(rpm, "x", 1, 2)]
    with pytest.raises(TypeError, match="triples"):
        bucketlimit.reserve_all(four)


# -- waiting ------------------------------------------------------------------------


def test_acquire_waits_on_the_limiters_clock(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 2, 4, clock, prefix=fresh())
    assert limiter.acquire("k", 2) == Decision(True, 0.0, 0, 0.5, 2)
    assert clock.now == 0.0
    assert limiter.acquire("k", 1).allowed
    assert clock.now == 0.25, "slept exactly the delay the script computed"
    refused = limiter.acquire("k", 2, timeout=0.1)
    assert not refused
    assert refused.retry_after == 0.4
    assert clock.now == 0.25, "a refusal returns at once"


def test_an_exception_while_waiting_gives_the_tokens_back(redis_client: redis.Redis) -> None:
    class Interrupted(ManualClock):
        def sleep(self, seconds: float) -> None:
            raise KeyboardInterrupt

    clock = Interrupted()
    limiter = RedisTokenBucketLimiter(redis_client, 1, 1, clock, prefix=fresh())
    assert limiter.allow("k")
    with pytest.raises(KeyboardInterrupt):
        limiter.acquire("k", 1)
    assert limiter.peek("k").retry_after == 1.0, "the waiter's token came back"


def test_redis_reservations_keep_the_one_contract_and_wait_what_is_left(
    redis_client: redis.Redis, redis_url: str
) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 1, 1, clock, prefix=fresh())
    assert limiter.reserve("k").delay == 0.0
    waiting = limiter.reserve("k")
    assert isinstance(waiting, bucketlimit.ReservationLike)
    assert waiting.delay == 1.0
    clock.advance(0.25)
    assert waiting.wait() == waiting.decision
    assert clock.now == 1.0  # 0.75 was left, not the whole delay
    refused = limiter.reserve("k", max_wait=0.5)
    assert not refused
    assert refused.wait() == refused.decision
    assert clock.now == 1.0

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            aclock = ManualClock()
            alimiter = AsyncRedisTokenBucketLimiter(client, 1, 1, aclock, prefix=fresh())
            await alimiter.allow("k")
            held = await alimiter.reserve("k")
            assert isinstance(held, bucketlimit.AsyncReservationLike)
            aclock.advance(0.5)
            assert await held.wait() == held.decision
            assert aclock.now == 1.0
            # The sync limiter's reservation, awaited from asyncio code.
            late = limiter.reserve("other")
            assert await late.wait_async() == late.decision
        finally:
            await client.aclose()

    asyncio.run(main())


def test_async_acquire_and_reservation(redis_url: str) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            clock = ManualClock()
            limiter = AsyncRedisTokenBucketLimiter(client, 2, 4, clock, prefix=fresh())
            r = await limiter.reserve("k", 2)
            assert isinstance(r, AsyncRedisReservation)
            assert r.delay == 0.0
            await r.settle(1)
            assert (await limiter.peek("k")).allowed
            assert not (await limiter.peek("k", 2)).allowed
            assert (await limiter.acquire("k", 2)).allowed
            assert clock.now == 0.25
            assert (await limiter.charge("k", 4)) == Decision(False, 1.0, 0, 1.5, 2)
            both = await bucketlimit.reserve_all([(limiter, "a", 1), (limiter, "b", 2)])
            assert both
            assert both.delay == 0.0
            await both.cancel()
            assert (await limiter.peek("b", 2)).allowed
            decided = await bucketlimit.acquire_all_async([(limiter, "a", 2), (limiter, "b", 1)])
            assert decided.allowed
        finally:
            await client.aclose()

    asyncio.run(main())


class Parked(ManualClock):
    """A ManualClock whose async sleep never ends by itself: a waiting task stays
    waiting until it is cancelled (no real time passes). ``parked`` counts the
    waiters that reached their sleep."""

    parked = 0

    async def sleep_async(self, seconds: float) -> None:
        self.parked += 1
        await asyncio.Event().wait()


@pytest.mark.timeout(60)
def test_cancelled_waiters_give_their_tokens_back_as_the_model_says(redis_url: str) -> None:
    """200 tasks wait on one key; a random half is cancelled, one after another; the
    bucket in Redis then answers as the in-process limiter given the same
    reservations (in the order the server ran them) and the same cancellations."""

    async def main() -> None:
        # A pool large enough for every waiter (else the policy answers the rest).
        client = redis.asyncio.Redis.from_url(redis_url, max_connections=400)
        clock = Parked()
        # 7 a minute: the drained bucket's TTL (to full, on the server's real clock,
        # while the ManualClock stands still) outlives starting 200 tasks on a loaded
        # machine. At 7 a second it was 1.4 s, and one CI run saw it expire first.
        limiter = AsyncRedisTokenBucketLimiter(client, 10, 7, clock, per=60, prefix=fresh())
        model = TokenBucketLimiter(10, 7, clock, per=60)
        try:
            await limiter.reserve("k", 10)
            model.reserve("k", 10)
            # Each waiter's delay, seen between its reservation and its wait: what
            # acquire is (reserve, then the reservation's wait).
            seen: list[tuple[float, int]] = []

            async def waiter(i: int) -> Decision:
                reservation = await limiter.reserve("k")
                seen.append((reservation.delay, i))
                return await reservation.wait()

            tasks = [asyncio.ensure_future(waiter(i)) for i in range(200)]
            while len(seen) < 200:
                await asyncio.sleep(0)
            # The order the server ran them: FIFO makes the delays strictly increase.
            order = [i for _, i in sorted(seen)]
            assert len({d for d, _ in seen}) == 200, sorted(seen)[:12]
            locals_ = {i: model.reserve("k") for i in order}
            rng = random.Random(12)
            for i in rng.sample(range(200), 100):
                tasks[i].cancel()
                with pytest.raises(asyncio.CancelledError):
                    await tasks[i]
                locals_[i].cancel()
            for cost in (1, 5, 10):
                assert await limiter.peek("k", cost) == model.peek("k", cost)
            assert limiter.stats()["lost_refunds"] == 0
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_the_sync_limiter_waits_in_asyncio_code_too(redis_client: redis.Redis) -> None:
    """acquire_async on the sync class: a blocking reservation, an awaited delay, and
    a cancelled waiter gives back."""

    async def main() -> None:
        clock = ManualClock()
        limiter = RedisTokenBucketLimiter(redis_client, 1, 4, clock, prefix=fresh())
        assert (await limiter.acquire_async("k")).allowed
        assert (await limiter.acquire_async("k")).allowed
        assert clock.now == 0.25, "awaited on the clock's sleep_async"
        refused = await limiter.acquire_async("k", timeout=0.1)
        assert not refused
        assert refused.retry_after == 0.15
        parked = Parked()
        waits = RedisTokenBucketLimiter(redis_client, 1, 1, parked, prefix=fresh())
        assert waits.allow("k")
        waiter = asyncio.ensure_future(waits.acquire_async("k"))
        while parked.parked == 0:
            await asyncio.sleep(0)
        assert waits.peek("k").retry_after == 2.0
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert waits.peek("k").retry_after == 1.0

    asyncio.run(main())


@pytest.mark.parametrize("how", ["acquire", "reserve", "acquire_all_async", "reserve_all"])
def test_a_waiter_cancelled_during_its_round_trip_gives_back_once_the_reply_lands(
    redis_url: str, how: str
) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        clock = Parked()
        limiter = AsyncRedisTokenBucketLimiter(client, 1, 1, clock, prefix=fresh())
        other = AsyncRedisTokenBucketLimiter(client, 5, 1, clock, prefix=fresh())
        starts: dict[str, Any] = {
            "acquire": lambda: limiter.acquire("k"),
            "reserve": lambda: limiter.reserve("k"),
            "acquire_all_async": lambda: bucketlimit.acquire_all_async(
                [(limiter, "k", 1), (other, "k", 5)]
            ),
            "reserve_all": lambda: bucketlimit.reserve_all([(limiter, "k", 1), (other, "k", 5)]),
        }
        try:
            assert (await limiter.allow("k")).allowed
            waiter = asyncio.ensure_future(starts[how]())
            await asyncio.sleep(0)  # it has sent its reservation, not read the reply
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            for _ in range(10_000):  # the reply lands, then the refund is sent
                if (await limiter.peek("k")).retry_after == 1.0:
                    break
                await asyncio.sleep(0)
            assert (await limiter.peek("k")).retry_after == 1.0, "its token came back"
            assert (await other.peek("k", 5)).allowed, "and the other bucket's"
            assert asyncio.all_tasks() == {asyncio.current_task()}, "no refund still running"
            assert clock.parked == 0, "cancelled before it could wait"
            stats = limiter.stats()
            assert stats["allowed"] == 2, "the reservation was made"
            assert stats["lost_refunds"] == 0
        finally:
            await client.aclose()

    asyncio.run(main())


def test_a_refund_that_cannot_reach_the_store_is_counted_and_logged(
    redis_server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory.start()

    async def main() -> None:
        client = redis.asyncio.Redis(
            host="127.0.0.1", port=server.port, retry=redis.asyncio.retry.Retry(NoBackoff(), 0)
        )
        clock = Parked()
        limiter = AsyncRedisTokenBucketLimiter(
            client, 1, 1, clock, prefix=fresh(), on_store_error="closed"
        )
        try:
            assert (await limiter.allow("k")).allowed
            waiter = asyncio.ensure_future(limiter.acquire("k"))
            while clock.parked == 0:  # until it waits for its token
                await asyncio.sleep(0)
            server.stop()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert limiter.stats()["lost_refunds"] == 1
        finally:
            await client.aclose()

    with caplog.at_level(logging.WARNING, logger="bucketlimit"):
        asyncio.run(main())
    assert any("did not reach the store" in r.getMessage() for r in caplog.records)


# -- bad input ----------------------------------------------------------------------


def test_bad_input_is_rejected_and_changes_nothing(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 5, 1, clock, prefix=fresh())
    local = TokenBucketLimiter(5, 1, clock)
    assert limiter.allow("k")
    before = raw(redis_client, limiter, "k")
    for wait in [-1, -0.5, math.nan]:
        with pytest.raises(ValueError, match="max_wait"):
            limiter.reserve("k", max_wait=wait)
        with pytest.raises(ValueError, match="max_wait"):
            local.reserve("k", max_wait=wait)
        with pytest.raises(ValueError, match="timeout"):
            limiter.acquire("k", timeout=wait)
    bad_waits: list[Any] = ["1", True, [1]]
    for bad in bad_waits:
        with pytest.raises(TypeError, match="max_wait"):
            limiter.reserve("k", max_wait=bad)
        with pytest.raises(TypeError):
            local.reserve("k", max_wait=bad)
    bad_costs: list[tuple[Any, type[ValueError | TypeError]]] = [
        (0, ValueError),
        (6, ValueError),
        (1.0, TypeError),
        (True, TypeError),
    ]
    for cost, error in bad_costs:
        with pytest.raises(error):
            limiter.reserve("k", cost)
        with pytest.raises(error):
            local.reserve("k", cost)
    bad_charges: list[tuple[Any, type[ValueError | TypeError]]] = [
        (0, ValueError),
        (1.5, TypeError),
        (2**64, ValueError),
    ]
    for cost, error in bad_charges:
        with pytest.raises(error):
            limiter.charge("k", cost)
        with pytest.raises(error):
            local.charge("k", cost)
    reservation = limiter.reserve("k", 2)
    mine = local.reserve("k", 2)
    after = raw(redis_client, limiter, "k")
    bad_used: list[tuple[Any, type[ValueError | TypeError]]] = [
        (-1, ValueError),
        (1.5, TypeError),
        ([1, 2], ValueError),
    ]
    for used, error in bad_used:
        with pytest.raises(error):
            reservation.settle(used)
        with pytest.raises(error):
            mine.settle(used)
    assert raw(redis_client, limiter, "k") == after
    reservation.settle(1)  # still unsettled: the rejected calls did nothing
    assert before != after != raw(redis_client, limiter, "k")
    # inf (and None) mean no limit.
    assert limiter.reserve("k", 5, max_wait=math.inf).delay == 2.0


def test_the_script_knows_the_cores_debt_bound() -> None:
    source = RedisTokenBucketLimiter._script.source
    line = f"local MAX_DEBT_CAPACITIES = {bucketlimit.MAX_DEBT_CAPACITIES}\n"
    assert line in source, "scripts.lua and src/bucket.rs must agree on the debt bound"


def test_the_debt_bound_follows_the_configuration(redis_client: redis.Redis) -> None:
    reach = 1 + bucketlimit.MAX_DEBT_CAPACITIES
    largest = (2**53 - 2) // (reach * 1_000_000)  # the largest owing 1,000 capacities
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, largest, 1, clock, prefix=fresh())
    local = TokenBucketLimiter(largest, 1, clock)
    assert limiter.max_debt == bucketlimit.MAX_DEBT_CAPACITIES * largest
    # One more token of capacity: accepted, owing one capacity less.
    beyond = RedisTokenBucketLimiter(redis_client, largest + 1, 1, prefix=fresh())
    assert beyond.max_debt == (bucketlimit.MAX_DEBT_CAPACITIES - 1) * (largest + 1)
    # Deepest debt, exact to the unit.
    assert limiter.charge("k", 2**64 - 1) == local.charge("k", 2**64 - 1)
    clock.advance(0.000_001)
    assert limiter.reserve("k", largest).decision == local.reserve("k", largest).decision
    assert limiter.peek("k", largest) == local.peek("k", largest)


# -- the store failing ---------------------------------------------------------------


def test_reservations_follow_the_failure_policy(dead: redis.Redis) -> None:
    clock = ManualClock()

    def make(policy: Any) -> RedisTokenBucketLimiter:
        return RedisTokenBucketLimiter(
            dead, 10, 1, clock, prefix=fresh(), on_store_error=policy, processes=2
        )

    local = make("local")  # a share of 5 tokens at 0.5 a second
    taken = local.reserve("k", 5)
    assert taken
    assert taken.decision.degraded
    assert taken.delay == 0.0
    waits = local.reserve("k", 1)
    assert waits
    assert waits.decision.degraded
    assert waits.delay == 2.0
    waits.cancel()  # given back to the local share
    # The share answers (its limit is the share, as for a degraded allow).
    assert local.reserve("k", 1, max_wait=1.9).decision == Decision(False, 0.1, 0, 10.0, 5, True)
    assert local.charge("k", 1).degraded
    opened = make("open").reserve("k", 10)
    assert opened
    assert opened.delay == 0.0
    assert opened.decision.degraded
    closed = make("closed").reserve("k")
    assert not closed
    assert closed.decision.degraded
    with pytest.raises(redis.ConnectionError):
        make("raise").reserve("k")
    stats = local.stats()
    assert stats["allowed"] == 2
    assert stats["refused"] == 1
    assert stats["fallback_decisions"] == 4
    with pytest.raises((StoreUnavailableError, redis.ConnectionError)):
        make("raise").acquire("k")


def test_a_refused_reservation_is_answered_from_the_refusal_cache(
    redis_client: redis.Redis,
) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 1, 0.01, prefix=fresh())  # 100 s a token
    assert limiter.allow("k")
    first = limiter.reserve("k", max_wait=1)
    assert not first
    assert first.delay > 99
    calls = limiter.stats()["store_calls"]
    again = limiter.reserve("k", max_wait=1)
    assert not again
    assert 98 < again.delay <= first.delay
    assert again.decision.retry_after == pytest.approx(again.delay - 1)
    assert limiter.stats()["store_calls"] == calls, "answered without the store"
    assert limiter.stats()["refusal_cache_hits"] == 1
    assert not limiter.allow("k")
    assert limiter.stats()["refusal_cache_hits"] == 2, "the reservation's wait refuses allows too"
    # Without a bound the store decides (a reservation in debt is granted).
    assert limiter.reserve("k")
    assert limiter.stats()["store_calls"] == calls + 1


def test_a_sync_waiters_lost_refund_is_counted_and_the_error_goes_on(
    redis_server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory.start()

    class Outage(ManualClock):
        """Stops the store while the waiter sleeps, then interrupts it."""

        def sleep(self, seconds: float) -> None:
            server.stop()
            raise KeyboardInterrupt

    client = redis.Redis(
        host="127.0.0.1", port=server.port, socket_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    limiter = RedisTokenBucketLimiter(client, 1, 1, Outage(), prefix=fresh())
    try:
        assert limiter.allow("k")
        with (
            caplog.at_level(logging.WARNING, logger="bucketlimit"),
            pytest.raises(KeyboardInterrupt),
        ):
            limiter.acquire("k")
        assert limiter.stats()["lost_refunds"] == 1
        assert any("did not reach the store" in r.getMessage() for r in caplog.records)
    finally:
        client.close()
