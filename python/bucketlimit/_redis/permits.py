"""Concurrency permits on Redis (docs/design.md §6, "Concurrency permits"), free of I/O.

A key's permits live on the store, on the script's clock (the server's ``TIME``, or
an injected clock), in the permit fragments of the general script (``scripts.lua``;
scripts.md: the operations of a permit key alone, and permit keys next to buckets in
the calls over several). They follow ``src/concurrency.rs``: at most ``limit``
unexpired permits per key, each expiring ``ttl`` after it was granted or renewed;
waiters queue in the order the server ran their scripts and are handed the slots
that free (a release, or an expiry a call noticed); every grant carries a fencing
token from the key's counter. This module holds what one limiter decides with
(:class:`PermitState`), what a permit is (:class:`Held`, :class:`PermitHolder`), and
every operation as a flow (``bucketlimit._redis.flows``), which the public classes
(``bucketlimit._redis.concurrency``) drive:

- the limiter's own calls: :func:`take` (``try_acquire``), :func:`acquire` (a
  *waiting flow*: it also yields ``Wait`` and ``Local`` steps),
  :func:`release`, :func:`renew`, :func:`valid`, :func:`in_flight`,
  :func:`check`;
- the ``*_all`` calls with permits among token buckets, one script each:
  :func:`allow_all`, :func:`reserve_all`, :func:`acquire_all`, and the
  give-backs of their reservations, which release the permits in the same
  script (:class:`ReservedPermits`).

A waiter sleeps until the slot is sure to be its (the expiry arithmetic of
docs/design.md §4), is woken by the message the script publishes when it hands
it one (``bucketlimit._redis.wakeups``); without the messages it asks the store
every ``POLL_WITHOUT_WAKEUPS`` (0.75) seconds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from bucketlimit import _core
from bucketlimit._core import ConcurrencyLimiter, Decision
from bucketlimit._histogram import ROUND_TRIP_BUCKETS, Histogram
from bucketlimit._redis.clients import LazyClient
from bucketlimit._redis.errors import ConfigurationError, NoPermissionError
from bucketlimit._redis.flows import (
    Command,
    Corrupt,
    Flow,
    Line,
    Local,
    Part,
    Reserved,
    ScriptCommand,
    Unanswered,
    Wait,
    change_all,
    check_store,
    check_wait,
    general,
    give_back,
    guarded,
    lost,
    refuse,
    unanswered,
)
from bucketlimit._redis.keys import Keys, check_one_slot
from bucketlimit._redis.module import Engine
from bucketlimit._redis.resilience import (
    CLOSED,
    LOCAL,
    OPEN,
    RAISE,
    Breaker,
    Policy,
    Processes,
    fork_safe,
)
from bucketlimit._redis.script import (
    ABANDON,
    GENERAL,
    GIVE_UP,
    IN_FLIGHT,
    LUA_EXACT,
    NONE,
    POLL,
    QUEUE,
    REFUND,
    RELEASE,
    RENEW,
    RESERVE,
    TAKE,
    VALID,
    Mode,
    Script,
    permit_keys,
)
from bucketlimit._redis.state import Breakers, Counters, StoreState
from bucketlimit._redis.timing import StoreTime
from bucketlimit._redis.wakeups import POLL_WITHOUT_WAKEUPS, WaitHandle, Wakeups

logger = logging.getLogger("bucketlimit")

MICROS: Final = 1_000_000

#: The longest ttl, in µs: every time the script computes (now + a reservation's
#: delay + ttl) stays exact below 2**53 µs.
MAX_TTL_MICROS: Final = LUA_EXACT // 8

#: A waiter's place lapses this long after it last asked the store (a process that
#: died stops asking): twice the ttl, at least this many µs.
MIN_LEASE_MICROS: Final = 2_000_000

#: Seconds a waiter waits at least between two questions to the store when it
#: waits in real time (a clock with ``sleep`` waits in its own time): with the
#: wake-ups, a waiter asks only when a slot is sure to free by expiry, and never
#: more often than this.
MIN_POLL: Final = POLL_WITHOUT_WAKEUPS

# The states of a permit in the script's replies (scripts.md).
GRANTED: Final = 1  # granted now, held as "token"
HANDED: Final = 3  # handed to the waiter, held as "token name"
QUEUED: Final = 2  # queued; the reply's last value is the µs until a slot is sure to be its
KEPT: Final = 4  # a permit the call held already, kept (extended by its tokens' delay)
RELEASED: Final = 5  # a permit the call held already, released (its tokens were refused)
FREE: Final = 0  # free now, not taken (the call was refused for something else)
BUSY: Final = -1  # no slot free: refused


def check_ttl(ttl: object) -> tuple[float, int]:
    """``ttl`` checked as the in-process limiter checks it (``TypeError``,
    ``ValueError``), within the script's exact range: seconds and µs."""
    probe = ConcurrencyLimiter(1, ttl=ttl)  # type: ignore[arg-type]  # checked by the call
    micros = _core.clock_to_micros(ttl)
    if micros > MAX_TTL_MICROS:
        raise ValueError(
            f"ttl must be at most {MAX_TTL_MICROS / 1_000_000:g} seconds on Redis "
            f"(the script computes in Lua doubles, exact below 2**53 µs), got {ttl!r}"
        )
    return probe.ttl, micros


def default_prefix(limit: int, ttl_micros: int) -> str:
    """The prefix of a concurrency limiter given none: its limit and its ttl (in
    µs), so that two different limiters never share a key's permits (a slot one
    hands on lives by the releaser's ttl: docs/redis.md, "Concurrency permits
    across processes")."""
    return f"bucketlimit:permits:{limit}:{ttl_micros}us:"


class Held:
    """A permit's answer and where it is held: on the store (``member``: "token", or
    "token name" when it was handed to a waiter), in process under
    ``on_store_error="local"`` (``local``: the core's ``Permit``), or nowhere (a
    refusal, or a grant under ``"open"``, which holds no slot and no token)."""

    __slots__ = ("decision", "key", "local", "member", "token")

    def __init__(
        self,
        key: str,
        decision: Decision,
        *,
        token: int = 0,
        member: str | None = None,
        local: _core.Permit | None = None,
    ) -> None:
        self.key = key
        self.decision = decision
        self.token = token
        self.member = member
        self.local = local

    @property
    def granted(self) -> bool:
        return self.decision.allowed


class PermitHolder:
    """What a permit object holds, shared by the blocking and the asyncio classes
    (``bucketlimit._redis.concurrency``): its limiter's state and its
    :class:`Held`; released once (by its holder, or by the reservation holding it)."""

    __slots__ = ("_held", "_lock", "_released", "_state")

    def __init__(self, state: PermitState, held: Held) -> None:
        self._state = state
        self._held = held
        self._lock = threading.Lock()
        self._released = not held.granted

    @property
    def key(self) -> str:
        return self._held.key

    @property
    def token(self) -> int:
        """The fencing token: larger for every later grant of the key, in every
        process (at least the store's time in µs when granted, so it grows across a
        key forgotten or a store that lost it); 0 for a refusal, and for a grant
        without the store under ``"open"``, which holds nothing."""
        return self._held.token

    @property
    def decision(self) -> Decision:
        """``limit`` = the limit, ``remaining`` = the permits free after this one;
        for a refusal ``retry_after`` = the time until a slot is sure to be free for
        it if no holder releases or renews (docs/design.md §4, "Permits")."""
        return self._held.decision

    @property
    def held(self) -> Held:
        return self._held

    @property
    def released(self) -> bool:
        """Released already, or never held (a refusal)."""
        return self._released

    def __bool__(self) -> bool:
        return self._held.granted

    def claim(self) -> bool:
        """True the first time (the call that releases it); False after."""
        with self._lock:
            if self._released:
                return False
            self._released = True
            return True

    def __repr__(self) -> str:
        granted = self._held.granted
        return (
            f"{type(self).__name__}(key={self.key!r}, token={self.token}, granted={granted}, "
            f"released={granted and self._released})"
        )


def granted_decision(state: PermitState, remaining: int, reset: int) -> Decision:
    return Decision(True, 0.0, remaining, reset / 1_000_000, state.limit)


def refused_decision(state: PermitState, retry: int, reset: int) -> Decision:
    return Decision(False, retry / 1_000_000, 0, reset / 1_000_000, state.limit)


def degraded(decision: Decision) -> Decision:
    d = decision
    return Decision(d.allowed, d.retry_after, d.remaining, d.reset_after, d.limit, True)


class PermitFallback:
    """The answers of an ``on_store_error`` policy other than ``"raise"`` for permits:
    ``"local"`` an in-process ``ConcurrencyLimiter`` of this process's share
    (``max(1, limit // processes)`` permits per key, the same ttl, on the
    limiter's clock); ``"open"`` granted, holding nothing; ``"closed"`` refused
    with ``retry_after`` = ``retry_interval``. Every answer has ``degraded=True``."""

    def __init__(
        self,
        policy: str,
        limit: int,
        ttl: float,
        *,
        processes: int,
        retry_interval: float,
        clock: Callable[[], float] | None,
    ) -> None:
        self.policy = policy
        self.share = max(1, limit // processes)
        self.local = (
            ConcurrencyLimiter(self.share, ttl=ttl, clock=clock) if policy == LOCAL else None
        )
        self.description = {
            LOCAL: "permits are taken from this process's share of each key",
            OPEN: "permits are granted, holding nothing",
            CLOSED: "permits are refused",
            RAISE: "calls raise StoreUnavailableError",
        }[policy]
        wait = float(retry_interval)
        self.closed = Decision(False, wait, 0, wait, limit, True)
        self.open = Decision(True, 0.0, 0, 0.0, limit, True)

    def held(self, key: str, permit: _core.Permit | None) -> Held:
        """What a policy answers: a local permit, or the open grant / closed refusal."""
        if permit is not None:
            local = permit if permit else None
            return Held(key, degraded(permit.decision), token=permit.token, local=local)
        return Held(key, self.open if self.policy == OPEN else self.closed)

    def take(self, key: str) -> Held:
        return self.held(key, None if self.local is None else self.local.try_acquire(key))


class PermitState(StoreState):
    """Everything one Redis concurrency limiter decides with (the module
    docstring); the shape of ``bucketlimit._redis.state.Store``. ``client`` is the
    client, or a ``LazyClient`` building it on first use."""

    #: The script adds a reservation's delay and a ttl to ``now``: half the range.
    clock_bits = 52
    fallback: PermitFallback

    def __init__(
        self,
        client: Any,
        *,
        cluster: bool,
        limit: int,
        ttl: float,
        ttl_micros: int,
        clock: Callable[[], float] | None,
        keys: Keys,
        policy: Policy,
        processes: int | None,
        retry_interval: float,
        name: str,
        threaded: bool,
        engine: Engine,
        timing: StoreTime,
    ) -> None:
        self.source = client
        self.engine = engine
        self.time = timing
        #: The client is a blocking one: waiters' wake-ups are heard by a thread.
        self.threaded = threaded
        self.client: Any = None if isinstance(client, LazyClient) else client
        self.cluster = cluster
        self.limit = limit
        self.ttl = ttl
        self.ttl_micros = ttl_micros
        #: A waiter's place lapses this long after its last question (µs).
        self.lease_micros = max(2 * ttl_micros, MIN_LEASE_MICROS)
        self.clock = clock
        #: The seconds a waiter waits at least between two questions (real time).
        self.min_poll = 0.0 if callable(getattr(clock, "sleep", None)) else MIN_POLL
        self.keys = keys
        self.script: Script = GENERAL
        self.name = name
        self.counters = Counters()
        self.round_trips = Histogram(ROUND_TRIP_BUCKETS)
        self.policy: Policy = policy
        self.retry_interval = retry_interval
        self.processes = Processes(processes)
        self.fallback = self._fallback()
        self.breakers = Breakers(retry_interval, name, self.without_store)
        self.wakeups = Wakeups(keys.prefix.decode("utf-8"))
        self._warned = False
        self.flying = set()
        self.closed = False
        fork_safe(self)

    def _after_fork(self) -> None:
        self.processes.forked()
        self.fallback = self._fallback()

    def _fallback(self) -> PermitFallback:
        return PermitFallback(
            self.answering_policy(),
            self.limit,
            self.ttl,
            processes=self.processes.count,
            retry_interval=self.retry_interval,
            clock=self.clock,
        )

    def micros(self) -> int:
        """The clock a wait's timeout counts on (the injected one, else the
        process's monotonic clock), in whole µs."""
        return _core.clock_to_micros((self.clock or time.monotonic)())

    # -- without the store ------------------------------------------------------------

    def without_store(self) -> str:
        if self.policy != LOCAL or not self.processes.known:
            return self.described()
        return (
            f"{self.fallback.description}: {self.fallback.share} of {self.limit} permits, "
            f"{self.processes.describe()}"
        )

    def learned(self, processes: int) -> None:
        """The store counted the live processes: the local share follows, once the
        local limiter holds nothing (its permits stay its own)."""
        if self.processes.learned(processes) or self.fallback.share != max(
            1, self.limit // self.processes.count
        ):
            local = self.fallback.local
            if local is None or local.stats()["in_flight"] == 0:
                self.fallback = self._fallback()

    def waiting(self) -> WaitHandle:
        """A waiter of this limiter's wake-ups, for one waiting call (closed by it)."""
        return WaitHandle(self.wakeups, self.clock, self.connect, threaded=self.threaded)

    # -- commands --------------------------------------------------------------------

    def key(self, key: str) -> bytes:
        """The Redis key of ``key``'s permits (``prefix{tag}:key``); checks ``key``."""
        return self.keys.bucket(key)

    def args(
        self, member: str | None = None, name: str | None = None, extra: int = 0
    ) -> tuple[Any, ...]:
        """A permit key's 9 values in the general script (scripts.md)."""
        return (
            self.now(),
            self.limit,
            self.ttl_micros,
            self.lease_micros,
            1,
            NONE if member is None else member,
            NONE if name is None else name,
            extra,
            NONE,
        )

    def command(
        self,
        mode: Mode,
        key: bytes,
        *,
        member: str | None = None,
        name: str | None = None,
        extra: int = 0,
    ) -> ScriptCommand:
        """A permit key alone: the general script, its four keys, ``mode``."""
        args = (1, mode.value, *self.args(member, name, extra))
        return ScriptCommand(self.script, permit_keys(key), args)

    def held(self, key: str, reply: Any, name: str | None = None) -> Held:
        """A permit-alone reply ``{state, token, remaining, reset_after_us,
        retry_after_us}`` as a Held (granted, handed, or refused)."""
        code, token, remaining, reset, retry = (int(v) for v in reply[:5])
        if code == GRANTED:
            return Held(
                key, granted_decision(self, remaining, reset), token=token, member=str(token)
            )
        if code == HANDED:
            member = f"{token} {name}"
            return Held(key, granted_decision(self, remaining, reset), token=token, member=member)
        return Held(key, refused_decision(self, retry, reset))


# -- the steps a waiting flow yields besides commands ----------------------------------


#: A flow that may wait: it yields commands, waits and in-process answers.
Waits = Flow[Any]


# -- the limiter's own calls -------------------------------------------------------------


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
    state.degraded(failure.error, logged=False)
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
    if held.member is None:
        return held.granted  # granted under "open": nothing to extend
    pkey = state.key(held.key)
    try:
        reply, sent = yield from ask_about(state, pkey, RENEW, member=held.member)
    except (Unanswered, Corrupt) as failure:
        state.counters.add(failure.sent)
        if state.policy == RAISE:
            refuse(failure, state.breaker(pkey))
        return False
    state.counters.add(sent)
    return bool(int(reply[0]))


def valid(state: PermitState, held: Held) -> Flow[bool]:
    """``permit.valid()``: held on the store and not expired, on the store's clock (a
    read); False when the store cannot say (raised under ``"raise"``)."""
    if held.local is not None:
        return held.local.valid()
    if held.member is None:
        return held.granted
    pkey = state.key(held.key)
    try:
        reply, sent = yield from ask_about(state, pkey, VALID, member=held.member)
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


# -- permits among token buckets (the *_all calls) -----------------------------------

#: One concurrency check of a call over several: its limiter's state and the key.
PermitPart = tuple[PermitState, str]


class Combined:
    """What a call over token buckets and permits answered: the reservation of its
    tokens (``reserved``: the combined decision, the delay, each bucket's line,
    where the tokens were taken) and each permit (``helds``, in the order of the
    checks). For a call still waiting (acquire_all): ``queued``, the index (in
    the call's order of keys) of the permit it waits for, and the µs until a slot
    is sure to be its."""

    __slots__ = ("helds", "queued", "reserved")

    def __init__(
        self, reserved: Reserved, helds: list[Held], queued: tuple[int, int] | None = None
    ) -> None:
        self.reserved = reserved
        self.helds = helds
        self.queued = queued


def ordered(permit_parts: Sequence[PermitPart]) -> list[int]:
    """The order permits are taken in: by Redis key, the same for every process, so
    that waiters holding some while they wait for the next never wait in a cycle
    (docs/design.md §4, "Permits")."""
    keys = [state.key(key) for state, key in permit_parts]
    return sorted(range(len(keys)), key=keys.__getitem__)


def combined_command(
    parts: Sequence[Part],
    more: Sequence[tuple[Any, ...]],
    permit_parts: Sequence[PermitPart],
    order: Sequence[int],
    mode: Mode,
    members: Sequence[str | None],
    names: Sequence[str | None],
) -> ScriptCommand:
    """The general script over the buckets (as ``flows.general``) and then the permit
    keys in ``order`` (each its four keys), each with its member (a permit the call
    holds) or name (a waiter queued there if it is busy). On a cluster every key must share one
    slot: said before anything is sent."""
    script = permit_parts[0][0].script
    keys: list[bytes] = []
    args: list[Any] = []
    if parts:
        command = general(parts, mode, more)
        script = command.script
        keys, args = list(command.keys), list(command.args[2:])
    for i in order:
        state, key = permit_parts[i]
        pkey = state.key(key)
        if pkey in keys:
            raise ValueError(
                f"the call names the Redis key {pkey!r} twice: limiters sharing a "
                "client need different prefixes"
            )
        keys += permit_keys(pkey)
        args += state.args(members[i], names[i])
    cluster = parts[0][0].cluster if parts else permit_parts[0][0].cluster
    if cluster:
        check_one_slot(keys)
    return ScriptCommand(script, keys, (len(order), mode.value, *args))


def combined_of(
    parts: Sequence[Part],
    permit_parts: Sequence[PermitPart],
    order: Sequence[int],
    reply: Any,
    before: Sequence[Held | None],
) -> Combined:
    """The reply ``{longest, fewest, reset, limit, delay, lines, answers}`` of a call
    over buckets and permits as the reservation and the permits, combined as the
    in-process ``*_all`` (py_reserve::with_permits): the tokens' decision first,
    then each permit's in the order of the checks. ``before``: the permits the
    call held already (a waiting acquire_all's), which answer with their grants."""
    answers: list[Any] = list(reply[6] or [])
    helds: list[Held] = [Held("", Decision(False, 0.0, 0, 0.0, 0))] * len(permit_parts)
    queued = None
    for position, i in enumerate(order):
        state, key = permit_parts[i]
        code, token, remaining, reset, retry = (int(v) for v in answers[position][:5])
        mine = before[i]
        if code == GRANTED:
            decision = granted_decision(state, remaining, reset)
            helds[i] = Held(key, decision, token=token, member=str(token))
        elif mine is not None:  # KEPT, or RELEASED (its tokens were refused)
            member = mine.member if code == KEPT else None
            helds[i] = Held(key, mine.decision, token=mine.token, member=member)
        elif code == FREE:
            helds[i] = Held(key, Decision(True, 0.0, remaining, reset / 1_000_000, state.limit))
        else:  # BUSY, QUEUED
            helds[i] = Held(key, refused_decision(state, retry, reset))
            if code == QUEUED:
                queued = (position, retry)
    decisions: list[Decision] = []
    lines: list[Line | None] = [None] * len(parts)
    delay = 0.0
    if parts:
        decisions.append(parts[0][0].decision(reply[:4]))
        delay = int(reply[4]) / 1_000_000 if int(reply[4]) >= 0 else math.inf
        for i, line in enumerate(reply[5] or []):
            if line:
                lines[i] = (line[0], line[1], line[2])
    decisions += [held.decision for held in helds]
    decision = _core.combine(decisions)  # the rule of allow_all, written once
    if not (decision.allowed and all(held.member is not None for held in helds)):
        d = decision
        decision = Decision(False, d.retry_after, d.remaining, d.reset_after, d.limit)
        for one in decisions:
            if not one.allowed:
                delay = max(delay, one.retry_after)
    return Combined(Reserved(decision, delay, lines), helds, queued)


def store_of(parts: Sequence[Part], permit_parts: Sequence[PermitPart]) -> Any:
    """The state whose breaker, policy and counters a call over several goes
    through: its first bucket's, else its first permit's."""
    return parts[0][0] if parts else permit_parts[0][0]


def count_all(
    parts: Sequence[Part], permit_parts: Sequence[PermitPart], sent: int, allowed: bool
) -> None:
    """A call over several: its commands once (on the state it went through), its
    decision on every limiter."""
    first = store_of(parts, permit_parts)
    first.counters.add(sent, allowed)
    seen = {id(first)}
    for state in [s for s, _, _ in parts] + [s for s, _ in permit_parts]:
        if id(state) not in seen:
            seen.add(id(state))
            state.counters.add(0, allowed)


def raises(parts: Sequence[Part], permit_parts: Sequence[PermitPart]) -> bool:
    """A call over several limiters raises when one of them does."""
    return any(s.policy == RAISE for s, _, _ in parts) or any(
        s.policy == RAISE for s, _ in permit_parts
    )


def combined_call(
    parts: Sequence[Part],
    permit_parts: Sequence[PermitPart],
    mode: Mode,
    max_wait: int | None,
    names: Sequence[str | None],
    before: Sequence[Held | None],
) -> Flow[tuple[Combined, int]]:
    """One script over the buckets and the permits (``ALLOW``: allow_all;
    ``RESERVE``: reserve_all, and each step of acquire_all), through the first
    check's breaker: the answer and the commands sent. A store failure raises
    ``Unanswered`` / ``Corrupt`` for the caller to answer by the policies."""
    order = ordered(permit_parts)
    more = [(NONE if max_wait is None else max_wait, NONE, NONE, NONE)] * len(parts)
    members = [None if held is None else held.member for held in before]
    command = combined_command(parts, more, permit_parts, order, mode, members, names)
    first = store_of(parts, permit_parts)
    breaker = first.breaker(command.keys[0])
    reply, sent = yield from guarded(first, breaker, command, wrote=True)
    return combined_of(parts, permit_parts, order, reply, before), sent


def failed_all(
    parts: Sequence[Part], permit_parts: Sequence[PermitPart], failure: Unanswered | Corrupt
) -> None:
    """A call over several that the store did not answer: raised when one of its
    limiters raises, else the answer to come is degraded (counted on the first)."""
    first = store_of(parts, permit_parts)
    pkey = first.key(permit_parts[0][1]) if not parts else first.keys.bucket(parts[0][1])
    breaker = first.breaker(pkey)
    if isinstance(failure, Corrupt) or raises(parts, permit_parts):
        if raises(parts, permit_parts):
            first.counters.add(failure.sent)
            refuse(failure, breaker)
        first.degraded(failure.error, logged=False)
        return
    unanswered(first, failure, breaker, raises=False)


def refused_all(parts: Sequence[Part], permit_parts: Sequence[PermitPart]) -> Combined:
    """A refusal of a call over several without the store (``"closed"``, or a
    corrupt key): ``retry_after`` = the first limiter's ``retry_interval``."""
    first = store_of(parts, permit_parts)
    refusal = first.fallback.closed if isinstance(first, PermitState) else first.fallback.refusal()
    helds = [Held(key, pstate.fallback.closed) for pstate, key in permit_parts]
    lines: list[Line | None] = [None] * len(parts)
    return Combined(Reserved(refusal, refusal.retry_after, lines, stored=False), helds)


def all_without_store(
    parts: Sequence[Part],
    permit_parts: Sequence[PermitPart],
    max_wait: int | None,
    *,
    wait: bool,
) -> Waits:
    """A call over buckets and permits without the store: any ``"closed"`` limiter
    refuses it; the ``"local"`` ones decide together in process, all or nothing,
    on this process's shares (a cost at most the share): ``_core.reserve_all``, or
    with ``wait`` ``_core.acquire_all`` (its permits waited for); ``"open"``
    ones take nothing. Every answer is degraded."""
    states = [s for s, _, _ in parts] + [s for s, _ in permit_parts]
    if any(state.fallback.policy == CLOSED for state in states):
        return refused_all(parts, permit_parts)
    local: list[tuple[Any, ...]] = [
        (s.fallback.local, key, min(cost, s.fallback.share))
        for s, key, cost in parts
        if s.fallback.local is not None
    ]
    permits_here = [(s.fallback.local, key) for s, key in permit_parts if s.fallback.local]
    lines: list[Line | None] = [None] * len(parts)
    if not local and not permits_here:  # all "open"
        helds = [pstate.fallback.held(key, None) for pstate, key in permit_parts]
        return Combined(Reserved(helds[0].decision, 0.0, lines, stored=False), helds)
    seconds = None if max_wait is None else max_wait / 1_000_000
    checks = local + permits_here
    reservation: _core.Reservation
    if wait and permits_here:
        reservation = yield Local(
            lambda: _core.acquire_all(checks, timeout=seconds),
            lambda: _core.acquire_all_async(checks, timeout=seconds),
        )
    else:
        reservation = _core.reserve_all(checks, max_wait=seconds)
        if wait and reservation:
            yield Local(reservation.wait, reservation.wait_async)
    decision = degraded(reservation.decision)
    taken = list(reservation.permits)
    helds = []
    for pstate, key in permit_parts:
        if pstate.fallback.local is None:
            helds.append(pstate.fallback.held(key, None))
        elif taken:
            helds.append(pstate.fallback.held(key, taken.pop(0)))
        else:
            refusal = Decision(False, decision.retry_after, 0, decision.reset_after, pstate.limit)
            helds.append(Held(key, degraded(refusal)))
    return Combined(
        Reserved(decision, reservation.delay, lines, stored=False, local=reservation), helds
    )


def reserve_all(
    parts: Sequence[Part], permit_parts: Sequence[PermitPart], mode: Mode, max_wait: int | None
) -> Waits:
    """``allow_all`` (``ALLOW``) and ``reserve_all`` (``RESERVE``) with permits among
    the checks: one script decides every bucket and every permit at one moment,
    all or nothing; a permit is taken only if it is free now (a reservation never
    queues for one), and lives ``ttl`` from when the tokens are ready. Without the
    store, each limiter's policy (:func:`all_without_store`)."""
    try:
        no = [None] * len(permit_parts)
        combined, sent = yield from combined_call(parts, permit_parts, mode, max_wait, no, no)
    except (Unanswered, Corrupt) as failure:
        failed_all(parts, permit_parts, failure)
        if isinstance(failure, Corrupt):
            combined = refused_all(parts, permit_parts)
        else:
            combined = yield from all_without_store(parts, permit_parts, max_wait, wait=False)
        count_all(parts, permit_parts, failure.sent, combined.reserved.decision.allowed)
        return combined
    count_all(parts, permit_parts, sent, combined.reserved.decision.allowed)
    return combined


def acquire_all(
    parts: Sequence[Part], permit_parts: Sequence[PermitPart], timeout: int | None
) -> Waits:
    """``acquire_all`` with permits among the checks (docs/design.md §4, "Permits"):
    one script takes every permit free now and, when all are, reserves the tokens
    within the timeout, all or nothing (one EVALSHA when nothing waits). When a
    permit is busy the call holds the ones before it in the fixed order (by Redis
    key) and queues there as its waiter (:func:`wait_for`); once handed it, the
    next script goes on from there, the permits it holds extended to live ``ttl``
    from when the tokens are ready, and released if the tokens are refused. The
    wait counts on the first check's clock. Without the store the policies answer
    for the rest (:func:`all_without_store`, waiting in process)."""
    waitings = [pstate.waiting() for pstate, _ in permit_parts]
    try:
        return (yield from acquired_all(parts, permit_parts, timeout, waitings))
    finally:
        for waiting in waitings:
            waiting.close()


def acquired_all(
    parts: Sequence[Part],
    permit_parts: Sequence[PermitPart],
    timeout: int | None,
    waitings: Sequence[WaitHandle],
) -> Waits:
    """:func:`acquire_all` once its waiters are registered (one per permit)."""
    names = [waiting.name for waiting in waitings]
    first = store_of(parts, permit_parts)
    clock = first.clock or time.monotonic
    start = _core.clock_to_micros(clock())
    deadline = None if timeout is None else start + timeout
    order = ordered(permit_parts)
    held: list[Held | None] = [None] * len(permit_parts)
    sent = 0
    try:
        while True:
            wait = None if deadline is None else max(0, deadline - _core.clock_to_micros(clock()))
            # No time left to wait (a timeout of 0): a busy permit refuses at once,
            # answered with the tokens' decision as the in-process call does.
            queue = wait is None or wait > 0
            queue_as = [
                None if held[i] or not queue else names[i] for i in range(len(permit_parts))
            ]
            combined, n = yield from combined_call(
                parts, permit_parts, RESERVE, wait, queue_as, held
            )
            sent += n
            if combined.queued is None:
                break
            position, hint = combined.queued
            for i, answer in enumerate(combined.helds):
                if answer.member is not None:
                    held[i] = answer
            i = order[position]
            pstate, key = permit_parts[i]
            got, n = yield from wait_for(pstate, key, pstate.key(key), waitings[i], hint, deadline)
            sent += n
            if got.member is None:  # the timeout passed: everything it holds goes back
                yield from release_all(permit_parts, held)
                refusal = got.decision
                helds = [Held(k, refusal) for _, k in permit_parts]
                lines: list[Line | None] = [None] * len(parts)
                combined = Combined(Reserved(refusal, refusal.retry_after, lines), helds)
                break
            held[i] = got
    except (Unanswered, Corrupt) as failure:
        yield from release_all(permit_parts, held)
        failed_all(parts, permit_parts, failure)
        if isinstance(failure, Corrupt):
            combined = refused_all(parts, permit_parts)
        else:
            wait = None if deadline is None else max(0, deadline - _core.clock_to_micros(clock()))
            combined = yield from all_without_store(parts, permit_parts, wait, wait=True)
        count_all(parts, permit_parts, sent + failure.sent, combined.reserved.decision.allowed)
        return combined
    except BaseException:
        yield from release_all(permit_parts, held)
        raise
    count_all(parts, permit_parts, sent, combined.reserved.decision.allowed)
    return combined


def release_all(permit_parts: Sequence[PermitPart], held: Sequence[Held | None]) -> Flow[None]:
    """Releases the permits a waiting acquire_all holds (its wait ended refused, or
    it stopped): one release each, never raising for the store (a permit it cannot
    reach expires by its ttl)."""
    for (state, key), one in zip(permit_parts, held, strict=True):
        if one is None or one.member is None:
            continue
        try:
            _, sent = yield from ask_about(state, state.key(key), RELEASE, member=one.member)
        except (Unanswered, Corrupt) as failure:
            state.counters.add(failure.sent)
            state.counters.event("lost_releases")
            continue
        except Exception:
            logger.debug("%s: a release failed", state.name, exc_info=True)
            continue
        state.counters.add(sent)


def give_back_all(
    parts: Sequence[Part],
    more: Sequence[tuple[Any, ...]],
    permit_parts: Sequence[PermitPart],
    members: Sequence[str],
) -> Flow[None]:
    """A reservation's give-backs (``parts`` with their lines in ``more``) and the
    releases of its permits (``members``), in one script (the general script's
    ``REFUND``); without the store they are lost for it (counted and logged: the
    tokens stay spent, the permits expire by their ttl)."""
    order = list(range(len(permit_parts)))
    names: list[str | None] = [None] * len(permit_parts)
    command = combined_command(parts, more, permit_parts, order, REFUND, list(members), names)
    first = store_of(parts, permit_parts)
    breaker = first.breaker(command.keys[0])
    try:
        reply, sent = yield from guarded(first, breaker, command, wrote=True)
    except (Unanswered, Corrupt) as failure:
        first.counters.add(failure.sent)
        for state, key, cost in parts:
            lost(state, [(key, cost)], failure.error)
        for (pstate, key), member in zip(permit_parts, members, strict=True):
            lost_release(pstate, Held(key, pstate.fallback.open, member=member), failure)
        if raises(parts, permit_parts):
            refuse(failure, breaker)
        return
    first.counters.add(sent)
    for (pstate, _), answer in zip(permit_parts, reply[6] or [], strict=False):
        if int(answer[0]):
            pstate.counters.event("released")


class ReservedPermits:
    """The permits of a reservation made with them (the ``*_all`` calls): held until
    its ``cancel()`` or ``settle()``, which release them, in the script of its
    give-backs (``bucketlimit._redis.reservations`` asks this for that script).
    ``where``: per check of the call, whether it is a permit's."""

    __slots__ = ("clock", "holders", "parts", "where")

    def __init__(
        self,
        holders: Sequence[PermitHolder],
        parts: Sequence[PermitPart],
        where: Sequence[bool],
    ) -> None:
        self.holders = tuple(holders)
        self.parts = list(parts)
        self.where = list(where)
        self.clock = parts[0][0].clock

    def token_uses(self, used: object, buckets: int) -> object:
        """``settle``'s ``used`` for the token buckets alone: one int for every check,
        or a sequence of one per check (a permit's checked, then left out)."""
        if not isinstance(used, (tuple, list)):
            return used
        if len(used) != len(self.where):
            raise ValueError(
                f"settle got {len(used)} used values for a reservation of {len(self.where)} checks"
            )
        for value, is_permit in zip(used, self.where, strict=True):
            if is_permit:
                if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                    raise TypeError(f"used must be an int, got {type(value).__name__}")
                if value.__index__() < 0:
                    raise ValueError(f"used must be >= 0, got {value.__index__()}")
        return [value for value, is_permit in zip(used, self.where, strict=True) if not is_permit]

    def local_uses(self, parts: Sequence[Part], shares: Sequence[int]) -> list[int]:
        """The settle of an in-process reservation made under ``"local"``
        (:func:`all_without_store`): its buckets' shares, then 1 per local permit."""
        mine = [share for (s, _, _), share in zip(parts, shares, strict=True) if s.fallback.local]
        for holder in self.holders:
            holder.claim()  # the in-process reservation releases them
        return mine + [1 for state, _ in self.parts if state.fallback.local is not None]

    def give_back(
        self, parts: Sequence[Part], more: Sequence[tuple[Any, ...]]
    ) -> list[tuple[Flow[Any], Any]]:
        """The one script giving back ``parts`` (with their lines, ``more``) and
        releasing every permit not released yet by its holder."""
        mine = [
            (part, holder.held.member)
            for part, holder in zip(self.parts, self.holders, strict=True)
            if holder.claim() and holder.held.member is not None
        ]
        if not parts and not mine:
            return []
        pparts = [part for part, _ in mine]
        members = [member for _, member in mine if member is not None]
        if not pparts:
            if len(parts) == 1:
                state, key, cost = parts[0]
                line = None if more[0][0] == NONE else more[0][:3]
                return [(give_back(state, key, cost, line, more[0][3] if line else 0), state)]
            return [(change_all(parts, REFUND, more), parts[0][0])]
        return [(give_back_all(parts, more, pparts, members), store_of(parts, pparts))]
