"""What the web adapters need from a limiter, sync or asyncio."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Protocol, runtime_checkable

from bucketlimit._core import Decision


@runtime_checkable
class SyncLimiter(Protocol):
    """What the adapters need from a limiter whose methods answer at once
    (``TokenBucketLimiter``, ``RedisTokenBucketLimiter``)."""

    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float: ...
    def allow(self, key: str, cost: int = 1) -> Decision: ...
    def peek(self, key: str, cost: int = 1) -> Decision: ...
    def refund(self, key: str, cost: int) -> None: ...


@runtime_checkable
class AsyncLimiter(Protocol):
    """The same, with coroutine methods (``AsyncRedisTokenBucketLimiter``)."""

    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float: ...
    async def allow(self, key: str, cost: int = 1) -> Decision: ...
    async def peek(self, key: str, cost: int = 1) -> Decision: ...
    async def refund(self, key: str, cost: int) -> None: ...


@runtime_checkable
class Limiter(Protocol):
    """Any limiter an async adapter accepts: methods that answer at once or are
    awaited. Every bucketlimit limiter is one; so is a class of your own with
    these members."""

    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float: ...
    def allow(self, key: str, cost: int = 1) -> Decision | Awaitable[Decision]: ...
    def peek(self, key: str, cost: int = 1) -> Decision | Awaitable[Decision]: ...
    def refund(self, key: str, cost: int) -> Awaitable[None] | None: ...


AnyLimiter = SyncLimiter | AsyncLimiter | Limiter


@runtime_checkable
class Waited(Protocol):
    """The reservation a limiter's ``_acquire_reservation`` answers (the in-process
    one's, or a Redis one's): a request that waited settles through it, so that a
    give-back keeps its place in the queue (docs/design.md §4, "Giving back")."""

    @property
    def decision(self) -> Decision: ...
    def settle(self, used: int) -> Awaitable[None] | None: ...


def is_async_limiter(limiter: object) -> bool:
    """True when ``limiter.allow`` is a coroutine function (the asyncio Redis limiter)."""
    return inspect.iscoroutinefunction(getattr(limiter, "allow", None))
