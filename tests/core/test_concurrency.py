"""ConcurrencyLimiter and Permit (docs/design.md §2 "Concurrency", §4 "Permits"), one
thread at a time: permits, expiry, fencing tokens, waiting on a ManualClock, bad
input, max_keys, and a random trace against a reference model.

Races (real threads, asyncio tasks) are in test_concurrency_races.py; the ``*_all``
calls with permits in test_concurrency_combined.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bucketlimit import (
    MAX_KEY_BYTES,
    ConcurrencyLimiter,
    ConcurrencyStats,
    Decision,
    Permit,
)
from bucketlimit.testing import ManualClock

pytestmark = pytest.mark.interpreters


def test_at_most_limit_per_key(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(2, ttl=10, clock=manual_clock)
    first, second, third = (limiter.try_acquire("k") for _ in range(3))
    assert first
    assert second
    assert not third
    assert isinstance(first, Permit)
    assert (first.key, first.token, second.token, third.token) == ("k", 1, 2, 0)
    assert first.decision == Decision(True, 0.0, 1, 10.0, 2)
    assert second.decision.remaining == 0
    # A refusal: nothing is sure to free before the earliest expiry.
    assert third.decision == Decision(False, 10.0, 0, 10.0, 2)
    assert limiter.in_flight("k") == 2
    assert limiter.try_acquire("other")  # keys are independent
    first.release()
    assert limiter.in_flight("k") == 1
    assert limiter.try_acquire("k").token == 4  # one counter per limiter; refusals take none


def test_release_acts_once_and_a_refusal_holds_nothing(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(1, clock=manual_clock)
    held = limiter.try_acquire("k")
    refused = limiter.try_acquire("k")
    refused.release()  # nothing to release
    assert limiter.in_flight("k") == 1
    held.release()
    replacement = limiter.try_acquire("k")
    held.release()  # a second release frees nothing of the replacement's
    assert limiter.in_flight("k") == 1
    assert replacement.valid()
    assert not held.valid()
    assert not refused.valid()
    assert not refused.renew()
    assert not held.renew()
    stats = limiter.stats()
    assert (stats["granted"], stats["refused"], stats["released"]) == (2, 1, 1)


def test_a_permit_past_its_ttl_expires_and_its_release_frees_nothing_else(
    manual_clock: ManualClock,
) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    old = limiter.try_acquire("k")
    manual_clock.advance(9.999999)
    assert old.valid()
    assert not limiter.try_acquire("k")
    manual_clock.advance(0.000001)
    assert not old.valid()
    assert limiter.in_flight("k") == 0
    new = limiter.try_acquire("k")
    assert new.token > old.token  # a store fencing on tokens rejects the old holder
    old.release()
    assert limiter.in_flight("k") == 1
    assert new.valid()
    assert not old.renew()  # a renewal never brings it back
    assert limiter.stats()["expired"] == 1


def test_an_expired_slot_goes_to_the_waiter_with_a_larger_token(
    manual_clock: ManualClock,
) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    stale = limiter.try_acquire("k")
    manual_clock.advance(4)
    # The waiter sleeps on the clock (ManualClock.sleep advances it) until the
    # only moment a slot is sure to free: the expiry.
    fresh = limiter.acquire("k")
    assert fresh
    assert manual_clock.now == 10.0
    assert fresh.token > stale.token
    assert not stale.valid()
    assert fresh.valid()
    stale.release()  # its slot is the waiter's now: nothing happens
    assert limiter.in_flight("k") == 1
    assert fresh.decision == Decision(True, 0.0, 0, 10.0, 1)


def test_renew_extends_by_ttl_from_now(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    permit = limiter.try_acquire("k")
    manual_clock.advance(8)
    assert permit.renew()
    manual_clock.advance(9.5)
    assert permit.valid()  # 17.5 s after the grant, 9.5 s after the renewal
    manual_clock.advance(0.5)
    assert not permit.valid()
    assert not permit.renew()


def test_acquire_refuses_when_its_timeout_passes_holding_nothing(
    manual_clock: ManualClock,
) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    limiter.try_acquire("k")
    refused = limiter.acquire("k", timeout=3)
    assert not refused
    assert refused.token == 0
    # It waited its 3 s (on this clock: at once) and then gave up; a slot is
    # sure to be free 7 s later.
    assert manual_clock.now == 3.0
    assert refused.decision == Decision(False, 7.0, 0, 7.0, 1)
    stats = limiter.stats()
    assert (stats["waiting"], stats["in_flight"], stats["refused"]) == (0, 1, 1)
    # A timeout reached exactly as the slot frees is a grant.
    assert limiter.acquire("k", timeout=7)
    assert manual_clock.now == 10.0


def test_timeout_zero_answers_at_once_as_try_acquire(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    assert limiter.acquire("k", timeout=0)
    refused = limiter.acquire("k", timeout=0)
    assert not refused
    assert manual_clock.now == 0.0
    assert refused.decision.retry_after == 10.0


def test_a_permit_is_a_context_manager_sync_and_async(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(1, clock=manual_clock)
    with limiter.acquire("k") as permit:
        assert permit
        assert limiter.in_flight("k") == 1
    assert limiter.in_flight("k") == 0
    with pytest.raises(KeyError), limiter.try_acquire("k"):
        raise KeyError("the body failed: released all the same")
    assert limiter.in_flight("k") == 0

    async def main() -> None:
        async with await limiter.acquire_async("k") as permit:
            assert permit
            assert limiter.in_flight("k") == 1
        assert limiter.in_flight("k") == 0
        async with limiter.try_acquire("k"):
            with limiter.try_acquire("k") as refused:  # a refusal's exit does nothing
                assert not refused
            assert limiter.in_flight("k") == 1

    asyncio.run(main())
    assert limiter.in_flight("k") == 0


def test_acquire_async_waits_on_a_manual_clock(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(1, ttl=5, clock=manual_clock)

    async def main() -> tuple[Permit, Permit, Permit]:
        first = await limiter.acquire_async("k")
        second = await limiter.acquire_async("k")  # the clock's sleep_async: 5 s, at once
        refused = await limiter.acquire_async("k", timeout=1)
        return first, second, refused

    first, second, refused = asyncio.run(main())
    assert first
    assert second
    assert not refused
    assert second.token > first.token
    assert manual_clock.now == 6.0
    assert refused.decision.retry_after == 4.0


def test_properties_repr_and_stats(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(3, ttl=0.5, clock=manual_clock, max_keys=100)
    assert (limiter.limit, limiter.ttl, limiter.max_keys) == (3, 0.5, 100)
    assert repr(limiter) == "ConcurrencyLimiter(limit=3, ttl=0.5, max_keys=100)"
    assert ConcurrencyLimiter(1).ttl == 60.0
    permit = limiter.try_acquire("k")
    assert repr(permit) == "Permit(key='k', token=1, granted=True, released=False)"
    permit.release()
    assert repr(permit) == "Permit(key='k', token=1, granted=True, released=True)"
    stats: ConcurrencyStats = limiter.stats()
    assert stats == {
        "granted": 1,
        "refused": 0,
        "released": 1,
        "expired": 0,
        "abandoned": 0,
        "refused_new_keys": 0,
        "keys": 1,
        "in_flight": 0,
        "waiting": 0,
    }


def test_idle_keys_are_forgotten_as_new_keys_come(manual_clock: ManualClock) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    for i in range(2_000):
        limiter.try_acquire(f"k{i}").release()
    assert limiter.stats()["keys"] <= 2
    for i in range(2_000):
        limiter.try_acquire(f"leaked{i}")  # never released
    manual_clock.advance(10)
    for i in range(2_000):
        limiter.try_acquire(f"new{i}").release()
    assert limiter.stats()["keys"] <= 100  # the expired ones went as new keys came


def test_max_keys_refuses_new_keys_and_logs_once(
    manual_clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock, max_keys=2)
    a = limiter.try_acquire("a")
    limiter.try_acquire("b")
    manual_clock.advance(1)
    with caplog.at_level(logging.WARNING, logger="bucketlimit"):
        refused = limiter.try_acquire("c")
        assert not limiter.acquire("c", timeout=None)  # cannot even queue
    assert refused.decision == Decision(False, 9.0, 0, 9.0, 1)
    assert [r.getMessage() for r in caplog.records if "max_keys=2" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert limiter.stats()["refused_new_keys"] == 2
    a.release()  # "a" is idle: its entry makes room
    assert limiter.try_acquire("c")
    assert limiter.stats()["keys"] == 2


# -- bad input: TypeError / ValueError, nothing changed --------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"limit": 0}, ValueError),
        ({"limit": -1}, ValueError),
        ({"limit": 2**32}, ValueError),
        ({"limit": 2**200}, ValueError),
        ({"limit": 1.0}, TypeError),
        ({"limit": True}, TypeError),
        ({"limit": "5"}, TypeError),
        ({"limit": None}, TypeError),
        ({"limit": 1, "ttl": 0}, ValueError),
        ({"limit": 1, "ttl": -1.0}, ValueError),
        ({"limit": 1, "ttl": math.nan}, ValueError),
        ({"limit": 1, "ttl": math.inf}, ValueError),
        ({"limit": 1, "ttl": 4e-7}, ValueError),  # rounds to 0 µs
        ({"limit": 1, "ttl": 1e300}, ValueError),
        ({"limit": 1, "ttl": "60"}, TypeError),
        ({"limit": 1, "ttl": True}, TypeError),
        ({"limit": 1, "ttl": None}, TypeError),
        ({"limit": 1, "clock": "monotonic"}, TypeError),
        ({"limit": 1, "max_keys": 0}, ValueError),
        ({"limit": 1, "max_keys": 1.5}, TypeError),
    ],
)
def test_bad_configuration(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error) as raised:
        ConcurrencyLimiter(**kwargs)
    assert type(raised.value) is error
    if error is ValueError and "limit" in str(raised.value):
        assert repr(kwargs["limit"]) in str(raised.value)


def test_ttl_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"ttl must be .* got -2"):
        ConcurrencyLimiter(1, ttl=-2)


@dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


BAD_CALLS = [
    (Call("try_acquire", (5,)), TypeError),
    (Call("try_acquire", (b"k",)), TypeError),
    (Call("try_acquire", ("",)), ValueError),
    (Call("try_acquire", ("\ud800",)), ValueError),
    (Call("try_acquire", ("x" * (MAX_KEY_BYTES + 1),)), ValueError),
    (Call("acquire", (None,)), TypeError),
    (Call("acquire", ("",)), ValueError),
    (Call("acquire", ("k",), {"timeout": -1}), ValueError),
    (Call("acquire", ("k",), {"timeout": math.nan}), ValueError),
    (Call("acquire", ("k",), {"timeout": "1"}), TypeError),
    (Call("acquire", ("k",), {"timeout": True}), TypeError),
    (Call("acquire_async", ("",)), ValueError),
    (Call("acquire_async", ("k",), {"timeout": -0.5}), ValueError),
    (Call("in_flight", (1,)), TypeError),
    (Call("in_flight", ("",)), ValueError),
]


@pytest.mark.parametrize(("call", "error"), BAD_CALLS, ids=lambda c: getattr(c, "name", ""))
def test_bad_calls_raise_and_change_nothing(
    call: Call, error: type[Exception], manual_clock: ManualClock
) -> None:
    limiter = ConcurrencyLimiter(1, ttl=10, clock=manual_clock)
    held = limiter.try_acquire("k")
    before = limiter.stats()
    with pytest.raises(error) as raised:
        getattr(limiter, call.name)(*call.args, **call.kwargs)  # acquire_async: at the call
    assert type(raised.value) is error
    assert limiter.stats() == before
    assert manual_clock.now == 0.0
    assert held.valid()
    assert not limiter.try_acquire("k")
    assert limiter.in_flight("k") == 1


class ClockFailure(Exception):
    """Raised by a test clock."""


def test_a_failing_clock_propagates_and_a_failing_sleep_leaves_the_queue() -> None:
    manual = ManualClock()

    class Clock:
        fail_next = False
        fail_sleep = False

        def __call__(self) -> float:
            if self.fail_next:
                self.fail_next = False
                raise ClockFailure("reading")
            return manual()

        def sleep(self, seconds: float) -> None:
            if self.fail_sleep:
                raise ClockFailure("interrupted")  # as KeyboardInterrupt would
            manual.sleep(seconds)

    clock = Clock()
    limiter = ConcurrencyLimiter(1, ttl=10, clock=clock)
    held = limiter.try_acquire("k")
    clock.fail_next = True
    with pytest.raises(ClockFailure):
        held.release()
    assert held.valid()  # nothing was released
    clock.fail_sleep = True
    with pytest.raises(ClockFailure):
        limiter.acquire("k")
    stats = limiter.stats()
    assert (stats["waiting"], stats["abandoned"], stats["in_flight"]) == (0, 1, 1)
    held.release()
    assert limiter.try_acquire("k")


# -- a random trace against a reference model ------------------------------------------

MICROS = 1_000_000


class ModelPermit:
    def __init__(self, key: str, token: int, expires: int) -> None:
        self.key, self.token, self.expires, self.released = key, token, expires, False


class ReferenceConcurrency:
    """docs/design.md §4 "Permits" for one caller at a time, in whole microseconds:
    the limiter-wide token counter, expiry at ``granted + ttl``, and a waiter on a
    ManualClock sleeping until the earliest expiry or its timeout."""

    def __init__(self, limit: int, ttl: int) -> None:
        self.limit, self.ttl, self.now, self.next_token = limit, ttl, 0, 1
        self.held: dict[str, list[ModelPermit]] = {}

    def live(self, key: str) -> list[ModelPermit]:
        held = [p for p in self.held.get(key, []) if p.expires > self.now and not p.released]
        self.held[key] = held
        return held

    def decision(self, key: str, allowed: bool) -> Decision:
        held = self.live(key)
        reset = max((p.expires for p in held), default=self.now) - self.now
        retry = 0 if allowed else min(p.expires for p in held) - self.now
        return Decision(allowed, retry / MICROS, self.limit - len(held), reset / MICROS, self.limit)

    def try_acquire(self, key: str) -> tuple[Decision, ModelPermit | None]:
        if len(self.live(key)) >= self.limit:
            refused = self.decision(key, False)
            return Decision(False, refused.retry_after, 0, refused.reset_after, self.limit), None
        permit = ModelPermit(key, self.next_token, self.now + self.ttl)
        self.next_token += 1
        self.held[key].append(permit)
        return self.decision(key, True), permit

    def acquire(self, key: str, timeout: int | None) -> tuple[Decision, ModelPermit | None]:
        held = self.live(key)
        if len(held) >= self.limit:
            earliest = min(p.expires for p in held)
            if timeout is not None and earliest - self.now > timeout:
                self.now += timeout
                return self.try_acquire(key)
            self.now = earliest
        return self.try_acquire(key)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.integers(0, 4_000).map(lambda ms: ms * 1_000)),
        st.tuples(st.just("try"), st.sampled_from(["a", "b"])),
        st.tuples(
            st.just("acquire"),
            st.sampled_from(["a", "b"]),
            st.one_of(st.none(), st.integers(0, 5_000).map(lambda ms: ms * 1_000)),
        ),
        st.tuples(st.just("release"), st.integers(0, 1_000)),
        st.tuples(st.just("renew"), st.integers(0, 1_000)),
        st.tuples(st.just("in_flight"), st.sampled_from(["a", "b"])),
    ),
    max_size=60,
)


@given(limit=st.integers(1, 3), ttl_ms=st.integers(1, 5_000), ops=OPS)
def test_random_traces_match_the_model(limit: int, ttl_ms: int, ops: list[Any]) -> None:
    clock = ManualClock()
    limiter = ConcurrencyLimiter(limit, ttl=ttl_ms / 1_000, clock=clock)
    model = ReferenceConcurrency(limit, ttl_ms * 1_000)
    permits: list[tuple[Permit, ModelPermit]] = []
    for op in ops:
        kind = op[0]
        if kind == "advance":
            clock.advance(op[1] / MICROS)
            model.now += op[1]
        elif kind in ("try", "acquire"):
            if kind == "try":
                real = limiter.try_acquire(op[1])
                expected, modelled = model.try_acquire(op[1])
            else:
                real = limiter.acquire(op[1], timeout=None if op[2] is None else op[2] / MICROS)
                expected, modelled = model.acquire(op[1], op[2])
            assert real.decision == expected
            assert round(clock.now * MICROS) == model.now
            if modelled is None:
                assert not real
            else:
                assert real.token == modelled.token
                permits.append((real, modelled))
        elif kind in ("release", "renew") and permits:
            real, modelled = permits[op[1] % len(permits)]
            alive = not modelled.released and modelled.expires > model.now
            assert real.valid() == alive
            if kind == "release":
                real.release()
                modelled.released = True
            else:
                assert real.renew() == alive
                if alive:
                    modelled.expires = model.now + model.ttl
        elif kind == "in_flight":
            assert limiter.in_flight(op[1]) == len(model.live(op[1]))
    assert limiter.stats()["in_flight"] == sum(len(model.live(k)) for k in ("a", "b"))
