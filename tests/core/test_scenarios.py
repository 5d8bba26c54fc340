"""The contract's scenarios (docs/design.md §1-2) on a hand-stepped clock."""

from __future__ import annotations

import math
import pickle

import pytest

import bucketlimit.testing
from bucketlimit import Decision, TokenBucketLimiter, allow_all
from bucketlimit.testing import ManualClock

pytestmark = pytest.mark.interpreters


def outcomes(limiter: TokenBucketLimiter, key: str, calls: int, cost: int = 1) -> list[bool]:
    return [limiter.allow(key, cost).allowed for _ in range(calls)]


# -- the seeds' scenarios -----------------------------------------------------


def test_capacity_2_rate_1() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(2, 1, clock=clock)
    assert outcomes(limiter, "k", 3) == [True, True, False]
    clock.advance(0.5)
    assert not limiter.allow("k")
    clock.advance(0.5)
    assert outcomes(limiter, "k", 2) == [True, False]


def test_capacity_3_rate_2() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(3, 2, clock=clock)
    assert limiter.allow("k", cost=3)
    assert not limiter.allow("k")
    clock.advance(0.25)
    assert not limiter.allow("k")
    clock.advance(0.25)
    assert limiter.allow("k", cost=1)
    clock.advance(100)
    assert limiter.allow("k", cost=3)
    assert not limiter.allow("k")
    with pytest.raises(ValueError, match="0"):
        limiter.allow("k", cost=0)
    with pytest.raises(ValueError, match="-1"):
        limiter.allow("k", cost=-1)
    with pytest.raises(TypeError):
        limiter.allow("k", cost=1.5)  # type: ignore[arg-type]


def test_capacity_3_rate_1() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(3, 1, clock=clock)
    assert outcomes(limiter, "k", 4) == [True, True, True, False]
    # Another key has a bucket of its own, full while "k" is empty.
    assert outcomes(limiter, "other", 4) == [True, True, True, False]
    clock.set(0.5)
    refused = limiter.allow("k")
    assert not refused
    assert refused.retry_after == 0.5
    clock.set(1.0)
    assert limiter.allow("k")
    clock.set(1000)
    assert outcomes(limiter, "k", 10).count(True) == 3
    with pytest.raises(ValueError, match="4"):
        limiter.allow("k", cost=4)


def test_capacity_10_rate_2() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(10, 2, clock=clock)
    assert outcomes(limiter, "k", 15).count(True) == 10
    clock.set(3)
    assert outcomes(limiter, "k", 15).count(True) == 6
    # Idle time refills up to capacity, never beyond it.
    clock.advance(10_000)
    assert outcomes(limiter, "k", 30).count(True) == 10


def test_tenth_second_float_steps_refill_exactly_one_token_each() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(1, 10, clock=clock)
    assert limiter.allow("k")
    failures = []
    for k in range(1, 100_001):
        clock.set(round(k * 0.1, 10))
        if not (limiter.allow("k").allowed and not limiter.allow("k").allowed):
            failures.append(k)
    assert failures == []


def test_per_minute_rate() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(10, 100, per=60, clock=clock)
    assert outcomes(limiter, "k", 11).count(True) == 10
    refused = limiter.allow("k")
    assert refused.retry_after == 0.6  # one token every 60/100 s
    assert refused.reset_after == 6.0
    clock.advance(0.599999)
    assert not limiter.allow("k")
    clock.advance(0.000001)
    assert limiter.allow("k")


def test_rate_zero_is_a_one_off_quota() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(2, 0, clock=clock)
    assert outcomes(limiter, "k", 2) == [True, True]
    clock.advance(1e9)
    refused = limiter.allow("k")
    assert not refused
    assert refused.retry_after == math.inf
    assert refused.reset_after == math.inf


# -- Decision -------------------------------------------------------------------


def test_decision_is_truthy_when_allowed() -> None:
    limiter = TokenBucketLimiter(1, 0, clock=ManualClock())
    allowed = limiter.allow("k")
    refused = limiter.allow("k")
    assert bool(allowed) is True
    assert bool(refused) is False


def test_decision_fields_and_repr() -> None:
    limiter = TokenBucketLimiter(3, 1, clock=ManualClock())
    d = limiter.allow("k", cost=2)
    assert (d.allowed, d.retry_after, d.remaining, d.reset_after, d.limit, d.degraded) == (
        True,
        0.0,
        1,
        2.0,
        3,
        False,
    )
    assert repr(d) == (
        "Decision(allowed=True, retry_after=0.0, remaining=1, reset_after=2.0, "
        "limit=3, degraded=False)"
    )
    # The repr of a finite decision is Python that rebuilds it.
    assert eval(repr(d), {"Decision": Decision}) == d


def test_decision_equality_hash_and_pickle() -> None:
    a = Decision(False, 1.5, 0, 3.0, 3)
    b = Decision(False, 1.5, 0, 3.0, 3, degraded=False)
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != Decision(False, 1.5, 0, 3.0, 3, degraded=True)
    assert a != Decision(True, 0.0, 0, 3.0, 3)
    assert a != (False, 1.5, 0, 3.0, 3, False)
    copy = pickle.loads(pickle.dumps(a))
    assert copy == a
    assert type(copy) is Decision
    never = Decision(False, math.inf, 0, math.inf, 2)
    assert pickle.loads(pickle.dumps(never)) == never


@pytest.mark.parametrize(
    "field", ["allowed", "retry_after", "remaining", "reset_after", "limit", "degraded", "other"]
)
def test_decision_is_immutable(field: str) -> None:
    d = Decision(True, 0.0, 1, 1.0, 2)
    with pytest.raises(AttributeError):
        setattr(d, field, 5)
    assert d == Decision(True, 0.0, 1, 1.0, 2)


# -- methods --------------------------------------------------------------------


def test_peek_changes_nothing() -> None:
    clock = ManualClock()
    peeked = TokenBucketLimiter(3, 1, clock=clock)
    twin = TokenBucketLimiter(3, 1, clock=clock)
    for step in range(12):
        for cost in (1, 2, 3):
            assert peeked.peek("k", cost) == peeked.peek("k", cost)
            assert peeked.peek("new-key", cost).allowed
        assert peeked.allow("k", 2) == twin.allow("k", 2)
        for cost in (1, 2, 3):
            assert peeked.peek("k", cost) == twin.peek("k", cost)
        clock.advance(0.3 * (step % 3))
    assert peeked.stats() == twin.stats()
    assert len(peeked) == len(twin)
    assert peeked.peek("never-allowed").remaining == 2
    assert peeked.stats() == twin.stats()


def test_peek_answers_what_allow_would() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(5, 2, clock=clock)
    for step in range(20):
        cost = 1 + step % 5
        assert limiter.peek("k", cost) == limiter.allow("k", cost)
        clock.advance(0.35)


def test_refund_gives_tokens_back_up_to_capacity() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(10, 1, clock=clock)
    assert limiter.allow("k", cost=8).remaining == 2
    limiter.refund("k", 5)
    assert limiter.peek("k").remaining == 6  # 7 left after a 1-token peek
    limiter.refund("k", 10)
    full = limiter.peek("k", 10)
    assert full.allowed
    assert full.remaining == 0
    assert limiter.allow("k", 10)
    assert not limiter.allow("k")
    # A key never seen is full: there is nothing to give back.
    limiter.refund("fresh", 3)
    assert outcomes(limiter, "fresh", 11).count(True) == 10


def test_refund_checks_cost() -> None:
    limiter = TokenBucketLimiter(3, 1, clock=ManualClock())
    limiter.allow("k", 3)
    for bad in (0, -1, 4):
        with pytest.raises(ValueError, match=str(bad)):
            limiter.refund("k", bad)
    with pytest.raises(TypeError):
        limiter.refund("k", 1.0)  # type: ignore[arg-type]
    assert not limiter.allow("k")  # nothing was refunded


def test_reset_refills_a_key() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(3, 0, clock=clock)
    assert limiter.allow("k", 3)
    assert limiter.allow("other", 3)
    limiter.reset("k")
    assert limiter.allow("k", 3)
    assert not limiter.allow("other")
    limiter.reset("never-seen")
    assert len(limiter) == 2


def test_len_and_clear() -> None:
    limiter = TokenBucketLimiter(2, 0, clock=ManualClock())
    assert len(limiter) == 0
    for key in ("a", "b", "c"):
        limiter.allow(key, 2)
    assert len(limiter) == 3
    assert not limiter.allow("a")
    limiter.clear()
    assert len(limiter) == 0
    assert limiter.allow("a", 2)


def test_stats_counts_decisions_and_keys() -> None:
    limiter = TokenBucketLimiter(2, 0, clock=ManualClock())
    outcomes(limiter, "a", 3)
    outcomes(limiter, "b", 1)
    limiter.peek("a")
    stats = limiter.stats()
    assert {"allowed", "refused", "keys", "evicted", "refused_new_keys"} <= stats.keys()
    assert stats["allowed"] == 3
    assert stats["refused"] == 1
    assert stats["keys"] == 2
    assert stats["evicted"] == 0
    assert stats["refused_new_keys"] == 0
    assert all(type(value) is int for value in stats.values())


def test_properties() -> None:
    limiter = TokenBucketLimiter(10, 100, per=60)
    assert limiter.capacity == 10
    assert limiter.rate == 100 / 60  # tokens per second
    assert limiter.per == 60.0
    other = TokenBucketLimiter(capacity=3, rate=2.5)
    assert (other.capacity, other.rate, other.per) == (3, 2.5, 1.0)
    with pytest.raises(AttributeError):
        limiter.capacity = 5  # type: ignore[misc]


def test_manual_clock_fixture_comes_from_the_entry_point(
    manual_clock: ManualClock, request: pytest.FixtureRequest
) -> None:
    # No conftest defines it: the installed package registers the plugin.
    plugin = request.config.pluginmanager.get_plugin("bucketlimit")
    assert plugin is bucketlimit.testing
    assert isinstance(manual_clock, ManualClock)
    assert manual_clock() == 0.0
    limiter = TokenBucketLimiter(1, 1, clock=manual_clock)
    assert limiter.allow("k")
    assert not limiter.allow("k")
    manual_clock.advance(1)
    assert limiter.allow("k")


# -- allow_all -----------------------------------------------------------------


def test_allow_all_spends_from_all_or_none() -> None:
    clock = ManualClock()
    user = TokenBucketLimiter(2, 0, clock=clock)
    everyone = TokenBucketLimiter(3, 0, clock=clock)
    assert allow_all([(user, "u1"), (everyone, "all")], cost=2)
    # The global cap refuses: u2 must not be charged.
    assert not allow_all([(user, "u2"), (everyone, "all")], cost=2)
    assert user.peek("u2", 2).allowed
    # u1's own bucket refuses: the global cap must not be charged.
    assert not allow_all([(user, "u1"), (everyone, "all")], cost=1)
    assert everyone.peek("all", 1).allowed
    assert allow_all([(user, "u2"), (everyone, "all")], cost=1)
    assert not allow_all([(user, "u2"), (everyone, "all")], cost=1)
    assert (user.peek("u2").remaining, everyone.peek("all").remaining) == (0, 0)
    assert user.stats()["allowed"] == everyone.stats()["allowed"] == 2
    assert user.stats()["refused"] == everyone.stats()["refused"] == 3


def test_allow_all_answer_when_allowed_reports_the_tightest_bucket() -> None:
    clock = ManualClock()
    wide = TokenBucketLimiter(10, 1, clock=clock)
    narrow = TokenBucketLimiter(4, 1, clock=clock)
    d = allow_all([(wide, "k"), (narrow, "k")], cost=3)
    assert d == Decision(True, 0.0, 1, 3.0, 4)


def test_allow_all_retry_after_is_the_longest_refusal() -> None:
    clock = ManualClock()
    fast = TokenBucketLimiter(1, 1, clock=clock)
    slow = TokenBucketLimiter(1, 0.25, clock=clock)
    roomy = TokenBucketLimiter(100, 1, clock=clock)
    fast.allow("k")
    slow.allow("k")
    d = allow_all([(fast, "k"), (roomy, "k"), (slow, "k")])
    assert not d
    assert d.retry_after == 4.0
    # remaining/reset_after/limit come from the fewest remaining, the first on a tie.
    assert (d.remaining, d.reset_after, d.limit) == (0, 1.0, 1)
    # The roomy bucket was not charged and reports itself as it stands.
    assert roomy.peek("k", 100).allowed
    never = TokenBucketLimiter(1, 0, clock=clock)
    never.allow("k")
    assert allow_all([(fast, "k"), (never, "k")]).retry_after == math.inf


def test_allow_all_tie_takes_the_first() -> None:
    clock = ManualClock()
    a = TokenBucketLimiter(5, 1, clock=clock)
    b = TokenBucketLimiter(3, 2, clock=clock)
    a.allow("k", 2)  # both now hold 3
    assert allow_all([(a, "k"), (b, "k")], cost=1) == Decision(True, 0.0, 2, 3.0, 5)
    assert allow_all([(b, "k"), (a, "k")], cost=1) == Decision(True, 0.0, 1, 1.0, 3)


def test_allow_all_rejects_the_same_limiter_and_key_twice() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(5, 0, clock=clock)
    other = TokenBucketLimiter(5, 0, clock=clock)
    with pytest.raises(ValueError, match="k"):
        allow_all([(limiter, "k"), (other, "k"), (limiter, "k")])
    assert limiter.peek("k", 5).allowed
    assert other.peek("k", 5).allowed
    # The same key on two limiters, or two keys on one limiter, is fine.
    assert allow_all([(limiter, "k"), (other, "k"), (limiter, "j")], cost=2)
    assert limiter.peek("k").remaining == 2
    assert limiter.peek("j").remaining == 2
