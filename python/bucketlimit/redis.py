"""Token buckets shared through Redis (docs/design.md §6): the in-process limiter's answers.

    from bucketlimit.redis import RedisTokenBucketLimiter

    limiter = RedisTokenBucketLimiter.from_url("redis://localhost:6379/0", 10, 2)
    if not limiter.allow("user-42"):
        ...  # 429

The arithmetic of docs/design.md §4 runs inside Redis as one Lua script, one atomic
step per call, so processes never race on a read-modify-write. The script reads the
server's ``TIME``, so processes with skewed clocks agree; a ``clock`` given to the
limiter is sent to the script instead (tests, single-clock setups).

The two classes here only talk to the client: every operation is written once,
free of I/O, in ``bucketlimit._redis.limiter`` (validation, keys, the script and
its arguments, the refusal cache, the breaker, the failure policy, the answer,
counting), as steps that leave a call pending on a command, which
:class:`RedisTokenBucketLimiter` sends with a blocking call and
:class:`AsyncRedisTokenBucketLimiter` awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, SupportsIndex

from bucketlimit._core import Decision
from bucketlimit._redis.errors import (
    ConfigurationError,
    CorruptBucketError,
    StoreUnavailableError,
)
from bucketlimit._redis.limiter import DEFAULT_TIMEOUT, PENDING, Call, RedisLimiter, allow_all_call
from bucketlimit._redis.resilience import Policy
from bucketlimit._redis.script import ALLOW, PEEK, REFUND
from bucketlimit._redis.script import Script as _Script

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncRedisTokenBucketLimiter",
    "ConfigurationError",
    "CorruptBucketError",
    "Policy",
    "RedisTokenBucketLimiter",
    "StoreUnavailableError",
    "_Script",
    "allow_all",
    "allow_all_async",
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

    ``client`` is a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (redis-py), or
    a ``valkey.Valkey`` or ``valkey.cluster.ValkeyCluster`` (valkey-py), as you built
    it (timeouts, TLS, pool); turn its retries off (see docs/redis.md: a retried
    timeout can charge twice) or use :meth:`from_url`. ``capacity``, ``rate``,
    ``clock`` and ``per`` mean what they mean for
    :class:`bucketlimit.TokenBucketLimiter`; ``clock=None`` uses the server's time.
    ``prefix`` starts every key (no braces); ``hash_tag(key) -> str`` picks the
    Redis Cluster hash tag of a key (default: the key itself).

    When the store fails: ``on_store_error`` is ``"local"`` (this process's share of
    each bucket, with ``processes`` processes sharing the limit), ``"open"``,
    ``"closed"`` or ``"raise"``; the store is then skipped for ``retry_interval``
    seconds (0: never skipped). ``refusal_cache=False`` asks the store about every
    call of a refused key. Nothing is sent at construction: the first call (or
    :meth:`check`) connects.
    """

    _asyncio = False
    _other = "AsyncRedisTokenBucketLimiter for asyncio clients"

    def _drive(self, call: Call) -> Any:
        """Runs a call: sends each command it waits on and hands it the outcome."""
        answer = self._start(call)
        while answer is PENDING:
            try:
                client = self._client if self._client is not None else self._connect()
                reply = getattr(client, call.name)(*call.argv)
            except BaseException as error:  # the call decides what a failure means
                answer = self._error(call, error)
            else:
                answer = self._reply(call, reply)
        return answer

    def _discard(self, client: SyncClient) -> None:
        client.close()

    def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """Refills the key's bucket and spends ``cost`` tokens if it holds that many."""
        answer: Decision = self._drive(self._call(ALLOW, key, cost))
        return answer

    def peek(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """What ``allow`` would answer now; writes nothing."""
        answer: Decision = self._drive(self._call(PEEK, key, cost))
        return answer

    def refund(self, key: str, cost: SupportsIndex) -> None:
        """Gives back ``cost`` tokens reserved but not used; never above capacity."""
        self._drive(self._call(REFUND, key, cost))

    def reset(self, key: str) -> None:
        """Makes the key's bucket full again (deletes it)."""
        self._drive(self._reset_call(key))

    def check(self) -> None:
        """Asks the store now: connects, authenticates, runs the script (a peek at a
        key no bucket uses, so nothing is written) and reads the server's version.

        Raises :class:`ConfigurationError` for what no retry will fix, and the
        client's error when the store cannot be reached: ``on_store_error`` does not
        apply. Call it at start-up to fail early; the limiter never calls it.
        """
        self._drive(self._check_call())


class AsyncRedisTokenBucketLimiter(RedisLimiter[AsyncClient]):
    """:class:`RedisTokenBucketLimiter` for ``redis.asyncio`` and ``valkey.asyncio``
    clients (standalone or cluster): the methods
    that talk to Redis are coroutines. Same buckets, keys, answers and failure
    handling (the breaker and caches take no lock across an ``await``)."""

    _asyncio = True
    _other = "RedisTokenBucketLimiter for blocking clients"

    async def _drive(self, call: Call) -> Any:
        """Runs a call: awaits each command it waits on and hands it the outcome.

        An answer given without any command (a cached refusal, the policy while the
        breaker skips the store) still yields to the event loop once, so a task
        calling a degraded limiter in a loop cannot starve the other tasks.
        """
        answer = self._start(call)
        if answer is not PENDING:
            await asyncio.sleep(0)
            return answer
        while answer is PENDING:
            try:
                client = self._client if self._client is not None else self._connect()
                reply = await getattr(client, call.name)(*call.argv)
            except BaseException as error:  # CancelledError too: the call counts it
                answer = self._error(call, error)
            else:
                answer = self._reply(call, reply)
        return answer

    async def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """:meth:`RedisTokenBucketLimiter.allow`, awaited."""
        answer: Decision = await self._drive(self._call(ALLOW, key, cost))
        return answer

    async def peek(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """:meth:`RedisTokenBucketLimiter.peek`, awaited."""
        answer: Decision = await self._drive(self._call(PEEK, key, cost))
        return answer

    async def refund(self, key: str, cost: SupportsIndex) -> None:
        """:meth:`RedisTokenBucketLimiter.refund`, awaited."""
        await self._drive(self._call(REFUND, key, cost))

    async def reset(self, key: str) -> None:
        """:meth:`RedisTokenBucketLimiter.reset`, awaited."""
        await self._drive(self._reset_call(key))

    async def check(self) -> None:
        """:meth:`RedisTokenBucketLimiter.check`, awaited."""
        await self._drive(self._check_call())


def allow_all(
    checks: Iterable[tuple[RedisTokenBucketLimiter, str]], cost: SupportsIndex = 1
) -> Decision:
    """``bucketlimit.allow_all`` for Redis limiters sharing one client: one script
    that checks every bucket before it spends from any."""
    limiter, call = allow_all_call(checks, cost)
    if not isinstance(limiter, RedisTokenBucketLimiter):
        raise TypeError("allow_all takes RedisTokenBucketLimiter instances here")
    answer: Decision = limiter._drive(call)
    return answer


async def allow_all_async(
    checks: Iterable[tuple[AsyncRedisTokenBucketLimiter, str]], cost: SupportsIndex = 1
) -> Decision:
    """:func:`allow_all` for :class:`AsyncRedisTokenBucketLimiter` instances."""
    limiter, call = allow_all_call(checks, cost)
    if not isinstance(limiter, AsyncRedisTokenBucketLimiter):
        raise TypeError("allow_all_async takes AsyncRedisTokenBucketLimiter instances")
    answer: Decision = await limiter._drive(call)
    return answer


def _route_allow_all(checks: list[Any], cost: object) -> Any:
    """For ``bucketlimit.allow_all``: the Redis answer (a coroutine for asyncio
    limiters), or ``None`` when no Redis limiter is named."""
    kinds: set[str | None] = set()
    for item in checks:
        try:
            limiter, _ = item
        except (TypeError, ValueError):
            limiter = None  # not a pair: the core says so
        if isinstance(limiter, RedisTokenBucketLimiter):
            kinds.add("redis")
        elif isinstance(limiter, AsyncRedisTokenBucketLimiter):
            kinds.add("asyncio redis")
        else:
            kinds.add(None)
    if kinds == {"redis"}:
        return allow_all(checks, cost)  # type: ignore[arg-type]  # cost is checked inside
    if kinds == {"asyncio redis"}:
        return allow_all_async(checks, cost)  # type: ignore[arg-type]
    if kinds <= {None}:
        return None
    raise TypeError(
        "allow_all cannot mix in-process, Redis and asyncio Redis limiters: each kind "
        "keeps its buckets elsewhere, so no single step can check them all"
    )
