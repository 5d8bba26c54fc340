"""bucketlimit: an exact, thread-safe token-bucket rate limiter with a Rust core.

>>> from bucketlimit import TokenBucketLimiter
>>> limiter = TokenBucketLimiter(capacity=10, rate=2)
>>> bool(limiter.allow("user-42"))
True
>>> limiter.acquire("user-42", 9)    # waits (here: not at all) for its turn
Decision(allowed=True, retry_after=0.0, remaining=0, reset_after=5.0, limit=10, degraded=False)
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Coroutine, Iterable
from typing import TYPE_CHECKING, Any, SupportsIndex, overload

from bucketlimit import _core
from bucketlimit._core import (
    MAX_DEBT_CAPACITIES,
    MAX_KEY_BYTES,
    Decision,
    Reservation,
    TokenBucketLimiter,
    __version__,
)
from bucketlimit._errors import ConfigurationError
from bucketlimit._stats import LimiterStats, RedisLimiterStats

if TYPE_CHECKING:
    from bucketlimit.redis import (
        AsyncRedisReservation,
        AsyncRedisTokenBucketLimiter,
        RedisReservation,
        RedisTokenBucketLimiter,
    )

    # The checks of Redis limiters (bucketlimit.redis), sync and asyncio.
    RedisCheck = (
        tuple[RedisTokenBucketLimiter, str] | tuple[RedisTokenBucketLimiter, str, SupportsIndex]
    )
    AsyncRedisCheck = (
        tuple[AsyncRedisTokenBucketLimiter, str]
        | tuple[AsyncRedisTokenBucketLimiter, str, SupportsIndex]
    )

# A library leaves output to the application: its records (rare: a full
# max_keys table, a store outage) go wherever the application's logging sends
# them, and nowhere when it has configured none.
logging.getLogger("bucketlimit").addHandler(logging.NullHandler())

__all__ = [
    "MAX_DEBT_CAPACITIES",
    "MAX_KEY_BYTES",
    "ConfigurationError",
    "Decision",
    "LimiterStats",
    "RedisLimiterStats",
    "Reservation",
    "TokenBucketLimiter",
    "__version__",
    "acquire_all",
    "acquire_all_async",
    "allow_all",
    "reserve_all",
]

#: One check of ``allow_all`` and friends: ``(limiter, key)`` (charged the call's
#: ``cost``) or ``(limiter, key, cost)``.
Check = tuple[TokenBucketLimiter, str] | tuple[TokenBucketLimiter, str, SupportsIndex]


@overload
def allow_all(checks: Iterable[Check], cost: SupportsIndex = 1) -> Decision: ...
@overload
def allow_all(checks: Iterable[RedisCheck], cost: SupportsIndex = 1) -> Decision: ...
@overload
def allow_all(
    checks: Iterable[AsyncRedisCheck], cost: SupportsIndex = 1
) -> Coroutine[Any, Any, Decision]: ...
def allow_all(checks: Iterable[tuple[Any, ...]], cost: Any = 1) -> Any:
    """Spends ``cost`` from every (limiter, key) only if all of them allow.

    A check may carry its own cost, ``(limiter, key, cost)``, so requests and
    tokens go in one call: ``allow_all([(rpm, org, 1), (tpm, org, 3_500)])``.

    In-process limiters are checked under their locks in Rust; Redis limiters
    sharing one client run as one script (``bucketlimit.redis``); for asyncio
    Redis limiters the result is a coroutine to await. The kinds cannot be mixed.
    """
    checks, routed = _via_redis("allow_all", checks, cost, None)
    if routed is not None:
        return routed
    return _core.allow_all(checks, cost)


@overload
def reserve_all(
    checks: Iterable[Check], cost: SupportsIndex = 1, *, max_wait: float | None = None
) -> Reservation: ...
@overload
def reserve_all(
    checks: Iterable[RedisCheck], cost: SupportsIndex = 1, *, max_wait: float | None = None
) -> RedisReservation: ...
@overload
def reserve_all(
    checks: Iterable[AsyncRedisCheck], cost: SupportsIndex = 1, *, max_wait: float | None = None
) -> Coroutine[Any, Any, AsyncRedisReservation]: ...
def reserve_all(checks: Iterable[tuple[Any, ...]], cost: Any = 1, *, max_wait: Any = None) -> Any:
    """Reserves each check's cost from every bucket at the same moment, all or
    nothing; the delay is the longest. Redis limiters sharing one client run as
    one script (``bucketlimit.redis.reserve_all``; a coroutine for asyncio ones)."""
    checks, routed = _via_redis("reserve_all", checks, cost, max_wait)
    if routed is not None:
        return routed
    return _core.reserve_all(checks, cost, max_wait=max_wait)


@overload
def acquire_all(
    checks: Iterable[Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Decision: ...
@overload
def acquire_all(
    checks: Iterable[RedisCheck], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Decision: ...
def acquire_all(checks: Iterable[tuple[Any, ...]], cost: Any = 1, *, timeout: Any = None) -> Any:
    """``reserve_all``, then blocks for its delay; refused at once beyond ``timeout``."""
    checks, routed = _via_redis("acquire_all", checks, cost, timeout)
    if routed is not None:
        return routed
    return _core.acquire_all(checks, cost, timeout=timeout)


@overload
def acquire_all_async(
    checks: Iterable[Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> _core.Acquiring: ...
@overload
def acquire_all_async(
    checks: Iterable[AsyncRedisCheck], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Coroutine[Any, Any, Decision]: ...
def acquire_all_async(
    checks: Iterable[tuple[Any, ...]], cost: Any = 1, *, timeout: Any = None
) -> Any:
    """``acquire_all`` for asyncio (a coroutine); a cancelled waiter gives its tokens back."""
    checks, routed = _via_redis("acquire_all_async", checks, cost, timeout)
    if routed is not None:
        return routed
    return _core.acquire_all_async(checks, cost, timeout=timeout)


def _via_redis(
    what: str, checks: Iterable[tuple[Any, ...]], cost: Any, wait: Any
) -> tuple[Iterable[tuple[Any, ...]], Any]:
    """``what`` over Redis limiters: the checks (as a list once read) and
    ``bucketlimit.redis``'s answer (a coroutine for asyncio ones), or ``None`` when
    no Redis limiter is named. A Redis limiter exists only once bucketlimit.redis
    was imported: no import (and no redis dependency) here otherwise."""
    redis = sys.modules.get("bucketlimit.redis")
    if redis is None:
        return checks, None
    checks = list(checks)
    if what == "allow_all":
        return checks, redis._route_allow_all(checks, cost)
    return checks, redis._route_all(what, checks, cost, wait)
