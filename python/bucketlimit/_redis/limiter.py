"""The Redis limiter written once, free of I/O (docs/design.md §6).

Everything a call decides is here: validation, keys, script arguments, the refusal
cache, the breaker, the failure policy, turning a reply into a ``Decision``,
counting. A call is a small state machine, the sans-I/O shape of h11: its steps
(:meth:`RedisLimiter._start`, ``_reply``, ``_error``) either answer it or leave it
pending on a command for the client. ``RedisTokenBucketLimiter`` sends that
command with a blocking call and ``AsyncRedisTokenBucketLimiter`` awaits it
(``bucketlimit.redis``); that is all they do.

One route for every operation: refusal cache, breaker, send, then the reply or the
failure policy; the call is counted once, when it ends (``_finish``). A script is
sent with EVALSHA; only a ``NOSCRIPT`` reply (the server lost its script cache:
restart, failover, ``SCRIPT FLUSH``) is answered by sending the script itself once
more, which is safe because the script did not run. Nothing else is retried: a
command that timed out may have run, and sending it again could charge twice.
"""

from __future__ import annotations

import enum
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Final,
    Generic,
    Literal,
    SupportsIndex,
    TypedDict,
    TypeVar,
    cast,
)

from bucketlimit import _core
from bucketlimit._core import MAX_DEBT_CAPACITIES, Decision
from bucketlimit._redis import clients
from bucketlimit._redis.errors import (
    CONFIG,
    CORRUPT,
    EXHAUSTED,
    FAULT,
    REDIRECTED,
    ClusterError,
    ExactRangeError,
    NoPermissionError,
    NoScriptError,
    ResponseError,
    StoreUnavailableError,
    check_version,
    classify,
    configuration_error,
    read_only,
    store_error,
)
from bucketlimit._redis.keys import Keys, check_one_slot, key_slot
from bucketlimit._redis.resilience import (
    CLOSED,
    LOCAL,
    RAISE,
    SKIP,
    STORE,
    Breaker,
    Fallback,
    Policy,
    RefusalCache,
    check_policy,
    check_processes,
    check_retry_interval,
    fork_safe,
)
from bucketlimit._redis.script import (
    ALLOW,
    BUCKET_SCRIPT,
    CHARGE,
    CHECK,
    LUA_EXACT,
    MANY,
    NO_ARGS,
    NONE,
    PEEK,
    REFUND,
    RESERVE,
    RESET,
    SERVER_TIME,
    Mode,
    Script,
    specialize,
)
from bucketlimit._stats import RedisLimiterStats

if TYPE_CHECKING:
    from typing import Self, Unpack

logger = logging.getLogger("bucketlimit")


class _Pending(enum.Enum):
    PENDING = "pending"


#: What a step answers while its call waits on a command (``call.name``,
#: ``call.argv``): the driver sends it and hands the outcome to the next step.
PENDING: Final = _Pending.PENDING
#: Where a waiting reservation left a bucket's cap line: the bucket's time and
#: balance right after it, and the headroom before it (docs/design.md §4, "Giving
#: back"); its give-back sends it, with the reservation's cost.
Line = tuple[int, int, int]


class Reserved:
    """What a reservation's steps answer: the decision, the delay in seconds (for a
    refusal the wait it would have needed; ``math.inf``: never), the line of each
    bucket it waits in (``None`` where it does not), and, when the store could not be
    asked under ``on_store_error="local"``, the in-process reservation made instead."""

    __slots__ = ("decision", "delay", "lines", "local")

    def __init__(
        self,
        decision: Decision,
        delay: float,
        lines: list[Line | None],
        local: _core.Reservation | None = None,
    ) -> None:
        self.decision = decision
        self.delay = delay
        self.lines = lines
        self.local = local


#: A step's answer: the call's result (a Decision, a Reserved, or None for a refund,
#: a reset, a check), or PENDING.
Answer = Decision | Reserved | None | Literal[_Pending.PENDING]
#: The client type of a limiter class (redis-py's sync or asyncio clients).
C = TypeVar("C")


#: The timeouts ``from_url`` gives its client, in seconds: a limiter that waits
#: longer than this for its store is slower than having no limiter at all.
DEFAULT_TIMEOUT: Final = 0.25

#: The connections ``from_url``'s standalone client may open (redis-py's default
#: pool size); a call finding them all busy waits up to ``timeout`` for one.
DEFAULT_MAX_CONNECTIONS: Final = 100


class LazyClient:
    """The client ``from_url`` builds on first use: redis-py's sync ``RedisCluster``
    asks a node for the slot map in its constructor, and nothing may be sent at
    construction (docs/design.md §6)."""

    __slots__ = ("build", "cluster")

    def __init__(self, build: Callable[[], Any], *, cluster: bool) -> None:
        self.build = build
        self.cluster = cluster


class Options(TypedDict, total=False):
    """The constructor's keyword arguments, for ``from_url``."""

    per: float | SupportsIndex
    prefix: str
    hash_tag: Callable[[str], str] | None
    on_store_error: Policy
    processes: SupportsIndex
    retry_interval: float
    refusal_cache: bool
    batching: bool


class Call:
    """One operation: what it sends, what it takes to answer without the store, and
    the command it waits on (``name``, ``argv``: a client method and its arguments)."""

    __slots__ = (
        "args",
        "argv",
        "breaker",
        "checks",
        "cost",
        "gate",
        "key",
        "keys",
        "max_wait",
        "mode",
        "name",
        "script",
        "sent",
        "started",
    )

    def __init__(
        self,
        mode: Mode,
        key: str,
        cost: int,
        script: Script,
        keys: list[bytes],
        args: Sequence[Any],
        checks: Sequence[tuple[RedisLimiter[Any], str, int]] | None = None,
        max_wait: int | None = None,
    ) -> None:
        self.mode = mode
        self.key = key  # "" for allow_all, which has checks instead
        self.cost = cost  # for allow_all, the smallest of the checks' costs
        self.script = script
        self.keys = keys
        self.args = args  # the script's arguments
        self.checks = checks  # (limiter, key, cost) of a call over several buckets
        self.max_wait = max_wait  # a reservation's, in µs; None: no limit
        self.gate = STORE
        self.breaker: Breaker | None = None  # the breaker of the node asked (set by _start)
        self.started = 0.0  # time.monotonic() before sending, for the refusal cache
        self.sent = 0  # commands sent, for stats()
        # The command it waits on: first its script by EVALSHA.
        self.name = "execute_command"
        self.argv: tuple[Any, ...] = ("EVALSHA", script.sha, len(keys), *keys, *args)


#: The most allows one shared round trip decides (bucket.lua's mode 'm'): a script
#: blocks the server while it runs, about 4-5 µs an allow, so 256 is about a
#: millisecond; more waiting allows go in the next one.
MAX_BATCH: Final = 256


class Batch:
    """Allows of one limiter sharing one round trip (docs/design.md §6, "Shared round
    trips"): its own form's mode 'm' over their keys in arrival order, at one
    ``now``, each answered as if sent alone. A batch of one is the call itself."""

    __slots__ = ("args", "argv", "calls", "keys", "name", "script", "sent")

    def __init__(self, script: Script, calls: list[Call], now: Any) -> None:
        self.calls = calls
        self.script = script
        self.keys = [call.keys[0] for call in calls]
        if len(calls) == 1:
            self.args: Sequence[Any] = calls[0].args
        else:
            costs = [NONE if call.cost == 1 else call.cost for call in calls]
            while costs and costs[-1] is NONE:
                costs.pop()  # an absent cost is 1: the common batch sends 3 arguments
            self.args = (NONE, MANY.value, now, *costs)
        self.sent = 1
        self.name = "execute_command"
        self.argv: tuple[Any, ...] = ("EVALSHA", script.sha, len(self.keys), *self.keys, *self.args)


#: How one call of a batch ended: its answer, or the error it raises.
Outcome = tuple[Any, BaseException | None]


class Waiter:
    """An allow waiting for a shared round trip: ``wake`` (a ``threading.Event`` or an
    asyncio future, the driver's) is set when it has its outcome, or, for the sync
    limiter, when it must send the next round trip itself (``lead``: every waiter of
    that round trip, itself first)."""

    __slots__ = ("call", "gone", "lead", "outcome", "wake")

    def __init__(self, call: Call, wake: Any) -> None:
        self.call = call
        self.wake = wake
        self.lead: list[Waiter] | None = None
        self.outcome: Outcome | None = None
        # A sync waiter interrupted while it waited (KeyboardInterrupt): its allow
        # is not sent, and it is never made the one that sends (set under the lock).
        self.gone = False

    def result(self) -> Any:
        assert self.outcome is not None
        answer, error = self.outcome
        if error is not None:
            raise error
        return answer


class Counters:
    """The numbers ``stats()`` reports; a lock, since many threads may share a limiter."""

    __slots__ = (
        "__weakref__",
        "_lock",
        "allowed",
        "fallback_decisions",
        "lost_refunds",
        "refusal_cache_hits",
        "refused",
        "script_loads",
        "store_calls",
        "store_errors",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.allowed = self.refused = self.store_calls = self.script_loads = 0
        self.store_errors = self.fallback_decisions = self.refusal_cache_hits = 0
        self.lost_refunds = 0
        fork_safe(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def add(self, sent: int, allowed: bool | None) -> None:
        """A call that ended: the commands it sent and, for an allow, its decision
        (``RedisLimiter._finish`` is the one caller)."""
        lock = self._lock
        lock.acquire()  # cheaper than `with` on every call, and nothing here raises
        self.store_calls += sent
        if allowed is not None:
            if allowed:
                self.allowed += 1
            else:
                self.refused += 1
        lock.release()

    def event(self, name: str) -> None:
        """One of the rarer things a call meets: ``script_loads``, ``store_errors``,
        ``fallback_decisions``, ``refusal_cache_hits`` or ``lost_refunds``."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: getattr(self, name) for name in self.__slots__ if name[0] != "_"}


class RedisLimiter(Generic[C]):
    """Configuration, keys and the steps of every call; the subclasses drive calls.

    A subclass names its clients (``_asyncio``: whether it takes the asyncio clients
    of each installed library, see ``bucketlimit._redis.clients``; ``_other``: the class
    for the other kind) and drives calls (``_drive``), sending each command with a
    blocking call or with ``await``.
    """

    # bucket.lua: allow_all runs it as it is; each limiter runs its own form
    # (specialize). A class attribute so that a test may swap it.
    _script: ClassVar[Script] = BUCKET_SCRIPT
    _asyncio: ClassVar[bool]
    _other: ClassVar[str]
    # Whether allow() shares round trips unless the constructor says (batching=).
    _batching_default: ClassVar[bool]

    def __init__(
        self,
        client: C,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
        prefix: str = "bucketlimit:",
        hash_tag: Callable[[str], str] | None = None,
        on_store_error: Policy = LOCAL,
        processes: SupportsIndex = 1,
        retry_interval: float = 1.0,
        refusal_cache: bool = True,
        batching: bool | None = None,
    ) -> None:
        lazy: LazyClient | None = client if isinstance(client, LazyClient) else None
        kinds = clients.kind(asyncio=self._asyncio)
        accepted = tuple(cls for kind in kinds for cls in (kind.standalone, kind.cluster))
        if lazy is None and not isinstance(client, accepted):
            each = [f"{c.__module__}.{c.__qualname__}" for c in accepted]
            names = ", ".join(each[:-1]) + " or " + each[-1]
            raise TypeError(f"client must be a {names} (use {self._other}), got {type(client)}")
        capacity, p, unit = _core.exact_units(capacity, rate, per=per)
        if clock is not None and not callable(clock):
            raise TypeError(
                "clock must be a zero-argument callable returning seconds, "
                f"got {type(clock).__name__}"
            )
        self._keys = Keys(prefix, hash_tag)
        # A bucket may owe MAX_DEBT_CAPACITIES capacities: every balance, wait and
        # cap line of the script is then within (1 + MAX_DEBT_CAPACITIES) * full.
        reach = (1 + MAX_DEBT_CAPACITIES) * capacity * unit + p
        if reach >= LUA_EXACT:
            raise ExactRangeError(
                f"capacity {capacity} with rate {rate!r} per {per!r} is beyond the exact range "
                "of the Redis script: Lua numbers are doubles, exact only below 2**53, and "
                f"a bucket may owe {MAX_DEBT_CAPACITIES} capacities, so (1 + "
                f"{MAX_DEBT_CAPACITIES}) * capacity * units per token + units per "
                f"microsecond must be below 2**53; it is {reach}"
            )
        # The client, or None until from_url's is built (_connect).
        self._client: C | None = None if lazy is not None else client
        self._lazy: LazyClient | None = lazy
        self._cluster = (
            lazy.cluster
            if lazy is not None
            else isinstance(client, tuple(kind.cluster for kind in kinds))
        )
        self._client_lock = threading.Lock()
        self._capacity: int = capacity
        self._p: int = p
        self._unit: int = unit
        self._per = per if isinstance(per, float) else float(operator.index(per))
        self._clock = clock
        # This limiter's own script, and the per-bucket arguments after `now` that
        # allow_all sends with the general one.
        self._own = Script(specialize(self._script.source, capacity, unit, p))
        self._config_args = (capacity, unit, p)
        self._counters = Counters()

        # Without the store (docs/design.md §6).
        self._policy = check_policy(on_store_error)
        self._processes = check_processes(processes)
        self._retry_interval = check_retry_interval(retry_interval)
        if not isinstance(refusal_cache, bool):
            raise TypeError(f"refusal_cache must be a bool, got {type(refusal_cache).__name__}")
        self._fallback = Fallback(
            self._policy,
            capacity,
            p,
            unit,
            processes=self._processes,
            retry_interval=self._retry_interval,
            clock=clock,
        )
        # One breaker for a standalone store; on a cluster one per node (keyed by
        # "host:port"), so that one shard's outage degrades only its keys. The
        # shared one answers for a cluster whose slot map is not known yet.
        self._name = f"{type(self).__name__}(prefix={prefix!r})"
        self._breaker = Breaker(self._retry_interval, self._name, self._fallback.description)
        self._node_breakers: dict[str, Breaker] = {}
        fork_safe(self)
        # Only on the store's clock: an injected clock (a ManualClock) may jump ahead
        # of time.monotonic(), which the cache measures waits with.
        self._refusals = RefusalCache() if refusal_cache and clock is None else None
        # Shared round trips (docs/design.md §6): allows asked while one of this
        # limiter's round trips is in flight wait in _queue and go together next.
        if batching is None:
            batching = self._batching_default
        if not isinstance(batching, bool):
            raise TypeError(f"batching must be a bool, got {type(batching).__name__}")
        self._batching = batching
        self._flying = False
        self._queue: list[Waiter] = []
        self._queue_lock = threading.Lock()

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
        **options: Unpack[Options],
    ) -> Self:
        """A limiter on a new client for ``url``: ``timeout`` seconds to connect and
        to answer, and no command retries (a command that failed may have run: a
        resend could charge twice). ``cluster=True`` builds a Redis Cluster client.
        ``options`` are the constructor's keyword arguments (``per``, ``prefix``, ...).
        ``valkey://`` and ``valkeys://`` URLs get a valkey-py client; ``redis://``,
        ``rediss://`` and ``unix://`` a redis-py client, or a valkey-py one when
        redis-py is not installed (docs/redis.md, "Valkey").

        The client is built on first use (the first call, or reading ``client``),
        so nothing is sent here. A standalone client gets a blocking pool of
        :data:`DEFAULT_MAX_CONNECTIONS`: a call finding every connection busy waits
        up to ``timeout`` for one (docs/redis.md, "A full connection pool")."""
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            raise TypeError(f"timeout must be an int or float, got {type(timeout).__name__}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be finite and > 0 (seconds), got {timeout!r}")
        library = clients.for_url(url)
        kind = library.asyncio if cls._asyncio else library.sync
        settings: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": kind.retry(library.no_backoff(), 0),
        }
        if cluster:
            cluster_class = kind.cluster
            # redis-py's asyncio cluster client closes every connection (those other
            # tasks are using too) on each 5th MOVED by default: during a migration
            # that lost replies of scripts that ran. With 0 a MOVED only updates the
            # slot it names (docs/redis.md, "Resharding and failover").
            settings["reinitialize_steps"] = 0

            def build() -> Any:
                return cluster_class.from_url(url, **settings)

        else:
            client_class, pool_class = kind.standalone, kind.blocking_pool
            # Built now (parsing the URL sends nothing): a bad URL fails here.
            pool = pool_class.from_url(
                url, max_connections=DEFAULT_MAX_CONNECTIONS, timeout=timeout, **settings
            )

            def build() -> Any:
                return client_class.from_pool(pool)

        lazy = LazyClient(build, cluster=cluster)
        return cls(cast("C", lazy), capacity, rate, clock, **options)

    # -- read-only configuration -------------------------------------------------

    @property
    def client(self) -> C:
        """The client; ``from_url``'s is built by the first call or by reading this
        (a sync cluster client then asks a node for the slot map, and raises the
        client's error when none answers)."""
        return self._connect()

    def _connect(self) -> C:
        """The client, built now if ``from_url`` has not built it yet. Two threads
        may both build one: the first to finish keeps its own, the other closes its."""
        client = self._client
        if client is not None:
            return client
        assert self._lazy is not None
        built = self._lazy.build()
        with self._client_lock:
            if self._client is None:
                self._client = built
                return cast("C", built)
            client = self._client
        self._discard(built)
        return client

    def _same_client(self) -> object:
        """What allow_all compares: the client, or what will build it."""
        return self._client if self._client is not None else self._lazy

    def _discard(self, client: Any) -> None:
        """Closes a client built by a thread that lost the race to build it (an
        asyncio client opened no connection yet: nothing to close)."""

    def _after_fork(self) -> None:
        self._client_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._flying = False  # the round trip in flight, if any, is not in this process
        self._queue = []

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def rate(self) -> float:
        """Tokens per second (``rate / per`` as given)."""
        return self._p / (self._unit // 1_000_000)

    @property
    def per(self) -> float:
        return self._per

    @property
    def prefix(self) -> str:
        return self._keys.prefix.decode("utf-8")

    @property
    def on_store_error(self) -> Policy:
        return self._policy

    @property
    def processes(self) -> int:
        return self._processes

    @property
    def retry_interval(self) -> float:
        return self._retry_interval

    @property
    def batching(self) -> bool:
        """Whether ``allow`` calls asked while a round trip is in flight share the
        next one (docs/redis.md, "Shared round trips")."""
        return self._batching

    @property
    def refusal_cache(self) -> bool:
        """Whether refusals are remembered (asked for, and the store's clock in use)."""
        return self._refusals is not None

    def stats(self) -> RedisLimiterStats:
        """Counters of this limiter object: ``allowed`` and ``refused`` decisions,
        ``store_calls`` (commands sent), ``script_loads`` (scripts re-sent after
        ``NOSCRIPT``), ``store_errors`` (store faults, corrupt buckets included),
        ``fallback_decisions`` (answers with ``degraded=True``), ``breaker_openings``
        (outages), ``refusal_cache_hits`` (refusals answered without the store) and
        ``lost_refunds`` (give-backs that could not reach the store: its bucket keeps
        those tokens spent; never sent again)."""
        stats = self._counters.snapshot()  # lost_refunds: give-backs the store never got
        breakers = [self._breaker, *list(self._node_breakers.values())]
        stats["breaker_openings"] = sum(breaker.openings for breaker in breakers)
        return cast("RedisLimiterStats", stats)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, rate={self.rate * self._per!r}, "
            f"per={self._per!r}, prefix={self.prefix!r})"
        )

    # -- keys and arguments --------------------------------------------------------

    def _key(self, key: str) -> bytes:
        """The Redis key of ``key``'s bucket (see bucketlimit._redis.keys)."""
        return self._keys.bucket(key)

    def _now(self) -> int | bytes:
        """The script's ``now``: the injected clock in µs, or "read the server's TIME"."""
        if self._clock is None:
            return SERVER_TIME
        seconds = self._clock()
        micros = _core.clock_to_micros(seconds)
        if not -LUA_EXACT < micros < LUA_EXACT:
            raise ValueError(
                f"clock returned {seconds!r}: the Redis script computes in Lua doubles, "
                "so readings must stay within +/-2**53 microseconds"
            )
        return micros

    def _args(self, mode: Mode, cost: int) -> tuple[Any, ...]:
        """The arguments of this limiter's own script: cost, mode and now, each only
        when needed (the script takes cost 1, an allow and the server's TIME when
        absent)."""
        if self._clock is not None:
            return cost, mode.value, self._now()
        if mode is not ALLOW:
            return cost, mode.value
        return NO_ARGS if cost == 1 else (cost,)

    def _call(self, mode: Mode, key: str, cost: object) -> Call:
        """An allow, a peek or a refund of one bucket; validates like the core."""
        if type(cost) is not int or not 0 < cost <= self._capacity:
            cost = _core.check_cost(cost, self._capacity)
        if mode is ALLOW and cost == 1 and self._clock is None:
            args = NO_ARGS  # the common call: _args written out
        else:
            args = self._args(mode, cost)
        return Call(mode, key, cost, self._own, [self._keys.bucket(key)], args)

    def _reserve_call(
        self, key: str, cost: object, max_wait: object, name: str = "max_wait"
    ) -> Call:
        """A reservation of one bucket (docs/design.md §4), validated like the core;
        ``name`` is what the caller calls ``max_wait`` (acquire: ``timeout``)."""
        if type(cost) is not int or not 0 < cost <= self._capacity:
            cost = _core.check_cost(cost, self._capacity)
        wait = check_wait(max_wait, name)
        bucket = self._keys.bucket(key)
        args = (cost, RESERVE.value, self._now(), NONE if wait is None else wait)
        return Call(RESERVE, key, cost, self._own, [bucket], args, max_wait=wait)

    def _charge_call(self, key: str, cost: object) -> Call:
        """A charge: use that already happened, any cost >= 1, debt allowed."""
        if type(cost) is not int or not 0 < cost < 2**64:
            cost = _core.check_cost(cost, 2**64 - 1)
        bucket = self._keys.bucket(key)
        args = (self._charged(cost), CHARGE.value, self._now())
        return Call(CHARGE, key, cost, self._own, [bucket], args)

    def _charged(self, cost: int) -> int:
        """The cost a charge sends: beyond (1 + MAX_DEBT_CAPACITIES) capacities any
        charge ends at the debt bound, so the script never multiplies past 2**53."""
        return min(cost, (1 + MAX_DEBT_CAPACITIES) * self._capacity)

    def _give_back_call(self, key: str, cost: int, line: Line | None, reserved: int) -> Call:
        """A give-back of ``cost`` by a reservation of ``reserved`` tokens (cancel,
        settle below its cost), with its line where it waited (docs/design.md §4,
        "Giving back")."""
        args: tuple[Any, ...] = (cost, REFUND.value, self._now())
        if line is not None:
            args += (*line, reserved)
        return Call(REFUND, key, cost, self._own, [self._keys.bucket(key)], args)

    def _reset_call(self, key: str) -> Call:
        call = Call(RESET, key, 0, self._own, [self._keys.bucket(key)], NO_ARGS)
        call.name, call.argv = "delete", tuple(call.keys)
        self._fallback.reset(key)  # full again here too, for the next outage
        return call

    def _check_call(self) -> Call:
        """check(): the script as a peek at a key no bucket has, then INFO."""
        return Call(CHECK, "", 1, self._own, [self._keys.probe()], self._args(PEEK, 1))

    # -- the steps of a call --------------------------------------------------------
    #
    # A call is a small state machine that the subclasses drive (the shape of h11):
    # _start answers it at once, or leaves it PENDING on a command to send
    # (call.name, call.argv); the driver sends the command and hands the reply to
    # _reply, or the error to _error, each of which answers or leaves the call
    # PENDING on its next command. Every path ends in _finish, which counts it.

    def _start(self, call: Call) -> Answer:
        """Answers from the refusal cache, or from the policy while the breaker skips
        the store; otherwise the call waits on its first command."""
        mode = call.mode
        if mode is CHECK:
            call.sent = 1
            return PENDING  # check() asks the store whatever the breaker says
        refusals = self._refusals
        if refusals is not None and call.checks is None:
            if mode is ALLOW or mode is PEEK:
                call.started = time.monotonic()
                cached = refusals.get(call.keys[0], call.cost, call.started)
                if cached is not None:
                    self._counters.event("refusal_cache_hits")
                    return self._finish(call, cached)
            elif mode is RESERVE:
                call.started = time.monotonic()
                if call.max_wait is not None:
                    cached = refusals.get(call.keys[0], call.cost, call.started)
                    answer = _cached_reservation(cached, call.max_wait)
                    if answer is not None:
                        self._counters.event("refusal_cache_hits")
                        return self._finish(call, answer)
            elif mode is not CHARGE:
                refusals.drop(call.keys[0])  # this process gives tokens back
        elif mode is REFUND and call.checks is not None:
            # A reservation over several buckets gives back to each of them.
            for (limiter, _, _), bucket in zip(call.checks, call.keys, strict=True):
                if limiter._refusals is not None:
                    limiter._refusals.drop(bucket)
        breaker = self._breaker_for(call.keys[0]) if self._cluster else self._breaker
        call.breaker = breaker
        if breaker.open:  # else admit() would say STORE
            call.gate = breaker.admit()
            if call.gate is SKIP:
                if mode is REFUND:
                    self._lost(call, None)
                return self._finish(call, self._without_store(call, None))
        call.sent = 1
        return PENDING

    def _breaker_for(self, key: bytes) -> Breaker:
        """On a cluster, the breaker of the primary the client's slot map names for
        ``key`` (the shared one until the client knows the map), so that one shard's
        outage degrades only its keys."""
        client = self._client
        if client is None:
            return self._breaker
        try:
            node = client.nodes_manager.slots_cache[key_slot(key)][0].name  # type: ignore[attr-defined]
        except (LookupError, AttributeError, TypeError):
            return self._breaker  # not known yet (or a client without the map)
        breaker = self._node_breakers.get(node)
        if breaker is None:
            with self._client_lock:
                breaker = self._node_breakers.get(node)
                if breaker is None:
                    breaker = Breaker(
                        self._retry_interval,
                        f"{self._name} node {node}",
                        self._fallback.description,
                    )
                    self._node_breakers[node] = breaker
        return breaker

    def _reply(self, call: Call, reply: Any) -> Answer:
        """The store answered the call's command.

        A script's reply is ``{retry_after_us, remaining, reset_after_us[, limit]}``:
        waits in whole microseconds, -1 for never; the limit of the tightest bucket
        follows when the script decided several (allow_all).
        """
        mode = call.mode
        if mode is CHECK:
            if call.name == "execute_command":  # the script ran: now the version
                call.name, call.argv = "info", ("server",)
                return PENDING
            check_version(reply)
            return self._finish(call, None)
        breaker = call.breaker
        assert breaker is not None
        if mode is REFUND or mode is RESET or (mode is CHARGE and call.checks is not None):
            breaker.succeeded(call.gate)
            return self._finish(call, None)
        retry_after, remaining, reset_after = reply[0], reply[1], reply[2]
        answer = Decision(
            retry_after == 0,
            retry_after / 1_000_000 if retry_after >= 0 else math.inf,
            remaining,
            reset_after / 1_000_000 if reset_after >= 0 else math.inf,
            reply[3] if len(reply) > 3 else self._capacity,
        )
        if call.gate is not STORE or breaker.open:  # else nothing to close
            # Only a write proves a store that said READONLY writable again.
            wrote = mode is CHARGE or (answer.allowed and (mode is ALLOW or mode is RESERVE))
            breaker.succeeded(call.gate, wrote=wrote)
        if mode is RESERVE:
            # {retry_after, remaining, reset_after, limit, delay, line per key}
            delay = reply[4] / 1_000_000 if reply[4] >= 0 else math.inf
            lines: list[Line | None] = [None] * len(call.keys)
            for i, line in enumerate(reply[5:]):
                if line:  # the bucket it waits in (nil, read as None, where it does not)
                    lines[i] = (line[0], line[1], line[2])
            refusals = self._refusals
            if refusals is not None and call.checks is None:
                if not answer.allowed:
                    # Remembered as the allow it implies: this cost waits `delay`.
                    implied = Decision(False, delay, remaining, answer.reset_after, answer.limit)
                    refusals.put(call.keys[0], call.cost, implied, call.started)
                elif refusals.entries:
                    refusals.drop(call.keys[0])
            return self._finish(call, Reserved(answer, delay, lines))
        refusals = self._refusals
        if refusals is not None and call.checks is None and mode is not CHARGE:
            if not answer.allowed:
                refusals.put(call.keys[0], call.cost, answer, call.started)
            elif refusals.entries:
                refusals.drop(call.keys[0])
        return self._finish(call, answer)

    def _error(self, call: Call, error: BaseException) -> Answer:
        """The call's command failed (CancelledError and KeyboardInterrupt too: a
        probe must be released and the call counted): send it again only after
        NOSCRIPT, else the failure policy answers, or this raises."""
        if call.sent == 1 and isinstance(error, ClusterError) and classify(error) == REDIRECTED:
            # Every node answered MOVED, ASK or TRYAGAIN: the script did not run, so
            # sending it once more is safe (docs/design.md §6); a second storm goes
            # to the policy.
            call.sent += 1
            return PENDING
        if isinstance(error, NoScriptError) and call.argv[0] == "EVALSHA":
            # The script did not run, so sending it whole is safe (and caches it).
            self._counters.event("script_loads")
            keys = call.keys
            call.argv = ("EVAL", call.script.source, len(keys), *keys, *call.args)
            call.sent += 1
            return PENDING
        return self._fail(call, error)

    def _fail(self, call: Call, error: BaseException) -> Answer:
        """The call's command failed and will not be sent again: the failure policy
        answers (and counts it), or this raises."""
        if isinstance(error, ResponseError):
            converted = store_error(error, call.keys)
            if converted is not error:
                converted.__cause__ = error
                error = converted
        if call.mode is REFUND:
            self._lost(call, error)
        try:
            if call.mode is CHECK:
                self._checked(call, error)
                answer = None
            else:
                answer = self._failed(call, error)
        except BaseException:
            self._finish(call, None)  # what it sent still counts
            raise
        return self._finish(call, answer)

    def _checked(self, call: Call, error: BaseException) -> None:
        """check()'s failure: raised, as a ConfigurationError when no retry will fix it."""
        if call.name == "info" and isinstance(error, NoPermissionError):
            return  # INFO forbidden: the script ran, which is what counts
        if classify(error) == CONFIG:
            raise configuration_error(error) from error
        raise error

    def _finish(self, call: Call, answer: Decision | Reserved | None) -> Decision | Reserved | None:
        """Counts a call that ended, once: the commands it sent and, for an allow or a
        reservation, its decision (an allow_all's counts for every (limiter, key) it
        named)."""
        mode = call.mode
        allowed = None
        if answer is not None:
            if mode is ALLOW:
                allowed = cast("Decision", answer).allowed
            elif mode is RESERVE:
                allowed = cast("Reserved", answer).decision.allowed
        self._counters.add(call.sent, allowed)
        if call.checks is not None and allowed is not None:
            for limiter, _, _ in call.checks[1:]:
                limiter._counters.add(0, allowed)
        return answer

    def _lost(self, call: Call, error: BaseException | None) -> None:
        """A give-back that cannot reach the store: counted and logged, never sent
        again (it may have run; a resend could give back twice). The store keeps the
        tokens spent: never more than the limit."""
        checks = call.checks or [(self, call.key, call.cost)]
        for limiter, key, cost in checks:
            limiter._counters.event("lost_refunds")
            logger.warning(
                "%s: a give-back of %d tokens to key %r did not reach the store (%s); "
                "its bucket keeps them spent",
                limiter._name,
                cost,
                key,
                "the store is skipped" if error is None else f"{type(error).__name__}: {error}",
            )

    def _failed(self, call: Call, error: BaseException) -> Decision | Reserved | None:
        """Answers a call whose command failed, or raises."""
        kind = classify(error)
        breaker = call.breaker
        assert breaker is not None
        if kind in (FAULT, CORRUPT):
            self._counters.event("store_errors")
        if kind == FAULT:
            breaker.failed(call.gate, error, read_only=read_only(error))
            return self._without_store(call, error)
        if kind in (EXHAUSTED, REDIRECTED):
            # This process has no free connection, or its cluster client lost its
            # way among redirections: the store is not down, so the breaker stays
            # as it was; the policy answers this one call.
            breaker.release(call.gate)
            return self._without_store(call, error)
        if kind == CORRUPT:
            # The store answered, so it works: no breaker; and never an allow.
            breaker.succeeded(call.gate, wrote=False)
            if self._raises(call):
                raise error
            if call.mode is REFUND or call.mode is RESET:
                return None
            self._counters.event("fallback_decisions")
            refusal = self._fallback.refusal()
            if call.mode is RESERVE:
                return Reserved(refusal, refusal.retry_after, [None] * len(call.keys))
            return refusal
        breaker.release(call.gate)
        if kind == CONFIG:
            raise configuration_error(error) from error
        raise error

    # -- shared round trips (docs/design.md §6) -------------------------------------
    #
    # An allow whose _start left it PENDING joins: the first finds nothing in flight
    # and is sent alone (_join answers None); the others wait in the queue. When a
    # round trip lands, _landed takes the whole queue for the next one, which
    # _batches splits by hash slot (on a cluster) and by `now` (an injected clock),
    # at most MAX_BATCH each, in arrival order; _batch_reply and _batch_error are
    # a batch's _reply and _error, giving each call its own outcome.

    def _many_calls(self, requests: object) -> list[Call]:
        """``allow_many``'s calls, every pair checked before anything is sent."""
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
            raise TypeError(
                f"allow_many takes a sequence of (key, cost) pairs, got {type(requests).__name__}"
            )
        calls = []
        for item in requests:
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(
                    f"allow_many takes (key, cost) pairs, got {item!r} ({type(item).__name__})"
                )
            key, cost = item
            if not isinstance(key, str):
                raise TypeError(f"key must be a str, got {type(key).__name__}")
            calls.append(self._call(ALLOW, key, cost))
        return calls

    def _join(self, call: Call, wake: Callable[[], Any]) -> Waiter | None:
        """None: nothing is in flight, send the call now (and call _landed after);
        else the call waits for the next round trip (on ``wake()``: the driver's
        event or future, made only for a call that waits)."""
        with self._queue_lock:
            if not self._flying:
                self._flying = True
                return None
            waiter = Waiter(call, wake())
            self._queue.append(waiter)
            return waiter

    def _landed(self) -> list[Waiter] | None:
        """A round trip of allows ended: the waiters of the next one, or None when
        none waits (then nothing is in flight)."""
        with self._queue_lock:
            waiters = self._queue
            if not waiters:
                self._flying = False
                return None
            self._queue = []
            return waiters

    def _dropped(self, call: Call) -> None:
        """A waiting allow given up before it was sent (its task cancelled)."""
        if call.breaker is not None:
            call.breaker.release(call.gate)
        call.sent = 0
        self._finish(call, None)

    def _batches(self, calls: Sequence[Call]) -> list[list[Batch]]:
        """Pending allows as batches: one list per hash slot (a cluster's; one list
        on a standalone store), each in arrival order, split where ``now`` changes
        (an injected clock read between them) or at MAX_BATCH."""
        slots: dict[int, list[tuple[Any, list[Call]]]] = {}
        for call in calls:
            slot = key_slot(call.keys[0]) if self._cluster else 0
            now = call.args[2] if len(call.args) > 2 else SERVER_TIME
            runs = slots.setdefault(slot, [])
            if runs and runs[-1][0] == now and len(runs[-1][1]) < MAX_BATCH:
                runs[-1][1].append(call)
            else:
                runs.append((now, [call]))
        return [[Batch(self._own, group, now) for now, group in runs] for runs in slots.values()]

    def _shared(self, batch: Batch) -> None:
        """The batch's commands counted once, on its first call."""
        for call in batch.calls:
            call.sent = 0
        batch.calls[0].sent = batch.sent

    def _batch_reply(self, batch: Batch, reply: Any) -> list[Outcome]:
        """The batch's script answered: 3 values per allow, each allow's as alone; a
        key that holds no bucket has the one-key call's error reply there."""
        self._shared(batch)
        outcomes: list[Outcome] = []
        for i, call in enumerate(batch.calls):
            first = reply[3 * i]
            try:
                if isinstance(first, BaseException):
                    answer = self._fail(call, first)
                else:
                    answer = self._reply(call, reply[3 * i : 3 * i + 3])
            except BaseException as error:  # the policy raises: this call's outcome
                outcomes.append((None, error))
            else:
                outcomes.append((answer, None))
        return outcomes

    def _batch_error(self, batch: Batch, error: BaseException) -> list[Outcome] | _Pending:
        """The batch's command failed: sent once more only after NOSCRIPT or a
        redirection storm (the script did not run), as a lone call is; else the
        failure policy answers each of its calls (each degraded, each counted)."""
        if batch.sent == 1 and isinstance(error, ClusterError) and classify(error) == REDIRECTED:
            batch.sent += 1
            return PENDING
        if isinstance(error, NoScriptError) and batch.argv[0] == "EVALSHA":
            self._counters.event("script_loads")
            keys = batch.keys
            batch.argv = ("EVAL", batch.script.source, len(keys), *keys, *batch.args)
            batch.sent += 1
            return PENDING
        self._shared(batch)
        outcomes: list[Outcome] = []
        for call in batch.calls:
            try:
                answer = self._fail(call, error)
            except BaseException as raised:
                outcomes.append((None, raised))
            else:
                outcomes.append((answer, None))
        return outcomes

    def _raises(self, call: Call) -> bool:
        limiters = [self] if call.checks is None else [limiter for limiter, _, _ in call.checks]
        return any(limiter._policy == RAISE for limiter in limiters)

    def _without_store(self, call: Call, error: BaseException | None) -> Decision | Reserved | None:
        """The policy's answer; ``error`` is None when the breaker skipped the store."""
        if self._raises(call):
            if error is not None:
                raise error
            assert call.breaker is not None
            raise StoreUnavailableError(call.breaker.describe())
        mode = call.mode
        if mode is REFUND:
            # Lost for the store, which keeps the charge: never more than the limit.
            for limiter, key, cost in call.checks or [(self, call.key, call.cost)]:
                limiter._fallback.refund(key, cost)
            return None
        if mode is RESET or (mode is CHARGE and call.checks is not None):
            return None  # lost for the store; the local bucket is full already
        self._counters.event("fallback_decisions")
        if mode is RESERVE:
            return _fallback_reserve(self, call)
        if mode is CHARGE:
            return self._fallback.charge(call.key, call.cost)
        if call.checks is not None:
            return _fallback_all(call.checks)
        return self._fallback.decide(call.key, call.cost, peek=mode is PEEK)


def check_wait(value: object, name: str) -> int | None:
    """A ``max_wait`` / ``timeout`` in whole µs by the clock's rounding, as the core
    reads it: ``None`` (or ``inf``, or beyond the clock's range) for no limit, else
    seconds >= 0 as an int or float."""
    if value is None:
        return None
    if isinstance(value, float):
        if math.isnan(value) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0 or None, got {value!r}")
        if math.isinf(value):
            return None
    elif isinstance(value, bool):
        raise TypeError(f"{name} must be an int, float or None, got bool")
    else:
        try:
            whole = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"{name} must be an int, float or None, got {type(value).__name__}"
            ) from None
        if whole < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0 or None, got {value!r}")
        value = whole
    try:
        micros = _core.clock_to_micros(value)
    except (ValueError, OverflowError):
        return None  # beyond the clock's range: as good as no limit
    return micros if micros < LUA_EXACT else None


def _cached_reservation(cached: Decision | None, max_wait: int) -> Reserved | None:
    """A reservation refused from the refusal cache: ``cached`` says this cost waits
    at least ``retry_after``; past ``max_wait`` (µs) the store would refuse too."""
    if cached is None:
        return None
    if math.isinf(cached.retry_after):
        return Reserved(cached, math.inf, [None])
    wait = round(cached.retry_after * 1_000_000)
    if wait <= max_wait:
        return None  # it might be granted: only the store knows
    refusal = Decision(
        False, (wait - max_wait) / 1_000_000, cached.remaining, cached.reset_after, cached.limit
    )
    return Reserved(refusal, wait / 1_000_000, [None])


#: One check of a call over several buckets: (limiter, key, cost), and the line of a
#: give-back.
Part = tuple["RedisLimiter[Any]", str, int]


def all_call(
    checks: Iterable[Any],
    cost: object,
    mode: Mode = ALLOW,
    max_wait: object = None,
    *,
    what: str = "allow_all",
    name: str = "max_wait",
) -> tuple[RedisLimiter[Any], Call]:
    """The limiter to drive it with, and the call of one ``allow_all`` or
    ``reserve_all`` script (the general form of bucket.lua: per bucket now, its
    configuration, its cost and max_wait), sent through the first limiter: its
    breaker, its policy for the store's faults.

    Everything is checked here, before anything is sent: pairs or triples,
    duplicates, one client, costs, keys and (on a cluster) one hash slot.
    """
    checks = list(checks)
    wait = check_wait(max_wait, name) if mode is RESERVE else None
    parts: list[Part] = []
    seen: set[tuple[int, str]] = set()
    for item in checks:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise TypeError(
                f"{what} takes a sequence of (limiter, key) pairs or (limiter, key, cost) "
                f"triples, got {type(item).__name__}"
            )
        limiter, key = item[0], item[1]
        own_cost = item[2] if len(item) == 3 else cost
        if not isinstance(limiter, RedisLimiter):
            raise TypeError(f"{what} got {type(limiter).__name__} among Redis limiters")
        if parts and limiter._same_client() is not parts[0][0]._same_client():
            raise ValueError(
                f"{what} runs one script on one client: every Redis limiter in it "
                "must share the same client object"
            )
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if (id(limiter), key) in seen:
            raise ValueError(f"{what} got the same (limiter, key) twice: key {key!r}")
        seen.add((id(limiter), key))
        parts.append((limiter, key, _core.check_cost(own_cost, limiter.capacity)))
    if not parts:
        raise ValueError(f"{what} needs at least one (limiter, key)")
    x = NONE if wait is None else wait
    return parts_call(mode, parts, [(x, NONE, NONE, NONE)] * len(parts), max_wait=wait)


def parts_call(
    mode: Mode,
    parts: Sequence[Part],
    extra: Sequence[tuple[Any, Any, Any, Any]],
    *,
    max_wait: int | None = None,
) -> tuple[RedisLimiter[Any], Call]:
    """One general-form script over ``parts`` (checked already): ``extra`` is each
    bucket's 4 more values (bucket.lua: a reservation's max_wait, a give-back's
    line and the reservation's cost)."""
    keys: list[bytes] = []
    args: list[Any] = [NONE, mode.value]
    for (limiter, key, cost), more in zip(parts, extra, strict=True):
        bucket = limiter._keys.bucket(key)
        if bucket in keys:
            # Two limiters with one prefix: the script would read the bucket twice
            # and charge it once.
            raise ValueError(
                f"the call names the Redis key {bucket!r} twice: limiters sharing a "
                "client need different prefixes"
            )
        keys.append(bucket)
        sent = limiter._charged(cost) if mode is CHARGE else cost
        args += [limiter._now(), *limiter._config_args, sent, *more]
    first = parts[0][0]
    if first._cluster:
        check_one_slot(keys)
    smallest = min(cost for _, _, cost in parts)
    call = Call(mode, "", smallest, first._script, keys, args, checks=parts, max_wait=max_wait)
    return first, call


def allow_all_call(checks: Iterable[Any], cost: object) -> tuple[RedisLimiter[Any], Call]:
    """:func:`all_call` for ``allow_all``."""
    return all_call(checks, cost)


def _fallback_all(checks: Sequence[Part]) -> Decision:
    """``allow_all`` without the store: each limiter's policy, combined as allow_all is.

    Any ``"closed"`` limiter refuses the whole call; ``"open"`` ones allow their
    part; the ``"local"`` ones decide together in process, all or nothing: one cost
    for all (pairs) is charged at most the smallest of their shares, as in
    ``allow_all``; checks with costs of their own are each charged at most its
    limiter's share.
    """
    for limiter, _, _ in checks:
        if limiter._policy == CLOSED:
            return limiter._fallback.refusal()
    local = []
    for limiter, key, cost in checks:
        if limiter._fallback.local is not None:
            local.append((limiter._fallback.local, key, min(cost, limiter._fallback.share)))
    if not local:
        return checks[0][0]._fallback.decide("", 1, peek=False)  # all "open"
    costs = {cost for _, _, cost in checks}
    if len(costs) == 1:
        shares = [limiter._fallback.share for limiter, _, _ in checks if limiter._policy == LOCAL]
        one = min(costs.pop(), *shares)
        local = [(fallback, key, one) for fallback, key, _ in local]
    return _core.allow_all(local)  # local limiters answer degraded


def _fallback_reserve(limiter: RedisLimiter[Any], call: Call) -> Reserved:
    """A reservation without the store: ``"closed"`` refuses, ``"open"`` grants at
    once, ``"local"`` reserves from this process's share (in process, degraded;
    its cancel and settle act there)."""
    checks = call.checks or [(limiter, call.key, call.cost)]
    lines: list[Line | None] = [None] * len(checks)
    for limiter, _, _ in checks:
        if limiter._policy == CLOSED:
            refusal = limiter._fallback.refusal()
            return Reserved(refusal, refusal.retry_after, lines)
    local = []
    for limiter, key, cost in checks:
        if limiter._fallback.local is not None:
            local.append((limiter._fallback.local, key, min(cost, limiter._fallback.share)))
    if not local:
        return Reserved(checks[0][0]._fallback.decide("", 1, peek=False), 0.0, lines)
    max_wait = None if call.max_wait is None else call.max_wait / 1_000_000
    reservation = _core.reserve_all(local, max_wait=max_wait)
    return Reserved(reservation.decision, reservation.delay, lines, local=reservation)


class ReservationState:
    """A reservation over Redis, apart from I/O: its buckets, its answer, and the
    calls its ``cancel`` and ``settle`` send (``bucketlimit.redis`` drives them, with
    a blocking call or with ``await``). Each acts once; on a refusal neither does
    anything; on a reservation made in process under ``on_store_error="local"``
    they act there."""

    __slots__ = ("_decision", "_delay", "_lines", "_local", "_lock", "_parts", "_settled")

    def __init__(self, parts: Sequence[Part], reserved: Reserved) -> None:
        self._parts = list(parts)
        self._decision = reserved.decision
        self._delay = reserved.delay
        self._lines = reserved.lines
        self._local = reserved.local
        self._lock = threading.Lock()
        self._settled = not reserved.decision.allowed

    @property
    def delay(self) -> float:
        """Seconds until the tokens are yours (0.0: now); for a refusal, the wait it
        would have needed (``math.inf`` when never)."""
        return self._delay

    @property
    def cost(self) -> int:
        """The tokens reserved (of the first bucket, for ``reserve_all``)."""
        return self._parts[0][2]

    @property
    def key(self) -> str:
        """The key (of the first bucket, for ``reserve_all``)."""
        return self._parts[0][1]

    @property
    def checks(self) -> tuple[tuple[Any, str, int], ...]:
        """Every bucket of the reservation: ``(limiter, key, cost)``."""
        return tuple(self._parts)

    @property
    def decision(self) -> Decision:
        """The ``Decision`` to report: allowed, or refused with ``retry_after``."""
        return self._decision

    def __bool__(self) -> bool:
        return self._decision.allowed

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, cost={self.cost}, delay={self._delay!r}, "
            f"granted={self._decision.allowed}, buckets={len(self._parts)})"
        )

    def _take(self) -> bool:
        """True the first time (the call that acts); False once cancelled or settled."""
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            return True

    def _cancel_calls(self) -> list[tuple[RedisLimiter[Any], Call]]:
        """The calls of ``cancel()``: every token back; none a second time."""
        if not self._take():
            return []
        if self._local is not None:
            self._local.cancel()
            return []
        return self._give_backs([(i, part[2]) for i, part in enumerate(self._parts)])

    def _settle_calls(self, used: object) -> list[tuple[RedisLimiter[Any], Call]]:
        """The calls of ``settle(used)``: ``cost - used`` back where less was used,
        ``used - cost`` charged where more; ``used`` is checked first."""
        each = _used_per_part(used, len(self._parts))
        if not self._take():
            return []
        if self._local is not None:
            self._local.settle(
                [
                    min(u, limiter._fallback.share)
                    for (limiter, _, _), u in zip(self._parts, each, strict=True)
                ]
            )
            return []
        backs = [(i, self._parts[i][2] - u) for i, u in enumerate(each) if u < self._parts[i][2]]
        charges = [
            (limiter, key, u - cost)
            for (limiter, key, cost), u in zip(self._parts, each, strict=True)
            if u > cost
        ]
        calls = self._give_backs(backs)
        if len(charges) == 1:
            limiter, key, cost = charges[0]
            calls.append((limiter, limiter._charge_call(key, cost)))
        elif charges:
            calls.append(parts_call(CHARGE, charges, [(NONE,) * 4] * len(charges)))
        return calls

    def _give_backs(self, backs: list[tuple[int, int]]) -> list[tuple[RedisLimiter[Any], Call]]:
        """One call giving ``cost`` back to each bucket ``i`` of ``backs``, with the
        reservation's line there."""
        if not backs:
            return []
        if len(backs) == 1:
            i, cost = backs[0]
            limiter, key, reserved = self._parts[i]
            return [(limiter, limiter._give_back_call(key, cost, self._lines[i], reserved))]
        parts = [(self._parts[i][0], self._parts[i][1], cost) for i, cost in backs]
        extra: list[tuple[Any, Any, Any, Any]] = []
        for i, _ in backs:
            line = self._lines[i]
            extra.append((NONE,) * 4 if line is None else (*line, self._parts[i][2]))
        return [parts_call(REFUND, parts, extra)]


def _used_per_part(used: object, parts: int) -> list[int]:
    """``settle``'s ``used``: one int for every bucket, or a sequence of one per bucket."""

    def one(value: object) -> int:
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise TypeError(f"used must be an int, got {type(value).__name__}")
        n = operator.index(value)  # type: ignore[arg-type]
        if n < 0:
            raise ValueError(f"used must be >= 0, got {n}")
        return n

    if isinstance(used, (tuple, list)):
        values = [one(v) for v in used]
        if len(values) != parts:
            raise ValueError(
                f"settle got {len(values)} used values for a reservation of {parts} buckets"
            )
        return values
    return [one(used)] * parts
