"""bucketlimit: an exact, thread-safe token-bucket rate limiter with a Rust core.

>>> from bucketlimit import TokenBucketLimiter
>>> limiter = TokenBucketLimiter(capacity=10, rate=2)
>>> bool(limiter.allow("user-42"))
True
>>> limiter.acquire("user-42", 9)    # waits (here: not at all) for its turn
Decision(allowed=True, retry_after=0.0, remaining=0, reset_after=5.0, limit=10, degraded=False)

At most N in flight per key, with :class:`ConcurrencyLimiter`:

>>> from bucketlimit import ConcurrencyLimiter
>>> inflight = ConcurrencyLimiter(2, ttl=30)
>>> with inflight.acquire("user-42") as permit:
...     inflight.in_flight("user-42")
1
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

from bucketlimit import _checks, _core
from bucketlimit._config import limiter, parse_limit, parse_limits
from bucketlimit._core import (
    MAX_DEBT_CAPACITIES,
    MAX_KEY_BYTES,
    ConcurrencyLimiter,
    Decision,
    Permit,
    Reservation,
    TokenBucketLimiter,
    __version__,
)
from bucketlimit._errors import ConfigurationError
from bucketlimit._reservations import AsyncReservationLike, ReservationLike
from bucketlimit._stats import (
    ConcurrencyStats,
    LimiterStats,
    LimitStats,
    RedisConcurrencyStats,
    RedisLimiterStats,
)

if TYPE_CHECKING:
    from bucketlimit.redis import (
        AsyncRedisConcurrencyLimiter,
        AsyncRedisReservation,
        AsyncRedisTokenBucketLimiter,
        RedisConcurrencyLimiter,
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
    # A permit of a Redis concurrency limiter among them: the call then answers the
    # reservation holding it.
    RedisPermitCheck = (
        tuple[RedisConcurrencyLimiter, str] | tuple[RedisConcurrencyLimiter, str, Literal[1]]
    )
    AsyncRedisPermitCheck = (
        tuple[AsyncRedisConcurrencyLimiter, str]
        | tuple[AsyncRedisConcurrencyLimiter, str, Literal[1]]
    )

# The package's records (rare: a full max_keys table, a store outage, a first
# answer without the store) go wherever the application's logging sends them. It
# installs no handler, not even a NullHandler: when the application configured no
# logging at all, logging's last resort writes the WARNINGs to stderr, so a wrong
# store URL or a store that is down is never silent (docs/design.md §2).

__all__ = [
    "MAX_DEBT_CAPACITIES",
    "MAX_KEY_BYTES",
    "AsyncReservationLike",
    "ConcurrencyLimiter",
    "ConcurrencyStats",
    "ConfigurationError",
    "Decision",
    "LimitStats",
    "LimiterStats",
    "Permit",
    "RedisConcurrencyStats",
    "RedisLimiterStats",
    "Reservation",
    "ReservationLike",
    "TokenBucketLimiter",
    "__version__",
    "acquire_all",
    "acquire_all_async",
    "allow_all",
    "limiter",
    "parse_limit",
    "parse_limits",
    "reserve_all",
]

#: One check of ``allow_all`` and friends: ``(limiter, key)`` (charged the call's
#: ``cost``) or ``(limiter, key, cost)``.
Check = tuple[TokenBucketLimiter, str] | tuple[TokenBucketLimiter, str, SupportsIndex]
#: One permit of a concurrency limiter in ``allow_all`` and friends: ``(limiter,
#: key)`` or ``(limiter, key, 1)``. With one among the checks, ``allow_all``,
#: ``acquire_all`` and ``acquire_all_async`` answer the :class:`Reservation` that
#: holds the permits (its ``cancel()`` / ``settle(used)`` release them).
PermitCheck = tuple[ConcurrencyLimiter, str] | tuple[ConcurrencyLimiter, str, Literal[1]]


@overload  # token buckets alone: the Decision (the second overload is the Reservation)
def allow_all(checks: Iterable[Check], cost: SupportsIndex = 1) -> Decision: ...  # type: ignore[overload-overlap]
@overload
def allow_all(checks: Iterable[Check | PermitCheck], cost: SupportsIndex = 1) -> Reservation: ...
@overload
def allow_all(checks: Iterable[RedisCheck], cost: SupportsIndex = 1) -> Decision: ...  # type: ignore[overload-overlap]
@overload
def allow_all(
    checks: Iterable[RedisCheck | RedisPermitCheck], cost: SupportsIndex = 1
) -> RedisReservation: ...
@overload
def allow_all(  # type: ignore[overload-overlap]
    checks: Iterable[AsyncRedisCheck], cost: SupportsIndex = 1
) -> Coroutine[Any, Any, Decision]: ...
@overload
def allow_all(
    checks: Iterable[AsyncRedisCheck | AsyncRedisPermitCheck], cost: SupportsIndex = 1
) -> Coroutine[Any, Any, AsyncRedisReservation]: ...
def allow_all(checks: Iterable[tuple[Any, ...]], cost: Any = 1) -> Any:
    """Spends ``cost`` from every (limiter, key) only if all of them allow.

    A check may carry its own cost, ``(limiter, key, cost)``, so requests and
    tokens go in one call: ``allow_all([(rpm, org, 1), (tpm, org, 3_500)])``.
    A :class:`ConcurrencyLimiter` check takes one permit, all or nothing with the
    rest; the call then answers the :class:`Reservation` holding it.

    In-process limiters are checked under their locks in Rust; Redis limiters
    sharing one client run as one script (``bucketlimit.redis``); for asyncio
    Redis limiters the result is a coroutine to await. The kinds cannot be mixed.
    """
    checks, backend = _checks.route(checks, "allow_all")
    if backend is not None:
        return backend.allow_all(checks, cost)
    return _core.allow_all(checks, cost)


@overload
def reserve_all(
    checks: Iterable[Check | PermitCheck],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
) -> Reservation: ...
@overload
def reserve_all(
    checks: Iterable[RedisCheck | RedisPermitCheck],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
) -> RedisReservation: ...
@overload
def reserve_all(
    checks: Iterable[AsyncRedisCheck | AsyncRedisPermitCheck],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
) -> Coroutine[Any, Any, AsyncRedisReservation]: ...
def reserve_all(checks: Iterable[tuple[Any, ...]], cost: Any = 1, *, max_wait: Any = None) -> Any:
    """Reserves each check's cost from every bucket at the same moment, all or
    nothing; the delay is the longest. A concurrency limiter's permit is taken if it
    is free now (a reservation never queues for one). Redis limiters sharing one
    client run as one script (``bucketlimit.redis.reserve_all``; a coroutine for
    asyncio ones)."""
    checks, backend = _checks.route(checks, "reserve_all")
    if backend is not None:
        return backend.reserve_all(checks, cost, max_wait)
    return _core.reserve_all(checks, cost, max_wait=max_wait)


@overload  # token buckets alone (the next overload: with concurrency limiters)
def acquire_all(  # type: ignore[overload-overlap]
    checks: Iterable[Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Decision: ...
@overload
def acquire_all(
    checks: Iterable[Check | PermitCheck],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Reservation: ...
@overload
def acquire_all(  # type: ignore[overload-overlap]
    checks: Iterable[RedisCheck], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Decision: ...
@overload
def acquire_all(
    checks: Iterable[RedisCheck | RedisPermitCheck],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> RedisReservation: ...
def acquire_all(checks: Iterable[tuple[Any, ...]], cost: Any = 1, *, timeout: Any = None) -> Any:
    """``reserve_all``, then blocks for its delay; refused at once beyond ``timeout``.

    With concurrency limiters it first waits for their permits (in arrival order,
    each held while it waits for the next), then for the tokens (docs/design.md §4,
    "Permits"), and answers the :class:`Reservation`."""
    checks, backend = _checks.route(checks, "acquire_all")
    if backend is not None:
        return backend.acquire_all(checks, cost, timeout)
    return _core.acquire_all(checks, cost, timeout=timeout)


@overload  # token buckets alone (the next overload: with concurrency limiters)
def acquire_all_async(  # type: ignore[overload-overlap]
    checks: Iterable[Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> _core.Acquiring[Decision]: ...
@overload
def acquire_all_async(
    checks: Iterable[Check | PermitCheck],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> _core.Acquiring[Reservation]: ...
@overload
def acquire_all_async(  # type: ignore[overload-overlap]
    checks: Iterable[AsyncRedisCheck], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Coroutine[Any, Any, Decision]: ...
@overload
def acquire_all_async(
    checks: Iterable[AsyncRedisCheck | AsyncRedisPermitCheck],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Coroutine[Any, Any, AsyncRedisReservation]: ...
def acquire_all_async(
    checks: Iterable[tuple[Any, ...]], cost: Any = 1, *, timeout: Any = None
) -> Any:
    """``acquire_all`` for asyncio (a coroutine); a cancelled waiter gives its tokens back."""
    checks, backend = _checks.route(checks, "acquire_all_async")
    if backend is not None:
        return backend.acquire_all_async(checks, cost, timeout)
    return _core.acquire_all_async(checks, cost, timeout=timeout)
