"""A reference model of the in-process limiter, written from docs/design.md §2 and §4.

It shares no code with the core: the exact rate comes from
``fractions.Fraction`` (a float by its shortest decimal form, ``repr``), time
from ``round(seconds * 1_000_000)``, and every bucket is plain Python
integers. Property tests replay one trace through both and compare answers,
so a bug has to be made twice, the same way, to go unnoticed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

MICROS = 1_000_000
#: docs/design.md §4: a bucket owes at most this many capacities (the debt bound).
DEBT_CAPACITIES = 1000


class DecisionLike(Protocol):
    """What both ``bucketlimit.Decision`` and :class:`Answer` provide."""

    @property
    def allowed(self) -> bool: ...
    @property
    def retry_after(self) -> float: ...
    @property
    def remaining(self) -> int: ...
    @property
    def reset_after(self) -> float: ...
    @property
    def limit(self) -> int: ...
    @property
    def degraded(self) -> bool: ...


@dataclass(frozen=True)
class Answer:
    """The fields of a ``Decision``, as the model computes them."""

    allowed: bool
    retry_after: float
    remaining: int
    reset_after: float
    limit: int
    degraded: bool = False


def answer_of(decision: DecisionLike) -> Answer:
    """A real ``Decision`` as an :class:`Answer`, for comparison."""
    return Answer(
        decision.allowed,
        decision.retry_after,
        decision.remaining,
        decision.reset_after,
        decision.limit,
        decision.degraded,
    )


def exact(number: int | float) -> Fraction:
    """An int as it is; a float by its shortest decimal form (``0.1`` is 1/10)."""
    if isinstance(number, float):
        return Fraction(repr(number))
    return Fraction(number)


def to_micros(seconds: int | float) -> int:
    """A clock reading in whole microseconds (Python's round: half to even)."""
    if isinstance(seconds, float):
        return round(seconds * MICROS)
    return seconds * MICROS


def seconds(micros: int | None) -> float:
    """A wait as the limiter reports it: microseconds / 1e6, ``inf`` for never."""
    if micros is None:
        return math.inf
    return float(micros) / 1e6


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Line:
    """Where a waiting reservation left its bucket's cap line (docs/design.md §4,
    "Giving back"): the bucket's time, ``balance + headroom`` right after it, the
    headroom before it and its cost."""

    last: int
    cap: int
    headroom_before: int
    cost: int


class ReferenceLimiter:
    """One limiter: exact integer buckets keyed by string, nothing evicted.

    Keeping every bucket forever is deliberate: docs/design.md §5 says a full bucket
    answers exactly like a missing one, so a limiter that forgets buckets
    must still agree with this model.
    """

    def __init__(self, capacity: int, rate: int | float, per: int | float = 1) -> None:
        self.capacity = capacity
        tokens_per_second = exact(rate) / exact(per)  # reduced by Fraction
        self.rate = tokens_per_second
        self.p = tokens_per_second.numerator  # units refilled per microsecond
        self.unit = tokens_per_second.denominator * MICROS  # units in one token
        self.full = capacity * self.unit
        # key -> (balance in units, last time in µs, headroom in units)
        self.buckets: dict[str, tuple[int, int, int]] = {}
        # Writes so far, and key -> the write at which its bucket was last found
        # full (refilled to full, new, or reset): a give-back after it may take
        # headroom others left (docs/design.md §4, "Giving back").
        self.writes = 0
        self.filled: dict[str, int] = {}
        # The latest time any spending call has seen; never goes back.
        self.time: int | None = None
        self.allowed = 0
        self.refused = 0

    # -- time and buckets ------------------------------------------------

    def observe_time(self, now: int) -> int:
        """Records a clock reading (µs) and returns the limiter's time."""
        self.time = now if self.time is None else max(self.time, now)
        return self.time

    def current(self, now: int) -> int:
        """The limiter's time for a reading, without recording it (peek)."""
        return now if self.time is None else max(self.time, now)

    def balance_at(self, key: str, now: int) -> int:
        """The key's balance refilled to ``now``; a missing bucket is full."""
        return self.bucket_at(key, now)[0]

    def bucket_at(self, key: str, now: int) -> tuple[int, int]:
        """(balance, headroom) refilled to ``now`` (docs/design.md §4, "Giving back"):
        full means headroom 0; else the headroom stays, within ``full - balance``."""
        if key not in self.buckets:
            return self.full, 0
        balance, last, headroom = self.buckets[key]
        elapsed = max(0, now - last)
        if balance + elapsed * self.p >= self.full:
            return self.full, 0
        balance += elapsed * self.p
        return balance, min(headroom, self.full - balance)

    def store(self, key: str, balance: int, now: int, headroom: int) -> None:
        _, last, _ = self.buckets.get(key, (self.full, now, 0))
        if self.bucket_at(key, now)[0] == self.full:
            self.filled[key] = self.writes
        self.writes += 1
        assert 0 <= headroom <= self.full - balance
        self.buckets[key] = (balance, max(last, now), headroom)

    def spend(self, key: str, cost: int, now: int) -> Line | None:
        """Takes ``cost`` tokens (granted) at ``now``; the line of a waiter, else None.

        Not waiting: the cap line stays, so the headroom grows by what was spent.
        Waiting (the balance goes below zero): the headroom drops to 0."""
        balance, headroom = self.bucket_at(key, now)
        after = balance - cost * self.unit
        if after >= 0:
            self.store(key, after, now, min(headroom + cost * self.unit, self.full - after))
            return None
        self.store(key, after, now, 0)
        return Line(last=self.time_of(key), cap=after, headroom_before=headroom, cost=cost)

    def time_of(self, key: str) -> int:
        return self.buckets[key][1]

    # -- answers -----------------------------------------------------------

    def wait(self, missing: int) -> int | None:
        """µs until ``missing`` units have refilled; None when never."""
        if missing <= 0:
            return 0
        if self.p == 0:
            return None
        return ceil_div(missing, self.p)

    def describe(self, balance: int, allowed: bool, retry_after: int | None) -> Answer:
        """An answer reporting a bucket holding ``balance``."""
        return Answer(
            allowed=allowed,
            retry_after=seconds(retry_after),
            remaining=max(0, balance) // self.unit,  # in debt: none
            reset_after=seconds(self.wait(self.full - balance)),
            limit=self.capacity,
        )

    def decide(self, balance: int, cost: int) -> tuple[Answer, int]:
        """The answer to ``cost`` from ``balance``, and the balance after it."""
        need = cost * self.unit
        if balance >= need:
            return self.describe(balance - need, True, 0), balance - need
        return self.describe(balance, False, self.wait(need - balance)), balance

    def check_cost(self, cost: int) -> None:
        if cost < 1 or cost > self.capacity:
            raise ValueError(f"cost {cost} outside 1..{self.capacity}")

    # -- the public operations, with the clock already read (µs) ------------

    def allow(self, key: str, cost: int, now: int) -> Answer:
        self.check_cost(cost)
        now = self.observe_time(now)
        answer, _ = self.decide(self.balance_at(key, now), cost)
        if answer.allowed:
            self.spend(key, cost, now)
            self.allowed += 1
        else:
            self.touch(key, now)
            self.refused += 1
        return answer

    def touch(self, key: str, now: int) -> None:
        """Refills a held bucket to ``now`` without spending (a refusal)."""
        if key in self.buckets:
            balance, headroom = self.bucket_at(key, now)
            self.store(key, balance, now, headroom)

    def peek(self, key: str, cost: int, now: int) -> Answer:
        self.check_cost(cost)
        now = self.current(now)
        return self.decide(self.balance_at(key, now), cost)[0]

    def refund(self, key: str, cost: int, now: int, line: Line | None = None) -> None:
        """Gives ``cost`` tokens back (docs/design.md §4, "Giving back"): found on the
        line a waiter left (only refilled since), it is undone exactly; else it takes
        headroom, never above capacity."""
        self.check_cost(cost)
        now = self.observe_time(now)
        if key not in self.buckets:
            return  # a missing bucket is full: nothing to give back
        balance, headroom = self.bucket_at(key, now)
        last = max(self.time_of(key), now)
        back = cost * self.unit
        if line is not None and line.cap + (last - line.last) * self.p == balance + headroom:
            balance = min(self.full, balance + back)
            kept = line.headroom_before if cost >= line.cost else headroom
            self.store(key, balance, now, min(kept, self.full - balance))
            return
        back = min(back, headroom)
        self.store(key, balance + back, now, headroom - back)

    # -- reservations (docs/design.md §4): the balance may go below zero -------------

    @property
    def floor(self) -> int:
        """The lowest balance: ``-DEBT_CAPACITIES * capacity`` tokens."""
        return -DEBT_CAPACITIES * self.full

    def reserve_from(
        self, balance: int, cost: int, max_wait: int | None
    ) -> tuple[Answer, int | None, int]:
        """A reservation from ``balance``: (answer, delay in µs or None, balance after)."""
        after = balance - cost * self.unit
        if after >= 0:
            return self.describe(after, True, 0), 0, after
        if self.p == 0:
            return self.describe(balance, False, None), None, balance
        delay = ceil_div(-after, self.p)
        # Past the bound or past max_wait: refused until both are met.
        over_bound = ceil_div(max(0, self.floor - after), self.p)
        over_wait = 0 if max_wait is None else max(0, delay - max_wait)
        refused_for = max(over_bound, over_wait)
        if refused_for == 0:
            return self.describe(after, True, 0), delay, after
        return self.describe(balance, False, refused_for), delay, balance

    def reserve(
        self, key: str, cost: int, now: int, max_wait: int | None
    ) -> tuple[Answer, int | None]:
        """``reserve(key, cost, max_wait=...)`` with ``max_wait`` in µs (None: no limit)."""
        answer, delay, _ = self.reserve_with_line(key, cost, now, max_wait)
        return answer, delay

    def reserve_with_line(
        self, key: str, cost: int, now: int, max_wait: int | None
    ) -> tuple[Answer, int | None, Line | None]:
        """:meth:`reserve`, and the line a waiter keeps for its give-back."""
        self.check_cost(cost)
        now = self.observe_time(now)
        answer, delay, _ = self.reserve_from(self.balance_at(key, now), cost, max_wait)
        line = None
        if answer.allowed:
            line = self.spend(key, cost, now)
            self.allowed += 1
        else:
            self.touch(key, now)
            self.refused += 1
        return answer, delay, line

    def charge(self, key: str, cost: int, now: int) -> Answer:
        """Use that happened: debt allowed, down to the bound, where it stops."""
        if cost < 1:
            raise ValueError(f"cost {cost} below 1")
        now = self.observe_time(now)
        balance, headroom = self.bucket_at(key, now)
        after = max(self.floor, balance - cost * self.unit)
        self.store(key, after, now, min(headroom + balance - after, self.full - after))
        if after >= 0:
            return self.describe(after, True, 0)
        return self.describe(after, False, self.wait(-after))

    # -- an upstream's report (docs/design.md §4, "Following the upstream") -----------

    def report_cap(
        self,
        remaining: int,
        limit: int | None,
        reset_after: int | str | None,
        retry_after: int | str | None,
    ) -> int:
        """The most units the bucket may hold when the report was made. Waits in µs;
        ``None``: not said; ``"never"``: an infinite wait. Written from the rule: the
        bucket holds at most what remains; it holds min(capacity, limit) no sooner
        than an upstream refilling steadily from what remains to its limit over
        ``reset_after``; a hold settles it alone: less than a token until its end,
        one token at it. Any of these below the debt bound is the debt bound; at
        rate 0 only what remains counts."""
        said = self.capacity if limit is None else limit
        left = min(remaining, said)
        bounds: list[int] = [min(left, self.capacity) * self.unit]
        if self.p > 0 and retry_after is not None:
            if retry_after == "never":
                return self.floor
            assert isinstance(retry_after, int)
            return max(self.unit - self.p * retry_after, self.floor)
        if self.p > 0:
            level = min(self.capacity, said)
            if reset_after is not None and left < level:
                if reset_after == "never":
                    bounds.append(self.floor)
                else:
                    assert isinstance(reset_after, int)
                    when = Fraction((level - left) * reset_after, said - left)
                    bounds.append(level * self.unit - self.p * math.ceil(when))
        return max(min(bounds), self.floor)

    def observe(self, key: str, cap: int, at: int, now: int) -> Answer:
        """Applies a report of ``cap`` units at ``at`` µs: the balance becomes at most
        cap plus the refill since ``at`` (none from the future), never higher; the
        cap line stays (the headroom grows by what was removed). The answer is the
        bucket as it stands: allowed when it holds a token, retry_after the wait."""
        now = self.observe_time(now)
        balance, headroom = self.bucket_at(key, now)
        bound = cap + self.p * max(0, now - at)
        if bound < balance:
            self.store(key, bound, now, min(headroom + balance - bound, self.full - bound))
            balance = bound
        else:
            self.touch(key, now)
        return self.describe(balance, balance >= self.unit, self.wait(self.unit - balance))

    def reset(self, key: str) -> None:
        self.buckets.pop(key, None)
        self.filled[key] = self.writes
        self.writes += 1

    def clear(self) -> None:
        self.buckets.clear()


def _check(charges: Sequence[tuple[ReferenceLimiter, str, int]], what: str) -> None:
    """Each check's cost, then whether its (limiter, key) came before, in order."""
    seen: list[tuple[ReferenceLimiter, str]] = []
    for limiter, key, cost in charges:
        limiter.check_cost(cost)
        if any(other is limiter and other_key == key for other, other_key in seen):
            raise ValueError(f"duplicate (limiter, key): {key!r}")
        seen.append((limiter, key))
    if not charges:
        raise ValueError(f"{what} needs at least one (limiter, key)")


def _all_or_nothing(
    charges: Sequence[tuple[ReferenceLimiter, str, int]],
    balances: list[int],
    answers: list[Answer],
) -> tuple[Answer, list[Line | None]]:
    """Spends every (limiter, key, cost) if every answer allowed, counts, and combines:
    allowed if all allow; retry_after the longest refusal's; the rest from the bucket
    with the fewest remaining tokens (the first on a tie)."""
    allowed = all(a.allowed for a in answers)
    lines: list[Line | None] = []
    for limiter, key, cost in charges:
        # Spent at the limiter's latest time (a limiter named twice may
        # have read its clock twice).
        assert limiter.time is not None
        if allowed:
            limiter.allowed += 1
            lines.append(limiter.spend(key, cost, limiter.time))
        else:
            limiter.touch(key, limiter.time)
            limiter.refused += 1
            lines.append(None)
    if not allowed:
        # Nothing was spent: the buckets that would have allowed are
        # reported as they stand, not as if charged.
        answers = [
            limiter.describe(balance, True, 0) if answer.allowed else answer
            for (limiter, _, _), balance, answer in zip(charges, balances, answers, strict=True)
        ]
    tightest = answers[0]
    for answer in answers[1:]:
        if answer.remaining < tightest.remaining:  # first one wins a tie
            tightest = answer
    retry_after = max((a.retry_after for a in answers if not a.allowed), default=0.0)
    combined = Answer(
        allowed=allowed,
        retry_after=retry_after,
        remaining=tightest.remaining,
        reset_after=tightest.reset_after,
        limit=tightest.limit,
    )
    return combined, lines


def allow_all(checks: Sequence[tuple[ReferenceLimiter, str, int]], cost: int) -> Answer:
    """docs/design.md §2's ``allow_all``; each check carries its limiter's reading (µs).

    Every bucket is checked first; cost is spent from all only if all allow.
    """
    charges = [(limiter, key, cost) for limiter, key, _ in checks]
    _check(charges, "allow_all")
    answers: list[Answer] = []
    balances: list[int] = []
    for limiter, key, reading in checks:
        now = limiter.observe_time(reading)
        balance = limiter.balance_at(key, now)
        balances.append(balance)
        answers.append(limiter.decide(balance, cost)[0])
    return _all_or_nothing(charges, balances, answers)[0]


def reserve_all(
    checks: Sequence[tuple[ReferenceLimiter, str, int, int]], max_wait: int | None
) -> tuple[Answer, int | None]:
    """docs/design.md §2's ``reserve_all``: ``(limiter, key, cost, reading µs)`` checks, all or
    nothing; the delay is the longest (None: never)."""
    answer, delay, _ = reserve_all_with_lines(checks, max_wait)
    return answer, delay


def reserve_all_with_lines(
    checks: Sequence[tuple[ReferenceLimiter, str, int, int]], max_wait: int | None
) -> tuple[Answer, int | None, list[Line | None]]:
    """:func:`reserve_all`, and each bucket's line (None where it did not wait)."""
    charges = [(limiter, key, cost) for limiter, key, cost, _ in checks]
    _check(charges, "reserve_all")
    answers: list[Answer] = []
    balances: list[int] = []
    delay: int | None = 0
    for limiter, key, cost, reading in checks:
        now = limiter.observe_time(reading)
        balance = limiter.balance_at(key, now)
        balances.append(balance)
        answer, own_delay, _ = limiter.reserve_from(balance, cost, max_wait)
        answers.append(answer)
        delay = None if delay is None or own_delay is None else max(delay, own_delay)
    answer, lines = _all_or_nothing(charges, balances, answers)
    return answer, delay, lines
