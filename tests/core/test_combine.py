"""``_core.combine``: the rule of ``allow_all`` (docs/design.md §2) for decisions
answered elsewhere (the Redis limiters'). It answers as ``allow_all`` does: the
decision of a call over several buckets is ``combine`` of each bucket's own.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bucketlimit import Decision, TokenBucketLimiter, allow_all
from bucketlimit._core import combine
from bucketlimit.testing import ManualClock

#: A bucket of a call: (capacity, rate, tokens charged before it, the call's cost).
bucket = st.integers(1, 50).flatmap(
    lambda capacity: st.tuples(
        st.just(capacity),
        st.sampled_from([0, 0.5, 1, 3, 1_000]),
        st.integers(0, 2 * capacity),
        st.integers(1, capacity),
    )
)


def world(
    buckets: list[tuple[int, float, int, int]], elapsed: float
) -> list[tuple[TokenBucketLimiter, str, int]]:
    """The call's checks, each bucket charged what it says, then ``elapsed`` later."""
    clock = ManualClock()
    checks = []
    for i, (capacity, rate, charged, cost) in enumerate(buckets):
        limiter = TokenBucketLimiter(capacity, rate, clock=clock)
        if charged:
            limiter.charge(f"k{i}", charged)
        checks.append((limiter, f"k{i}", cost))
    clock.advance(elapsed)
    return checks


def own_decision(limiter: TokenBucketLimiter, key: str, cost: int, call_allowed: bool) -> Decision:
    """What ``allow_all`` reports for this bucket: charged when the call is allowed,
    else its refusal, or its state as it stands (uncharged) when it alone would pass."""
    if call_allowed:
        return limiter.allow(key, cost)
    alone = limiter.peek(key, cost)
    if not alone:
        return alone
    # A report of more than it holds changes nothing and answers the bucket as it stands.
    return limiter.observe(key, 2**64 - 1)


@given(st.lists(bucket, min_size=1, max_size=4), st.sampled_from([0.0, 0.25, 2.0]))
def test_combine_answers_as_allow_all(
    buckets: list[tuple[int, float, int, int]], elapsed: float
) -> None:
    called = allow_all(world(buckets, elapsed))
    own = [
        own_decision(limiter, key, cost, called.allowed)
        for limiter, key, cost in world(buckets, elapsed)
    ]
    assert combine(own) == called, f"combine of {own} against allow_all's {called}"


def test_the_rule_on_ties_never_and_degraded() -> None:
    tight = Decision(False, 2.0, 1, 3.0, 10)
    assert combine([Decision(True, 0.0, 5, 1.0, 5), tight]) == tight
    first = Decision(True, 0.0, 1, 1.0, 4, degraded=True)
    second = Decision(True, 0.0, 1, 9.0, 8)
    assert combine([first, second]) == first, "the first of the fewest remaining"
    assert combine([second, first]) == Decision(True, 0.0, 1, 9.0, 8, degraded=True), (
        "degraded when any is"
    )
    never = Decision(False, math.inf, 3, math.inf, 3)
    assert combine([tight, never]).retry_after == math.inf, "a refusal that never passes"
    assert combine([Decision(True, 0.0, 0, 1.0, 1), tight]).retry_after == 2.0, (
        "retry_after counts the refusals only"
    )


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        combine([])
    with pytest.raises(TypeError, match="Decision, got tuple"):
        combine([(True, 0.0, 1, 0.0, 1)])  # type: ignore[list-item]
