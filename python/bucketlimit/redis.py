"""Token buckets shared through Redis (docs/design.md §6): the in-process limiter's answers.

    from bucketlimit.redis import RedisTokenBucketLimiter

    limiter = RedisTokenBucketLimiter.from_url("redis://localhost:6379/0", 10, 2)
    if not limiter.allow("user-42"):
        ...  # 429

The arithmetic of docs/design.md §4 runs inside Redis as one Lua script, one atomic
step per call, so processes never race on a read-modify-write. The script reads the
server's ``TIME``, so processes with skewed clocks agree; a ``clock`` given to the
limiter is sent to the script instead (tests, single-clock setups). Reservations
(``reserve``, ``acquire``, ``charge``, a reservation's ``cancel`` and ``settle``,
``reserve_all`` / ``acquire_all``) are modes of the same script: FIFO across every
process that talks to the server, in the order it ran the scripts; the waiter
sleeps on its own clock for the delay the server computed (docs/redis.md,
"Waiting your turn"). With ``lease=True`` a process takes a hot key's tokens ahead
of use, in one script call, and answers ``allow()`` in process until they are spent
(``bucketlimit._redis.leases``; docs/redis.md, "Hot keys: leases").
:class:`RedisConcurrencyLimiter` and :class:`AsyncRedisConcurrencyLimiter` keep at
most N permits in flight per key, for every process, with fencing tokens, expiry
on the server's clock and FIFO waiting without polling; the ``*_all`` calls take
them next to the token buckets, in the same script (``bucketlimit._redis.concurrency``;
docs/redis.md, "Concurrency permits across processes").

Each operation is written once, as a flow over the limiter's state
(``bucketlimit._redis.flows``); the two classes here drive it, with a blocking call
(:class:`RedisTokenBucketLimiter`) or with ``await``
(:class:`AsyncRedisTokenBucketLimiter`), one line per method.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, SupportsIndex

from bucketlimit import _checks
from bucketlimit._core import Decision
from bucketlimit._redis import buckets, concurrency, drivers, flows, leases
from bucketlimit._redis.batching import Batcher, GroupCommit, allow_many, allow_many_async
from bucketlimit._redis.buckets import Part, Reserved
from bucketlimit._redis.clients import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    LazyClient,
    client_from_url,
    closed_async,
)
from bucketlimit._redis.concurrency import (
    AsyncRedisConcurrencyLimiter,
    AsyncRedisPermit,
    RedisConcurrencyLimiter,
    RedisPermit,
)
from bucketlimit._redis.drivers import run, run_async
from bucketlimit._redis.errors import (
    ConfigurationError,
    CorruptBucketError,
    ExactRangeError,
    StoreUnavailableError,
)
from bucketlimit._redis.leases import LeasePolicy
from bucketlimit._redis.limiter import RedisLimiter
from bucketlimit._redis.module import module_path
from bucketlimit._redis.reservations import AsyncRedisReservation, RedisReservation
from bucketlimit._redis.resilience import Policy
from bucketlimit._redis.script import ALLOW, RESERVE

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_TIMEOUT",
    "AsyncRedisConcurrencyLimiter",
    "AsyncRedisPermit",
    "AsyncRedisReservation",
    "AsyncRedisTokenBucketLimiter",
    "ConfigurationError",
    "CorruptBucketError",
    "ExactRangeError",
    "LazyClient",
    "LeasePolicy",
    "Policy",
    "RedisConcurrencyLimiter",
    "RedisPermit",
    "RedisReservation",
    "RedisTokenBucketLimiter",
    "StoreUnavailableError",
    "acquire_all",
    "acquire_all_async",
    "allow_all",
    "allow_all_async",
    "client_from_url",
    "module_path",
    "reserve_all",
    "reserve_all_async",
]

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
    # Whichever libraries are installed (bucketlimit._redis.clients): redis-py,
    # valkey-py or both; the names are for the type checker.
    SyncClient = AsyncClient = Any


class RedisTokenBucketLimiter(RedisLimiter[SyncClient]):
    """Token buckets in Redis, shared by every process using the same keys and prefix.

    ``client`` is a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (redis-py), a
    ``valkey.Valkey`` or ``valkey.cluster.ValkeyCluster`` (valkey-py), as you built
    it (timeouts, TLS, pool; turn its retries off, see docs/redis.md: a retried
    timeout can charge twice), or what :func:`client_from_url` built; or use
    :meth:`from_url`. ``capacity``, ``rate``, ``clock`` and ``per`` mean what they
    mean for :class:`bucketlimit.TokenBucketLimiter`; ``clock=None`` uses the
    server's time. ``prefix`` starts every key (no braces; by default
    ``bucketlimit:`` and the limit, so that different limits never share a
    bucket); ``hash_tag(key) -> str`` picks the Redis Cluster hash tag of a key
    (default: the key itself).

    When the store fails: ``on_store_error`` is ``"local"`` (this process's share of
    each bucket: ``capacity // processes``, where ``processes`` is learned from the
    store while it is up unless you give it), ``"open"``, ``"closed"`` or
    ``"raise"``; the store is then skipped for ``retry_interval`` seconds (0:
    never skipped). ``refusal_cache=False`` asks the store about every call of a
    refused key. ``batching=True``: threads share round trips (group commit).
    ``lease=True`` (or a :class:`LeasePolicy`): a hot key's tokens are taken ahead
    of use and ``allow()`` is answered in process from them, never over the cap
    (docs/redis.md, "Hot keys: leases"); :meth:`close` gives them back.
    Nothing is sent at construction: the first call (or :meth:`check`) connects.
    """

    _asyncio = False
    _other = "AsyncRedisTokenBucketLimiter for asyncio clients"
    _batching_default = False
    _shared_round_trips = GroupCommit

    def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """Refills the key's bucket and spends ``cost`` tokens if it holds that many.

        With ``batching=True``, a thread that finds another thread's round trip in
        flight waits, and its allow goes in the next one, with every other allow
        that arrived meanwhile (sent by the first of them: group commit). With
        ``lease``, the key's lease answers in process while it can (docs/redis.md,
        "Hot keys: leases")."""
        take = self._lease_take
        if take is not None:
            decision = take(key, cost)
            if decision is not None:
                return decision
            return run(self._lease_allow(key, cost), self._state)
        if self._shared is not None:
            return self._shared.allow(key, cost)  # type: ignore[no-any-return]
        return drivers.run_flowing(buckets.Allow(self._state, key, cost), self._state)  # type: ignore[no-any-return]

    def allow_many(self, requests: Iterable[tuple[str, SupportsIndex]]) -> list[Decision]:
        """``allow`` of every ``(key, cost)`` pair, in order, sharing round trips: one
        script for all of them (one per hash slot on a cluster), each decided as if
        sent alone, at one instant of the server. A key may come more than once:
        each pair sees the previous one's spending. Every pair is checked first
        (``TypeError``, ``ValueError``): a bad one sends nothing."""
        return allow_many(self._state, requests)

    def peek(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """What ``allow`` would answer now; writes nothing. With ``lease``: the key's
        lease's answer when it has one, else the shared bucket's."""
        leased = None if self._leases is None else self._leases.ledger.peek(key, cost)
        if leased is not None:
            return leased
        return run(buckets.decide(self._state, key, cost, peek=True), self._state)

    def refund(self, key: str, cost: SupportsIndex, *, degraded: bool = False) -> None:
        """Gives back ``cost`` tokens reserved but not used; never above capacity.
        ``degraded=True``: they were taken by an answer with ``degraded=True`` (given
        without the store), so they go back where the failure policy took them,
        this process's share under ``"local"``, and nowhere else: the store never had
        them, and giving them to it would admit more than the limit."""
        flow = buckets.give_back(self._state, key, self._state.cost(cost), degraded=_flag(degraded))
        run(flow, self._state)

    def reset(self, key: str) -> None:
        """Makes the key's bucket full again (deletes it)."""
        run(buckets.reset(self._state, key), self._state)

    def reserve(
        self, key: str, cost: SupportsIndex = 1, *, max_wait: float | None = None
    ) -> RedisReservation:
        """Takes ``cost`` tokens now, in debt if need be, in one script on the server's
        clock; ``delay`` says when they are yours. Refused at once, spending nothing,
        when the wait would exceed ``max_wait`` seconds (``None``: no limit but the
        debt bound, :attr:`max_debt`). FIFO across every process using the bucket
        (docs/redis.md)."""
        return self._reserve(key, cost, max_wait, "max_wait")

    def _reserve(self, key: str, cost: object, wait: object, name: str) -> RedisReservation:
        cost = self._state.cost(cost)
        reserved = run(buckets.reserve(self._state, key, cost, wait, name), self._state)
        return RedisReservation([(self, key, cost)], [(self._state, key, cost)], reserved)

    def acquire(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> Decision:
        """``reserve``, then sleeps this thread for its delay (the limiter's clock's
        ``sleep`` when it has one, else ``time.sleep``); refused at once beyond
        ``timeout``. An exception while sleeping gives the tokens back (one refund)
        before it propagates."""
        return self._reserve(key, cost, timeout, "timeout").wait()

    async def acquire_async(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> Decision:
        """``acquire`` for asyncio code holding this sync limiter (an async view or
        middleware given it): the reservation is one blocking round trip, as
        ``allow`` is from async code, then the delay is awaited (the clock's
        ``sleep_async`` when it has one, else ``asyncio.sleep``). No cancellation
        point lies between taking the tokens and holding them; a task cancelled
        while it waits gives them back (one refund, a blocking round trip too).
        An asyncio service should use :class:`AsyncRedisTokenBucketLimiter`."""
        return await self._reserve(key, cost, timeout, "timeout").wait_async()

    def charge(self, key: str, cost: SupportsIndex) -> Decision:
        """Records use that already happened: any cost >= 1, debt allowed down to
        :attr:`max_debt`, where it stops."""
        return run(buckets.charge(self._state, key, cost), self._state)

    def observe(
        self,
        key: str,
        remaining: SupportsIndex,
        *,
        limit: SupportsIndex | None = None,
        reset_after: float | None = None,
        retry_after: float | None = None,
        at: float | None = None,
    ) -> Decision:
        """:meth:`bucketlimit.TokenBucketLimiter.observe` in one script: the bucket
        holds at most what the upstream reported, never more than it did (``at``: a
        reading of the limiter's clock, ``time.monotonic()`` for the store's own).
        Without the store the report is not applied: the policy answers."""
        flow = buckets.observe(self._state, key, remaining, limit, reset_after, retry_after, at)
        return run(flow, self._state)

    def check(self) -> None:
        """Asks the store now: connects, authenticates, runs the script (a peek at a
        key no bucket uses, so nothing is written) and reads the server's version.

        Raises :class:`ConfigurationError` for what no retry will fix, and the
        client's error when the store cannot be reached: ``on_store_error`` does not
        apply. Call it at start-up to fail early; the limiter never calls it.
        """
        run(buckets.check(self._state), self._state)

    def close(self) -> None:
        """Gives back the leases this limiter holds (``lease``: one round trip a key),
        then closes the client :meth:`from_url` built for this limiter (a client you
        gave it stays yours to close). Also ``with limiter:``."""
        if self._leases is not None:
            run(leases.give_back_all(self._state, self._leases), self._state)
        if self._owned is not None and self._owned.built:
            self._state.land()  # the commands of other threads land first
            self._owned.get().close()

    def _give_back_at_exit(self) -> None:
        if self._leases is not None:
            run(leases.give_back_all(self._state, self._leases), self._state)

    def __enter__(self) -> RedisTokenBucketLimiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRedisTokenBucketLimiter(RedisLimiter[AsyncClient]):
    """:class:`RedisTokenBucketLimiter` for ``redis.asyncio`` and ``valkey.asyncio``
    clients (standalone or cluster): the methods that talk to Redis are coroutines.
    Same buckets, keys, answers and failure handling (the breaker and caches take
    no lock across an ``await``). ``batching=True`` (the default): allows asked
    while another of the same node's is on its way share the next round trip."""

    _asyncio = True
    _other = "RedisTokenBucketLimiter for blocking clients"
    _batching_default = True
    _shared_round_trips = Batcher

    async def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """:meth:`RedisTokenBucketLimiter.allow`, awaited.

        With ``batching=True`` (the default), an allow asked while another of this
        limiter's allows is on its way goes in the next round trip, with every
        other allow asked meanwhile: one script decides them all, each as if sent
        alone (docs/redis.md, "Shared round trips"). With ``lease``, the key's lease
        answers in process while it can; a refusal it gives (its lease waits its
        turn) still yields to the event loop once."""
        take = self._lease_take
        if take is not None:
            decision = take(key, cost)
            if decision is None:
                return await run_async(self._lease_allow(key, cost), self._state)
            if not decision.allowed:
                await asyncio.sleep(0)
            return decision
        if self._shared is not None:
            return await self._shared.allow(key, cost)  # type: ignore[no-any-return]
        return await drivers.run_flowing_async(buckets.Allow(self._state, key, cost), self._state)  # type: ignore[no-any-return]

    async def allow_many(self, requests: Iterable[tuple[str, SupportsIndex]]) -> list[Decision]:
        """:meth:`RedisTokenBucketLimiter.allow_many`, awaited (the nodes of a cluster
        side by side)."""
        return await allow_many_async(self._state, requests)

    async def peek(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """:meth:`RedisTokenBucketLimiter.peek`, awaited."""
        leased = None if self._leases is None else self._leases.ledger.peek(key, cost)
        if leased is not None:
            await asyncio.sleep(0)  # no I/O, still a yield
            return leased
        return await run_async(buckets.decide(self._state, key, cost, peek=True), self._state)

    async def refund(self, key: str, cost: SupportsIndex, *, degraded: bool = False) -> None:
        """:meth:`RedisTokenBucketLimiter.refund`, awaited."""
        flow = buckets.give_back(self._state, key, self._state.cost(cost), degraded=_flag(degraded))
        await run_async(flow, self._state)

    async def reset(self, key: str) -> None:
        """:meth:`RedisTokenBucketLimiter.reset`, awaited."""
        await run_async(buckets.reset(self._state, key), self._state)

    async def reserve(
        self, key: str, cost: SupportsIndex = 1, *, max_wait: float | None = None
    ) -> AsyncRedisReservation:
        """:meth:`RedisTokenBucketLimiter.reserve`, awaited; its ``wait``, ``cancel``
        and ``settle`` are coroutines. Cancelled while its script is on its way, it
        lets the reply land and then gives the tokens back (one refund)."""
        return await self._reserve(key, cost, max_wait, "max_wait")

    async def _reserve(
        self, key: str, cost: object, wait: object, name: str
    ) -> AsyncRedisReservation:
        cost = self._state.cost(cost)
        flow = buckets.reserve(self._state, key, cost, wait, name)
        return await _shielded(flow, [(self, key, cost)], [(self._state, key, cost)])

    async def acquire(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> Decision:
        """:meth:`RedisTokenBucketLimiter.acquire` for asyncio: awaits the delay (the
        clock's ``sleep_async`` when it has one, else ``asyncio.sleep``); a task
        cancelled while it waits gives its tokens back (one refund, shielded from a
        second cancellation). Cancelled while the reservation itself is on its way,
        it lets the reply land and then gives the tokens back."""
        return await (await self._reserve(key, cost, timeout, "timeout")).wait()

    async def charge(self, key: str, cost: SupportsIndex) -> Decision:
        """:meth:`RedisTokenBucketLimiter.charge`, awaited."""
        return await run_async(buckets.charge(self._state, key, cost), self._state)

    async def observe(
        self,
        key: str,
        remaining: SupportsIndex,
        *,
        limit: SupportsIndex | None = None,
        reset_after: float | None = None,
        retry_after: float | None = None,
        at: float | None = None,
    ) -> Decision:
        """:meth:`RedisTokenBucketLimiter.observe`, awaited."""
        flow = buckets.observe(self._state, key, remaining, limit, reset_after, retry_after, at)
        return await run_async(flow, self._state)

    async def check(self) -> None:
        """:meth:`RedisTokenBucketLimiter.check`, awaited."""
        await run_async(buckets.check(self._state), self._state)

    async def aclose(self) -> None:
        """Gives back the leases this limiter holds (``lease``: one round trip a key),
        then closes the client :meth:`from_url` built for this limiter (a client you
        gave it stays yours to close). Also ``async with limiter:``."""
        if self._leases is not None:
            await run_async(leases.give_back_all(self._state, self._leases), self._state)
        if self._owned is not None and self._owned.built:
            await self._state.land_async()  # the commands of other tasks land first
            await closed_async(self._owned.get())

    def _give_back_at_exit(self) -> None:
        # No event loop runs at exit: the give-backs get one of their own. An asyncio
        # client bound to a closed loop may not reconnect; its leases then expire.
        if self._leases is not None:
            flow = leases.give_back_all(self._state, self._leases)
            asyncio.run(run_async(flow, self._state))

    async def __aenter__(self) -> AsyncRedisTokenBucketLimiter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _flag(degraded: object) -> bool:
    if not isinstance(degraded, bool):
        raise TypeError(f"degraded must be a bool, got {type(degraded).__name__}")
    return degraded


async def _shielded(
    flow: flows.Flow[Reserved], checks: list[tuple[Any, str, int]], parts: list[Part]
) -> AsyncRedisReservation:
    """An asyncio reservation's round trip, cancel-safe: a waiter cancelled while its
    script may already have run lets the reply land and then gives the tokens back
    (one refund), instead of losing them with the reply."""

    async def undo(reserved: Reserved) -> None:
        await AsyncRedisReservation(checks, parts, reserved).cancel()

    return AsyncRedisReservation(checks, parts, await run_async(flow, parts[0][0], undo=undo))


def allow_all(checks: Iterable[tuple[Any, ...]], cost: SupportsIndex = 1) -> Any:
    """``bucketlimit.allow_all`` for Redis limiters sharing one client: one script
    that checks every bucket before it spends from any. A check is ``(limiter, key)``
    (charged ``cost``) or ``(limiter, key, cost)``. With a
    :class:`RedisConcurrencyLimiter` among them (``(conc, key)``: one permit, taken
    only if free now), the same script takes the permits, all or nothing, and the
    answer is the :class:`RedisReservation` holding them (its ``cancel()`` /
    ``settle(used)`` release them)."""
    return concurrency.allow_all(_SYNC, list(checks), cost, ALLOW, None)


async def allow_all_async(checks: Iterable[tuple[Any, ...]], cost: SupportsIndex = 1) -> Any:
    """:func:`allow_all` for :class:`AsyncRedisTokenBucketLimiter` (and
    :class:`AsyncRedisConcurrencyLimiter`) instances."""
    return await concurrency.allow_all_async(_ASYNC, list(checks), cost, ALLOW, None)


def reserve_all(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
    _name: str = "max_wait",
) -> RedisReservation:
    """``bucketlimit.reserve_all`` for Redis limiters sharing one client: one script
    reserves every check's cost at the same moment, all or nothing (every bucket is
    checked before any is written); the delay is the longest. A concurrency check
    takes its permit in the same script if it is free now (a reservation never
    queues for one), living ``ttl`` from when the tokens are ready."""
    return concurrency.allow_all(_SYNC, list(checks), cost, RESERVE, max_wait, _name)  # type: ignore[no-any-return]


async def reserve_all_async(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
    _name: str = "max_wait",
) -> AsyncRedisReservation:
    """:func:`reserve_all` for :class:`AsyncRedisTokenBucketLimiter` (and
    :class:`AsyncRedisConcurrencyLimiter`) instances; cancelled while its script is
    on its way, it gives the tokens back once the reply lands."""
    return await concurrency.allow_all_async(_ASYNC, list(checks), cost, RESERVE, max_wait, _name)  # type: ignore[no-any-return]


def acquire_all(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Any:
    """:func:`reserve_all`, then sleeps for its delay on the first limiter's clock;
    refused at once beyond ``timeout``. With concurrency checks it first waits for
    their permits (FIFO each, taken in the order of their Redis keys, each held
    while it waits for the next), then for the tokens, and answers the
    :class:`RedisReservation` holding the permits; with nothing to wait for it is
    one script."""
    checks = list(checks)
    if concurrency.has_permits(checks):
        return concurrency.acquire_all(_SYNC, checks, cost, timeout)
    return reserve_all(checks, cost, max_wait=timeout, _name="timeout").wait()


async def acquire_all_async(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Any:
    """:func:`acquire_all` for :class:`AsyncRedisTokenBucketLimiter` (and
    :class:`AsyncRedisConcurrencyLimiter`) instances; with concurrency checks it
    answers the :class:`AsyncRedisReservation` holding the permits, cancel-safe."""
    checks = list(checks)
    if concurrency.has_permits(checks):
        return await concurrency.acquire_all_async(_ASYNC, checks, cost, timeout)
    reservation = await reserve_all_async(checks, cost, max_wait=timeout, _name="timeout")
    return await reservation.wait()


class _Backend:
    """The ``bucketlimit.allow_all`` family over Redis limiters of one kind (sync or
    asyncio), registered with ``bucketlimit._checks`` for their class."""

    def __init__(self, kind: str, *, asyncio: bool) -> None:
        self.kind = kind
        self._asyncio = asyncio

    def allow_all(self, checks: Iterable[Any], cost: Any) -> Any:
        return (allow_all_async if self._asyncio else allow_all)(checks, cost)

    def reserve_all(self, checks: Iterable[Any], cost: Any, max_wait: Any) -> Any:
        return (reserve_all_async if self._asyncio else reserve_all)(
            checks, cost, max_wait=max_wait
        )

    def acquire_all(self, checks: Iterable[Any], cost: Any, timeout: Any) -> Any:
        if self._asyncio:
            raise TypeError(
                "acquire_all blocks the thread: over AsyncRedisTokenBucketLimiter "
                "instances use acquire_all_async"
            )
        return acquire_all(checks, cost, timeout=timeout)

    def acquire_all_async(self, checks: Iterable[Any], cost: Any, timeout: Any) -> Any:
        if not self._asyncio:
            raise TypeError(
                "acquire_all_async takes AsyncRedisTokenBucketLimiter instances "
                "(over RedisTokenBucketLimiter instances use acquire_all)"
            )
        return acquire_all_async(checks, cost, timeout=timeout)


_SYNC = concurrency.CallClasses(
    RedisTokenBucketLimiter, RedisConcurrencyLimiter, RedisReservation, RedisPermit
)
_ASYNC = concurrency.CallClasses(
    AsyncRedisTokenBucketLimiter,
    AsyncRedisConcurrencyLimiter,
    AsyncRedisReservation,
    AsyncRedisPermit,
)
for _kind_of, _backend in (
    ((RedisTokenBucketLimiter, RedisConcurrencyLimiter), _Backend("Redis", asyncio=False)),
    (
        (AsyncRedisTokenBucketLimiter, AsyncRedisConcurrencyLimiter),
        _Backend("asyncio Redis", asyncio=True),
    ),
):
    for _cls in _kind_of:
        _checks.register(_cls, _backend)
