"""Concurrency permits with rate and token limits in one call (docs/design.md §2, §4
"Permits"): ``allow_all`` / ``reserve_all`` / ``acquire_all`` / ``acquire_all_async``
take ``(conc, key)`` checks, all or nothing; the Reservation they answer holds the
permits and its ``settle`` / ``cancel`` release them.

How the waits compose: an ``acquire_all`` waits for its permits first (in a fixed
order, FIFO each, holding no tokens), then reserves the tokens and sleeps for them
holding the permits, which live ``ttl`` from when the tokens are ready.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest

from bucketlimit import (
    ConcurrencyLimiter,
    Decision,
    Reservation,
    ReservationLike,
    TokenBucketLimiter,
    acquire_all,
    acquire_all_async,
    allow_all,
    reserve_all,
)
from bucketlimit.testing import ManualClock
from tests.support.threads import run_threads, wait_until

pytestmark = pytest.mark.interpreters


def tokens_left(limiter: TokenBucketLimiter, key: str) -> int:
    probe = limiter.peek(key)
    return probe.remaining + (1 if probe.allowed else 0)


class Limits:
    """A tenant's three limits on one clock: requests a minute, tokens a minute, and
    requests in flight."""

    def __init__(self, clock: ManualClock, inflight: int = 1, ttl: float = 30) -> None:
        self.clock = clock
        self.rpm = TokenBucketLimiter(60, 60, per=60, clock=clock)
        self.tpm = TokenBucketLimiter(90_000, 90_000, per=60, clock=clock)
        self.inflight = ConcurrencyLimiter(inflight, ttl=ttl, clock=clock)

    def checks(self, tokens: int, key: str = "org") -> list[Any]:
        return [(self.rpm, key, 1), (self.tpm, key, tokens), (self.inflight, key)]


def test_allow_all_takes_the_permit_with_the_tokens_all_or_nothing(
    manual_clock: ManualClock,
) -> None:
    limits = Limits(manual_clock)
    held = allow_all(limits.checks(3_500))
    assert isinstance(held, Reservation)
    assert held
    assert isinstance(held, ReservationLike)
    (permit,) = held.permits
    assert permit.valid()
    assert permit.token == 1
    assert limits.inflight.in_flight("org") == 1
    assert held.checks == (
        (limits.rpm, "org", 1),
        (limits.tpm, "org", 3_500),
        (limits.inflight, "org", 1),
    )
    assert tokens_left(limits.tpm, "org") == 86_500

    # The permit is taken: refused, and not a token spent.
    refused = allow_all(limits.checks(3_500))
    assert not refused
    assert refused.permits == ()
    assert refused.decision == Decision(False, 30.0, 0, 30.0, 1)
    assert tokens_left(limits.tpm, "org") == 86_500
    assert tokens_left(limits.rpm, "org") == 59

    # The tokens refuse: no permit held afterwards.
    assert allow_all([(limits.tpm, "other", 90_000)])
    assert not allow_all(limits.checks(1, key="other"))
    assert limits.inflight.in_flight("other") == 0

    held.settle(2_000)  # 1,500 tokens back, the permit released
    assert limits.inflight.in_flight("org") == 0
    assert not permit.valid()
    assert tokens_left(limits.tpm, "org") == 88_000
    held.settle(0)  # once
    held.cancel()
    assert tokens_left(limits.tpm, "org") == 88_000
    refused.cancel()  # a refusal holds nothing
    assert limits.inflight.in_flight("org") == 0


def test_cancel_gives_the_tokens_back_and_releases_the_permit(
    manual_clock: ManualClock,
) -> None:
    limits = Limits(manual_clock, inflight=2)
    held = reserve_all(limits.checks(3_500))
    assert held.delay == 0.0
    held.cancel()
    assert limits.inflight.in_flight("org") == 0
    assert tokens_left(limits.tpm, "org") == 90_000
    assert tokens_left(limits.rpm, "org") == 60
    # settle takes one used per check, in their order (a permit's is ignored).
    held = reserve_all(limits.checks(3_500))
    with pytest.raises(ValueError, match="3 buckets"):
        held.settle([1, 100])
    held.settle([1, 100, 0])
    assert tokens_left(limits.tpm, "org") == 89_900
    assert limits.inflight.in_flight("org") == 0


def test_reserve_all_never_queues_for_a_permit(manual_clock: ManualClock) -> None:
    limits = Limits(manual_clock, ttl=10)
    first = reserve_all([(limits.tpm, "org", 90_000), (limits.inflight, "org")])
    assert first
    # The permit is busy: refused at once, whatever max_wait says (when it frees
    # is not known); the tokens are untouched.
    later = reserve_all([(limits.inflight, "org"), (limits.tpm, "org", 1)], max_wait=None)
    assert not later
    assert later.decision.retry_after == 10.0
    assert later.delay == 10.0
    assert tokens_left(limits.tpm, "org") == 0
    first.cancel()
    assert limits.inflight.in_flight("org") == 0
    assert tokens_left(limits.tpm, "org") == 90_000
    # A free permit, tokens in 2 s (1,500 a second): the permit lives its ttl from then.
    assert allow_all([(limits.tpm, "org", 90_000)])
    spent = reserve_all([(limits.tpm, "org", 3_000), (limits.inflight, "x")])
    assert spent.delay == 2.0
    (permit,) = spent.permits
    manual_clock.advance(11.999999)
    assert permit.valid()
    manual_clock.advance(0.000001)
    assert not permit.valid()


def test_acquire_all_waits_for_the_permit_holding_no_tokens_then_for_the_tokens() -> None:
    seen: list[tuple[float, int, int]] = []

    class Clock(ManualClock):
        def sleep(self, seconds: float) -> None:
            # What the waiter holds as it goes to sleep.
            seen.append((self.now, tokens_left(tpm, "org"), inflight.in_flight("org")))
            super().sleep(seconds)

    clock = Clock()
    tpm = TokenBucketLimiter(100, 1, clock=clock)  # 1 token a second
    inflight = ConcurrencyLimiter(1, ttl=30, clock=clock)
    first = acquire_all([(tpm, "org", 60), (inflight, "org")])
    assert first
    assert clock.now == 0.0
    second = acquire_all([(inflight, "org"), (tpm, "org", 90)])
    assert second
    # Waited 30 s for the permit (until the first one's expiry) holding none of the
    # 40 tokens left; then, holding the permit, 20 s for the 90 it reserved (in debt).
    assert seen == [(0.0, 40, 1), (30.0, 0, 1)]
    assert clock.now == 50.0
    (permit,) = second.permits
    assert permit.token > first.permits[0].token
    # Its ttl runs from when the tokens were ready.
    clock.advance(29.999999)
    assert permit.valid()
    clock.advance(0.000001)
    assert not permit.valid()


def test_acquire_all_refused_by_its_timeout_holds_nothing(manual_clock: ManualClock) -> None:
    tpm = TokenBucketLimiter(100, 1, clock=manual_clock)
    inflight = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    assert acquire_all([(tpm, "org", 100), (inflight, "org")])
    # The permit frees at 10 s: too late for a 5 s timeout.
    refused = acquire_all([(tpm, "org", 1), (inflight, "org")], timeout=5)
    assert not refused
    assert manual_clock.now == 5.0
    assert refused.decision.retry_after == 5.0
    assert tokens_left(tpm, "org") == 5
    # In time for the permit (10 s) but not for 20 more tokens (30 s): the permit goes back.
    refused = acquire_all([(tpm, "org", 30), (inflight, "org")], timeout=15)
    assert not refused
    assert refused.permits == ()
    assert manual_clock.now == 10.0
    assert inflight.in_flight("org") == 0
    assert tokens_left(tpm, "org") == 10
    assert refused.decision.retry_after == 10.0  # 20 s for the tokens, 10 s of timeout left


def test_a_combined_reservation_waits_like_any_reservation(manual_clock: ManualClock) -> None:
    tpm = TokenBucketLimiter(100, 10, clock=manual_clock)
    inflight = ConcurrencyLimiter(1, ttl=30, clock=manual_clock)
    assert allow_all([(tpm, "org", 100)])
    held = reserve_all([(inflight, "org"), (tpm, "org", 20)])
    assert held.delay == 2.0
    assert held.wait() == held.decision
    assert manual_clock.now == 2.0

    async def main() -> Decision:
        return await held.wait_async()  # nothing left to wait

    assert asyncio.run(main()) == held.decision
    assert held.permits[0].valid()
    held.cancel()
    assert inflight.in_flight("org") == 0


def test_acquire_all_async_waits_for_the_permit_then_the_tokens(
    manual_clock: ManualClock,
) -> None:
    tpm = TokenBucketLimiter(100, 1, clock=manual_clock)
    inflight = ConcurrencyLimiter(1, ttl=30, clock=manual_clock)

    async def main() -> tuple[Reservation, Reservation]:
        first = await acquire_all_async([(tpm, "org", 100), (inflight, "org")])
        second = await acquire_all_async([(inflight, "org"), (tpm, "org", 50)])
        return first, second

    first, second = asyncio.run(main())
    assert first
    assert second
    assert manual_clock.now == 50.0
    assert second.permits[0].valid()
    assert not first.permits[0].valid()


def test_a_cancelled_acquire_all_async_spends_nothing_and_holds_nothing() -> None:
    frozen = ManualClock()

    async def main() -> None:
        # A clock read through a lambda has no sleep_async: real asyncio waits, while
        # the buckets never refill.
        tpm = TokenBucketLimiter(100, 1, clock=lambda: frozen())
        inflight = ConcurrencyLimiter(1, ttl=600, clock=lambda: frozen())
        holder = inflight.try_acquire("org")
        # Cancelled while it waits for the permit: no token was taken.
        task: asyncio.Task[Reservation] = asyncio.create_task(
            acquire_all_async([(tpm, "org", 10), (inflight, "org")])
        )
        await asyncio.sleep(0.01)
        assert inflight.stats()["waiting"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert inflight.stats()["waiting"] == 0
        assert tokens_left(tpm, "org") == 100
        holder.release()
        # Cancelled while it sleeps for tokens: they go back, the permit is released.
        assert allow_all([(tpm, "org", 100)])
        task = asyncio.create_task(acquire_all_async([(tpm, "org", 10), (inflight, "org")]))
        await asyncio.sleep(0.01)
        assert inflight.in_flight("org") == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert inflight.in_flight("org") == 0
        assert tpm.peek("org").retry_after == 1.0  # the 10 tokens came back

    asyncio.run(main())


def test_two_concurrency_limiters_named_in_any_order_never_deadlock() -> None:
    org = ConcurrencyLimiter(1, ttl=600)
    region = ConcurrencyLimiter(1, ttl=600)
    guard = threading.Lock()
    inside = 0

    def work(index: int) -> int:
        nonlocal inside
        order = [(org, "o"), (region, "r")] if index % 2 else [(region, "r"), (org, "o")]
        for _ in range(300):
            held = acquire_all(order)
            assert held
            with guard:
                inside += 1
                assert inside == 1  # both limits of 1: one holder at a time
                inside -= 1
            held.cancel()
        return 300

    assert sum(run_threads(8, work)) == 2_400
    assert org.in_flight("o") == 0
    assert region.in_flight("r") == 0


def test_a_waiter_for_a_permit_holds_the_ones_before_it_in_the_order() -> None:
    a = ConcurrencyLimiter(1, ttl=600)
    b = ConcurrencyLimiter(1, ttl=600)
    first, second = sorted([a, b], key=id)  # permits are taken by limiter, then key
    busy = second.try_acquire("k")
    done: list[Reservation] = []
    thread = threading.Thread(
        target=lambda: done.append(acquire_all([(second, "k"), (first, "k")])), daemon=True
    )
    thread.start()
    wait_until(lambda: second.stats()["waiting"] == 1, "it waits for the second")
    assert first.in_flight("k") == 1  # held while it waits for the next
    busy.release()
    thread.join(30)
    assert done
    assert done[0]
    assert [p.valid() for p in done[0].permits] == [True, True]


def test_threads_combining_rate_and_concurrency_stay_within_both() -> None:
    rpm = TokenBucketLimiter(1_000, 0)  # a quota of 1,000 requests
    inflight = ConcurrencyLimiter(3, ttl=600)
    guard = threading.Lock()
    inside = most = 0

    def work(_: int) -> int:
        nonlocal inside, most
        admitted = 0
        for _ in range(200):
            held = acquire_all([(rpm, "org", 1), (inflight, "org")], timeout=0.5)
            if not held:
                continue
            admitted += 1
            with guard:
                inside += 1
                most = max(most, inside)
            with guard:
                inside -= 1
            held.settle(1)
        return admitted

    assert sum(run_threads(8, work)) == 1_000
    assert 1 <= most <= 3
    assert inflight.in_flight("org") == 0
    assert tokens_left(rpm, "org") == 0


@pytest.mark.parametrize(
    ("check", "error"),
    [
        (2, ValueError),
        (0, ValueError),
        ("1", TypeError),
        (True, TypeError),
        (1.0, TypeError),
    ],
)
def test_a_permit_check_costs_one(check: Any, error: type[Exception]) -> None:
    clock = ManualClock()
    tpm = TokenBucketLimiter(10, 1, clock=clock)
    inflight = ConcurrencyLimiter(1, clock=clock)
    for call in (allow_all, reserve_all, acquire_all, acquire_all_async):
        with pytest.raises(error) as raised:
            call([(tpm, "org", 5), (inflight, "org", check)])
        assert type(raised.value) is error
    assert tokens_left(tpm, "org") == 10
    assert inflight.in_flight("org") == 0
    assert allow_all([(tpm, "org", 5), (inflight, "org", 1)])


def test_bad_combined_checks_change_nothing(manual_clock: ManualClock) -> None:
    tpm = TokenBucketLimiter(10, 1, clock=manual_clock)
    inflight = ConcurrencyLimiter(2, clock=manual_clock)
    bad: list[tuple[list[Any], type[Exception]]] = [
        ([(tpm, "org", 5), (inflight, "org"), (inflight, "org")], ValueError),
        ([(tpm, "org", 5), (inflight, "")], ValueError),
        ([(tpm, "org", 5), (inflight, 7)], TypeError),
        ([(tpm, "org", 11), (inflight, "org")], ValueError),
        ([(inflight, "org"), ("not a limiter", "org")], TypeError),
    ]
    for checks, error in bad:
        for call in (allow_all, reserve_all, acquire_all):
            with pytest.raises(error):
                call(checks)
    with pytest.raises(ValueError, match="timeout"):
        acquire_all([(inflight, "org")], timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        acquire_all_async([(inflight, "org")], timeout=math.nan)
    assert tokens_left(tpm, "org") == 10
    assert inflight.stats()["granted"] == 0
    assert inflight.in_flight("org") == 0
