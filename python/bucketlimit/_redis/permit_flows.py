"""A concurrency limiter's own calls on Redis, each a flow (docs/design.md §6,
"Concurrency permits"): :func:`take` (``try_acquire``), :func:`acquire` (a
*waiting flow*: it also yields ``Wait`` and ``Local`` steps), :func:`release`,
:func:`renew`, :func:`valid`, :func:`in_flight`, :func:`check`; and the permits
they hand out (:class:`RedisPermit`, :class:`AsyncRedisPermit`).

A waiter sleeps until the slot is sure to be its (the expiry arithmetic of
docs/design.md §4), is woken by the message the script publishes when it hands
it one (``bucketlimit._redis.wakeups``); without the messages it asks the store
every ``POLL_WITHOUT_WAKEUPS`` (0.75) seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, TypeVar

from bucketlimit._redis import permits
from bucketlimit._redis.drivers import run, run_async
from bucketlimit._redis.errors import ConfigurationError, NoPermissionError
from bucketlimit._redis.flows import (
    Command,
    Corrupt,
    Flow,
    Local,
    Unanswered,
    Wait,
    check_store,
    check_wait,
    guarded,
    refuse,
    unanswered,
)
from bucketlimit._redis.permits import (
    MICROS,
    QUEUED,
    Held,
    PermitState,
    granted_decision,
)
from bucketlimit._redis.resilience import RAISE, Breaker
from bucketlimit._redis.script import (
    ABANDON,
    GIVE_UP,
    IN_FLIGHT,
    POLL,
    QUEUE,
    RELEASE,
    RENEW,
    TAKE,
    VALID,
    Mode,
)
from bucketlimit._redis.wakeups import WaitHandle

logger = logging.getLogger("bucketlimit")

T = TypeVar("T")


#: A flow that may wait: it yields commands, waits and in-process answers.
Waits = Flow[Any]


def take(state: PermitState, key: str) -> Flow[Held]:
    """``try_acquire(key)``: a permit now, or a refusal; never waits, never jumps the
    queue."""
    pkey = state.key(key)
    breaker = state.breaker(pkey)
    try:
        reply, sent = yield from guarded(state, breaker, state.command(TAKE, pkey), wrote=True)
    except Unanswered as failure:
        unanswered(state, failure, breaker)
        held = state.fallback.take(key)
        state.counters.add(failure.sent, held.granted)
        return held
    except Corrupt as failure:
        held = corrupt(state, failure, breaker, key)
        state.counters.add(failure.sent, False)
        return held
    held = state.held(key, reply)
    state.counters.add(sent, held.granted)
    return held


def corrupt(state: PermitState, failure: Corrupt, breaker: Breaker, key: str) -> Held:
    """A key holding something that is not a permit's: raised under ``"raise"``, else
    refused, degraded (never a grant)."""
    if state.policy == RAISE:
        state.counters.add(failure.sent)
        refuse(failure, breaker)
    state.degraded(failure.error, logged=False, refused=True)
    return Held(key, state.fallback.closed)


def deadline_of(state: PermitState, wait: int | None) -> int | None:
    """When a wait of ``wait`` µs ends on the limiter's clock, in whole µs by the
    clock's rounding as the core reads it (None: never)."""
    return None if wait is None else state.micros() + wait


def left_of(state: PermitState, deadline: int | None) -> int | None:
    """The µs left until ``deadline`` (None: no deadline)."""
    return None if deadline is None else max(0, deadline - state.micros())


def acquire(state: PermitState, key: str, timeout: object) -> Waits:
    """``acquire(key, timeout=...)``: a permit now, or a place in the key's queue and
    a wait (:func:`wait_for`, as the waiter its handle names) until one is handed
    to it; refused once ``timeout`` has passed. Without the store, the policy
    answers for the rest of the wait."""
    pkey = state.key(key)
    wait = check_wait(timeout, "timeout")
    if wait == 0:
        return (yield from take(state, key))
    waiting = state.waiting()
    try:
        return (yield from queued(state, key, pkey, waiting, deadline_of(state, wait)))
    finally:
        waiting.close()


def queued(
    state: PermitState, key: str, pkey: bytes, waiting: WaitHandle, deadline: int | None
) -> Waits:
    """:func:`acquire` once its waiter is registered: take or queue, then wait."""
    name = waiting.name
    breaker = state.breaker(pkey)
    try:
        command = state.command(QUEUE, pkey, name=name)
        reply, sent = yield from guarded(state, breaker, command, wrote=True)
        if int(reply[0]) == QUEUED:
            held, more = yield from wait_for(state, key, pkey, waiting, int(reply[4]), deadline)
            sent += more
        else:
            held = state.held(key, reply)
    except Unanswered as failure:
        unanswered(state, failure, breaker)
        left = left_of(state, deadline)
        held = yield from acquired_without_store(
            state, key, None if left is None else left / MICROS
        )
        state.counters.add(failure.sent, held.granted)
        return held
    except Corrupt as failure:
        held = corrupt(state, failure, breaker, key)
        state.counters.add(failure.sent, False)
        return held
    state.counters.add(sent, held.granted)
    return held


def acquired_without_store(state: PermitState, key: str, timeout: float | None) -> Waits:
    """A wait for a permit without the store: ``"local"`` waits in process (this
    process's share), ``"open"`` grants, ``"closed"`` refuses."""
    local = state.fallback.local
    if local is None:
        return state.fallback.held(key, None)
    permit = yield Local(
        lambda: local.acquire(key, timeout=timeout),
        lambda: local.acquire_async(key, timeout=timeout),
    )
    return state.fallback.held(key, permit)


def wait_for(
    state: PermitState, key: str, pkey: bytes, waiting: WaitHandle, hint: int, deadline: int | None
) -> Flow[tuple[Held, int]]:
    """The wait of a queued waiter (``waiting``: its handle; ``hint``: µs until a slot
    is sure to be its): it sleeps until then, its timeout's end, or a wake-up (a grant told, or
    RESYNC: ask the store), asking the store (``POLL``) at most every
    ``state.min_poll`` seconds and before half its lease is gone; at the deadline
    it gives up (``GIVE_UP``: granted if one was handed to it meanwhile). An
    exception or a cancellation leaves the queue first (``ABANDON``, which also
    releases a permit handed to it meanwhile). Answers the Held and the commands
    sent; a store failure raises ``Unanswered`` / ``Corrupt`` (its caller answers
    by the policy)."""
    name = waiting.name
    sent = 0
    most = state.lease_micros / 2_000_000
    asked = time.monotonic()  # its last question (the queueing call just answered)
    try:
        while True:
            left = left_of(state, deadline)
            if left is not None and left <= 0:
                reply, n = yield from ask_about(state, pkey, GIVE_UP, name=name)
                return state.held(key, reply, name), sent + n
            seconds = min(max(hint / MICROS, state.min_poll), most)
            woken = yield Wait(seconds if left is None else min(seconds, left / MICROS), waiting)
            # Woken early (RESYNC): still no question sooner than min_poll after the last.
            while not told(woken) and (gap := state.min_poll - (time.monotonic() - asked)) > 0:
                left = left_of(state, deadline)
                if left is not None and left <= 0:
                    break
                woken = yield Wait(gap if left is None else min(gap, left / MICROS), waiting)
            if told(woken):
                token, remaining, reset = woken
                decision = granted_decision(state, remaining, reset)
                return Held(key, decision, token=token, member=f"{token} {name}"), sent
            left = left_of(state, deadline)
            if left is not None and left <= 0:
                continue  # the timeout's end: it gives up at the top
            reply, n = yield from ask_about(state, pkey, POLL, name=name)
            asked = time.monotonic()
            sent += n
            if int(reply[0]) != QUEUED:
                return state.held(key, reply, name), sent
            hint = int(reply[4])
    except (Unanswered, Corrupt):
        raise
    except BaseException:
        yield from abandon(state, pkey, name)
        raise


def told(woken: object) -> bool:
    """Whether a wake-up told a grant (``token, remaining, reset_µs``)."""
    return isinstance(woken, tuple) and len(woken) == 3


def ask_about(
    state: PermitState,
    pkey: bytes,
    mode: Mode,
    *,
    member: str | None = None,
    name: str | None = None,
    extra: int = 0,
) -> Flow[tuple[Any, int]]:
    """One permit-alone command through the breaker: its reply and the commands sent;
    a store failure raises ``Unanswered`` (or ``Corrupt``)."""
    breaker = state.breaker(pkey)
    command = state.command(mode, pkey, member=member, name=name, extra=extra)
    reply, sent = yield from guarded(state, breaker, command, wrote=mode is not VALID)
    return reply, sent


def abandon(state: PermitState, pkey: bytes, name: str) -> Flow[None]:
    """A waiter that stops (an exception, a cancellation) leaves the queue, and
    gives back at once a permit handed to it meanwhile. Never raises for the store:
    a waiter it cannot reach lapses by its lease, a grant by its ttl."""
    state.counters.event("abandoned")
    try:
        _, sent = yield from ask_about(state, pkey, ABANDON, name=name)
    except (Unanswered, Corrupt) as failure:
        state.counters.add(failure.sent)
        return
    except Exception:
        logger.debug("%s: a waiter could not leave its queue", state.name, exc_info=True)
        return
    state.counters.add(sent)


def release(state: PermitState, held: Held) -> Flow[bool]:
    """``permit.release()`` (once, the holder's business): frees the slot of its
    member for the key's first waiter; False when it was not held (expired). A
    release that cannot reach the store is counted (``lost_releases``) and logged,
    never resent: the permit expires by its ttl (raised under ``"raise"``)."""
    if held.local is not None:
        held.local.release()
        state.counters.event("released")
        return True
    if held.member is None:
        return False  # a refusal, or granted under "open": nothing is held
    pkey = state.key(held.key)
    try:
        reply, sent = yield from ask_about(state, pkey, RELEASE, member=held.member)
    except (Unanswered, Corrupt) as failure:
        lost_release(state, held, failure)
        return False
    state.counters.add(sent)
    released = bool(int(reply[0]))
    if released:
        state.counters.event("released")
    return released


def lost_release(state: PermitState, held: Held, failure: Unanswered | Corrupt) -> None:
    state.counters.add(failure.sent)
    state.counters.event("lost_releases")
    why = "the store is skipped" if failure.error is None else repr(failure.error)
    logger.warning(
        "%s: the release of permit %d of key %r did not reach the store (%s); "
        "its slot frees when it expires",
        state.name,
        held.token,
        held.key,
        why,
    )
    if state.policy == RAISE:
        refuse(failure, state.breaker(state.key(held.key)))


def renew(state: PermitState, held: Held) -> Flow[bool]:
    """``permit.renew()``: extends it to ``ttl`` from now while it is held; False
    when it expired or was released (a renewal never brings one back), and False
    when the store cannot say (raised under ``"raise"``): treat the permit as lost."""
    if held.local is not None:
        return held.local.renew()
    return (yield from still_held(state, held, RENEW))


def valid(state: PermitState, held: Held) -> Flow[bool]:
    """``permit.valid()``: held on the store and not expired, on the store's clock (a
    read); False when the store cannot say (raised under ``"raise"``)."""
    if held.local is not None:
        return held.local.valid()
    return (yield from still_held(state, held, VALID))


def still_held(state: PermitState, held: Held, operation: Mode) -> Flow[bool]:
    """The store's answer to ``operation`` (renew, valid) on a permit it granted:
    whether it still holds it; False when it cannot say (raised under ``"raise"``)."""
    if held.member is None:
        return held.granted  # granted under "open": nothing on the store
    pkey = state.key(held.key)
    try:
        reply, sent = yield from ask_about(state, pkey, operation, member=held.member)
    except (Unanswered, Corrupt) as failure:
        state.counters.add(failure.sent)
        if state.policy == RAISE:
            refuse(failure, state.breaker(pkey))
        return False
    state.counters.add(sent)
    return bool(int(reply[0]))


def in_flight(state: PermitState, key: str) -> Flow[int]:
    """``in_flight(key)``: the key's permits held now (the expired ones gone, their
    slots handed on). Without the store: this process's local ones under
    ``"local"``, else 0, or raised under ``"raise"``."""
    pkey = state.key(key)
    try:
        reply, sent = yield from ask_about(state, pkey, IN_FLIGHT)
    except (Unanswered, Corrupt) as failure:
        state.counters.add(failure.sent)
        if state.policy == RAISE:
            refuse(failure, state.breaker(pkey))
        local = state.fallback.local
        return 0 if local is None else local.in_flight(key)
    state.counters.add(sent)
    return int(reply[0])


def check(state: PermitState) -> Flow[None]:
    """``check()``: the script as a read of a key no permit has (nothing written),
    then ``INFO server`` (Redis 5.0 or later). Raises ``ConfigurationError`` for
    what no retry will fix and the client's error otherwise; the policy never
    applies. Then a PUBLISH on its wake-ups' channel (an empty message, which no
    listener reads as a grant): the scripts that hand a slot on publish, and an ACL
    without the channel would refuse them at the first hand-off."""
    probe = state.command(VALID, state.keys.probe(), member="0")
    publish = Command("publish", (state.wakeups.channel, ""))
    try:
        yield from check_store(state, probe, publish)
    except ConfigurationError as refused:
        cause = refused.__cause__
        if not isinstance(cause, NoPermissionError) or "channel" not in str(cause).lower():
            raise
        raise ConfigurationError(
            f"{refused}; a concurrency limiter's user also needs PUBLISH on its "
            f"channels ({state.keys.prefix.decode()}{{bucketlimit-wake}}:*, an ACL "
            "&pattern): a release hands its slot to the first waiter with a message"
        ) from refused.__cause__


class RedisPermit(permits.PermitHolder):
    """A concurrency permit held on Redis (or, without the store, as the failure
    policy gave it); truthy when granted. ``token`` is its fencing token: larger
    for every later grant of the key by the store, across every process; a
    degraded permit's (``decision.degraded``) comes from this process's local
    limiter and is not comparable with the store's (docs/redis.md, "Concurrency
    permits across processes"). A context manager, ``with`` and ``async with``,
    releasing it on exit."""

    __slots__ = ()

    def release(self) -> None:
        """Frees its slot for the key's first waiter (one script). Once: later calls,
        and a call on a refusal or an expired permit, free nothing of anyone else's.
        A release that cannot reach the store is counted (``lost_releases``) and
        logged, and the permit expires by its ttl; under ``"raise"`` the client's
        error (or ``StoreUnavailableError``) is raised too, the permit released
        all the same (a second call sends nothing)."""
        if self.claim():
            run(release(self._state, self._held), self._state)

    def renew(self) -> bool:
        """Extends it to ``ttl`` seconds from now, on the store's clock; False when it
        expired or was released (a renewal never brings a permit back), or when the
        store cannot say."""
        if self.released:
            return False
        return run(renew(self._state, self._held), self._state)

    def valid(self) -> bool:
        """Whether it is held now on the store's clock (a read): granted, not
        released, not expired; False when the store cannot say."""
        if self.released:
            return False
        return run(valid(self._state, self._held), self._state)

    def __enter__(self) -> RedisPermit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> RedisPermit:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()  # the sync limiter's: a blocking round trip, as its calls are


class AsyncRedisPermit(permits.PermitHolder):
    """:class:`RedisPermit` of the asyncio limiter: ``release``, ``renew`` and
    ``valid`` are coroutines; ``async with`` releases it on exit."""

    __slots__ = ()

    async def release(self) -> None:
        """:meth:`RedisPermit.release`, awaited (shielded: a second cancellation
        cannot lose it)."""
        if self.claim():
            await _shielded(run_async(release(self._state, self._held), self._state))

    async def renew(self) -> bool:
        """:meth:`RedisPermit.renew`, awaited."""
        if self.released:
            return False
        return await run_async(renew(self._state, self._held), self._state)

    async def valid(self) -> bool:
        """:meth:`RedisPermit.valid`, awaited."""
        if self.released:
            return False
        return await run_async(valid(self._state, self._held), self._state)

    async def __aenter__(self) -> AsyncRedisPermit:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.release()


#: Releases and renewals cancelled while they run, held until they end.
_RUNNING: set[asyncio.Future[Any]] = set()


async def _shielded(work: Awaitable[T]) -> T:
    """``work`` in a task of its own: cancelled while it runs, it runs on."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)
        raise
