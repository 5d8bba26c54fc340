"""Reservations over Redis (docs/design.md §2 and §6): ``RedisReservation`` and
``AsyncRedisReservation``, both ``bucketlimit.ReservationLike`` /
``AsyncReservationLike``.

What a reservation holds and what its ``cancel``, ``settle`` and ``wait`` do is
written once in :class:`ReservationState`; the two classes drive its flows with
the blocking driver or with ``await``. Its give-backs and charges go where its
tokens were taken: to the store's buckets, to this process's share
(a reservation made in process under ``on_store_error="local"``), or nowhere (one
granted under ``"open"``, which took nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._redis import buckets
from bucketlimit._redis.buckets import NO_MORE, Part, Reserved
from bucketlimit._redis.drivers import run, run_async
from bucketlimit._redis.flows import Flow
from bucketlimit._redis.script import CHARGE, REFUND
from bucketlimit._redis.state import LimiterState

if TYPE_CHECKING:
    from bucketlimit._redis.combined import ReservedPermits
    from bucketlimit._redis.permit_flows import AsyncRedisPermit, RedisPermit
    from bucketlimit._redis.permits import PermitHolder

logger = logging.getLogger("bucketlimit")


def used_per_part(used: object, parts: int) -> list[int]:
    """``settle``'s ``used``: one int for every bucket, or a sequence of one per bucket."""

    def one(value: object) -> int:
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise TypeError(f"used must be an int, got {type(value).__name__}")
        n: int = value.__index__()  # type: ignore[attr-defined]
        if n < 0:
            raise ValueError(f"used must be >= 0, got {n}")
        return n

    if isinstance(used, (tuple, list)):
        values = [one(v) for v in used]
        if len(values) != parts:
            raise ValueError(
                f"settle got {len(values)} used values for a reservation of {parts} buckets"
            )
        return values
    return [one(used)] * parts


class ReservationState:
    """A reservation over Redis, apart from I/O: its buckets, its answer, where its
    tokens were taken, and the flows its ``cancel`` and ``settle`` run. Each acts
    once; on a refusal neither does anything; a rejected ``settle`` changes
    nothing (it can still be settled or cancelled)."""

    __slots__ = (
        "_checks",
        "_clock",
        "_lock",
        "_made",
        "_parts",
        "_permits",
        "_reserved",
        "_settled",
    )

    def __init__(
        self,
        checks: Sequence[tuple[Any, str, int]],
        parts: Sequence[Part],
        reserved: Reserved,
        permits: ReservedPermits | None = None,
    ) -> None:
        self._checks = tuple(checks)  # (limiter, key, cost), for .checks
        self._parts = list(parts)  # (its state, key, cost)
        self._reserved = reserved
        # Concurrency permits among the checks (*_all): released by cancel / settle.
        self._permits = permits
        self._lock = threading.Lock()
        self._settled = not reserved.decision.allowed
        # The clock its wait runs on (the first limiter's; time.monotonic for the
        # store's own), and its reading when the answer came: the tokens are the
        # caller's `delay` after that.
        self._clock = parts[0][0].clock if parts else (permits.clock if permits else None)
        waits = reserved.decision.allowed and reserved.delay > 0
        self._made = (self._clock or time.monotonic)() if waits else 0.0

    @property
    def delay(self) -> float:
        """Seconds until the tokens are yours (0.0: now); for a refusal, the wait it
        would have needed (``math.inf`` when never)."""
        return self._reserved.delay

    @property
    def cost(self) -> int:
        """The tokens reserved (of the first check, for ``reserve_all``; a permit's 1)."""
        return self._checks[0][2]

    @property
    def key(self) -> str:
        """The key (of the first check, for ``reserve_all``)."""
        return self._checks[0][1]

    @property
    def checks(self) -> tuple[tuple[Any, str, int], ...]:
        """Every check of the reservation: ``(limiter, key, cost)``, a permit's cost 1."""
        return self._checks

    def _holders(self) -> tuple[PermitHolder, ...]:
        """The permits a granted reservation holds, in the order of its checks."""
        if self._permits is None or not self:
            return ()
        return self._permits.holders

    @property
    def decision(self) -> Decision:
        """The ``Decision`` to report: allowed, or refused with ``retry_after``."""
        return self._reserved.decision

    def __bool__(self) -> bool:
        return self._reserved.decision.allowed

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, cost={self.cost}, delay={self.delay!r}, "
            f"granted={bool(self)}, buckets={len(self._parts)})"
        )

    def _left(self) -> float:
        """Seconds left of the wait now (0.0 for a refusal, which holds nothing)."""
        if not self or not self._reserved.delay > 0:
            return 0.0
        return max(0.0, self._reserved.delay - ((self._clock or time.monotonic)() - self._made))

    def _sleep(self, name: str) -> Any:
        """The clock's ``sleep`` / ``sleep_async`` when it has one, else ``None``."""
        sleep = getattr(self._clock, name, None)
        return sleep if callable(sleep) else None

    def _take(self) -> bool:
        """True the first time (the call that acts); False once cancelled or settled."""
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True

    def _cancel_flows(self) -> list[tuple[Flow[Any], LimiterState]]:
        """The flows of ``cancel()``: every token back where it was taken; none twice."""
        if not self._take():
            return []
        reserved = self._reserved
        if reserved.local is not None:
            reserved.local.cancel()  # its local permits too
            return []
        if not reserved.stored:
            return []  # granted under "open": nothing was taken
        return self._give_backs([(i, cost) for i, (_, _, cost) in enumerate(self._parts)])

    def _settle_flows(self, used: object) -> list[tuple[Flow[Any], LimiterState]]:
        """The flows of ``settle(used)``: ``cost - used`` back where less was used,
        ``used - cost`` charged where more. Everything is checked first."""
        if self._permits is not None:
            used = self._permits.token_uses(used, len(self._parts))
        each = used_per_part(used, len(self._parts))
        for (_, _, cost), u in zip(self._parts, each, strict=True):
            if u > cost:
                _core.check_charge(u - cost)
        if not self._take():
            return []
        reserved = self._reserved
        if reserved.local is not None:
            shares = [
                min(u, state.fallback.share)
                for (state, _, _), u in zip(self._parts, each, strict=True)
            ]
            if self._permits is not None:
                shares = self._permits.local_uses(self._parts, shares)
            reserved.local.settle(shares)
            return []
        if not reserved.stored:
            return []
        backs = [(i, self._parts[i][2] - u) for i, u in enumerate(each) if u < self._parts[i][2]]
        charges = [
            (state, key, u - cost)
            for (state, key, cost), u in zip(self._parts, each, strict=True)
            if u > cost
        ]
        planned = self._give_backs(backs)
        if len(charges) == 1:
            state, key, cost = charges[0]
            planned.append((buckets.charge(state, key, cost), state))
        elif charges:
            planned.append(
                (buckets.change_all(charges, CHARGE, [NO_MORE] * len(charges)), charges[0][0])
            )
        return planned

    def _line(self, i: int) -> tuple[Any, ...]:
        """The 4 more values of bucket ``i``'s give-back: its line and its cost."""
        line = self._reserved.lines[i]
        return NO_MORE if line is None else (*line, self._parts[i][2])

    def _give_backs(self, backs: list[tuple[int, int]]) -> list[tuple[Flow[Any], LimiterState]]:
        """One flow giving ``cost`` back to each bucket ``i`` of ``backs``, with the
        reservation's line there (and releasing its permits, in the same script)."""
        lines = self._reserved.lines
        if self._permits is not None:
            backs_parts = [(self._parts[i][0], self._parts[i][1], cost) for i, cost in backs]
            lines_of = [self._line(i) for i, _ in backs]
            return self._permits.give_back(backs_parts, lines_of)
        if not backs:
            return []
        if len(backs) == 1:
            i, cost = backs[0]
            state, key, reserved = self._parts[i]
            return [(buckets.give_back(state, key, cost, lines[i], reserved), state)]
        parts = [(self._parts[i][0], self._parts[i][1], cost) for i, cost in backs]
        more: list[tuple[Any, ...]] = []
        for i, _ in backs:
            line = lines[i]
            more.append(NO_MORE if line is None else (*line, self._parts[i][2]))
        return [(buckets.change_all(parts, REFUND, more), parts[0][0])]


class RedisReservation(ReservationState):
    """Tokens taken from one or more Redis buckets; truthy when granted. Use them
    after ``delay`` seconds (``wait()``); ``cancel()`` gives them back,
    ``settle(used)`` turns the estimate into the actual use (each sends one script,
    once)."""

    __slots__ = ()

    @property
    def permits(self) -> tuple[RedisPermit, ...]:
        """The permits a granted reservation holds (``*_all`` with concurrency
        limiters), in the order of its checks; empty for a refusal."""
        return cast("tuple[RedisPermit, ...]", self._holders())

    def wait(self) -> Decision:
        """Sleeps until the tokens are yours (``delay`` after the reservation was
        made, on the limiter's clock: its ``sleep`` when it has one, else
        ``time.sleep``) and returns ``decision``; at once for a refusal. An
        exception while sleeping gives the tokens back (one refund) before it
        propagates."""
        left = self._left()
        if left > 0:
            try:
                (self._sleep("sleep") or time.sleep)(left)
            except BaseException:
                self._cancel_quietly()
                raise
        return self.decision

    async def wait_async(self) -> Decision:
        """``wait`` for asyncio code holding the sync limiter: the delay is awaited
        (the clock's ``sleep_async`` when it has one, else ``asyncio.sleep``); a task
        cancelled while it waits gives the tokens back (one refund, a blocking round
        trip)."""
        left = self._left()
        if left > 0:
            try:
                await (self._sleep("sleep_async") or asyncio.sleep)(left)
            except BaseException:
                self._cancel_quietly()
                raise
        return self.decision

    def _cancel_quietly(self) -> None:
        """A waiter's one refund; its failure is counted and logged as a lost refund,
        and the waiter's own error goes on."""
        try:
            self.cancel()
        except Exception:
            logger.debug("a waiter's refund failed", exc_info=True)

    def cancel(self) -> None:
        """Gives every token back (capped at capacity, and at what the buckets may
        take back: docs/design.md §4). Once; nothing for a refusal."""
        for flow, state in self._cancel_flows():
            run(flow, state)

    def settle(self, used: SupportsIndex | Sequence[SupportsIndex]) -> None:
        """The actual use: gives back ``cost - used``, or charges ``used - cost`` more.
        One ``used`` for every bucket, or a sequence with one per bucket. Once."""
        for flow, state in self._settle_flows(used):
            run(flow, state)


# Refunds sent after their waiter was cancelled: held until they end (the event
# loop keeps only weak references to tasks).
_REFUNDS: set[asyncio.Future[None]] = set()


class AsyncRedisReservation(ReservationState):
    """:class:`RedisReservation` of the asyncio limiters: ``wait``, ``cancel`` and
    ``settle`` are coroutines."""

    __slots__ = ()

    @property
    def permits(self) -> tuple[AsyncRedisPermit, ...]:
        """:attr:`RedisReservation.permits`: permits whose ``release`` is a coroutine."""
        return cast("tuple[AsyncRedisPermit, ...]", self._holders())

    async def wait(self) -> Decision:
        """:meth:`RedisReservation.wait`, awaited (the clock's ``sleep_async`` when it
        has one, else ``asyncio.sleep``): a task cancelled while it waits sends its
        refund in a task of its own, shielded, so that a second cancellation cannot
        lose it."""
        left = self._left()
        if left > 0:
            try:
                await (self._sleep("sleep_async") or asyncio.sleep)(left)
            except BaseException:
                refund = asyncio.ensure_future(self._cancel_quietly())
                # Cancelled again while it is sent: the refund goes on without us.
                with contextlib.suppress(BaseException):
                    await asyncio.shield(refund)
                raise
        return self.decision

    async def _cancel_quietly(self) -> None:
        try:
            await self.cancel()
        except Exception:  # counted and logged as a lost refund
            logger.debug("a waiter's refund failed", exc_info=True)

    async def cancel(self) -> None:
        """:meth:`RedisReservation.cancel`, awaited."""
        for flow, state in self._cancel_flows():
            await run_async(flow, state)

    async def settle(self, used: SupportsIndex | Sequence[SupportsIndex]) -> None:
        """:meth:`RedisReservation.settle`, awaited."""
        for flow, state in self._settle_flows(used):
            await run_async(flow, state)
