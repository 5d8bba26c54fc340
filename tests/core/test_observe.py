"""observe(): an upstream's report bounds the bucket (docs/design.md §2, §4 "Following
the upstream"), through the public API on a ManualClock, and against the Fraction
model on random traces."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bucketlimit import TokenBucketLimiter
from bucketlimit.testing import ManualClock
from tests.core.test_properties import Config, FakeClock, refilling_configs
from tests.support.reference import answer_of, to_micros


def limiter(capacity: int = 100, rate: float = 10, **kwargs: Any) -> TokenBucketLimiter:
    return TokenBucketLimiter(capacity, rate, **kwargs)


def test_a_report_lowers_the_bucket_to_what_remains(manual_clock: ManualClock) -> None:
    tpm = limiter(clock=manual_clock)
    d = tpm.observe("org", 30)
    assert d.allowed
    assert d.remaining == 30
    assert d.limit == 100
    assert d.reset_after == 7.0  # 70 tokens at 10 a second
    assert not tpm.allow("org", 31)
    assert tpm.allow("org", 30)


def test_a_report_never_raises_the_bucket(manual_clock: ManualClock) -> None:
    tpm = limiter(clock=manual_clock)
    assert tpm.allow("org", 90)
    assert tpm.observe("org", 80).remaining == 10
    assert tpm.observe("org", 10_000).remaining == 10
    # A full bucket stays a missing one: nothing is kept for it.
    assert tpm.observe("other", 100).remaining == 100
    assert len(tpm) == 1


def test_a_stale_report_bounds_only_what_it_still_implies(manual_clock: ManualClock) -> None:
    tpm = limiter(clock=manual_clock)
    manual_clock.advance(10)
    # The newer report (made at 9 s: 40 left, so 50 by now) applies first; the
    # stale one (made at 5 s: 0 left) arrives late and implies at most 50 by now
    # too: it cannot undo the newer one.
    assert tpm.observe("org", 40, at=9).remaining == 50
    assert tpm.observe("org", 0, at=5).remaining == 50
    # The order does not matter.
    other = limiter(clock=manual_clock)
    assert other.observe("org", 0, at=5).remaining == 50
    assert other.observe("org", 40, at=9).remaining == 50
    # From the future: as if now.
    assert limiter(clock=manual_clock).observe("org", 20, at=60).remaining == 20


def test_a_limiter_above_the_upstream_follows_its_pace(manual_clock: ManualClock) -> None:
    # Configured 10 % above the upstream's true limit (110 at 11/s against 100 at
    # 10/s): the bucket may not hold 100 before the upstream does.
    tpm = TokenBucketLimiter(110, 11, clock=manual_clock)
    d = tpm.observe("org", 0, limit=100, reset_after=10)
    assert not d.allowed
    assert d.retry_after == 1.0
    manual_clock.advance(10)
    assert tpm.peek("org").remaining == 99  # 100 at the upstream's reset, not before
    # A limiter below the upstream (10 of 100): only what remains counts.
    share = TokenBucketLimiter(10, 10, clock=manual_clock)
    assert share.observe("org", 20, limit=100, reset_after=8).remaining == 10


def test_a_hold_lets_nothing_pass_before_it_ends(manual_clock: ManualClock) -> None:
    rpm = TokenBucketLimiter(60, 60, per=60, clock=manual_clock)
    d = rpm.observe("org", 0, retry_after=2.5)
    assert not d.allowed
    assert d.retry_after == 2.5
    waiter = rpm.reserve("org")
    assert waiter.delay == 2.5  # every worker waits for its end
    waiter.cancel()
    manual_clock.advance(2.5 - 1e-6)
    assert not rpm.allow("org")
    manual_clock.advance(1e-6)
    assert rpm.acquire("org", timeout=0)


def test_a_holds_end_makes_a_token_whatever_else_the_report_says(
    manual_clock: ManualClock,
) -> None:
    # 100 an hour: a token every 36 s. A 429 saying "nothing left, full in an hour,
    # retry after 1 s": the token comes at the hold's end, not 36 s on.
    rph = TokenBucketLimiter(100, 100, per=3600, clock=manual_clock)
    held = rph.observe("org", 0, limit=100, reset_after=3600, retry_after=1)
    assert held.retry_after == 1.0, "the hold delayed the key beyond its end"
    manual_clock.advance(1 - 1e-6)
    assert not rph.allow("org")
    manual_clock.advance(1e-6)
    assert rph.allow("org")
    # One token, then the bucket's own pace.
    assert rph.peek("org").retry_after == 36.0


def test_a_waiting_reservation_gets_its_tokens_back_after_a_report(
    manual_clock: ManualClock,
) -> None:
    tpm = limiter(10, 1, clock=manual_clock)
    assert tpm.reserve("org", 10)
    waiting = tpm.reserve("org", 5)
    assert waiting.delay == 5.0
    tpm.observe("org", 0, retry_after=8)
    waiting.cancel()  # never sent: the upstream never counted it
    assert tpm.peek("org").retry_after == 3.0  # the hold's 8 s, less the 5 given back


def test_a_quota_is_lowered_only_to_what_remains(manual_clock: ManualClock) -> None:
    quota = limiter(10, 0, clock=manual_clock)
    d = quota.observe("org", 4, limit=10, reset_after=1, retry_after=1)
    assert d.remaining == 4
    assert d.allowed
    assert quota.observe("org", 0).retry_after == math.inf


def test_never_is_the_debt_bound(manual_clock: ManualClock) -> None:
    tpm = limiter(10, 1, clock=manual_clock)
    d = tpm.observe("org", 0, retry_after=math.inf)
    assert d.retry_after == 10_001.0  # 1,000 capacities of debt, then a token


def test_at_reads_time_monotonic_for_the_builtin_clock() -> None:
    tpm = limiter(100, 10)
    d = tpm.observe("org", 10, at=time.monotonic() - 2)  # 2 s ago: 20 more by now
    assert 29 <= d.remaining <= 30


def test_a_new_key_without_room_records_nothing(manual_clock: ManualClock) -> None:
    tpm = limiter(10, 1, clock=manual_clock, max_keys=1)
    assert tpm.observe("a", 3).remaining == 3
    d = tpm.observe("b", 3)
    assert not d.allowed
    assert d.remaining == 0
    assert len(tpm) == 1
    assert tpm.peek("a").remaining == 2


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((1.5,), {}, TypeError, "remaining must be an int"),
        ((True,), {}, TypeError, "remaining must be an int"),
        (("3",), {}, TypeError, "remaining must be an int"),
        ((-1,), {}, ValueError, "remaining must be an int from 0"),
        ((2**64,), {}, ValueError, "remaining must be an int from 0"),
        ((1,), {"limit": 2.0}, TypeError, "limit must be an int"),
        ((1,), {"limit": -3}, ValueError, "limit must be an int from 0"),
        ((1,), {"reset_after": "6m0s"}, TypeError, "reset_after must be an int, float"),
        ((1,), {"reset_after": -1}, ValueError, "reset_after must be a number of seconds >= 0"),
        ((1,), {"reset_after": math.nan}, ValueError, "reset_after must be a number"),
        ((1,), {"retry_after": False}, TypeError, "retry_after must be an int, float"),
        ((1,), {"retry_after": -0.5}, ValueError, "retry_after must be a number of seconds"),
        ((1,), {"at": "now"}, TypeError, "at must be a reading of the limiter's clock"),
        ((1,), {"at": math.inf}, ValueError, "at must be a reading of the limiter's clock"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    manual_clock: ManualClock,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: type[Exception],
    words: str,
) -> None:
    tpm = limiter(clock=manual_clock)
    assert tpm.allow("org", 10)
    with pytest.raises(error, match=words):
        tpm.observe("org", *args, **kwargs)
    with pytest.raises(TypeError, match="key must be a str"):
        tpm.observe(b"org", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key must not be empty"):
        tpm.observe("", 1)
    assert tpm.peek("org").remaining == 89


# -- against the model -----------------------------------------------------------

KEYS = ["a", "b"]
waits_us = st.one_of(st.none(), st.just("never"), st.integers(0, 30_000_000))
reports = st.tuples(
    st.just("observe"),
    st.sampled_from(KEYS),
    st.integers(0, 10**5),  # remaining
    st.one_of(st.none(), st.integers(0, 10**5)),  # limit
    waits_us,  # reset_after
    waits_us,  # retry_after
    st.integers(-5_000_000, 1_000_000),  # at, relative to now
)
spends = st.tuples(st.sampled_from(["allow", "reserve", "charge"]), st.sampled_from(KEYS))
steps = st.tuples(st.just("wait"), st.integers(0, 3_000_000))
traces = st.lists(st.one_of(reports, reports, spends, steps), max_size=40)


def seconds_of(wait: int | str | None) -> float | None:
    if wait is None:
        return None
    if isinstance(wait, str):  # "never"
        return math.inf
    return wait / 1e6


@given(config=refilling_configs, start=st.integers(-(10**6), 10**6), trace=traces)
def test_observe_matches_the_model(config: Config, start: int, trace: list[Any]) -> None:
    clock = FakeClock(start)
    real = config.limiter(clock)
    model = config.model()
    for step in trace:
        now = to_micros(clock())
        kind = step[0]
        if kind == "wait":
            clock.step_micros(step[1])
        elif kind == "observe":
            _, key, remaining, limit, reset, hold, at = step
            got = real.observe(
                key,
                remaining,
                limit=limit,
                reset_after=seconds_of(reset),
                retry_after=seconds_of(hold),
                at=(now + at) / 1e6,
            )
            at_micros = to_micros((now + at) / 1e6)
            want = model.observe(
                key, model.report_cap(remaining, limit, reset, hold), at_micros, now
            )
            assert answer_of(got) == want, step
        else:
            _, key = step
            cost = 1 + (now // 7) % config.capacity
            if kind == "allow":
                assert answer_of(real.allow(key, cost)) == model.allow(key, cost, now)
            elif kind == "reserve":
                reservation = real.reserve(key, cost)
                answer, _delay = model.reserve(key, cost, now, None)
                assert answer_of(reservation.decision) == answer
            else:
                assert answer_of(real.charge(key, cost)) == model.charge(key, cost, now)
    for key in KEYS:
        now = to_micros(clock())
        assert answer_of(real.peek(key)) == model.peek(key, 1, now)
