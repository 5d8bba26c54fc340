"""What both public Redis limiter classes share, written once (docs/design.md §6):
their constructor (every argument checked), ``from_url``, the read-only
configuration, ``stats()`` and ``repr``. The operations are flows
(``bucketlimit._redis.flows``); the public classes (``bucketlimit.redis``) drive
them, blocking or awaited, in one line each.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Final,
    Generic,
    SupportsIndex,
    TypedDict,
    TypeVar,
    cast,
)

from bucketlimit import _core
from bucketlimit._histogram import Histogram
from bucketlimit._redis import clients, leases
from bucketlimit._redis.clients import DEFAULT_TIMEOUT, LazyClient, client_from_url
from bucketlimit._redis.errors import ExactRangeError
from bucketlimit._redis.flows import Flow
from bucketlimit._redis.keys import Keys
from bucketlimit._redis.leases import NO_LEASE_STATS, LeasePolicy, LeaseState, check_lease
from bucketlimit._redis.module import Engine, EngineName, check_engine
from bucketlimit._redis.resilience import (
    LOCAL,
    Policy,
    check_policy,
    check_processes,
    check_retry_interval,
)
from bucketlimit._redis.script import FRAGMENTS, LUA_EXACT, Script
from bucketlimit._redis.state import LimiterState, default_prefix
from bucketlimit._redis.timing import StoreTime, TimeSource, check_time_source
from bucketlimit._stats import RedisLimiterStats

if TYPE_CHECKING:
    from typing import Self, Unpack

#: What ``stats()`` reports of the limiter's counters (then its leases' and breakers').
COUNTED: Final = (
    "allowed",
    "refused",
    "store_calls",
    "script_loads",
    "store_errors",
    "fallback_decisions",
    "refusal_cache_hits",
    "lost_refunds",
)

#: The client type of a limiter class (redis-py's sync or asyncio clients).
C = TypeVar("C")


class BucketOptions(TypedDict, total=False):
    """The constructor's keyword arguments, for ``from_url``."""

    per: float | SupportsIndex
    prefix: str | None
    hash_tag: Callable[[str], str] | None
    on_store_error: Policy
    processes: SupportsIndex | None
    retry_interval: float
    refusal_cache: bool
    batching: bool
    lease: bool | LeasePolicy
    engine: EngineName
    time_source: TimeSource


def check_client(client: object, *, asyncio: bool, other: str) -> bool:
    """A limiter's ``client``: one of the installed libraries' clients of its kind
    (blocking, or ``asyncio``), or a ``LazyClient`` of that kind; ``TypeError``
    otherwise, naming ``other``, the class for the other kind. True for a cluster
    client."""
    kinds = clients.kind(asyncio=asyncio)
    if isinstance(client, LazyClient):
        if client.asyncio != asyncio:
            raise TypeError(
                f"client is a lazy {'asyncio' if asyncio is False else 'blocking'} "
                f"client (use {other}), got {client!r}"
            )
        return client.cluster
    accepted = tuple(cls for kind in kinds for cls in (kind.standalone, kind.cluster))
    if not isinstance(client, accepted):
        each = [f"{c.__module__}.{c.__qualname__}" for c in accepted]
        names = ", ".join(each[:-1]) + " or " + each[-1]
        raise TypeError(f"client must be a {names} (use {other}), got {type(client)}")
    return isinstance(client, tuple(kind.cluster for kind in kinds))


class RedisLimiter(Generic[C]):
    """Configuration of a Redis limiter; the subclasses drive its operations.

    A subclass names its clients (``_asyncio``: whether it takes the asyncio clients
    of each installed library, see ``bucketlimit._redis.clients``; ``_other``: the
    class for the other kind) and whether ``allow`` shares round trips by default.
    ``_shared_round_trips`` makes what shares ``allow``'s round trips when
    batching. ``_script`` holds the fragments the class's scripts are assembled from,
    scripts.lua: a subclass may run a variant of it (the parity tests raise its
    smallest TTL); nothing else is meant to change it.
    """

    _script: ClassVar[Script] = FRAGMENTS
    _asyncio: ClassVar[bool]
    _other: ClassVar[str]
    _batching_default: ClassVar[bool]
    # What shares allow()'s round trips when batching (batching.GroupCommit, Batcher).
    _shared_round_trips: ClassVar[type[Any]]

    def __init__(
        self,
        client: C | LazyClient,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
        prefix: str | None = None,
        hash_tag: Callable[[str], str] | None = None,
        on_store_error: Policy = LOCAL,
        processes: SupportsIndex | None = None,
        retry_interval: float = 1.0,
        refusal_cache: bool = True,
        batching: bool | None = None,
        lease: bool | LeasePolicy = False,
        engine: EngineName = "auto",
        time_source: TimeSource = "auto",
    ) -> None:
        cluster = check_client(client, asyncio=self._asyncio, other=self._other)
        engine = check_engine(engine)
        capacity, p, unit = _core.exact_units(capacity, rate, per=per)
        if clock is not None and not callable(clock):
            raise TypeError(
                "clock must be a zero-argument callable returning seconds, "
                f"got {type(clock).__name__}"
            )
        if prefix is None:
            prefix = default_prefix(capacity, p, unit)
        keys = Keys(prefix, hash_tag)
        # The module computes in the core's integers; the script in Lua doubles.
        if engine != "module" and capacity * unit + p >= LUA_EXACT:
            raise ExactRangeError(
                f"capacity {capacity} with rate {rate!r} per {per!r} is beyond the exact range "
                "of the Redis script: Lua numbers are doubles, exact only below 2**53, so "
                "capacity * units per token + units per microsecond must be below 2**53; "
                f"it is {capacity * unit + p} (engine='module' computes it exactly: "
                "docs/redis.md, 'The module')"
            )
        if not isinstance(refusal_cache, bool):
            raise TypeError(f"refusal_cache must be a bool, got {type(refusal_cache).__name__}")
        if batching is None:
            batching = self._batching_default
        if not isinstance(batching, bool):
            raise TypeError(f"batching must be a bool, got {type(batching).__name__}")
        policy = check_lease(lease)
        self._per = per if isinstance(per, float) else float(operator.index(per))
        self._state = LimiterState(
            client,
            cluster=cluster,
            capacity=capacity,
            p=p,
            unit=unit,
            per=self._per,
            clock=clock,
            keys=keys,
            script=self._script,
            policy=check_policy(on_store_error),
            processes=check_processes(processes),
            retry_interval=check_retry_interval(retry_interval),
            refusal_cache=refusal_cache,
            name=f"{type(self).__name__}(prefix={prefix!r})",
            leasing=policy is not None,
            engine=Engine(engine),
            timing=StoreTime(check_time_source(time_source)),
        )
        self._batching = batching
        self._shared = self._shared_round_trips(self._state) if batching else None
        # Leases (docs/design.md §6, "Hot keys: leases"): the ledger's take() is the
        # leased allow()'s fast path, one native call.
        self._leases = None if policy is None else LeaseState(self._state, policy)
        self._lease_take = None if self._leases is None else self._leases.ledger.take
        if self._leases is not None:
            self._leases.at_exit(self._give_back_at_exit)
        # The client from_url built for this limiter alone, which close() closes.
        self._owned: LazyClient | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        cluster: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        **options: Unpack[BucketOptions],
    ) -> Self:
        """A limiter on a new client for ``url`` (:func:`bucketlimit.redis.client_from_url`):
        ``timeout`` seconds to connect and to answer, and no command retries (a
        command that failed may have run: a resend could charge twice).
        ``cluster=True`` (or a ``redis+cluster://`` URL) builds a Redis Cluster
        client, ``redis+sentinel://`` asks Sentinel for the primary. ``options``
        are the constructor's keyword arguments (``per``, ``prefix``, ...).
        ``valkey://`` and ``valkeys://`` URLs get a valkey-py client; ``redis://``,
        ``rediss://`` and ``unix://`` a redis-py client, or a valkey-py one when
        redis-py is not installed (docs/redis.md, "Valkey").

        The client is built on first use (the first call, or reading ``client``),
        so nothing is sent here. A standalone client gets a blocking pool of
        :data:`~bucketlimit.redis.DEFAULT_MAX_CONNECTIONS`: a call finding every
        connection busy waits up to ``timeout`` for one (docs/redis.md, "A full
        connection pool")."""
        lazy = client_from_url(url, asyncio=cls._asyncio, cluster=cluster, timeout=timeout)
        limiter = cls(lazy, capacity, rate, clock, **options)
        limiter._owned = lazy
        return limiter

    # -- read-only configuration -------------------------------------------------

    @property
    def client(self) -> C:
        """The client; ``from_url``'s is built by the first call or by reading this
        (a sync cluster client then asks a node for the slot map, and raises the
        client's error when none answers)."""
        return cast("C", self._state.connect())

    @property
    def capacity(self) -> int:
        return self._state.capacity

    @property
    def rate(self) -> float:
        """Tokens per second (``rate / per`` as given)."""
        return self._state.p / (self._state.unit // 1_000_000)

    @property
    def per(self) -> float:
        return self._per

    @property
    def prefix(self) -> str:
        """The start of every key: the one given, or by default ``bucketlimit:`` and
        this limit (docs/redis.md, "Keys")."""
        return self._state.keys.prefix.decode("utf-8")

    @property
    def max_debt(self) -> int:
        """Tokens a bucket may owe to waiting reservations and charges: 1,000
        capacities where the script computes that exactly, else as many as it does
        (fewer, or none, for the largest configurations; docs/design.md §4)."""
        return self._state.debt_capacities * self._state.capacity

    @property
    def on_store_error(self) -> Policy:
        return self._state.policy

    @property
    def processes(self) -> int:
        """The processes this one shares the limit with (itself included): the one
        given, or the count the store keeps of live ones (1 until it answered)."""
        return self._state.processes.count

    @property
    def retry_interval(self) -> float:
        return self._state.retry_interval

    @property
    def batching(self) -> bool:
        """Whether ``allow`` calls asked while a round trip is in flight share the
        next one (docs/redis.md, "Shared round trips")."""
        return self._batching

    @property
    def lease(self) -> LeasePolicy | None:
        """The lease policy (``lease=True``: the default one), or ``None`` without
        leasing (docs/redis.md, "Hot keys: leases")."""
        return None if self._leases is None else self._leases.policy

    @property
    def time_source(self) -> str:
        """Where its calls take their time from now: ``"script"`` (the store's TIME,
        read by each script), ``"store"`` or ``"client"`` (sent by each call:
        docs/redis.md, "Managed stores and alternatives")."""
        return self._state.time.source

    @property
    def engine(self) -> EngineName:
        """What runs the calls in the store: ``"auto"`` (the bucketlimit module when
        the server has it loaded, else the Lua scripts), ``"module"`` or ``"lua"``
        (docs/redis.md, "The module")."""
        return self._state.engine.name

    @property
    def refusal_cache(self) -> bool:
        """Whether refusals are remembered (asked for, and the store's clock in use)."""
        return self._state.refusals is not None

    def redis_key(self, key: str) -> bytes:
        """The Redis key of ``key``'s bucket (``prefix{tag}:key``, escaped; docs/redis.md,
        "Keys"); checks ``key`` as every call does."""
        return self._state.keys.bucket(key)

    def stats(self) -> RedisLimiterStats:
        """Counters of this limiter object: ``allowed`` and ``refused`` decisions,
        ``store_calls`` (commands sent), ``script_loads`` (scripts re-sent after
        ``NOSCRIPT``), ``store_errors`` (store faults, corrupt buckets included),
        ``fallback_decisions`` (answers with ``degraded=True``), ``breaker_openings``
        (outages), ``refusal_cache_hits`` (refusals answered without the store),
        ``lost_refunds`` (give-backs that could not reach the store: its bucket keeps
        those tokens spent; never sent again), and ``breaker_open``, a state rather
        than a counter: the breakers open now (one per node on a cluster). With
        ``lease``: ``lease_hits`` (calls answered from a lease, counted in
        ``allowed``), ``lease_round_trips``, ``lease_tokens`` (leased),
        ``lease_tokens_returned`` (given back) and ``lease_tokens_expired``
        (leased, neither used nor given back); 0 without."""
        state = self._state
        stats = state.counters.snapshot(COUNTED)
        if self._leases is None:
            stats.update(NO_LEASE_STATS)
        else:
            stats.update(self._leases.stats(state.counters))
            stats["allowed"] += stats["lease_hits"]
            stats["refused"] += self._leases.ledger.waits
        breakers = state.breakers.all()
        stats["breaker_openings"] = sum(breaker.openings for breaker in breakers)
        stats["breaker_open"] = sum(breaker.open for breaker in breakers)
        return cast("RedisLimiterStats", stats)

    def histograms(self) -> list[tuple[str, dict[str, str], Histogram]]:
        """This object's histograms, ``(name, labels, histogram)``: the seconds each
        command took the store to answer (``store_round_trip_seconds``), which
        ``bucketlimit.metrics`` exports (docs/metrics.md). Commands are timed from
        the first call of this method on (``metrics`` makes it when it adds the
        limiter): a limiter nobody measures spends nothing on timing."""
        self._state.round_trips.want()
        return [("store_round_trip_seconds", {}, self._state.round_trips)]

    def _lease_allow(self, key: str, cost: object) -> Flow[_core.Decision]:
        """The slow path of a leased ``allow`` (no lease answered)."""
        assert self._leases is not None  # called only when leasing
        return leases.allow(self._state, self._leases, key, cost)

    def _give_back_at_exit(self) -> None:
        """The interpreter exits: the leases go back (each class sends them its way)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self.capacity}, rate={self.rate * self._per!r}, "
            f"per={self._per!r}, prefix={self.prefix!r})"
        )


def state_of(limiter: RedisLimiter[Any]) -> LimiterState:
    """A limiter's state, for the calls over several limiters (``bucketlimit.redis``)."""
    return limiter._state
