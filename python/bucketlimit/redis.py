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
"Waiting your turn").

The two classes here only talk to the client: every operation is written once,
free of I/O, in ``bucketlimit._redis.limiter`` (validation, keys, the script and
its arguments, the refusal cache, the breaker, the failure policy, the answer,
counting), as steps that leave a call pending on a command, which
:class:`RedisTokenBucketLimiter` sends with a blocking call and
:class:`AsyncRedisTokenBucketLimiter` awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

from bucketlimit._core import Decision
from bucketlimit._redis.errors import (
    ConfigurationError,
    CorruptBucketError,
    ExactRangeError,
    StoreUnavailableError,
)
from bucketlimit._redis.limiter import (
    DEFAULT_TIMEOUT,
    PENDING,
    Batch,
    Call,
    Outcome,
    RedisLimiter,
    ReservationState,
    Waiter,
    all_call,
    allow_all_call,
)
from bucketlimit._redis.resilience import Policy
from bucketlimit._redis.script import ALLOW, PEEK, REFUND, RESERVE
from bucketlimit._redis.script import Script as _Script

logger = logging.getLogger("bucketlimit")

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncRedisReservation",
    "AsyncRedisTokenBucketLimiter",
    "ConfigurationError",
    "CorruptBucketError",
    "ExactRangeError",
    "Policy",
    "RedisReservation",
    "RedisTokenBucketLimiter",
    "StoreUnavailableError",
    "_Script",
    "acquire_all",
    "acquire_all_async",
    "allow_all",
    "allow_all_async",
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
    _batching_default = False

    @staticmethod
    def _wake_event() -> threading.Event:
        """What a waiting allow waits on (a method so that a test may swap it)."""
        return threading.Event()

    def _drive(self, call: Call) -> Any:
        """Runs a call: sends each command it waits on and hands it the outcome."""
        answer = self._start(call)
        if answer is PENDING:
            answer = self._send(call)
        return answer

    def _send(self, call: Call) -> Any:
        answer: Any = PENDING
        while answer is PENDING:
            try:
                client = self._client if self._client is not None else self._connect()
                reply = getattr(client, call.name)(*call.argv)
            except BaseException as error:  # the call decides what a failure means
                answer = self._error(call, error)
            else:
                answer = self._reply(call, reply)
        return answer

    def _send_batch(self, batch: Batch) -> list[Outcome]:
        """Sends a batch's command (once more after NOSCRIPT) and splits its reply."""
        outcomes: Any = PENDING
        while outcomes is PENDING:
            try:
                client = self._client if self._client is not None else self._connect()
                reply = getattr(client, batch.name)(*batch.argv)
            except BaseException as error:
                outcomes = self._batch_error(batch, error)
            else:
                outcomes = self._batch_reply(batch, reply)
        return cast("list[Outcome]", outcomes)

    def _discard(self, client: SyncClient) -> None:
        client.close()

    def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """Refills the key's bucket and spends ``cost`` tokens if it holds that many.

        With ``batching=True``, a thread that finds another thread's round trip in
        flight waits, and its allow goes in the next one, with every other allow
        that arrived meanwhile (sent by the first of them: group commit)."""
        call = self._call(ALLOW, key, cost)
        if not self._batching:
            answer: Decision = self._drive(call)
            return answer
        started = self._start(call)
        if started is not PENDING:
            return cast("Decision", started)
        waiter = self._join(call, self._wake_event)
        if waiter is None:
            try:
                answer = self._send(call)
            finally:
                self._hand_over()
            return answer
        try:
            waiter.wake.wait()
        except BaseException:
            # Interrupted (KeyboardInterrupt): this allow is not sent; but if this
            # thread was just made the one to send the next round trip, it sends it
            # for the others first, so that no thread waits for ever.
            with self._queue_lock:
                waiter.gone = True
                leading = waiter.lead
            if leading is not None:
                try:
                    self._fly(leading)
                finally:
                    self._hand_over()
            raise
        if waiter.lead is not None:  # this thread sends the next round trip
            try:
                self._fly(waiter.lead)
            finally:
                self._hand_over()
        return cast("Decision", waiter.result())

    def _hand_over(self) -> None:
        """A round trip of allows landed: the first waiter still there sends the next
        one (when every waiter was interrupted, their allows are dropped)."""
        while (waiters := self._landed()) is not None:
            with self._queue_lock:
                lead = next((waiter for waiter in waiters if not waiter.gone), None)
                if lead is not None:
                    lead.lead = waiters
            if lead is not None:
                lead.wake.set()
                return
            for waiter in waiters:
                self._dropped(waiter.call)

    def _fly(self, waiters: list[Waiter]) -> None:
        """One shared round trip per batch; every waiter gets its outcome (one
        interrupted while it waited is dropped, not sent)."""
        outcomes: dict[int, Outcome] = {}
        try:
            live = []
            for waiter in waiters:
                if waiter.gone:
                    self._dropped(waiter.call)
                else:
                    live.append(waiter)
            for runs in self._batches([waiter.call for waiter in live]):
                for batch in runs:
                    for call, outcome in zip(batch.calls, self._send_batch(batch), strict=True):
                        outcomes[id(call)] = outcome
        finally:
            for waiter in waiters:
                waiter.outcome = outcomes.get(id(waiter.call), _NOT_SENT)
                if waiter.lead is None:
                    waiter.wake.set()

    def allow_many(self, requests: Iterable[tuple[str, SupportsIndex]]) -> list[Decision]:
        """``allow`` of every ``(key, cost)`` pair, in order, sharing round trips: one
        script for all of them (one per hash slot on a cluster), each decided as if
        sent alone, at one instant of the server. A key may come more than once:
        each pair sees the previous one's spending. Every pair is checked first
        (``TypeError``, ``ValueError``): a bad one sends nothing."""
        calls = self._many_calls(requests)
        answers = [self._start(call) for call in calls]
        pending = [call for call, answer in zip(calls, answers, strict=True) if answer is PENDING]
        outcomes: dict[int, Outcome] = {}
        for runs in self._batches(pending):
            for batch in runs:
                for call, outcome in zip(batch.calls, self._send_batch(batch), strict=True):
                    outcomes[id(call)] = outcome
        return _many_answers(calls, answers, outcomes)

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

    def reserve(
        self, key: str, cost: SupportsIndex = 1, *, max_wait: float | None = None
    ) -> RedisReservation:
        """Takes ``cost`` tokens now, in debt if need be, in one script on the server's
        clock; ``delay`` says when they are yours. Refused at once, spending nothing,
        when the wait would exceed ``max_wait`` seconds (``None``: no limit but the
        debt bound). FIFO across every process using the bucket (docs/redis.md)."""
        return self._reserve(key, cost, max_wait, "max_wait")

    def _reserve(self, key: str, cost: object, wait: object, name: str) -> RedisReservation:
        call = self._reserve_call(key, cost, wait, name)
        return RedisReservation([(self, key, call.cost)], self._drive(call))

    def acquire(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> Decision:
        """``reserve``, then sleeps this thread for its delay (the limiter's clock's
        ``sleep`` when it has one, else ``time.sleep``); refused at once beyond
        ``timeout``. An exception while sleeping gives the tokens back (one refund)
        before it propagates."""
        return _waited(self._reserve(key, cost, timeout, "timeout")).decision

    def _acquire_reservation(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> RedisReservation:
        """``acquire``, answering with the reservation (granted or refused), for
        callers that settle it later: the web adapters' ``max_wait``."""
        return _waited(self._reserve(key, cost, timeout, "timeout"))

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
        return (await self._acquire_reservation_async(key, cost, timeout=timeout)).decision

    async def _acquire_reservation_async(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> RedisReservation:
        """``acquire_async``, answering with the reservation (see
        ``_acquire_reservation``)."""
        reservation = self._reserve(key, cost, timeout, "timeout")
        if reservation and reservation.delay > 0:
            sleep = getattr(self._clock, "sleep_async", None)
            try:
                await (sleep if callable(sleep) else asyncio.sleep)(reservation.delay)
            except BaseException:
                _cancel_or_log(reservation)
                raise
        return reservation

    def charge(self, key: str, cost: SupportsIndex) -> Decision:
        """Records use that already happened: any cost >= 1, debt allowed."""
        answer: Decision = self._drive(self._charge_call(key, cost))
        return answer

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
    _batching_default = True

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
        return await self._send(call)

    async def _send(self, call: Call) -> Any:
        answer: Any = PENDING
        while answer is PENDING:
            try:
                client = self._client if self._client is not None else self._connect()
                reply = await getattr(client, call.name)(*call.argv)
            except BaseException as error:  # CancelledError too: the call counts it
                answer = self._error(call, error)
            else:
                answer = self._reply(call, reply)
        return answer

    async def _send_batch(self, batch: Batch) -> list[Outcome]:
        """:meth:`RedisTokenBucketLimiter._send_batch`, awaited."""
        outcomes: Any = PENDING
        while outcomes is PENDING:
            try:
                client = self._client if self._client is not None else self._connect()
                reply = await getattr(client, batch.name)(*batch.argv)
            except BaseException as error:
                outcomes = self._batch_error(batch, error)
            else:
                outcomes = self._batch_reply(batch, reply)
        return cast("list[Outcome]", outcomes)

    async def _send_runs(self, runs: list[Batch]) -> dict[int, Outcome]:
        """The batches of one hash slot, one after the other (arrival order)."""
        outcomes: dict[int, Outcome] = {}
        for batch in runs:
            for call, outcome in zip(batch.calls, await self._send_batch(batch), strict=True):
                outcomes[id(call)] = outcome
        return outcomes

    async def _send_all(self, calls: list[Call]) -> dict[int, Outcome]:
        """Every pending allow in shared round trips: the hash slots side by side."""
        outcomes: dict[int, Outcome] = {}
        slots = self._batches(calls)
        if len(slots) == 1:
            return await self._send_runs(slots[0])
        for part in await asyncio.gather(*(self._send_runs(runs) for runs in slots)):
            outcomes.update(part)
        return outcomes

    async def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """:meth:`RedisTokenBucketLimiter.allow`, awaited.

        With ``batching=True`` (the default), an allow asked while another of this
        limiter's allows is on its way goes in the next round trip, with every
        other allow asked meanwhile: one script decides them all, each as if sent
        alone (docs/redis.md, "Shared round trips")."""
        call = self._call(ALLOW, key, cost)
        if not self._batching:
            answer: Decision = await self._drive(call)
            return answer
        started = self._start(call)
        if started is not PENDING:
            await asyncio.sleep(0)
            return cast("Decision", started)
        waiter = self._join(call, asyncio.get_running_loop().create_future)
        if waiter is None:
            try:
                answer = await self._send(call)
            finally:
                self._next_flight()
            return answer
        await waiter.wake  # cancelled before it is sent: _fly drops it
        return cast("Decision", waiter.result())

    def _next_flight(self) -> None:
        """A round trip of allows landed: the next one, for every waiter, in a task of
        its own (no waiter's cancellation can stop it)."""
        waiters = self._landed()
        if waiters is not None:
            flight = asyncio.ensure_future(self._fly(waiters))
            _FLIGHTS.add(flight)
            flight.add_done_callback(_FLIGHTS.discard)

    async def _fly(self, waiters: list[Waiter]) -> None:
        outcomes: dict[int, Outcome] = {}
        try:
            live = []
            for waiter in waiters:
                if waiter.wake.done():  # cancelled while it waited: never sent
                    self._dropped(waiter.call)
                else:
                    live.append(waiter)
            outcomes = await self._send_all([waiter.call for waiter in live])
        finally:
            for waiter in waiters:
                waiter.outcome = outcomes.get(id(waiter.call), _NOT_SENT)
                if not waiter.wake.done():
                    waiter.wake.set_result(None)
            self._next_flight()

    async def allow_many(self, requests: Iterable[tuple[str, SupportsIndex]]) -> list[Decision]:
        """:meth:`RedisTokenBucketLimiter.allow_many`, awaited (the hash slots of a
        cluster side by side)."""
        calls = self._many_calls(requests)
        answers = [self._start(call) for call in calls]
        pending = [call for call, answer in zip(calls, answers, strict=True) if answer is PENDING]
        if not pending:
            await asyncio.sleep(0)
        outcomes = await self._send_all(pending) if pending else {}
        return _many_answers(calls, answers, outcomes)

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

    async def reserve(
        self, key: str, cost: SupportsIndex = 1, *, max_wait: float | None = None
    ) -> AsyncRedisReservation:
        """:meth:`RedisTokenBucketLimiter.reserve`, awaited; its ``cancel`` and
        ``settle`` are coroutines. Cancelled while its script is on its way, it
        lets the reply land and then gives the tokens back (one refund)."""
        call = self._reserve_call(key, cost, max_wait)
        return await _shielded(self._reserved(key, call))

    async def _reserved(self, key: str, call: Call) -> AsyncRedisReservation:
        return AsyncRedisReservation([(self, key, call.cost)], await self._drive(call))

    async def acquire(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> Decision:
        """:meth:`RedisTokenBucketLimiter.acquire` for asyncio: awaits the delay (the
        clock's ``sleep_async`` when it has one, else ``asyncio.sleep``); a task
        cancelled while it waits gives its tokens back (one refund, shielded from a
        second cancellation). Cancelled while the reservation itself is on its way,
        it lets the reply land and then gives the tokens back."""
        call = self._reserve_call(key, cost, timeout, "timeout")
        return (await _waited_async(await _shielded(self._reserved(key, call)))).decision

    async def _acquire_reservation_async(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> AsyncRedisReservation:
        """``acquire``, answering with the reservation (granted or refused), for
        callers that settle it later: the web adapters' ``max_wait``."""
        call = self._reserve_call(key, cost, timeout, "timeout")
        return await _waited_async(await _shielded(self._reserved(key, call)))

    async def charge(self, key: str, cost: SupportsIndex) -> Decision:
        """:meth:`RedisTokenBucketLimiter.charge`, awaited."""
        answer: Decision = await self._drive(self._charge_call(key, cost))
        return answer

    async def check(self) -> None:
        """:meth:`RedisTokenBucketLimiter.check`, awaited."""
        await self._drive(self._check_call())


#: A waiter's outcome when its round trip never happened (an error of the driver).
_NOT_SENT: Outcome = (None, StoreUnavailableError("the shared round trip was not sent"))

# Shared round trips in flight: held until they land (the event loop keeps only
# weak references to tasks).
_FLIGHTS: set[asyncio.Future[None]] = set()


def _many_answers(
    calls: list[Call], answers: list[Any], outcomes: dict[int, Outcome]
) -> list[Decision]:
    """allow_many's decisions in order; the first call whose policy raises raises."""
    decisions: list[Decision] = []
    for call, answer in zip(calls, answers, strict=True):
        if answer is PENDING:
            answer, error = outcomes[id(call)]
            if error is not None:
                raise error
        decisions.append(answer)
    return decisions


class RedisReservation(ReservationState):
    """Tokens taken from one or more Redis buckets; truthy when granted. Use them
    after ``delay`` seconds; ``cancel()`` gives them back, ``settle(used)`` turns the
    estimate into the actual use (each sends one script, once)."""

    __slots__ = ()

    def cancel(self) -> None:
        """Gives every token back (capped at capacity, and at what the buckets may
        take back: docs/design.md §4). Once; nothing for a refusal."""
        for limiter, call in self._cancel_calls():
            cast("RedisTokenBucketLimiter", limiter)._drive(call)

    def settle(self, used: SupportsIndex | Sequence[SupportsIndex]) -> None:
        """The actual use: gives back ``cost - used``, or charges ``used - cost`` more.
        One ``used`` for every bucket, or a sequence with one per bucket. Once."""
        for limiter, call in self._settle_calls(used):
            cast("RedisTokenBucketLimiter", limiter)._drive(call)


class AsyncRedisReservation(ReservationState):
    """:class:`RedisReservation` of the asyncio limiters: ``cancel`` and ``settle``
    are coroutines."""

    __slots__ = ()

    async def cancel(self) -> None:
        """:meth:`RedisReservation.cancel`, awaited."""
        for limiter, call in self._cancel_calls():
            await cast("AsyncRedisTokenBucketLimiter", limiter)._drive(call)

    async def settle(self, used: SupportsIndex | Sequence[SupportsIndex]) -> None:
        """:meth:`RedisReservation.settle`, awaited."""
        for limiter, call in self._settle_calls(used):
            await cast("AsyncRedisTokenBucketLimiter", limiter)._drive(call)


def _waited(reservation: RedisReservation) -> RedisReservation:
    """Sleeps until a granted reservation's tokens are there; an exception while it
    sleeps gives them back (one refund) before it propagates."""
    if reservation and reservation.delay > 0:
        limiter = reservation.checks[0][0]
        sleep = getattr(limiter._clock, "sleep", None)
        try:
            (sleep if callable(sleep) else time.sleep)(reservation.delay)
        except BaseException:
            _cancel_or_log(reservation)
            raise
    return reservation


def _cancel_or_log(reservation: RedisReservation) -> None:
    """A waiter's one refund; its failure is counted and logged as a lost refund,
    and the waiter's own error goes on."""
    try:
        reservation.cancel()
    except Exception:
        logger.debug("a waiter's refund failed", exc_info=True)


async def _waited_async(reservation: AsyncRedisReservation) -> AsyncRedisReservation:
    """:func:`_waited` for asyncio: a task cancelled while it waits sends its refund in
    a task of its own, shielded, so that a second cancellation cannot lose it."""
    if reservation and reservation.delay > 0:
        limiter = reservation.checks[0][0]
        sleep = getattr(limiter._clock, "sleep_async", None)
        try:
            await (sleep if callable(sleep) else asyncio.sleep)(reservation.delay)
        except BaseException:
            refund = asyncio.ensure_future(_cancel_quietly(reservation))
            # Cancelled again while it is sent: the refund goes on without us.
            with contextlib.suppress(BaseException):
                await asyncio.shield(refund)
            raise
    return reservation


# Refunds sent after their waiter was cancelled: held until they end (the event
# loop keeps only weak references to tasks).
_REFUNDS: set[asyncio.Future[None]] = set()


async def _shielded(reserving: Coroutine[Any, Any, AsyncRedisReservation]) -> AsyncRedisReservation:
    """Awaits a reservation's round trip shielded from cancellation: a waiter
    cancelled while its script may already have run lets the reply land and then
    gives the tokens back (one refund), instead of losing them with the reply."""
    task = asyncio.ensure_future(reserving)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_give_back_when_done)
        raise


def _give_back_when_done(task: asyncio.Future[AsyncRedisReservation]) -> None:
    if task.cancelled() or task.exception() is not None:
        return  # nothing was reserved, or the failure was answered and counted
    reservation = task.result()
    if reservation:
        refund = asyncio.ensure_future(_cancel_quietly(reservation))
        _REFUNDS.add(refund)
        refund.add_done_callback(_REFUNDS.discard)


async def _cancel_quietly(reservation: AsyncRedisReservation) -> None:
    try:
        await reservation.cancel()
    except Exception:  # counted and logged as a lost refund
        logger.debug("a waiter's refund failed", exc_info=True)


def allow_all(checks: Iterable[tuple[Any, ...]], cost: SupportsIndex = 1) -> Decision:
    """``bucketlimit.allow_all`` for Redis limiters sharing one client: one script
    that checks every bucket before it spends from any. A check is ``(limiter, key)``
    (charged ``cost``) or ``(limiter, key, cost)``."""
    limiter, call = allow_all_call(checks, cost)
    if not isinstance(limiter, RedisTokenBucketLimiter):
        raise TypeError("allow_all takes RedisTokenBucketLimiter instances here")
    answer: Decision = limiter._drive(call)
    return answer


async def allow_all_async(checks: Iterable[tuple[Any, ...]], cost: SupportsIndex = 1) -> Decision:
    """:func:`allow_all` for :class:`AsyncRedisTokenBucketLimiter` instances."""
    limiter, call = allow_all_call(checks, cost)
    if not isinstance(limiter, AsyncRedisTokenBucketLimiter):
        raise TypeError("allow_all_async takes AsyncRedisTokenBucketLimiter instances")
    answer: Decision = await limiter._drive(call)
    return answer


def reserve_all(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
    _name: str = "max_wait",
) -> RedisReservation:
    """``bucketlimit.reserve_all`` for Redis limiters sharing one client: one script
    reserves every check's cost at the same moment, all or nothing (every bucket is
    checked before any is written); the delay is the longest."""
    limiter, call = all_call(checks, cost, RESERVE, max_wait, what="reserve_all", name=_name)
    if not isinstance(limiter, RedisTokenBucketLimiter):
        raise TypeError("reserve_all takes RedisTokenBucketLimiter instances here")
    assert call.checks is not None
    return RedisReservation(call.checks, limiter._drive(call))


async def reserve_all_async(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
) -> AsyncRedisReservation:
    """:func:`reserve_all` for :class:`AsyncRedisTokenBucketLimiter` instances;
    cancelled while its script is on its way, it gives the tokens back once the
    reply lands."""
    limiter, call = _all_async_call(checks, cost, max_wait, "max_wait")
    return await _shielded(_reserved_all(limiter, call))


def acquire_all(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Decision:
    """:func:`reserve_all`, then sleeps for its delay on the first limiter's clock;
    refused at once beyond ``timeout``."""
    return _waited(reserve_all(checks, cost, max_wait=timeout, _name="timeout")).decision


async def acquire_all_async(
    checks: Iterable[tuple[Any, ...]],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Decision:
    """:func:`acquire_all` for :class:`AsyncRedisTokenBucketLimiter` instances."""
    limiter, call = _all_async_call(checks, cost, timeout, "timeout")
    return (await _waited_async(await _shielded(_reserved_all(limiter, call)))).decision


def _all_async_call(
    checks: Iterable[tuple[Any, ...]], cost: object, wait: object, name: str
) -> tuple[AsyncRedisTokenBucketLimiter, Call]:
    limiter, call = all_call(checks, cost, RESERVE, wait, what="reserve_all", name=name)
    if not isinstance(limiter, AsyncRedisTokenBucketLimiter):
        raise TypeError("reserve_all_async takes AsyncRedisTokenBucketLimiter instances")
    return limiter, call


async def _reserved_all(limiter: AsyncRedisTokenBucketLimiter, call: Call) -> AsyncRedisReservation:
    assert call.checks is not None
    return AsyncRedisReservation(call.checks, await limiter._drive(call))


def _kind(checks: list[Any], what: str) -> str | None:
    """``"redis"``, ``"asyncio redis"``, or ``None`` when no Redis limiter is named."""
    kinds: set[str | None] = set()
    for item in checks:
        limiter = item[0] if isinstance(item, tuple) and item else None
        if isinstance(limiter, RedisTokenBucketLimiter):
            kinds.add("redis")
        elif isinstance(limiter, AsyncRedisTokenBucketLimiter):
            kinds.add("asyncio redis")
        else:
            kinds.add(None)
    if kinds <= {None}:
        return None
    if len(kinds) == 1:
        return kinds.pop()
    raise TypeError(
        f"{what} cannot mix in-process, Redis and asyncio Redis limiters: each kind "
        "keeps its buckets elsewhere, so no single step can check them all"
    )


def _route_all(what: str, checks: list[Any], cost: object, wait: object) -> Any:
    """For ``bucketlimit.reserve_all`` / ``acquire_all`` / ``acquire_all_async``: the
    Redis answer (a coroutine for asyncio limiters), or ``None`` when no Redis
    limiter is named. ``acquire_all`` over asyncio limiters is a TypeError: it would
    block the event loop (use ``acquire_all_async``)."""
    kind = _kind(checks, what)
    if kind is None:
        return None
    if what == "reserve_all":
        if kind == "redis":
            return reserve_all(checks, cost, max_wait=wait)  # type: ignore[arg-type]
        return reserve_all_async(checks, cost, max_wait=wait)  # type: ignore[arg-type]
    if what == "acquire_all" and kind == "redis":
        return acquire_all(checks, cost, timeout=wait)  # type: ignore[arg-type]
    if what == "acquire_all_async" and kind == "asyncio redis":
        return acquire_all_async(checks, cost, timeout=wait)  # type: ignore[arg-type]
    raise TypeError(
        f"{what} takes "
        + ("RedisTokenBucketLimiter" if what == "acquire_all" else "AsyncRedisTokenBucketLimiter")
        + " instances (acquire_all blocks the thread, acquire_all_async awaits)"
    )


def _route_allow_all(checks: list[Any], cost: object) -> Any:
    """For ``bucketlimit.allow_all``: the Redis answer (a coroutine for asyncio
    limiters), or ``None`` when no Redis limiter is named."""
    kind = _kind(checks, "allow_all")
    if kind == "redis":
        return allow_all(checks, cost)  # type: ignore[arg-type]  # cost is checked inside
    if kind == "asyncio redis":
        return allow_all_async(checks, cost)  # type: ignore[arg-type]
    return None
