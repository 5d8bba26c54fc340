"""The Redis limiter written once, free of I/O (docs/design.md §6).

Every operation is a *flow*: a generator that yields the commands to send and is
sent their replies (or has their errors thrown in), the shape of httpx's
``auth_flow``. Everything a call decides is here: validation, keys, script
arguments, the refusal cache, the breaker, the failure policy, turning a reply into
a ``Decision``, counting. ``RedisTokenBucketLimiter`` drives a flow with blocking
calls and ``AsyncRedisTokenBucketLimiter`` with ``await`` (``bucketlimit.redis``);
that is all they do.

One route for every operation (:meth:`RedisLimiter._run`): refusal cache, breaker,
send, then the reply or the failure policy; the call's counters are added in one
place when it ends. A script is sent with EVALSHA; only a ``NOSCRIPT`` reply (the
server lost its script cache: restart, failover, ``SCRIPT FLUSH``) is answered by
sending the script itself once more, which is safe because the script did not run.
Nothing else is retried: a command that timed out may have run, and sending it again
could charge twice.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
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

from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ClusterError, NoPermissionError, NoScriptError, ResponseError

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._redis.errors import (
    CONFIG,
    CORRUPT,
    EXHAUSTED,
    FAULT,
    REDIRECTED,
    StoreUnavailableError,
    check_version,
    classify,
    configuration_error,
    read_only,
    store_error,
)
from bucketlimit._redis.keys import Keys, check_one_slot
from bucketlimit._redis.resilience import (
    CLOSED,
    LOCAL,
    RAISE,
    Breaker,
    Fallback,
    Gate,
    Policy,
    RefusalCache,
    check_policy,
    check_processes,
    check_retry_interval,
    fork_safe,
)
from bucketlimit._redis.script import (
    BUCKET_SCRIPT,
    LUA_EXACT,
    NO_ARGS,
    SERVER_TIME,
    Mode,
    Script,
    decision,
    specialize,
)

if TYPE_CHECKING:
    from typing import Self, Unpack

#: A command for the client: the name of one of its methods, and the arguments.
Command = tuple[str, tuple[Any, ...]]
T = TypeVar("T")
#: An operation: yields commands, is sent their replies, returns its answer.
Flow = Generator[Command, Any, T]
#: The client type of a limiter class (redis-py's sync or asyncio clients).
C = TypeVar("C")


def resume(flow: Flow[Any], reply: Any, error: BaseException | None) -> Command:
    """Hands a flow its command's reply, or the error the command raised; returns the
    next command, or raises StopIteration carrying the flow's answer."""
    return flow.send(reply) if error is None else flow.throw(error)


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


class Call:
    """One operation on its way to the store: what to send, what it takes to answer
    without the store, and what happened (counted once, when it ends)."""

    __slots__ = (
        "args",
        "breaker",
        "cache_hit",
        "checks",
        "cost",
        "fallback",
        "gate",
        "key",
        "keys",
        "mode",
        "reloads",
        "script",
        "sent",
        "started",
        "store_error",
    )

    def __init__(
        self,
        mode: Mode,
        key: str,
        cost: int,
        script: Script,
        keys: list[bytes],
        args: Sequence[Any],
        checks: Sequence[tuple[RedisLimiter[Any], str]] | None = None,
    ) -> None:
        self.mode = mode
        self.key = key  # "" for allow_all, which has checks instead
        self.cost = cost
        self.script = script
        self.keys = keys
        self.args = args
        self.checks = checks
        self.gate = Gate.STORE
        self.breaker: Breaker | None = None  # the breaker of the node asked (set by _run)
        self.started = 0.0  # time.monotonic() before sending, for the refusal cache
        # What happened, for stats(): commands sent, scripts re-sent after NOSCRIPT,
        # a store fault, an answer without the store, a refusal from the cache.
        self.sent = self.reloads = 0
        self.store_error = self.fallback = self.cache_hit = False


class Counters:
    """The numbers ``stats()`` reports; a lock, since many threads may share a limiter."""

    __slots__ = (
        "__weakref__",
        "_lock",
        "allowed",
        "fallback_decisions",
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
        fork_safe(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def add(self, call: Call | None, allowed: bool | None) -> None:
        """What one call did (``None``: nothing sent through this limiter), and its
        decision when it was an allow (``None``: no decision)."""
        with self._lock:
            if call is not None:
                self.store_calls += call.sent
                self.script_loads += call.reloads
                self.store_errors += call.store_error
                self.fallback_decisions += call.fallback
                self.refusal_cache_hits += call.cache_hit
            if allowed is not None:
                if allowed:
                    self.allowed += 1
                else:
                    self.refused += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: getattr(self, name) for name in self.__slots__ if name[0] != "_"}


class RedisLimiter(Generic[C]):
    """Configuration, keys and every operation's flow; the subclasses drive the flows.

    A subclass names its clients (``_clients``: the standalone and the cluster
    client class it accepts; ``_retry``: their Retry class; ``_other``: the class
    for the other kind) and drives flows (``_drive``), with blocking calls or with
    ``await``.
    """

    # bucket.lua: allow_all runs it as it is; each limiter runs its own form
    # (specialize). A class attribute so that a test may swap it.
    _script: ClassVar[Script] = BUCKET_SCRIPT
    _clients: ClassVar[tuple[type[Any], type[Any]]]
    _retry: ClassVar[type[Any]]
    _blocking_pool: ClassVar[type[Any]]
    _other: ClassVar[str]

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
    ) -> None:
        lazy: LazyClient | None = client if isinstance(client, LazyClient) else None
        if lazy is None and not isinstance(client, self._clients):
            names = " or ".join(f"{c.__module__}.{c.__qualname__}" for c in self._clients)
            raise TypeError(f"client must be a {names} (use {self._other}), got {type(client)}")
        capacity, p, unit = _core.exact_units(capacity, rate, per=per)
        if clock is not None and not callable(clock):
            raise TypeError(
                "clock must be a zero-argument callable returning seconds, "
                f"got {type(clock).__name__}"
            )
        self._keys = Keys(prefix, hash_tag)
        if capacity * unit + p >= LUA_EXACT:
            raise ValueError(
                f"capacity {capacity} with rate {rate!r} per {per!r} is beyond the exact range "
                "of the Redis script: Lua numbers are doubles, exact only below 2**53, and "
                f"capacity * units per token + units per microsecond = {capacity * unit + p}"
            )
        # The client, or None until from_url's is built (_connect).
        self._client: C | None = None if lazy is not None else client
        self._lazy: LazyClient | None = lazy
        self._cluster = lazy.cluster if lazy is not None else isinstance(client, self._clients[1])
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

        The client is built on first use (the first call, or reading ``client``),
        so nothing is sent here. A standalone client gets a blocking pool of
        :data:`DEFAULT_MAX_CONNECTIONS`: a call finding every connection busy waits
        up to ``timeout`` for one (docs/redis.md, "A full connection pool")."""
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            raise TypeError(f"timeout must be an int or float, got {type(timeout).__name__}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be finite and > 0 (seconds), got {timeout!r}")
        settings: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": cls._retry(NoBackoff(), 0),
        }
        if cluster:
            cluster_class = cls._clients[1]
            # redis-py's asyncio cluster client closes every connection (those other
            # tasks are using too) on each 5th MOVED by default: during a migration
            # that lost replies of scripts that ran. With 0 a MOVED only updates the
            # slot it names (docs/redis.md, "Resharding and failover").
            settings["reinitialize_steps"] = 0

            def build() -> Any:
                return cluster_class.from_url(url, **settings)

        else:
            client_class, pool_class = cls._clients[0], cls._blocking_pool
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
    def refusal_cache(self) -> bool:
        """Whether refusals are remembered (asked for, and the store's clock in use)."""
        return self._refusals is not None

    def stats(self) -> dict[str, int]:
        """Counters of this limiter object: ``allowed`` and ``refused`` decisions,
        ``store_calls`` (commands sent), ``script_loads`` (scripts re-sent after
        ``NOSCRIPT``), ``store_errors`` (store faults, corrupt buckets included),
        ``fallback_decisions`` (answers with ``degraded=True``), ``breaker_openings``
        (outages) and ``refusal_cache_hits`` (refusals answered without the store)."""
        stats = self._counters.snapshot()
        breakers = [self._breaker, *list(self._node_breakers.values())]
        stats["breaker_openings"] = sum(breaker.openings for breaker in breakers)
        return stats

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
        if mode is not Mode.ALLOW:
            return cost, mode.value
        return NO_ARGS if cost == 1 else (cost,)

    def _call(self, mode: Mode, key: str, cost: object) -> Call:
        """A one-bucket call of this limiter's own script; validates like the core."""
        if type(cost) is not int or not 0 < cost <= self._capacity:
            cost = _core.check_cost(cost, self._capacity)
        return Call(mode, key, cost, self._own, [self._keys.bucket(key)], self._args(mode, cost))

    # -- the operations --------------------------------------------------------------

    # Each returns the flow of _run, which always decides for an allow or a peek
    # (cast: the type cannot say so) and answers None to a refund or a reset.

    def _allow(self, key: str, cost: object) -> Flow[Decision]:
        return cast("Flow[Decision]", self._run(self._call(Mode.ALLOW, key, cost)))

    def _peek(self, key: str, cost: object) -> Flow[Decision]:
        return cast("Flow[Decision]", self._run(self._call(Mode.PEEK, key, cost)))

    def _refund(self, key: str, cost: object) -> Flow[None]:
        return cast("Flow[None]", self._run(self._call(Mode.REFUND, key, cost)))

    def _reset(self, key: str) -> Flow[None]:
        call = Call(Mode.RESET, key, 0, self._own, [self._keys.bucket(key)], NO_ARGS)
        self._fallback.reset(key)  # full again here too, for the next outage
        return cast("Flow[None]", self._run(call))

    def _check(self) -> Flow[None]:
        """``check()``: the script (a peek at a key no bucket uses), then the version."""
        call = Call(Mode.PEEK, "", 1, self._own, [self._keys.probe()], self._args(Mode.PEEK, 1))
        try:
            try:
                yield from self._send(call)
                try:
                    info = yield ("info", ("server",))
                except NoPermissionError:
                    info = None  # INFO forbidden: the script ran, which is what counts
            except Exception as e:
                if classify(e) == CONFIG:
                    raise configuration_error(e) from e
                raise
        finally:
            self._counters.add(call, None)
        check_version(info)

    # -- one route for every call: refusal cache, breaker, store, policy --------------

    def _run(self, call: Call) -> Flow[Decision | None]:
        """Answers ``call``: from the refusal cache, from the policy while the breaker
        skips the store, or from the store's reply (the policy when it fails)."""
        answer: Decision | None = None
        try:
            answer = self._cached(call)
            if answer is not None:
                return answer
            call.breaker = breaker = self._breaker_for(call.keys[0])
            call.gate = breaker.admit()
            if call.gate is Gate.SKIP:
                answer = self._without_store(call, None)
                return answer
            try:
                reply = yield from self._send(call)
            except BaseException as error:  # CancelledError too: a probe must be released
                answer = self._failed(call, error)
                return answer
            answer = self._answered(call, reply)
            return answer
        finally:
            self._count(call, answer)

    def _breaker_for(self, key: bytes) -> Breaker:
        """The breaker of the node serving ``key``: the one breaker of a standalone
        store; on a cluster, the breaker of the primary the client's slot map names
        (the shared one until the client knows the map)."""
        client = self._client
        if not self._cluster or client is None:
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

    def _send(self, call: Call) -> Flow[Any]:
        """The call's command: its script by EVALSHA (the source after NOSCRIPT), or
        DEL for a reset."""
        call.sent += 1
        keys = call.keys
        if call.mode is Mode.RESET:
            return (yield ("delete", tuple(keys)))
        script, args = call.script, call.args
        evalsha = ("execute_command", ("EVALSHA", script.sha, len(keys), *keys, *args))
        try:
            try:
                try:
                    return (yield evalsha)
                except ClusterError as e:
                    if classify(e) != REDIRECTED:
                        raise
                    # Every node answered MOVED, ASK or TRYAGAIN: the script did not
                    # run, so sending it once more is safe (docs/design.md §6).
                    call.sent += 1
                    return (yield evalsha)
            except NoScriptError:
                # The script did not run, so sending it whole is safe (and caches it).
                call.sent += 1
                call.reloads += 1
                return (yield ("execute_command", ("EVAL", script.source, len(keys), *keys, *args)))
        except ResponseError as e:
            converted = store_error(e, keys)
            if converted is e:
                raise
            raise converted from e

    def _cached(self, call: Call) -> Decision | None:
        """A refusal still in force for an allow or a peek of one bucket; a refund or
        a reset forgets the key's refusal (this process gives tokens back)."""
        refusals = self._refusals
        if refusals is None or call.checks is not None:
            return None
        if call.mode is Mode.ALLOW or call.mode is Mode.PEEK:
            call.started = time.monotonic()
            cached = refusals.get(call.keys[0], call.cost, call.started)
            call.cache_hit = cached is not None
            return cached
        refusals.drop(call.keys[0])
        return None

    def _answered(self, call: Call, reply: Any) -> Decision | None:
        assert call.breaker is not None
        if call.mode is Mode.REFUND or call.mode is Mode.RESET:
            call.breaker.succeeded(call.gate)
            return None
        answer = decision(reply, self._capacity)
        # Only a write proves a store that said READONLY writable again.
        call.breaker.succeeded(call.gate, wrote=call.mode is Mode.ALLOW and answer.allowed)
        refusals = self._refusals
        if refusals is not None and call.checks is None:
            if not answer.allowed:
                refusals.put(call.keys[0], call.cost, answer, call.started)
            elif refusals.entries:
                refusals.drop(call.keys[0])
        return answer

    def _failed(self, call: Call, error: BaseException) -> Decision | None:
        """Answers a call whose command failed, or raises."""
        kind = classify(error)
        breaker = call.breaker
        assert breaker is not None
        if kind == FAULT:
            call.store_error = True
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
            call.store_error = True
            breaker.succeeded(call.gate, wrote=False)
            if self._raises(call):
                raise error
            if call.mode is Mode.REFUND or call.mode is Mode.RESET:
                return None
            call.fallback = True
            return self._fallback.refusal()
        breaker.release(call.gate)
        if kind == CONFIG:
            raise configuration_error(error) from error
        raise error

    def _raises(self, call: Call) -> bool:
        limiters = [self] if call.checks is None else [limiter for limiter, _ in call.checks]
        return any(limiter._policy == RAISE for limiter in limiters)

    def _without_store(self, call: Call, error: BaseException | None) -> Decision | None:
        """The policy's answer; ``error`` is None when the breaker skipped the store."""
        if self._raises(call):
            if error is not None:
                raise error
            assert call.breaker is not None
            raise StoreUnavailableError(call.breaker.describe())
        if call.mode is Mode.REFUND:
            # Lost for the store, which keeps the charge: never more than the limit.
            self._fallback.refund(call.key, call.cost)
            return None
        if call.mode is Mode.RESET:
            return None  # lost for the store; the local bucket is full already
        call.fallback = True
        if call.checks is not None:
            return _fallback_all(call.checks, call.cost)
        return self._fallback.decide(call.key, call.cost, peek=call.mode is Mode.PEEK)

    def _count(self, call: Call, answer: Decision | None) -> None:
        """Adds what ``call`` did to the stats: once, when it ends. An allow_all's
        decision counts for every (limiter, key) it named."""
        allowed = None if answer is None or call.mode is not Mode.ALLOW else answer.allowed
        self._counters.add(call, allowed)
        if call.checks is not None and allowed is not None:
            for limiter, _ in call.checks[1:]:
                limiter._counters.add(None, allowed)


def allow_all_flow(checks: Iterable[Any], cost: object) -> tuple[RedisLimiter[Any], Flow[Decision]]:
    """The limiter to drive it with, and the flow of one ``allow_all`` script (the
    general form of bucket.lua: cost, mode, then now and the configuration of each
    bucket), sent through the first limiter: its breaker, its policy for the store's
    faults.

    Everything is checked here, before anything is sent: pairs, duplicates, one
    client, costs, keys and (on a cluster) one hash slot.
    """
    checks = list(checks)
    limiters: list[RedisLimiter[Any]] = []
    keys: list[bytes] = []
    args: list[Any] = [0, Mode.ALLOW.value]
    seen: set[tuple[int, str]] = set()
    for item in checks:
        try:
            limiter, key = item
        except (TypeError, ValueError):
            raise TypeError(
                f"allow_all takes a sequence of (limiter, key) pairs, got {type(item).__name__}"
            ) from None
        if not isinstance(limiter, RedisLimiter):
            raise TypeError(f"allow_all got {type(limiter).__name__} among Redis limiters")
        if limiters and limiter._same_client() is not limiters[0]._same_client():
            raise ValueError(
                "allow_all runs one script on one client: every Redis limiter in it "
                "must share the same client object"
            )
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if (id(limiter), key) in seen:
            raise ValueError(f"allow_all got the same (limiter, key) twice: key {key!r}")
        seen.add((id(limiter), key))
        checked = _core.check_cost(cost, limiter.capacity)
        bucket = limiter._keys.bucket(key)
        if bucket in keys:
            # Two limiters with one prefix: the script would read the bucket twice
            # and charge it once.
            raise ValueError(
                f"allow_all names the Redis key {bucket!r} twice: limiters sharing a "
                "client need different prefixes"
            )
        limiters.append(limiter)
        keys.append(bucket)
        args += [limiter._now(), *limiter._config_args]
        args[0] = checked
    if not limiters:
        raise ValueError("allow_all needs at least one (limiter, key)")
    first = limiters[0]
    if first._cluster:
        check_one_slot(keys)
    call = Call(Mode.ALLOW, "", args[0], first._script, keys, args, checks=checks)
    return first, cast("Flow[Decision]", first._run(call))


def _fallback_all(checks: Sequence[tuple[RedisLimiter[Any], str]], cost: int) -> Decision:
    """``allow_all`` without the store: each limiter's policy, combined as allow_all is.

    Any ``"closed"`` limiter refuses the whole call; ``"open"`` ones allow their
    part; the ``"local"`` ones decide together in process, all or nothing, charged
    at most the smallest of their shares (one cost for all, as in ``allow_all``).
    """
    for limiter, _ in checks:
        if limiter._policy == CLOSED:
            return limiter._fallback.refusal()
    local = []
    for limiter, key in checks:
        if limiter._fallback.local is not None:
            local.append((limiter._fallback.local, key))
    if not local:
        return checks[0][0]._fallback.decide("", cost, peek=False)  # all "open"
    shares = [limiter._fallback.share for limiter, _ in checks if limiter._policy == LOCAL]
    return _core.allow_all(local, min(cost, *shares))  # local limiters answer degraded
