"""What the web adapters need from a limiter, sync or asyncio."""

from __future__ import annotations

import inspect
from typing import Protocol

from bucketlimit._core import Decision


class SyncLimiter(Protocol):
    """What the adapters need from a limiter whose methods answer at once."""

    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float: ...
    def allow(self, key: str, cost: int = 1) -> Decision: ...
    def peek(self, key: str, cost: int = 1) -> Decision: ...
    def refund(self, key: str, cost: int) -> None: ...


class AsyncLimiter(Protocol):
    """The same, with coroutine methods (``AsyncRedisTokenBucketLimiter``)."""

    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float: ...
    async def allow(self, key: str, cost: int = 1) -> Decision: ...
    async def peek(self, key: str, cost: int = 1) -> Decision: ...
    async def refund(self, key: str, cost: int) -> None: ...


AnyLimiter = SyncLimiter | AsyncLimiter


def is_async_limiter(limiter: object) -> bool:
    """True when ``limiter.allow`` is a coroutine function (the asyncio Redis limiter)."""
    return inspect.iscoroutinefunction(getattr(limiter, "allow", None))
