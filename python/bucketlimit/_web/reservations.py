"""Reservations: reserve the largest cost up front, give back the unused part."""

from __future__ import annotations

import inspect
import threading
from typing import Any, Generic, TypeVar

from bucketlimit._core import Decision
from bucketlimit._web.limiters import AnyLimiter, SyncLimiter, Waited


def _check_used(used: int) -> int:
    if isinstance(used, bool) or not isinstance(used, int):
        raise TypeError(f"used must be an int, got {type(used).__name__}")
    if used < 0:
        raise ValueError(f"used must be >= 0, got {used}")
    return used


L = TypeVar("L")


# One lock for every reservation: settling is rare and short, and a lock per
# request would cost each request its creation.
_SETTLE_LOCK = threading.Lock()


class _ReservationBase(Generic[L]):
    __slots__ = ("_core", "_limiter", "_settled", "charged", "decision", "key")

    def __init__(self, limiter: L | None, key: str, charged: int, decision: Decision | None):
        self._limiter = limiter
        self.key = key
        #: Tokens this reservation holds (0 when refused, exempt, or settled).
        self.charged = charged
        #: The limiter's answer; ``None`` when the request was exempt.
        self.decision = decision
        self._settled = False
        # The in-process limiter's reservation when the request waited for its
        # tokens: settled through it, a give-back keeps its place in the queue
        # (docs/design.md §4, "Giving back"); else refund / charge on the limiter.
        self._core: Waited | None = None

    def _settle_through(self, core: Waited) -> None:
        self._core = core

    @property
    def allowed(self) -> bool:
        """True when the request may go on (exempt requests included)."""
        return self.decision is None or self.decision.allowed

    def _take_difference(self, used: int) -> int:
        """Tokens to give back (> 0) or charge more (< 0) now; marks it settled.

        A refused or exempt reservation holds nothing and is charged nothing."""
        _check_used(used)
        with _SETTLE_LOCK:
            if self._settled or self._limiter is None or not self.allowed:
                self._settled = True
                return 0
            self._settled = True
            difference = self.charged - used
            if difference > 0 or callable(getattr(self._limiter, "charge", None)):
                self.charged = used
            return difference

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, charged={self.charged}, "
            f"settled={self._settled}, decision={self.decision!r})"
        )


class Reservation(_ReservationBase[SyncLimiter]):
    """Tokens taken before a handler runs; ``settle`` gives back what it did not use.

    Made by :func:`reserve` and by the adapters. ``settle(used)`` refunds
    ``charged - used`` once, and when ``used`` is larger charges the overage
    (``limiter.charge``: the use happened, so the bucket may go into debt and
    later callers wait for it); later calls do nothing and return 0, so it is safe
    in a ``finally`` or a callback that may run twice. A limiter without
    ``charge`` (one of your own) keeps the reservation's charge. A refused
    or exempt reservation holds nothing to give back and is charged nothing.
    """

    __slots__ = ()

    def settle(self, used: int) -> int:
        """Keeps ``used`` tokens: refunds the rest or charges the overage; returns how
        many were refunded (0 when charged more)."""
        difference = self._take_difference(used)
        limiter: Any = self._limiter
        if difference and self._core is not None:
            self._core.settle(used)
        elif difference > 0:
            limiter.refund(self.key, difference)
        elif difference < 0 and callable(getattr(limiter, "charge", None)):
            limiter.charge(self.key, -difference)
        return max(0, difference)

    def cancel(self) -> int:
        """Refunds everything (the request did not run); same as ``settle(0)``."""
        return self.settle(0)


class AsyncReservation(_ReservationBase[AnyLimiter]):
    """:class:`Reservation` for async code: ``await settle(used)``.

    Works with both kinds of limiter: a coroutine ``refund`` is awaited, the
    in-process one is called directly.
    """

    __slots__ = ()

    async def settle(self, used: int) -> int:
        """Keeps ``used`` tokens: refunds the rest or charges the overage; returns how
        many were refunded (0 when charged more)."""
        difference = self._take_difference(used)
        limiter: Any = self._limiter
        result: Any = None
        if difference and self._core is not None:
            result = self._core.settle(used)  # awaited for an asyncio Redis limiter
        elif difference > 0:
            result = limiter.refund(self.key, difference)
        elif difference < 0 and callable(getattr(limiter, "charge", None)):
            result = limiter.charge(self.key, -difference)
        if inspect.isawaitable(result):
            await result
        return max(0, difference)

    async def cancel(self) -> int:
        """Refunds everything (the request did not run); same as ``settle(0)``."""
        return await self.settle(0)


def reserve(limiter: SyncLimiter, key: str, max_cost: int) -> Reservation:
    """Spends ``max_cost`` now, if the bucket holds it; settle the real cost later.

    >>> from bucketlimit import TokenBucketLimiter
    >>> limiter = TokenBucketLimiter(1000, 0)
    >>> r = reserve(limiter, "user-1", 500)   # the request may generate 500 tokens
    >>> r.allowed, r.decision.remaining
    (True, 500)
    >>> r.settle(120)                         # it generated 120: 380 come back
    380
    >>> limiter.allow("user-1", 880).remaining   # 1000 - 120 were left
    0
    >>> over = reserve(TokenBucketLimiter(1000, 0), "user-2", 500)
    >>> over.settle(700)                      # it generated 700: 200 more are charged
    0
    """
    decision = limiter.allow(key, max_cost)
    return Reservation(limiter, key, max_cost if decision.allowed else 0, decision)


async def reserve_async(limiter: AnyLimiter, key: str, max_cost: int) -> AsyncReservation:
    """:func:`reserve` for async code and either kind of limiter."""
    answer = limiter.allow(key, max_cost)
    decision: Decision = await answer if inspect.isawaitable(answer) else answer
    return AsyncReservation(limiter, key, max_cost if decision.allowed else 0, decision)
