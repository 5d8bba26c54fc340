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
import math
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final, NamedTuple
from urllib.parse import unquote, urlsplit

from bucketlimit._errors import without_password


class Kind(NamedTuple):
    """One library's clients of one kind (blocking, or asyncio)."""

    standalone: type[Any]
    cluster: type[Any]
    blocking_pool: type[Any]
    retry: type[Any]
    sentinel: type[Any]


class Library(NamedTuple):
    """One installed client library."""

    name: str  # "redis-py", "valkey-py"
    module: str  # "redis", "valkey"
    schemes: tuple[str, ...]  # the URL schemes from_url gives it
    sync: Kind
    asyncio: Kind
    no_backoff: type[Any]
    exceptions: ModuleType
    node_command: type[Any]  # asyncio.cluster.PipelineCommand: one command of a node's write


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
    sentinel = importlib.import_module(f"{module}.sentinel")
    aio_sentinel = importlib.import_module(f"{module}.asyncio.sentinel")
    return Library(
        name=name,
        module=module,
        schemes=schemes,
        sync=Kind(
            getattr(root, prefix),
            getattr(mods["cluster"], f"{prefix}Cluster"),
            root.BlockingConnectionPool,
            mods["retry"].Retry,
            sentinel.Sentinel,
        ),
        asyncio=Kind(
            getattr(aio, prefix),
            getattr(aio_cluster, f"{prefix}Cluster"),
            aio.BlockingConnectionPool,
            aio_retry.Retry,
            aio_sentinel.Sentinel,
        ),
        no_backoff=mods["backoff"].NoBackoff,
        exceptions=mods["exceptions"],
        node_command=aio_cluster.PipelineCommand,
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
    ``unix://`` redis-py, or valkey-py when redis-py is not installed (the
    ``+cluster`` and ``+sentinel`` forms of each alike)."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    scheme = scheme.removesuffix("+cluster").removesuffix("+sentinel")
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
    raise ValueError(
        f"url must start with one of {known} (or redis+cluster://, redis+sentinel://, "
        f"valkey+cluster://, valkey+sentinel://), got {without_password(url)!r}"
    )


def kind(*, asyncio: bool) -> tuple[Kind, ...]:
    """Every installed library's clients of one kind."""
    return tuple(lib.asyncio if asyncio else lib.sync for lib in LIBRARIES)


#: The timeouts ``from_url`` and :func:`client_from_url` give a client, in seconds: a
#: limiter that waits longer than this for its store is slower than no limiter.
DEFAULT_TIMEOUT: Final = 0.25

#: The connections a standalone client of :func:`client_from_url` may open (redis-py's
#: default pool size); a call finding them all busy waits up to ``timeout`` for one.
DEFAULT_MAX_CONNECTIONS: Final = 100

#: How many other masters a blocking cluster client's constructor may ask for the
#: COMMAND table when its default node (the master of slot 0) does not answer.
CLUSTER_START_RETRIES: Final = 3


async def closed_async(client: Any) -> None:
    """Closes an asyncio ``client``. A cluster client that never started (its first
    command could not reach the master of slot 0: ``drivers.unstarted_node``) closes
    nothing itself, so the nodes a command went to directly are disconnected too."""
    await client.aclose()
    if any(isinstance(client, lib.asyncio.cluster) for lib in LIBRARIES):
        for node in client.get_nodes():
            await node.disconnect()


class LazyClient:
    """A client built on first use, once: what :func:`client_from_url` answers and
    every Redis limiter accepts as its ``client``. redis-py's sync ``RedisCluster``
    asks a node for the slot map in its constructor, and nothing may be sent at a
    limiter's construction (docs/design.md §6). Many limiters may share one; many
    threads asking at once get the one client (were each to build its own on the
    one pool, the losers' ``close()`` would cut the winner's connections)."""

    __slots__ = ("__weakref__", "_build", "_client", "_lock", "asyncio", "cluster", "url")

    def __init__(self, build: Callable[[], Any], *, url: str, cluster: bool, asyncio: bool) -> None:
        self._build = build
        self._client: Any = None
        self._lock = threading.Lock()
        self.url = url
        self.cluster = cluster
        self.asyncio = asyncio

    def build(self) -> Any:
        """The client: built now (under a lock, once) when it was not yet."""
        client = self._client
        if client is None:
            with self._lock:
                client = self._client
                if client is None:
                    client = self._client = self._build()
        return client

    get = build

    @property
    def built(self) -> bool:
        """Whether the client exists yet (nothing is sent before)."""
        return self._client is not None

    def __repr__(self) -> str:
        kind = "asyncio " if self.asyncio else ""
        url = without_password(self.url)
        return f"LazyClient({kind}{'cluster ' if self.cluster else ''}{url!r})"


def _sentinels(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``: the
    sentinels, the service name, and the primary's settings (password, db, TLS)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    settings: dict[str, Any] = {}
    if "@" in netloc:
        credentials, netloc = netloc.rsplit("@", 1)
        user, _, password = credentials.partition(":")
        if user:
            settings["username"] = unquote(user)
        if password:
            settings["password"] = unquote(password)
    shown = without_password(url)
    hosts = []
    for hostport in netloc.split(","):
        host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "26379")
        if not host:
            raise ValueError(f"a sentinel URL names host:port pairs, got {shown!r}")
        try:
            hosts.append((host.strip("[]"), int(port)))
        except ValueError:
            raise ValueError(f"a sentinel URL names host:port pairs, got {shown!r}") from None
    path = [segment for segment in parts.path.split("/") if segment]
    if not path:
        raise ValueError(
            f"a sentinel URL names the service after the hosts (/mymaster), got {shown!r}"
        )
    if len(path) > 1:
        settings["db"] = int(path[1])
    if parts.scheme.lower().startswith(("rediss", "valkeys")):
        settings["ssl"] = True
    return hosts, unquote(path[0]), settings


def client_from_url(
    url: str, *, asyncio: bool = False, cluster: bool = False, timeout: float = DEFAULT_TIMEOUT
) -> LazyClient:
    """A client for ``url`` as ``from_url`` builds one, built on first use (nothing is
    sent here), to give one or many Redis limiters: ``timeout`` seconds to connect
    and to answer, no command retries (a command that failed may have run: a resend
    could charge twice), a blocking pool of :data:`DEFAULT_MAX_CONNECTIONS` for a
    standalone server. Schemes: ``redis://``, ``rediss://``, ``unix://``,
    ``valkey://``, ``valkeys://``; ``redis+cluster://`` (or ``cluster=True``) for a
    Redis Cluster, ``redis+sentinel://host:port[,host:port]/service[/db]`` for the
    primary that Sentinel names (and the ``valkey+`` forms). ``asyncio=True``:
    the asyncio client, for the asyncio limiters."""
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be an int or float, got {type(timeout).__name__}")
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be finite and > 0 (seconds), got {timeout!r}")
    library = for_url(url)
    kind = library.asyncio if asyncio else library.sync
    scheme = url.split("://", 1)[0].lower()
    plain = scheme.removesuffix("+cluster").removesuffix("+sentinel") + url[len(scheme) :]
    settings: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": kind.retry(library.no_backoff(), 0),
    }
    build: Callable[[], Any]
    if scheme.endswith("+sentinel"):
        hosts, service, primary = _sentinels(url)
        sentinel = kind.sentinel(hosts, **settings, sentinel_kwargs=dict(settings))

        def build() -> Any:
            return sentinel.master_for(service, **settings, **primary)

        cluster = False
    elif cluster or scheme.endswith("+cluster"):
        cluster_class = kind.cluster
        # redis-py's asyncio cluster client closes every connection (those other
        # tasks are using too) on each 5th MOVED by default: during a migration
        # that lost replies of scripts that ran. With 0 a MOVED only updates the
        # slot it names (docs/redis.md, "Resharding and failover").
        settings["reinitialize_steps"] = 0
        cluster = True
        # The blocking client reads COMMAND from its default node (the master of
        # slot 0) in its constructor: with no retries, one master down would stop
        # the client for every key. Its constructor may retry (COMMAND is a read,
        # and each retry asks another master); the client's commands never do.
        starting = {**settings, "retry": kind.retry(library.no_backoff(), CLUSTER_START_RETRIES)}

        def build() -> Any:
            if asyncio:  # it starts at its first command, without those retries
                return cluster_class.from_url(plain, **settings)
            client = cluster_class.from_url(plain, **starting)
            client.set_retry(settings["retry"])
            return client

    else:
        client_class, pool_class = kind.standalone, kind.blocking_pool
        # Built now (parsing the URL sends nothing): a bad URL fails here.
        pool = pool_class.from_url(
            plain, max_connections=DEFAULT_MAX_CONNECTIONS, timeout=timeout, **settings
        )

        def build() -> Any:
            return client_class.from_pool(pool)

    return LazyClient(build, url=url, cluster=cluster, asyncio=asyncio)
