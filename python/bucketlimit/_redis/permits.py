"""Concurrency permits on Redis (docs/design.md §6, "Concurrency permits"), free of I/O.

A key's permits live on the store, on the script's clock (the server's ``TIME``, or
an injected clock), in the permit fragments of the general script (``scripts.lua``;
scripts.md: the operations of a permit key alone, and permit keys next to buckets in
the calls over several). They follow ``src/concurrency.rs``: at most ``limit``
unexpired permits per key, each expiring ``ttl`` after it was granted or renewed;
waiters queue in the order the server ran their scripts and are handed the slots
that free (a release, or an expiry a call noticed); every grant carries a fencing
token from the key's counter. This module holds what one limiter decides with
(:class:`PermitState`) and what a permit is (:class:`Held`, :class:`PermitHolder`).
The operations are flows: a limiter's own calls in ``permit_flows``, the
``*_all`` calls with permits among token buckets in ``combined``; the public
classes (``concurrency``) drive them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from bucketlimit import _core
from bucketlimit._core import ConcurrencyLimiter, Decision
from bucketlimit._histogram import ROUND_TRIP_BUCKETS, Histogram, fork_safe
from bucketlimit._redis.clients import LazyClient
from bucketlimit._redis.flows import (
    ScriptCommand,
)
from bucketlimit._redis.keys import Keys
from bucketlimit._redis.module import Engine
from bucketlimit._redis.resilience import (
    CLOSED,
    LOCAL,
    OPEN,
    RAISE,
    Policy,
    Processes,
)
from bucketlimit._redis.script import (
    GENERAL,
    LUA_EXACT,
    NONE,
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
        self.round_trips = Histogram(ROUND_TRIP_BUCKETS, wanted=False)
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
