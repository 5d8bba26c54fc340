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
        # key -> (balance in units, last time in µs)
        self.buckets: dict[str, tuple[int, int]] = {}
        # The latest time any spending call has seen; never goes back.
        self.time: int | None = None
        self.allowed = 0
        self.refused = 0

    # -- time and buckets ------------------------------------------------

    def observe(self, now: int) -> int:
        """Records a clock reading (µs) and returns the limiter's time."""
        self.time = now if self.time is None else max(self.time, now)
        return self.time

    def current(self, now: int) -> int:
        """The limiter's time for a reading, without recording it (peek)."""
        return now if self.time is None else max(self.time, now)

    def balance_at(self, key: str, now: int) -> int:
        """The key's balance refilled to ``now``; a missing bucket is full."""
        if key not in self.buckets:
            return self.full
        balance, last = self.buckets[key]
        elapsed = max(0, now - last)
        return min(self.full, balance + elapsed * self.p)

    def store(self, key: str, balance: int, now: int) -> None:
        _, last = self.buckets.get(key, (self.full, now))
        self.buckets[key] = (balance, max(last, now))

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
        now = self.observe(now)
        answer, balance = self.decide(self.balance_at(key, now), cost)
        self.store(key, balance, now)
        if answer.allowed:
            self.allowed += 1
        else:
            self.refused += 1
        return answer

    def peek(self, key: str, cost: int, now: int) -> Answer:
        self.check_cost(cost)
        now = self.current(now)
        return self.decide(self.balance_at(key, now), cost)[0]

    def refund(self, key: str, cost: int, now: int) -> None:
        self.check_cost(cost)
        now = self.observe(now)
        balance = self.balance_at(key, now)
        self.store(key, min(self.full, balance + cost * self.unit), now)

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
        self.check_cost(cost)
        now = self.observe(now)
        answer, delay, balance = self.reserve_from(self.balance_at(key, now), cost, max_wait)
        self.store(key, balance, now)
        if answer.allowed:
            self.allowed += 1
        else:
            self.refused += 1
        return answer, delay

    def charge(self, key: str, cost: int, now: int) -> Answer:
        """Use that happened: debt allowed, down to the bound, where it stops."""
        if cost < 1:
            raise ValueError(f"cost {cost} below 1")
        now = self.observe(now)
        after = max(self.floor, self.balance_at(key, now) - cost * self.unit)
        self.store(key, after, now)
        if after >= 0:
            return self.describe(after, True, 0)
        return self.describe(after, False, self.wait(-after))

    def reset(self, key: str) -> None:
        self.buckets.pop(key, None)

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
) -> Answer:
    """Spends every (limiter, key, cost) if every answer allowed, counts, and combines:
    allowed if all allow; retry_after the longest refusal's; the rest from the bucket
    with the fewest remaining tokens (the first on a tie)."""
    allowed = all(a.allowed for a in answers)
    for limiter, key, cost in charges:
        if allowed:
            limiter.allowed += 1
            # Spent at the limiter's latest time (a limiter named twice may
            # have read its clock twice).
            assert limiter.time is not None
            now = limiter.time
            limiter.store(key, limiter.balance_at(key, now) - cost * limiter.unit, now)
        else:
            limiter.refused += 1
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
    return Answer(
        allowed=allowed,
        retry_after=retry_after,
        remaining=tightest.remaining,
        reset_after=tightest.reset_after,
        limit=tightest.limit,
    )


def allow_all(checks: Sequence[tuple[ReferenceLimiter, str, int]], cost: int) -> Answer:
    """docs/design.md §2's ``allow_all``; each check carries its limiter's reading (µs).

    Every bucket is checked first; cost is spent from all only if all allow.
    """
    charges = [(limiter, key, cost) for limiter, key, _ in checks]
    _check(charges, "allow_all")
    answers: list[Answer] = []
    balances: list[int] = []
    for limiter, key, reading in checks:
        now = limiter.observe(reading)
        balance = limiter.balance_at(key, now)
        balances.append(balance)
        answers.append(limiter.decide(balance, cost)[0])
    return _all_or_nothing(charges, balances, answers)


def reserve_all(
    checks: Sequence[tuple[ReferenceLimiter, str, int, int]], max_wait: int | None
) -> tuple[Answer, int | None]:
    """docs/design.md §2's ``reserve_all``: ``(limiter, key, cost, reading µs)`` checks, all or
    nothing; the delay is the longest (None: never)."""
    charges = [(limiter, key, cost) for limiter, key, cost, _ in checks]
    _check(charges, "reserve_all")
    answers: list[Answer] = []
    balances: list[int] = []
    delay: int | None = 0
    for limiter, key, cost, reading in checks:
        now = limiter.observe(reading)
        balance = limiter.balance_at(key, now)
        balances.append(balance)
        answer, own_delay, _ = limiter.reserve_from(balance, cost, max_wait)
        answers.append(answer)
        delay = None if delay is None or own_delay is None else max(delay, own_delay)
    return _all_or_nothing(charges, balances, answers), delay
