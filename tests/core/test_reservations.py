"""Reservations through the public API (docs/design.md §2, §4): reserve, acquire, charge,
cancel, settle, the *_all forms, the debt bound, and bad input. Time is a
ManualClock, except where real threads sleep on the real clock."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import bucketlimit
from bucketlimit import (
    MAX_DEBT_CAPACITIES,
    Decision,
    Reservation,
    TokenBucketLimiter,
    acquire_all,
    allow_all,
    reserve_all,
)
from bucketlimit.testing import ManualClock


def test_the_names_are_exported() -> None:
    for name in ("Reservation", "reserve_all", "acquire_all", "acquire_all_async"):
        assert name in bucketlimit.__all__
        assert hasattr(bucketlimit, name)


def test_a_reservation_takes_the_tokens_now_and_says_when_they_are_yours(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=manual_clock)
    first = limiter.reserve("k", 2)
    assert first
    assert first.delay == 0.0
    assert first.cost == 2
    assert first.key == "k"
    assert first.decision == Decision(True, 0.0, 0, 2.0, 2)
    later = limiter.reserve("k", 1)
    assert later
    assert later.delay == 1.0
    assert later.decision.allowed
    assert later.decision.remaining == 0
    assert isinstance(later, Reservation)
    assert "delay=1.0" in repr(later)


def test_fifo_1000_reservations_are_ready_in_the_order_made(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(10, 3.7, clock=manual_clock)
    rng = random.Random(11)
    ready = []
    for _ in range(1000):
        manual_clock.advance(rng.choice([0, 0, 0.01, 0.3]))
        reservation = limiter.reserve("k", rng.randint(1, 10))
        assert reservation
        ready.append(manual_clock.now + reservation.delay)
    assert ready == sorted(ready)
    # allow() never jumps the queue: refused until every waiter is served.
    decision = limiter.allow("k")
    assert not decision
    assert manual_clock.now + decision.retry_after >= ready[-1]
    manual_clock.set(manual_clock.now + decision.retry_after - 1e-6)
    assert not limiter.allow("k")
    manual_clock.advance(1e-6)
    assert limiter.allow("k")


def test_max_wait_refuses_at_once_spending_nothing(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(1, 1, clock=manual_clock)
    assert limiter.reserve("k")
    before = limiter.peek("k")
    refused = limiter.reserve("k", max_wait=0.25)
    assert not refused
    assert refused.delay == 1.0  # the wait it would have needed
    assert refused.decision.retry_after == 0.75  # until max_wait 0.25 would do
    assert limiter.peek("k") == before
    refused.cancel()
    refused.settle(1)  # a refusal holds nothing: both change nothing
    assert limiter.peek("k") == before
    manual_clock.advance(0.75)
    assert limiter.reserve("k", max_wait=0.25).delay == 0.25
    # max_wait=0 answers as allow.
    assert limiter.reserve("x", max_wait=0).decision == TokenBucketLimiter(1, 1).allow("x")


def test_rate_zero_with_too_few_tokens_is_refused_at_once() -> None:
    limiter = TokenBucketLimiter(3, 0, clock=ManualClock())
    assert limiter.reserve("k", 3)
    refused = limiter.reserve("k")
    assert not refused
    assert refused.delay == math.inf
    assert refused.decision.retry_after == math.inf
    assert limiter.acquire("k") == refused.decision


def test_the_debt_bound_queues_10000_reservations_on_capacity_10(
    manual_clock: ManualClock,
) -> None:
    assert MAX_DEBT_CAPACITIES == 1000
    limiter = TokenBucketLimiter(10, 1, clock=manual_clock)
    delays = [limiter.reserve("k").delay for _ in range(10_000)]
    assert delays[-1] == 9_990.0
    # Up to 1,000 capacities of debt; one token past it is refused like max_wait.
    assert all(limiter.reserve("k") for _ in range(10))
    beyond = limiter.reserve("k")
    assert not beyond
    assert beyond.decision.retry_after == 1.0
    assert beyond.delay == 10_001.0
    assert limiter.charge("k", 10**18).retry_after == 10_000.0  # a charge stops at the bound


def test_cancel_gives_the_tokens_back_and_later_waits_do_not_move(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=manual_clock)
    limiter.reserve("k", 2)
    waiting = limiter.reserve("k", 2)
    after = limiter.reserve("k", 1)
    assert (waiting.delay, after.delay) == (2.0, 3.0)
    # The last of the queue gives back exactly, as if it had never been made.
    newcomer = limiter.reserve("k", 1)
    assert newcomer.delay == 4.0
    newcomer.cancel()
    assert limiter.peek("k").retry_after == 4.0
    # Ahead of a waiter nothing comes back: `after` keeps its time, and nobody may
    # use those tokens alongside or before it (docs/design.md §4, "Giving back").
    waiting.cancel()
    waiting.cancel()  # once
    assert limiter.peek("k").retry_after == 4.0
    assert limiter.reserve("k", 1, max_wait=3.5).delay == 4.0  # refused: 4 s needed
    # `after` is the last now: its tokens come back exactly.
    after.cancel()
    assert limiter.peek("k").retry_after == 3.0
    # Capped at capacity: a cancel never makes a bucket fuller than full.
    fresh = TokenBucketLimiter(5, 1, clock=manual_clock)
    held = fresh.reserve("k", 5)
    manual_clock.advance(100)
    held.cancel()
    assert fresh.peek("k", 5).allowed
    assert not fresh.allow("k", 5).retry_after


def test_settle_gives_back_or_charges_the_difference(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(100, 10, clock=manual_clock)
    estimate = limiter.reserve("k", 50)
    estimate.settle(20)
    assert limiter.peek("k").remaining == 79
    estimate.settle(0)  # settling twice changes nothing
    assert limiter.peek("k").remaining == 79
    over = limiter.reserve("k", 80)
    over.settle(130)  # the real use: 50 more than reserved, into debt
    decision = limiter.peek("k")
    assert not decision
    assert decision.retry_after == pytest.approx(5.1)
    # Later callers wait for the debt.
    assert limiter.reserve("k", 10).delay == pytest.approx(6.0)


def test_charge_records_use_beyond_capacity(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(10, 2, clock=manual_clock)
    assert limiter.charge("k", 4) == Decision(True, 0.0, 6, 2.0, 10)
    in_debt = limiter.charge("k", 26)
    assert not in_debt
    assert (in_debt.remaining, in_debt.retry_after, in_debt.reset_after) == (0, 10.0, 15.0)
    assert limiter.allow("k").retry_after == 10.5
    assert limiter.stats()["allowed"] == 0  # a charge is not a decision


def test_a_bucket_in_debt_is_never_evicted_and_reset_fills_it(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(1, 1, clock=manual_clock, max_keys=1)
    limiter.reserve("a")
    waiting = limiter.reserve("a", 1)
    assert waiting.delay == 1.0
    manual_clock.advance(0.5)
    assert not limiter.allow("b")  # "a" is in debt: not full, not evictable
    assert len(limiter) == 1
    limiter.reset("a")
    assert limiter.allow("a")
    assert waiting.delay == 1.0  # a waiter keeps its delay
    limiter.clear()
    assert len(limiter) == 0


def test_manual_clock_sleep_advances_it_and_acquire_waits_on_it(
    manual_clock: ManualClock,
) -> None:
    manual_clock.sleep(0.25)
    assert manual_clock.now == 0.25
    with pytest.raises(ValueError, match="back"):
        manual_clock.sleep(-1)
    limiter = TokenBucketLimiter(1, 4, clock=manual_clock)
    for _k in range(5):
        assert limiter.acquire("k")
    assert manual_clock.now == 0.25 + 4 * 0.25  # waited exactly the delays, never slept


def test_acquire_timeout_refuses_without_sleeping() -> None:
    slept: list[float] = []

    class Clock(ManualClock):
        def sleep(self, seconds: float) -> None:
            slept.append(seconds)
            super().sleep(seconds)

    clock = Clock()
    limiter = TokenBucketLimiter(1, 1, clock=clock)
    assert limiter.acquire("k")
    assert slept == []
    refused = limiter.acquire("k", timeout=0.5)
    assert not refused
    assert refused.retry_after == 0.5
    assert slept == []  # refused at once: no wait to find out
    assert limiter.acquire("k", timeout=1)
    assert slept == [1.0]


def test_an_interrupt_while_waiting_cancels_the_reservation() -> None:
    class Interrupted(ManualClock):
        def sleep(self, seconds: float) -> None:
            raise KeyboardInterrupt

    clock = Interrupted()
    limiter = TokenBucketLimiter(1, 1, clock=clock)
    limiter.reserve("k")
    before = limiter.peek("k")
    with pytest.raises(KeyboardInterrupt):
        limiter.acquire("k")
    assert limiter.peek("k") == before  # its token came back
    with pytest.raises(KeyboardInterrupt):
        acquire_all([(limiter, "k")])
    assert limiter.peek("k") == before


def test_acquire_sleeps_on_time_sleep_without_a_clock_sleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clock with no ``sleep`` (time.monotonic, a lambda): the thread sleeps for real."""
    now = ManualClock()
    limiter = TokenBucketLimiter(2, 1000, clock=lambda: now())
    assert limiter.acquire("k", 2)
    started = time.monotonic()
    assert limiter.acquire("k", 2)  # 2 ms: the manual clock stands still, so does the debt
    # A lower bound, which no slowness can break: the thread did sleep its 2 ms.
    slept = time.monotonic() - started
    assert slept >= 0.002 - 1e-4, f"acquire returned after {slept * 1000:.3f} ms, not 2 ms"


def test_allow_all_and_acquire_all_with_per_bucket_costs(manual_clock: ManualClock) -> None:
    rpm = TokenBucketLimiter(60, 60, clock=manual_clock, per=60)
    tpm = TokenBucketLimiter(90_000, 90_000, clock=manual_clock, per=60)
    assert allow_all([(rpm, "org", 1), (tpm, "org", 60_000)])
    refused = allow_all([(rpm, "org", 1), (tpm, "org", 40_000)])
    assert not refused
    assert refused.retry_after == pytest.approx(10_000 / 1500, abs=1e-6)
    assert rpm.peek("org", 59)  # nobody charged for a refusal
    assert tpm.peek("org", 30_000)
    assert not tpm.peek("org", 30_001)
    # The pair form still charges the call's cost to every bucket.
    assert allow_all([(rpm, "a"), (rpm, "b")], 2)
    assert rpm.peek("a", 58)
    assert not rpm.peek("a", 59)
    # acquire_all waits for the longest: the tokens.
    started = manual_clock.now
    decision = acquire_all([(rpm, "org", 1), (tpm, "org", 31_500)])
    assert decision
    assert manual_clock.now - started == pytest.approx(1.0, abs=1e-6)
    refused = acquire_all([(rpm, "org", 1), (tpm, "org", 90_000)], timeout=1)
    assert not refused
    assert manual_clock.now - started == pytest.approx(1.0, abs=1e-6)


def test_reserve_all_cancels_and_settles_every_bucket(manual_clock: ManualClock) -> None:
    rpm = TokenBucketLimiter(10, 1, clock=manual_clock)
    tpm = TokenBucketLimiter(1000, 100, clock=manual_clock)
    assert reserve_all([(rpm, "org", 1), (tpm, "org", 1000)]).delay == 0.0
    held = reserve_all([(rpm, "org", 1), (tpm, "org", 500)])
    assert held
    assert held.delay == 5.0
    assert held.cost == 1
    assert held.key == "org"
    assert [(key, cost) for _, key, cost in held.checks] == [("org", 1), ("org", 500)]
    held.settle([1, 700])  # one used per bucket: the tokens ran over by 200
    assert rpm.peek("org", 8)
    assert not rpm.peek("org", 9)
    assert tpm.peek("org").retry_after == pytest.approx(7.01)
    again = reserve_all([(rpm, "x"), (tpm, "x")], 5)
    again.cancel()
    assert rpm.peek("x", 10)
    assert tpm.peek("x", 1000)
    one_for_all = reserve_all([(rpm, "y"), (tpm, "y")], 5)
    one_for_all.settle(2)
    assert rpm.peek("y", 8)
    assert not rpm.peek("y", 9)
    assert tpm.peek("y", 998)
    assert not tpm.peek("y", 999)
    refused = reserve_all([(rpm, "z", 1), (tpm, "z", 1000), (tpm, "org", 1)], max_wait=1)
    assert not refused
    assert rpm.peek("z", 10)
    assert tpm.peek("z", 1000)


def test_threads_16_x_200_acquire_obey_the_order_statistic_bound() -> None:
    """Real threads on the real clock: the k-th token is never handed out before
    start + (k - capacity) / rate (10,000 a second: 0.3 s of waiting; threads that
    fall behind on a busy machine only hand them out later)."""
    capacity, rate = 50, 10_000.0
    limiter = TokenBucketLimiter(capacity, rate, clock=time.monotonic)
    got: list[float] = []
    lock = threading.Lock()
    results: list[bool] = []
    barrier = threading.Barrier(16)

    def worker() -> None:
        barrier.wait()
        for _ in range(200):
            decision = limiter.acquire("k")
            at = time.monotonic()
            with lock:
                got.append(at)
                results.append(decision.allowed)

    # The bucket starts full at its first reading; no call precedes `start`.
    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3200, f"{len(results)} acquisitions of 3,200"
    assert all(results), "an acquire without a timeout was refused"
    granularity = 2e-6  # the limiter's µs rounding of each reading, both sides
    for k, at in enumerate(sorted(got), start=1):
        early = start + (k - capacity) / rate - at
        assert early <= granularity, f"token {k} handed out {early:.6f} s before its time"


def test_timeouts_under_threads_return_without_waiting() -> None:
    slept = threading.local()
    calls: list[int] = []

    class Clock:
        def __call__(self) -> float:
            return time.monotonic()

        def sleep(self, seconds: float) -> None:
            calls.append(1)
            slept.value = True
            time.sleep(seconds)

    limiter = TokenBucketLimiter(5, 100, clock=Clock())
    refused: list[Decision] = []

    def worker() -> None:
        for _ in range(20):
            slept.value = False
            decision = limiter.acquire("k", timeout=0.01)
            if not decision:
                assert not slept.value  # a timeout refusal never slept
                refused.append(decision)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert refused
    assert calls
    assert all(d.retry_after > 0 for d in refused)


BAD_WAITS: list[tuple[Any, type[Exception]]] = [
    (-1, ValueError),
    (-0.5, ValueError),
    (math.nan, ValueError),
    ("1", TypeError),
    (True, TypeError),
    ([1], TypeError),
]


def calls_with(wait: Any) -> list[Callable[[TokenBucketLimiter], object]]:
    return [
        lambda lim: lim.reserve("k", max_wait=wait),
        lambda lim: lim.acquire("k", timeout=wait),
        lambda lim: lim.acquire_async("k", timeout=wait),
        lambda lim: reserve_all([(lim, "k")], max_wait=wait),
        lambda lim: acquire_all([(lim, "k")], timeout=wait),
        lambda lim: bucketlimit.acquire_all_async([(lim, "k")], timeout=wait),
    ]


@pytest.mark.parametrize(("wait", "error"), BAD_WAITS)
def test_bad_max_wait_or_timeout_changes_nothing(wait: Any, error: type[Exception]) -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(2, 1, clock=clock)
    limiter.allow("k")
    before = limiter.peek("k")
    for call in calls_with(wait):
        with pytest.raises(error) as info:
            call(limiter)
        assert type(info.value) is error
        assert ("wait" in str(info.value)) or ("timeout" in str(info.value))
    assert limiter.peek("k") == before
    assert limiter.stats()["allowed"] == 1


@pytest.mark.parametrize(
    ("cost", "error"), [(0, ValueError), (3, ValueError), (1.0, TypeError), (True, TypeError)]
)
def test_cost_rules_as_allow(cost: Any, error: type[Exception]) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=ManualClock())
    for call in (
        lambda: limiter.reserve("k", cost),
        lambda: limiter.acquire("k", cost),
        lambda: limiter.acquire_async("k", cost),
        lambda: reserve_all([(limiter, "k", cost)]),
        lambda: allow_all([(limiter, "k", cost)]),
    ):
        with pytest.raises(error, match="cost"):
            call()
    assert limiter.peek("k", 2)
    assert len(limiter) == 0


@pytest.mark.parametrize(("cost", "error"), [(0, ValueError), (-3, ValueError), (2.5, TypeError)])
def test_charge_checks_its_cost(cost: Any, error: type[Exception]) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=ManualClock())
    with pytest.raises(error, match="cost"):
        limiter.charge("k", cost)
    with pytest.raises(ValueError, match="cost"):
        limiter.charge("k", 2**64)
    with pytest.raises(ValueError, match="key"):
        limiter.charge("", 1)
    assert len(limiter) == 0


@pytest.mark.parametrize(
    ("used", "error"),
    [(-1, ValueError), (1.5, TypeError), ("2", TypeError), (None, TypeError), ([1, 2], ValueError)],
)
def test_settle_with_bad_used_changes_nothing(used: Any, error: type[Exception]) -> None:
    limiter = TokenBucketLimiter(5, 1, clock=ManualClock())
    held = limiter.reserve("k", 3)
    with pytest.raises(error, match="used"):
        held.settle(used)
    assert limiter.peek("k").remaining == 1
    held.settle(1)  # still unsettled: the good call works
    assert limiter.peek("k").remaining == 3


def test_a_rejected_settle_changes_nothing_and_leaves_the_reservation_usable() -> None:
    # A settle(cost + 2**64) that raises must not use the reservation up: a later
    # settle(0) or cancel() still gives the tokens back.
    limiter = TokenBucketLimiter(10, 1, clock=ManualClock())
    held = limiter.reserve("k", 2)
    with pytest.raises(ValueError, match=r"at most 2\*\*64 - 1"):
        held.settle(2 + 2**64)
    assert limiter.peek("k").remaining == 7  # nothing charged, nothing given back
    held.cancel()  # still unsettled: both tokens come back
    assert limiter.peek("k").remaining == 9
    other = TokenBucketLimiter(10, 1, clock=ManualClock())
    both = reserve_all([(limiter, "a", 1), (other, "b", 3)])
    with pytest.raises(ValueError, match=r"at most 2\*\*64 - 1"):
        both.settle([0, 3 + 2**64])
    assert not limiter.peek("a", 10)  # the first part was not given back
    assert other.peek("b").remaining == 6
    both.settle([0, 0])
    assert limiter.peek("a", 10)
    assert other.peek("b").remaining == 9


def test_a_charge_beyond_two_to_the_64_says_so() -> None:
    limiter = TokenBucketLimiter(10, 1, clock=ManualClock())
    with pytest.raises(ValueError, match=r"the cost of a charge must be at most 2\*\*64 - 1"):
        limiter.charge("k", 2**64)
    assert limiter.charge("k", 2**64 - 1).retry_after > 0  # the largest charge is recorded


def test_bad_checks_are_type_errors() -> None:
    limiter = TokenBucketLimiter(2, 1)
    for checks in ([(limiter,)], [(limiter, "k", 1, 2)], ["k"], [("not", "k")]):
        with pytest.raises(TypeError):
            reserve_all(checks)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            allow_all(checks)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        reserve_all([(limiter, "k", 1), (limiter, "k", 2)])
    with pytest.raises(ValueError, match="at least one"):
        reserve_all([])
