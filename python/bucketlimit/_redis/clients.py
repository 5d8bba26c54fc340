"""The client libraries a Redis limiter can drive: redis-py and valkey-py (docs/design.md §6).

valkey-py is a fork of redis-py: module ``valkey`` instead of ``redis``, the same
API and the same exception names (``RedisClusterException`` is
``ValkeyClusterException`` there). Whichever of the two is installed is found
here, once, at import; nothing else in the package imports either library. Each
:class:`Library` names its client classes (sync and asyncio, standalone and
cluster), its blocking pools, its Retry classes, ``NoBackoff`` and its exceptions
module; :func:`errors` gathers one exception class from every installed library,
so that a single ``isinstance`` check classifies both clients' errors.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Final, NamedTuple


class Kind(NamedTuple):
    """One library's clients of one kind (blocking, or asyncio)."""

    standalone: type[Any]
    cluster: type[Any]
    blocking_pool: type[Any]
    retry: type[Any]


class Library(NamedTuple):
    """One installed client library."""

    name: str  # "redis-py", "valkey-py"
    module: str  # "redis", "valkey"
    schemes: tuple[str, ...]  # the URL schemes from_url gives it
    sync: Kind
    asyncio: Kind
    no_backoff: type[Any]
    exceptions: ModuleType


def _load(name: str, module: str, schemes: tuple[str, ...]) -> Library | None:
    try:
        root = importlib.import_module(module)
        mods = {
            sub: importlib.import_module(f"{module}.{sub}")
            for sub in ("cluster", "retry", "backoff", "exceptions", "asyncio")
        }
        aio_cluster = importlib.import_module(f"{module}.asyncio.cluster")
        aio_retry = importlib.import_module(f"{module}.asyncio.retry")
    except ImportError:
        return None
    prefix = "Valkey" if module == "valkey" else "Redis"
    aio = mods["asyncio"]
    return Library(
        name=name,
        module=module,
        schemes=schemes,
        sync=Kind(
            getattr(root, prefix),
            getattr(mods["cluster"], f"{prefix}Cluster"),
            root.BlockingConnectionPool,
            mods["retry"].Retry,
        ),
        asyncio=Kind(
            getattr(aio, prefix),
            getattr(aio_cluster, f"{prefix}Cluster"),
            aio.BlockingConnectionPool,
            aio_retry.Retry,
        ),
        no_backoff=mods["backoff"].NoBackoff,
        exceptions=mods["exceptions"],
    )


#: The URL schemes of each library. redis-py's are given to valkey-py when it is
#: the only library installed (valkey-py parses them the same way).
REDIS_SCHEMES: Final = ("redis", "rediss", "unix")
VALKEY_SCHEMES: Final = ("valkey", "valkeys")

#: The installed libraries, redis-py first.
LIBRARIES: Final[tuple[Library, ...]] = tuple(
    lib
    for lib in (
        _load("redis-py", "redis", REDIS_SCHEMES),
        _load("valkey-py", "valkey", VALKEY_SCHEMES),
    )
    if lib is not None
)
if not LIBRARIES:
    raise ImportError(
        "bucketlimit.redis needs a Redis client library: "
        "pip install 'bucketlimit[redis]' (redis-py) or 'bucketlimit[valkey]' (valkey-py)"
    )

#: The modules whose internal errors are the client's, not a bug of the caller.
CLIENT_MODULES: Final = tuple(f"{lib.module}." for lib in LIBRARIES)


def errors(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes of these names in every installed library (a library
    without one of them adds nothing for it)."""
    found: list[type[BaseException]] = []
    for lib in LIBRARIES:
        for name in names:
            cls = getattr(lib.exceptions, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in found:
                found.append(cls)
    return tuple(found)


def base(name: str, fallback: type[BaseException]) -> type[BaseException]:
    """A base class for one of bucketlimit's own errors: a subclass of ``name`` of
    every installed library (so code catching either client's error catches it)."""
    bases = errors(name) or (fallback,)
    if len(bases) == 1:
        return bases[0]
    return type(name, bases, {"__module__": "bucketlimit._redis.clients"})


def for_url(url: str) -> Library:
    """The library ``from_url`` builds its client with, by the URL's scheme:
    ``valkey://`` and ``valkeys://`` valkey-py; ``redis://``, ``rediss://`` and
    ``unix://`` redis-py, or valkey-py when redis-py is not installed."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    for lib in LIBRARIES:
        if scheme in lib.schemes:
            return lib
    if scheme in REDIS_SCHEMES:
        return LIBRARIES[0]  # only valkey-py is installed: it reads these URLs too
    if scheme in VALKEY_SCHEMES:
        raise ValueError(
            f"a {scheme}:// URL needs valkey-py, which is not installed: "
            "pip install 'bucketlimit[valkey]'"
        )
    known = ", ".join(f"{s}://" for s in REDIS_SCHEMES + VALKEY_SCHEMES)
    raise ValueError(f"url must start with one of {known}, got {url!r}")


def kind(*, asyncio: bool) -> tuple[Kind, ...]:
    """Every installed library's clients of one kind."""
    return tuple(lib.asyncio if asyncio else lib.sync for lib in LIBRARIES)
