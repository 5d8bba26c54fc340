"""Limits written as strings, and limiters built from a limit and a storage URI
(docs/web.md, "Limits as strings, storage as a URI").

``parse_limit("100/minute")`` is ``(100, 100, 60)``: the token bucket equal to
"100 per minute" holds 100 tokens and refills 100 per 60 seconds. The grammar is
that of the ``limits`` library (and so flask-limiter and slowapi): ``N/period``,
``N per period``, ``N/k periods``, with ``second``, ``minute``, ``hour``, ``day``,
``month`` (30 days) and ``year`` (360 days), singular or plural, any case.

``limiter(limit, storage=...)`` builds the limiter: ``memory://`` an in-process
:class:`bucketlimit.TokenBucketLimiter`; a Redis or Valkey URI one of the Redis
limiters on one client per URI, shared by every limiter built here
(``bucketlimit.redis.client_from_url``). Nothing here imports a Redis client until
a Redis URI is asked for.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

from bucketlimit._core import TokenBucketLimiter
from bucketlimit._errors import without_password

if TYPE_CHECKING:
    from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter

__all__ = ["STORAGE_SCHEMES", "ParsedLimit", "limiter", "parse_limit", "parse_limits"]

#: ``(capacity, rate, per)``: ``capacity`` tokens, refilled ``rate`` per ``per`` seconds.
ParsedLimit = tuple[int, int, int]

#: Seconds in each period a limit string may name (``limits``'s own lengths).
PERIODS: dict[str, int] = {
    "second": 1,
    "minute": 60,
    "hour": 3600,
    "day": 86400,
    "month": 30 * 86400,
    "year": 360 * 86400,
}

# Each run of spaces is read by one \s* that a non-space must follow, so a refusal
# backtracks over each run once: linear in the string (adjacent \s* would try every
# way to share a run between them).
_ONE = re.compile(
    r"\s*(?P<count>[0-9]+)\s*(?:/|per)\s*(?:(?P<multiple>[0-9]+)\s*)?"
    r"(?P<period>second|minute|hour|day|month|year)s?\s*",
    re.IGNORECASE,
)
#: What joins several limits in one string (``limits`` accepts all three).
_SEPARATORS = re.compile(r"[;,|]")


def parse_limit(text: str) -> ParsedLimit:
    """``(capacity, rate, per)`` of one limit string::

        >>> parse_limit("100/minute")
        (100, 100, 60)
        >>> parse_limit("5 per 2 seconds")
        (5, 5, 2)

    "N per period" as a token bucket holds N tokens and refills N per period: over
    any period it admits at most 2N (a full bucket, then what refills), where a
    fixed window admits 2N in an instant at the window's edge. A string that is
    not one limit is a ``ValueError`` naming it; several joined by ``;`` are for
    :func:`parse_limits`.
    """
    if not isinstance(text, str):
        raise TypeError(f"a limit must be a str such as '100/minute', got {type(text).__name__}")
    match = _ONE.fullmatch(text)
    if match is None:
        several = len([p for p in _SEPARATORS.split(text) if p.strip()]) > 1
        hint = (
            "; several limits are for parse_limits(), or one Limit each"
            if several
            else " (write e.g. '100/minute', '100 per minute', '5/2 seconds', '1000/day')"
        )
        raise ValueError(f"not a limit: {text!r}{hint}")
    count = int(match["count"])
    multiple = 1 if match["multiple"] is None else int(match["multiple"])
    if count < 1 or multiple < 1:
        raise ValueError(f"a limit needs a count and a period of at least 1: {text!r}")
    return count, count, multiple * PERIODS[match["period"].lower()]


def parse_limits(text: str | Iterable[str]) -> list[ParsedLimit]:
    """Every limit of a string joined by ``;`` (or ``,`` or ``|``, as ``limits``
    accepts), or of a list of strings, in order::

        >>> parse_limits("10/second;1000/day")
        [(10, 10, 1), (1000, 1000, 86400)]

    An empty string or list is a ``ValueError``, as is any part that is not a limit.
    """
    parts: list[str] = []
    if isinstance(text, str):
        parts = _SEPARATORS.split(text)
    else:
        for item in text:
            if not isinstance(item, str):
                raise TypeError(f"limits must be strings, got {item!r}")
            parts.extend(_SEPARATORS.split(item))
    limits = [parse_limit(part) for part in parts if part.strip()]
    if not limits:
        raise ValueError(f"no limit in {text!r}")
    return limits


def split_limits(text: str | Iterable[str]) -> list[str]:
    """The limit strings of ``text`` (as :func:`parse_limits` reads it), each checked,
    stripped: what an adapter names the limits it builds from a setting."""
    parts = [text] if isinstance(text, str) else list(text)
    found = [p.strip() for part in parts for p in _SEPARATORS.split(part) if p.strip()]
    parse_limits(found or [""])
    return found


# -- storage -----------------------------------------------------------------------------

MEMORY = "memory"
#: The URI schemes :func:`limiter` takes; ``async+`` before a Redis one asks for asyncio.
STORAGE_SCHEMES = (
    "memory",
    "redis",
    "rediss",
    "unix",
    "valkey",
    "valkeys",
    "redis+cluster",
    "redis+sentinel",
    "valkey+cluster",
    "valkey+sentinel",
)
ASYNC_PREFIX = "async+"


def storage_scheme(storage: str) -> tuple[str, str, bool]:
    """``(scheme, client URI, asyncio)`` of a storage URI; a ``ValueError`` names an
    unknown scheme. ``async+redis://...`` is ``("redis", "redis://...", True)``."""
    if not isinstance(storage, str):
        raise TypeError(f"storage must be a URI (str), got {type(storage).__name__}")
    uri, asyncio = storage, False
    if uri.lower().startswith(ASYNC_PREFIX):
        uri, asyncio = uri[len(ASYNC_PREFIX) :], True
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme not in STORAGE_SCHEMES or (asyncio and scheme == MEMORY):
        known = ", ".join(f"{s}://" for s in STORAGE_SCHEMES)
        raise ValueError(
            f"storage must be a URI starting with one of {known} (async+ before a Redis one "
            f"for asyncio), got {without_password(storage)!r}"
        )
    return scheme, uri, asyncio


_CLIENTS: dict[tuple[str, bool, float], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(uri: str, *, asyncio: bool, timeout: float | None) -> Any:
    """The one client of ``uri`` (per kind and timeout) every limiter built here
    shares, so routes do not each open a pool; built lazily by
    ``bucketlimit.redis.client_from_url`` (nothing is sent before its first use)."""
    from bucketlimit import redis as bl_redis

    seconds = bl_redis.DEFAULT_TIMEOUT if timeout is None else timeout
    key = (uri, asyncio, seconds)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = bl_redis.client_from_url(uri, asyncio=asyncio, timeout=seconds)
        return client


def _capacity_rate_per(limit: object) -> tuple[Any, Any, Any]:
    if isinstance(limit, str):
        return parse_limit(limit)
    if isinstance(limit, tuple) and len(limit) in (2, 3):
        capacity, rate, *per = limit
        return capacity, rate, per[0] if per else 1
    raise TypeError(
        "limit must be a limit string such as '100/minute' or (capacity, rate[, per]), "
        f"got {limit!r}"
    )


LimitSpec = str | tuple[SupportsIndex, float] | tuple[SupportsIndex, float, float]


@overload
def limiter(
    limit: LimitSpec,
    *,
    storage: Literal["memory://"] = ...,
    async_: Literal[False] | None = ...,
    timeout: None = ...,
    **options: Any,
) -> TokenBucketLimiter: ...
@overload
def limiter(
    limit: LimitSpec,
    *,
    storage: str,
    async_: Literal[True],
    timeout: float | None = ...,
    **options: Any,
) -> AsyncRedisTokenBucketLimiter: ...
@overload
def limiter(
    limit: LimitSpec,
    *,
    storage: str,
    async_: Literal[False],
    timeout: float | None = ...,
    **options: Any,
) -> TokenBucketLimiter | RedisTokenBucketLimiter: ...
@overload
def limiter(
    limit: LimitSpec,
    *,
    storage: str,
    async_: None = ...,
    timeout: float | None = ...,
    **options: Any,
) -> TokenBucketLimiter | RedisTokenBucketLimiter | AsyncRedisTokenBucketLimiter: ...
def limiter(
    limit: LimitSpec,
    *,
    storage: str = "memory://",
    async_: bool | None = None,
    timeout: float | None = None,
    **options: Any,
) -> TokenBucketLimiter | RedisTokenBucketLimiter | AsyncRedisTokenBucketLimiter:
    """The limiter of ``limit`` (a limit string, or ``(capacity, rate[, per])``) on
    ``storage``:

    - ``memory://``: a :class:`bucketlimit.TokenBucketLimiter` (``options``: ``clock``,
      ``max_keys``);
    - ``redis://``, ``rediss://``, ``unix://``, ``valkey://``, ``valkeys://``,
      ``redis+cluster://``, ``redis+sentinel://`` (and ``valkey+cluster://``,
      ``valkey+sentinel://``): a
      ``bucketlimit.redis.RedisTokenBucketLimiter``, or with ``async_=True`` (or an
      ``async+redis://...`` URI) an ``AsyncRedisTokenBucketLimiter``. Every limiter
      built for one URI (and kind) shares one client; ``timeout`` is that client's
      (default ``bucketlimit.redis.DEFAULT_TIMEOUT``), ``options`` the limiter's
      (``clock``, ``prefix``, ``on_store_error``, ...). Without ``prefix`` the keys
      include the limit, so two different limits never read each other's buckets
      (two limiters of the same limit on one store share them per key).

    ``async_`` says which kind a Redis URI gives: ``None`` (the default) as the URI
    says, ``True`` the asyncio limiter, ``False`` the blocking one (an ``async+``
    URI with ``async_=False`` is a ``ValueError``). The type checker knows the
    class: ``TokenBucketLimiter`` for the default storage, the asyncio limiter for
    ``async_=True``, a limiter whose ``allow()`` answers at once for
    ``async_=False``.

    ::

        >>> limiter("10/second")
        TokenBucketLimiter(capacity=10, rate=10, per=1)
    """
    capacity, rate, per = _capacity_rate_per(limit)
    scheme, uri, asyncio = storage_scheme(storage)
    if async_ is not None and not isinstance(async_, bool):
        raise TypeError(f"async_ must be a bool or None, got {async_!r}")
    if scheme == MEMORY:
        if async_:
            raise ValueError("async_=True needs a Redis storage: the in-process limiter is sync")
        if timeout is not None:
            raise ValueError("timeout is the Redis client's: memory:// has none")
        return TokenBucketLimiter(capacity, rate, options.pop("clock", None), per=per, **options)
    if async_ is False and asyncio:
        raise ValueError(f"async_=False with an async+ storage URI: {storage!r}")
    from bucketlimit import redis as bl_redis

    asyncio = asyncio or bool(async_)
    client = shared_client(uri, asyncio=asyncio, timeout=timeout)
    cls = bl_redis.AsyncRedisTokenBucketLimiter if asyncio else bl_redis.RedisTokenBucketLimiter
    return cls(client, capacity, rate, options.pop("clock", None), per=per, **options)
