"""The one reservation contract (docs/design.md §2): every reservation is a
``bucketlimit.ReservationLike``; ``wait()`` / ``wait_async()`` sleep until the
tokens are there on the limiter's clock, and give them back when interrupted."""

from __future__ import annotations

import asyncio

import pytest

from bucketlimit import ReservationLike, TokenBucketLimiter, reserve_all
from bucketlimit.testing import ManualClock

pytestmark = pytest.mark.interpreters


def test_the_core_reservation_is_reservation_like() -> None:
    limiter = TokenBucketLimiter(2, 1, clock=ManualClock())
    reservation = limiter.reserve("k")
    assert isinstance(reservation, ReservationLike)
    assert isinstance(reserve_all([(limiter, "k")]), ReservationLike)


def test_wait_sleeps_what_is_left_of_the_delay_on_the_limiters_clock() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(1, 1, clock=clock)
    assert limiter.reserve("k").delay == 0.0
    waiting = limiter.reserve("k")
    assert waiting.delay == 1.0
    clock.advance(0.25)  # the caller did something else first
    decision = waiting.wait()
    assert decision is waiting.decision
    assert decision.allowed
    assert clock.now == 1.0  # slept 0.75, not the whole delay again
    assert waiting.wait() == decision
    assert clock.now == 1.0
    late = limiter.reserve("k")
    clock.advance(5)
    late.wait()
    assert clock.now == 6.0  # already there: no sleep at all


def test_a_refusal_waits_for_nothing() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(1, 1, clock=clock)
    limiter.allow("k")
    refused = limiter.reserve("k", max_wait=0.5)
    assert not refused
    assert refused.wait() == refused.decision
    assert not refused.wait()
    assert clock.now == 0.0


class InterruptedClock(ManualClock):
    def sleep(self, seconds: float) -> None:
        raise KeyboardInterrupt


def test_wait_interrupted_gives_the_tokens_back() -> None:
    clock = InterruptedClock()
    limiter = TokenBucketLimiter(1, 1, clock=clock)
    limiter.allow("k")
    waiting = limiter.reserve("k")
    with pytest.raises(KeyboardInterrupt):
        waiting.wait()
    # The last waiter was undone exactly: the bucket is as before it.
    assert limiter.peek("k").retry_after == 1.0
    waiting.cancel()  # acted already: nothing more comes back
    assert limiter.peek("k").retry_after == 1.0


def test_wait_async_answers_the_decision_and_a_cancelled_one_gives_back() -> None:
    async def main() -> None:
        clock = ManualClock()
        limiter = TokenBucketLimiter(1, 1, clock=clock)
        limiter.allow("k")
        waiting = limiter.reserve("k")
        clock.advance(0.5)
        assert await waiting.wait_async() == waiting.decision
        assert clock.now == 1.0

        real = TokenBucketLimiter(1, 1)  # the real clock: this sleep takes a second
        real.allow("k")
        sleeper = real.reserve("k")
        task = asyncio.ensure_future(sleeper.wait_async())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Given back: the bucket waits for the first token only, not for two.
        assert 0.5 < real.peek("k").retry_after <= 1.0

    asyncio.run(main())
