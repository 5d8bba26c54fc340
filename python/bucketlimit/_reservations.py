"""The one reservation contract (docs/design.md §2, "Reservations").

Every backend's reservation satisfies one of these protocols: the in-process
``bucketlimit.Reservation`` and ``bucketlimit.redis.RedisReservation`` are
:class:`ReservationLike`; ``bucketlimit.redis.AsyncRedisReservation`` is
:class:`AsyncReservationLike`, whose ``wait``, ``cancel`` and ``settle`` are
coroutines. Code that takes "a reservation" (the web adapters, a caller's own
helpers) is written against these, never against one backend's class.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol, SupportsIndex, runtime_checkable

from bucketlimit._core import Decision


@runtime_checkable
class ReservationLike(Protocol):
    """Tokens taken now, the caller's after ``delay`` seconds; truthy when granted.

    - ``delay``: seconds until the tokens are the caller's (0.0: now); for a refusal
      the wait it would have needed (``math.inf``: never).
    - ``cost``, ``key``: the tokens reserved and the key (the first bucket's, for a
      reservation over several).
    - ``decision``: the ``Decision`` to report (allowed, or refused with
      ``retry_after``).
    - ``wait()``: blocks until the tokens are there and returns ``decision`` (at
      once for a refusal); interrupted, it cancels before the exception goes on.
      ``wait_async()``: the same, awaited, for asyncio code holding this
      reservation.
    - ``cancel()``: every token back; ``settle(used)``: ``cost - used`` back when
      less, ``used - cost`` charged when more. Each acts once; later calls, and
      both on a refusal, do nothing.
    """

    @property
    def delay(self) -> float: ...
    @property
    def cost(self) -> int: ...
    @property
    def key(self) -> str: ...
    @property
    def decision(self) -> Decision: ...
    def __bool__(self) -> bool: ...
    def wait(self) -> Decision: ...
    def wait_async(self) -> Awaitable[Decision]: ...
    def cancel(self) -> object: ...
    def settle(self, used: SupportsIndex, /) -> object: ...


@runtime_checkable
class AsyncReservationLike(Protocol):
    """:class:`ReservationLike` of an asyncio backend: ``wait``, ``cancel`` and
    ``settle`` are coroutines (``await reservation.wait()``)."""

    @property
    def delay(self) -> float: ...
    @property
    def cost(self) -> int: ...
    @property
    def key(self) -> str: ...
    @property
    def decision(self) -> Decision: ...
    def __bool__(self) -> bool: ...
    def wait(self) -> Awaitable[Decision]: ...
    def cancel(self) -> Awaitable[object]: ...
    def settle(self, used: SupportsIndex, /) -> Awaitable[object]: ...
