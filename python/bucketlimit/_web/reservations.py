"""Reservations: reserve the largest cost up front, give back the unused part.

The adapters' reservations satisfy the one reservation contract
(``bucketlimit.ReservationLike`` for :class:`Reservation`,
``bucketlimit.AsyncReservationLike`` for :class:`AsyncReservation`; docs/design.md
§2): ``delay``, ``cost``, ``key``, ``decision``, truthy when the request may go on,
``wait()`` (the request already waited: it answers at once), ``cancel()`` and
``settle(used)``, which here return how many tokens were refunded.
"""

from __future__ import annotations

import inspect
import math
import operator
import threading
from typing import Any, Generic, SupportsIndex, TypeVar

from bucketlimit._core import Decision
from bucketlimit._reservations import AsyncReservationLike, ReservationLike
from bucketlimit._web.limiters import AnyLimiter, SyncLimiter


def _check_used(used: SupportsIndex) -> int:
    if isinstance(used, bool) or not hasattr(type(used), "__index__"):
        raise TypeError(f"used must be an int, got {type(used).__name__}")
    used = operator.index(used)
    if used < 0:
        raise ValueError(f"used must be >= 0, got {used}")
    return used


L = TypeVar("L")


# One lock for every reservation: settling is rare and short, and a lock per
# request would cost each request its creation.
_SETTLE_LOCK = threading.Lock()


class _ReservationBase(Generic[L]):
    __slots__ = ("_core", "_limiter", "_settled", "charged", "cost", "decision", "key", "permit")

    def __init__(self, limiter: L | None, key: str, charged: int, decision: Decision | None):
        self._limiter = limiter
        self.key = key
        #: Tokens this reservation holds (0 when refused, exempt, or settled).
        self.charged = charged
        #: Tokens it reserved (0 when refused or exempt); ``charged`` is what is left.
        self.cost = charged
        #: The limiter's answer; ``None`` when the request was exempt.
        self.decision = decision
        self._settled = False
        # The in-process limiter's reservation when the request waited for its
        # tokens: settled through it, a give-back keeps its place in the queue
        # (docs/design.md §4, "Giving back"); else refund / charge on the limiter.
        self._core: ReservationLike | AsyncReservationLike | None = None
        #: The concurrency permit the request holds (``Limit(concurrency=...)``), or
        #: ``None``: its ``token`` is the fencing token. The adapter releases it when
        #: the response ends (:meth:`release` frees it sooner); :meth:`cancel`
        #: releases it too (the request did not run).
        self.permit: Any = None

    def settle_through(self, core: ReservationLike | AsyncReservationLike) -> None:
        """Settle through ``core``, the limiter's own reservation of a request that
        waited for its tokens (the request procedure calls it)."""
        self._core = core

    @property
    def allowed(self) -> bool:
        """True when the request may go on (exempt requests included)."""
        return self.decision is None or self.decision.allowed

    def __bool__(self) -> bool:
        return self.allowed

    @property
    def delay(self) -> float:
        """Seconds the request waited for its tokens (0.0 when it did not; they are
        the request's by the time the handler holds this); for a refusal, its
        ``retry_after`` (``math.inf``: never)."""
        if not self.allowed:
            return self.decision.retry_after if self.decision is not None else math.inf
        core = self._core
        return 0.0 if core is None else float(core.delay)

    def _take_difference(self, used: SupportsIndex) -> int:
        """Tokens to give back (> 0) or charge more (< 0) now; marks it settled.

        A refused or exempt reservation holds nothing and is charged nothing."""
        used = _check_used(used)
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

    def wait(self) -> Decision | None:
        """The tokens are already the request's (it waited before the handler ran):
        returns :attr:`decision` at once (``None`` when exempt)."""
        return self.decision

    async def wait_async(self) -> Decision | None:
        """:meth:`wait`, awaitable."""
        return self.decision

    def settle(self, used: SupportsIndex) -> int:
        """Keeps ``used`` tokens: refunds the rest or charges the overage; returns how
        many were refunded (0 when charged more)."""
        difference = self._take_difference(used)
        used = operator.index(used)
        limiter: Any = self._limiter
        if difference and self._core is not None:
            self._core.settle(used)
        elif difference > 0:
            refund(limiter, self.key, difference, self.decision)
        elif difference < 0 and callable(getattr(limiter, "charge", None)):
            limiter.charge(self.key, -difference)
        return max(0, difference)

    def release(self) -> None:
        """Releases the request's concurrency permit now, before the response ends
        (the expensive part is done); once: later calls, the adapter's at the end of
        the response included, free nothing. Nothing without a permit."""
        if self.permit is not None:
            self.permit.release()

    def cancel(self) -> int:
        """Refunds everything and releases the permit (the request did not run);
        returns the tokens refunded, as ``settle(0)``."""
        refunded = self.settle(0)
        self.release()
        return refunded


class AsyncReservation(_ReservationBase[AnyLimiter]):
    """:class:`Reservation` for async code: ``await settle(used)``.

    Works with both kinds of limiter: a coroutine ``refund`` is awaited, the
    in-process one is called directly.
    """

    __slots__ = ()

    async def wait(self) -> Decision | None:
        """The tokens are already the request's (it waited before the handler ran):
        returns :attr:`decision` (``None`` when exempt)."""
        return self.decision

    async def settle(self, used: SupportsIndex) -> int:
        """Keeps ``used`` tokens: refunds the rest or charges the overage; returns how
        many were refunded (0 when charged more)."""
        difference = self._take_difference(used)
        used = operator.index(used)
        limiter: Any = self._limiter
        result: Any = None
        if difference and self._core is not None:
            result = self._core.settle(used)  # awaited for an asyncio Redis limiter
        elif difference > 0:
            result = refund(limiter, self.key, difference, self.decision)
        elif difference < 0 and callable(getattr(limiter, "charge", None)):
            result = limiter.charge(self.key, -difference)
        if inspect.isawaitable(result):
            await result
        return max(0, difference)

    async def release(self) -> None:
        """:meth:`Reservation.release`: an asyncio limiter's release is awaited."""
        if self.permit is not None:
            answer = self.permit.release()
            if inspect.isawaitable(answer):
                await answer

    async def cancel(self) -> int:
        """Refunds everything and releases the permit (the request did not run);
        returns the tokens refunded, as ``settle(0)``."""
        refunded = await self.settle(0)
        await self.release()
        return refunded


def refund(limiter: Any, key: str, tokens: int, decision: Decision | None) -> Any:
    """A reservation's tokens given back where they were taken: a
    degraded answer's were not taken from the store, so they go to the limiter's
    ``refund(..., degraded=True)`` (the Redis limiters': this process's share under
    ``"local"``, else nowhere); a limiter of your own without that keyword keeps
    them. Answers what ``refund`` answers (a coroutine for an asyncio limiter)."""
    if decision is None or not decision.degraded:
        return limiter.refund(key, tokens)
    if "degraded" in inspect.signature(limiter.refund).parameters:
        return limiter.refund(key, tokens, degraded=True)
    return None


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
