"""Concurrency permits shared through Redis (docs/design.md §6, "Concurrency permits"):
the public classes, re-exported by ``bucketlimit.redis``.

:class:`RedisConcurrencyLimiter` and :class:`AsyncRedisConcurrencyLimiter` answer
as :class:`bucketlimit.ConcurrencyLimiter` does, for every process using the same
keys and prefix, on the server's clock; their permits are :class:`RedisPermit`
and :class:`AsyncRedisPermit` (``permit_flows``). Every operation is a flow of
``permit_flows`` or ``combined``; the classes drive it in one line a method,
with a blocking call or with ``await`` (``drivers``, which also wait out a
waiting flow's ``Wait`` steps and run its ``Local`` ones).
"""

from __future__ import annotations

import logging
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
from bucketlimit._redis import combined, permit_flows, permits
from bucketlimit._redis.buckets import Part
from bucketlimit._redis.clients import (
    DEFAULT_TIMEOUT,
    LazyClient,
    client_from_url,
    closed_async,
)
from bucketlimit._redis.combined import Combined, PermitPart, ReservedPermits
from bucketlimit._redis.drivers import run, run_async
from bucketlimit._redis.flows import check_wait
from bucketlimit._redis.keys import Keys
from bucketlimit._redis.limiter import check_client
from bucketlimit._redis.limiter import state_of as bucket_state_of
from bucketlimit._redis.module import Engine, EngineName, check_engine
from bucketlimit._redis.permit_flows import AsyncRedisPermit, RedisPermit
from bucketlimit._redis.permits import Held, PermitState
from bucketlimit._redis.resilience import (
    LOCAL,
    Policy,
    check_policy,
    check_processes,
    check_retry_interval,
)
from bucketlimit._redis.script import ALLOW, Mode
from bucketlimit._redis.timing import StoreTime, TimeSource, check_time_source
from bucketlimit._stats import RedisConcurrencyStats

if TYPE_CHECKING:
    from typing import Self, Unpack

logger = logging.getLogger("bucketlimit")

C = TypeVar("C")
T = TypeVar("T")

#: What ``stats()`` reports of the limiter's counters (``allowed`` as ``granted``).
COUNTED: Final = (
    "allowed",
    "refused",
    "released",
    "abandoned",
    "store_calls",
    "script_loads",
    "store_errors",
    "fallback_decisions",
    "lost_releases",
)


# -- the limiters -----------------------------------------------------------------------


class PermitOptions(TypedDict, total=False):
    """The constructor's keyword arguments, for ``from_url``."""

    ttl: float | SupportsIndex
    clock: Callable[[], float] | None
    prefix: str | None
    hash_tag: Callable[[str], str] | None
    on_store_error: Policy
    processes: SupportsIndex | None
    retry_interval: float
    engine: EngineName
    time_source: TimeSource


class RedisConcurrency(Generic[C]):
    """What both Redis concurrency limiter classes share: the constructor (every
    argument checked, nothing sent), ``from_url``, the configuration, ``stats()``
    and ``repr``."""

    _asyncio: ClassVar[bool]
    _other: ClassVar[str]

    def __init__(
        self,
        client: C | LazyClient,
        limit: SupportsIndex,
        *,
        ttl: float | SupportsIndex = 60.0,
        clock: Callable[[], float] | None = None,
        prefix: str | None = None,
        hash_tag: Callable[[str], str] | None = None,
        on_store_error: Policy = LOCAL,
        processes: SupportsIndex | None = None,
        retry_interval: float = 1.0,
        engine: EngineName = "auto",
        time_source: TimeSource = "auto",
    ) -> None:
        cluster = check_client(client, asyncio=self._asyncio, other=self._other)
        probe = _core_limiter(limit, ttl)
        seconds, micros = permits.check_ttl(ttl)
        if clock is not None and not callable(clock):
            raise TypeError(
                "clock must be a zero-argument callable returning seconds, "
                f"got {type(clock).__name__}"
            )
        if prefix is None:
            prefix = permits.default_prefix(probe.limit, micros)
        keys = Keys(prefix, hash_tag)
        self._state = PermitState(
            client,
            cluster=cluster,
            limit=probe.limit,
            ttl=seconds,
            ttl_micros=micros,
            clock=clock,
            keys=keys,
            policy=check_policy(on_store_error),
            processes=check_processes(processes),
            retry_interval=check_retry_interval(retry_interval),
            name=f"{type(self).__name__}(prefix={prefix!r})",
            threaded=not self._asyncio,
            engine=Engine(check_engine(engine)),
            timing=StoreTime(check_time_source(time_source)),
        )
        self._owned: LazyClient | None = None

    @classmethod
    def from_url(
        cls,
        url: str,
        limit: SupportsIndex,
        *,
        cluster: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        **options: Unpack[PermitOptions],
    ) -> Self:
        """A limiter on a new client for ``url`` (:func:`bucketlimit.redis.client_from_url`:
        ``timeout`` seconds to connect and to answer, no command retries), built on
        first use; ``options`` are the constructor's keyword arguments."""
        lazy = client_from_url(url, asyncio=cls._asyncio, cluster=cluster, timeout=timeout)
        limiter = cls(lazy, limit, **options)
        limiter._owned = lazy
        return limiter

    @property
    def client(self) -> C:
        """The client; ``from_url``'s is built by the first call or by reading this."""
        return cast("C", self._state.connect())

    @property
    def limit(self) -> int:
        return self._state.limit

    @property
    def time_source(self) -> str:
        """Where its calls take their time from now: ``"script"`` (the store's TIME,
        read by each script), ``"store"`` or ``"client"`` (sent by each call:
        docs/redis.md, "Managed stores and alternatives")."""
        return self._state.time.source

    @property
    def engine(self) -> EngineName:
        """What runs the calls in the store: ``"auto"``, ``"module"`` or ``"lua"``
        (docs/redis.md, "The module")."""
        return self._state.engine.name

    @property
    def ttl(self) -> float:
        """Seconds a permit lives without a renewal, on the store's clock."""
        return self._state.ttl

    @property
    def prefix(self) -> str:
        """The start of every key: the one given, or ``bucketlimit:permits:``, the
        limit and the ttl in µs (docs/redis.md, "Concurrency permits across
        processes")."""
        return self._state.keys.prefix.decode("utf-8")

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

    def redis_key(self, key: str) -> bytes:
        """The Redis key of ``key``'s permits (``prefix{tag}:key``; ``:h``, ``:q`` and
        ``:g`` after it name its held permits, its queue and its grants waiting to
        be picked up); checks ``key`` as every call does."""
        return self._state.key(key)

    def stats(self) -> RedisConcurrencyStats:
        """Counters of this limiter object: ``granted`` and ``refused`` answers,
        ``released`` (permits released by their holder before they expired),
        ``abandoned`` (waits given up by a cancellation or an exception),
        ``store_calls``, ``script_loads``, ``store_errors``, ``fallback_decisions``
        (answers with ``degraded=True``), ``lost_releases`` (releases that could not
        reach the store: those permits expire by their ttl), ``breaker_openings``,
        ``breaker_open`` (breakers open now), ``waiting`` (this object's waiters now)
        and ``wakeups`` (grants told to its waiters by a message)."""
        state = self._state
        stats = state.counters.snapshot(COUNTED)
        stats["granted"] = stats.pop("allowed")
        breakers = state.breakers.all()
        stats["breaker_openings"] = sum(breaker.openings for breaker in breakers)
        stats["breaker_open"] = sum(breaker.open for breaker in breakers)
        stats["waiting"] = state.wakeups.waiting()
        stats["wakeups"] = state.wakeups.messages
        return cast("RedisConcurrencyStats", stats)

    def histograms(self) -> list[tuple[str, dict[str, str], Histogram]]:
        """This object's histograms, ``(name, labels, histogram)``: the seconds each
        command took the store to answer (``store_round_trip_seconds``), which
        ``bucketlimit.metrics`` exports (docs/metrics.md). Commands are timed from
        the first call of this method on (``metrics`` makes it when it adds the
        limiter): a limiter nobody measures spends nothing on timing."""
        self._state.round_trips.want()
        return [("store_round_trip_seconds", {}, self._state.round_trips)]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(limit={self.limit}, ttl={self.ttl!r}, prefix={self.prefix!r})"
        )


def _core_limiter(limit: object, ttl: object) -> Any:
    """``limit`` and ``ttl`` checked by the in-process limiter's own rules."""
    from bucketlimit._core import ConcurrencyLimiter

    return ConcurrencyLimiter(limit, ttl=ttl)  # type: ignore[arg-type]


def state_of(limiter: RedisConcurrency[Any]) -> PermitState:
    """A limiter's state, for the calls over several limiters (``bucketlimit.redis``)."""
    return limiter._state


if TYPE_CHECKING:
    import redis
    import redis.asyncio
    import valkey
    import valkey.asyncio
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster
    from valkey.asyncio.cluster import ValkeyCluster as AsyncValkeyCluster
    from valkey.cluster import ValkeyCluster

    SyncClient = redis.Redis | RedisCluster | valkey.Valkey | ValkeyCluster
    AsyncClient = (
        redis.asyncio.Redis | AsyncRedisCluster | valkey.asyncio.Valkey | AsyncValkeyCluster
    )
else:
    SyncClient = AsyncClient = Any


class RedisConcurrencyLimiter(RedisConcurrency[SyncClient]):
    """At most ``limit`` permits held per key, across every process using the same
    keys and prefix (docs/redis.md, "Concurrency permits across processes"):
    :class:`bucketlimit.ConcurrencyLimiter` on Redis, with the same answers, on
    the server's clock.

    ``client`` is a blocking redis-py or valkey-py client (standalone or cluster)
    or what :func:`bucketlimit.redis.client_from_url` built; or use
    :meth:`from_url`. ``ttl``: seconds a permit lives unless released or renewed.
    ``clock=None`` uses the server's time (a clock given is sent to the script
    instead: tests). ``prefix`` starts every key (by default
    ``bucketlimit:permits:``, the limit and the ttl), ``hash_tag(key) -> str`` picks a
    key's Redis Cluster hash tag. When the store fails: ``on_store_error``
    (``"local"``: this process's share, ``limit // processes`` permits per key, in
    process; ``"open"``, ``"closed"``, ``"raise"``), the store then skipped for
    ``retry_interval`` seconds. Nothing is sent at construction.
    """

    _asyncio = False
    _other = "AsyncRedisConcurrencyLimiter for asyncio clients"

    def try_acquire(self, key: str) -> RedisPermit:
        """A permit now, or a refusal (falsy); never waits, never jumps the queue."""
        return RedisPermit(self._state, run(permit_flows.take(self._state, key), self._state))

    def acquire(self, key: str, *, timeout: float | None = None) -> RedisPermit:
        """Blocks this thread until a permit is handed to it, in the order the server
        received the requests (every process's); a refusal (falsy) as soon as
        ``timeout`` seconds have passed. It sleeps until woken by the release that
        hands it a slot, or until a slot is sure to free by expiry (without the
        store's messages, asking every 0.75 s). An exception while it waits (``KeyboardInterrupt``)
        leaves the queue first."""
        return RedisPermit(
            self._state, run(permit_flows.acquire(self._state, key, timeout), self._state)
        )

    async def acquire_async(self, key: str, *, timeout: float | None = None) -> RedisPermit:
        """``acquire`` for asyncio code holding this sync limiter: its commands are
        blocking round trips, as ``try_acquire`` is from async code, and its waits
        are awaited. A task cancelled while it waits leaves the queue (a permit
        handed to it meanwhile goes to the next). An asyncio service should use
        :class:`AsyncRedisConcurrencyLimiter`."""
        flow = permit_flows.acquire(self._state, key, timeout)
        held = await run_async(flow, self._state, blocking=True, undo=self._undo)
        return RedisPermit(self._state, held)

    async def _undo(self, held: Held) -> None:
        RedisPermit(self._state, held).release()

    def in_flight(self, key: str) -> int:
        """The key's permits held now (every process's; the expired ones gone)."""
        return run(permit_flows.in_flight(self._state, key), self._state)

    def check(self) -> None:
        """Asks the store now (connects, runs the script as a read, reads the
        version): ``ConfigurationError`` for what no retry will fix, the client's
        error when the store cannot be reached. The limiter never calls it."""
        run(permit_flows.check(self._state), self._state)

    def close(self) -> None:
        """Stops the wake-up listener and closes the client :meth:`from_url` built
        (a client you gave it stays yours), once the commands other threads sent
        have landed; a waiter still waiting gets a ``RuntimeError`` at its next
        question (its place lapses). Also ``with limiter:``."""
        self._state.wakeups.stop()
        if self._owned is not None and self._owned.built:
            self._state.land()
            self._owned.get().close()

    def __enter__(self) -> RedisConcurrencyLimiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRedisConcurrencyLimiter(RedisConcurrency[AsyncClient]):
    """:class:`RedisConcurrencyLimiter` for ``redis.asyncio`` and ``valkey.asyncio``
    clients: the methods that talk to Redis are coroutines, and so are its permits'
    ``release``, ``renew`` and ``valid``."""

    _asyncio = True
    _other = "RedisConcurrencyLimiter for blocking clients"

    async def try_acquire(self, key: str) -> AsyncRedisPermit:
        """:meth:`RedisConcurrencyLimiter.try_acquire`, awaited."""
        flow = permit_flows.take(self._state, key)
        return AsyncRedisPermit(self._state, await run_async(flow, self._state, undo=self._undo))

    async def acquire(self, key: str, *, timeout: float | None = None) -> AsyncRedisPermit:
        """:meth:`RedisConcurrencyLimiter.acquire`, awaited. Cancel-safe: a task
        cancelled while it waits (or while its request is on its way) leaves the
        queue, and a permit handed to it meanwhile goes at once to the next."""
        flow = permit_flows.acquire(self._state, key, timeout)
        held = await run_async(flow, self._state, undo=self._undo)
        return AsyncRedisPermit(self._state, held)

    #: The same coroutine as :meth:`acquire`, for code written for
    #: ``ConcurrencyLimiter.acquire_async``.
    acquire_async = acquire

    async def _undo(self, held: Held) -> None:
        await AsyncRedisPermit(self._state, held).release()

    async def in_flight(self, key: str) -> int:
        """:meth:`RedisConcurrencyLimiter.in_flight`, awaited."""
        return await run_async(permit_flows.in_flight(self._state, key), self._state)

    async def check(self) -> None:
        """:meth:`RedisConcurrencyLimiter.check`, awaited."""
        await run_async(permit_flows.check(self._state), self._state)

    async def aclose(self) -> None:
        """Stops the wake-up listener and closes the client :meth:`from_url` built.
        Also ``async with limiter:``."""
        self._state.wakeups.stop()
        if self._owned is not None and self._owned.built:
            await self._state.land_async()
            await closed_async(self._owned.get())

    async def __aenter__(self) -> AsyncRedisConcurrencyLimiter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = [
    "AsyncRedisConcurrencyLimiter",
    "AsyncRedisPermit",
    "RedisConcurrencyLimiter",
    "RedisPermit",
]


# -- the *_all calls: token buckets, with or without permits among them -------------------


def split(
    checks: Any, cost: object, what: str, *, buckets: type[Any], concurrency: type[Any]
) -> tuple[list[tuple[Any, str, int]], list[Part], list[PermitPart], list[bool]]:
    """The checks of a call over Redis token buckets (``buckets``, the class of the
    call's kind) and concurrency limiters (``concurrency``), every one checked
    before anything is sent: pairs or triples (a permit's cost 1), one client,
    keys, duplicates, costs. Answers them as ``(limiter, key, cost)``, the buckets'
    and the permits' parts, and per check whether it is a permit's."""
    named: list[tuple[Any, str, int]] = []
    parts: list[Part] = []
    pparts: list[PermitPart] = []
    where: list[bool] = []
    seen: set[tuple[int, str]] = set()
    client: object = None
    for item in checks:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise TypeError(
                f"{what} takes a sequence of (limiter, key) pairs or (limiter, key, cost) "
                f"triples, got {type(item).__name__}"
            )
        limiter, key = item[0], item[1]
        if isinstance(limiter, concurrency):
            state: Any = state_of(limiter)
        elif isinstance(limiter, buckets):
            state = bucket_state_of(limiter)
        else:
            raise TypeError(
                f"{what} takes {buckets.__name__} or {concurrency.__name__} instances here, "
                f"got {type(limiter).__name__}"
            )
        if client is not None and state.same_client() is not client:
            raise ValueError(
                f"{what} runs one script on one client: every Redis limiter in it "
                "must share the same client object"
            )
        client = state.same_client()
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if (id(limiter), key) in seen:
            raise ValueError(f"{what} got the same (limiter, key) twice: key {key!r}")
        seen.add((id(limiter), key))
        if isinstance(limiter, concurrency):
            if len(item) == 3:
                one = item[2]
                if isinstance(one, bool) or not hasattr(type(one), "__index__"):
                    raise TypeError(f"cost must be an int, got {type(one).__name__}")
                if one.__index__() != 1:
                    raise ValueError(
                        "a concurrency limiter's check takes one permit: its cost must be 1, "
                        f"got {one.__index__()}"
                    )
            state.key(key)  # checks the key
            named.append((limiter, key, 1))
            pparts.append((state, key))
            where.append(True)
        else:
            checked = _core.check_cost(item[2] if len(item) == 3 else cost, limiter.capacity)
            state.keys.bucket(key)
            named.append((limiter, key, checked))
            parts.append((state, key, checked))
            where.append(False)
    if not named:
        raise ValueError(f"{what} needs at least one (limiter, key)")
    return named, parts, pparts, where


def has_permits(checks: list[Any]) -> bool:
    """Whether a call's checks name a Redis concurrency limiter, of either kind (one
    of the other kind than the call's is then refused by :func:`split`)."""
    return any(
        isinstance(item, tuple) and item and isinstance(item[0], RedisConcurrency)
        for item in checks
    )


def reservation(
    kind: CallClasses,
    named: list[tuple[Any, str, int]],
    parts: list[Part],
    pparts: list[PermitPart],
    where: list[bool],
    got: Combined,
) -> Any:
    """The reservation of a call over buckets and permits (``kind.reservation``:
    RedisReservation or AsyncRedisReservation; ``kind.holder``: its permits'
    class); over buckets alone it holds no permits."""
    if not pparts:
        return kind.reservation(named, parts, got.reserved)
    holders = [kind.holder(state, held) for (state, _), held in zip(pparts, got.helds, strict=True)]
    return kind.reservation(named, parts, got.reserved, ReservedPermits(holders, pparts, where))


def with_permits(
    what: str, checks: list[Any], cost: object, max_wait: object, name: str, *, kind: CallClasses
) -> tuple[list[tuple[Any, str, int]], list[Part], list[PermitPart], list[bool], int | None]:
    """The checks and the wait (called ``name``) of a call over buckets and permits."""
    waited = check_wait(max_wait, name)
    named, parts, pparts, where = split(
        checks, cost, what, buckets=kind.buckets, concurrency=kind.concurrency
    )
    return named, parts, pparts, where, waited


def sender(parts: list[Part], pparts: list[PermitPart]) -> Any:
    """The state whose driver sends a call over several (its engine, its time
    source): the first permit's, else the first bucket's."""
    return pparts[0][0] if pparts else parts[0][0]


class CallClasses:
    """The classes of one kind of call over several Redis limiters (blocking or
    asyncio), which ``bucketlimit.redis`` gives: its token-bucket class, its
    concurrency class, its reservation class and its permits' class."""

    def __init__(
        self, buckets: type[Any], concurrency: type[Any], reservation: type[Any], holder: type[Any]
    ) -> None:
        self.buckets = buckets
        self.concurrency = concurrency
        self.reservation = reservation
        self.holder = holder


def allow_all(
    kind: CallClasses,
    checks: list[Any],
    cost: object,
    mode: Mode,
    max_wait: object,
    name: str = "max_wait",
) -> Any:
    """``allow_all`` (``ALLOW``) and ``reserve_all`` (``RESERVE``) over token buckets
    and concurrency permits (or none), blocking: one script (``combined``).
    ``allow_all`` over buckets alone answers its ``Decision``; any other, the
    reservation (holding the permits)."""
    what = "allow_all" if mode is ALLOW else "reserve_all"
    named, parts, pparts, where, waited = with_permits(
        what, checks, cost, max_wait, name, kind=kind
    )
    got = run(combined.reserve_all(parts, pparts, mode, waited), sender(parts, pparts))
    if mode is ALLOW and not pparts:
        return got.reserved.decision
    return reservation(kind, named, parts, pparts, where, got)


async def allow_all_async(
    kind: CallClasses,
    checks: list[Any],
    cost: object,
    mode: Mode,
    max_wait: object,
    name: str = "max_wait",
) -> Any:
    """:func:`allow_all` for the asyncio limiters. A reservation is shielded:
    cancelled while its script is on its way, it gives back what it got once the
    reply lands (a decision holds nothing to give back)."""
    what = "allow_all" if mode is ALLOW else "reserve_all"
    named, parts, pparts, where, waited = with_permits(
        what, checks, cost, max_wait, name, kind=kind
    )
    decides = mode is ALLOW and not pparts

    async def undo(got: Combined) -> None:
        await reservation(kind, named, parts, pparts, where, got).cancel()

    flow = combined.reserve_all(parts, pparts, mode, waited)
    got = await run_async(flow, sender(parts, pparts), undo=None if decides else undo)
    if decides:
        return got.reserved.decision
    return reservation(kind, named, parts, pparts, where, got)


def acquire_all(kind: CallClasses, checks: list[Any], cost: object, timeout: object) -> Any:
    """``acquire_all`` with permits among the checks, blocking: waits for the permits
    (in the order of their Redis keys, FIFO each), then for the tokens; answers the
    reservation holding them (its ``settle`` / ``cancel`` release them)."""
    named, parts, pparts, where, waited = with_permits(
        "acquire_all", checks, cost, timeout, "timeout", kind=kind
    )
    got = run(combined.acquire_all(parts, pparts, waited), pparts[0][0])
    made = reservation(kind, named, parts, pparts, where, got)
    made.wait()
    return made


async def acquire_all_async(
    kind: CallClasses, checks: list[Any], cost: object, timeout: object
) -> Any:
    """:func:`acquire_all` for the asyncio limiters; cancel-safe (a cancelled waiter
    leaves its queue, and what it held or was handed goes back)."""
    named, parts, pparts, where, waited = with_permits(
        "acquire_all", checks, cost, timeout, "timeout", kind=kind
    )

    async def undo(got: Combined) -> None:
        made = reservation(kind, named, parts, pparts, where, got)
        await made.cancel()

    flow = combined.acquire_all(parts, pparts, waited)
    got = await run_async(flow, pparts[0][0], undo=undo)
    made = reservation(kind, named, parts, pparts, where, got)
    await made.wait()
    return made
