"""What the web adapters need from a limiter, sync or asyncio."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable

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
class ConcurrencyLimiterLike(Protocol):
    """What the adapters need from a concurrency limiter (``concurrency=``):
    ``ConcurrencyLimiter``, ``RedisConcurrencyLimiter``, and
    ``AsyncRedisConcurrencyLimiter`` (whose methods are coroutines, awaited). The
    ``Permit`` they answer is truthy when granted, has a ``decision`` and
    ``release()`` (once), and ``renew()``; ``ttl`` is read when there is one."""

    @property
    def limit(self) -> int: ...
    def try_acquire(self, key: str) -> Any: ...
    def acquire(self, key: str, *, timeout: float | None = None) -> Any: ...


def is_limiter(candidate: object) -> bool:
    """True for a limiter (it has allow, peek and refund), false for a plan function."""
    return all(callable(getattr(candidate, m, None)) for m in ("allow", "peek", "refund"))


def is_concurrency_limiter(candidate: object) -> bool:
    """True for a concurrency limiter (it has try_acquire and acquire), which a
    ``Limit`` takes as ``concurrency=`` (or in place of its limiter)."""
    return all(callable(getattr(candidate, m, None)) for m in ("try_acquire", "acquire"))


def is_async_limiter(limiter: object) -> bool:
    """True when ``limiter.allow`` (a concurrency limiter's ``try_acquire``) is a
    coroutine function: the asyncio Redis limiters."""
    method = getattr(limiter, "allow", None) or getattr(limiter, "try_acquire", None)
    return inspect.iscoroutinefunction(method)
