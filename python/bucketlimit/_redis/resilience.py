"""What a distributed limiter does when its store fails (docs/design.md §6), apart from the store.

Three small parts, shared by the sync and the asyncio Redis limiters, which know
nothing of Redis here:

- :class:`Breaker`: after a store failure, skip the store for ``retry_interval``
  seconds, then let exactly one call probe it; the others keep answering without
  the store while the probe is out. An outage costs one timeout per interval.
- :class:`RefusalCache`: a key the store refused stays refused here, without a
  round trip, for the wait the store gave (at most :data:`REFUSAL_CACHE_MAX_AGE`).
- :class:`Fallback`: the answer of the ``on_store_error`` policy.

Times here are ``time.monotonic()``: a limiter's injected clock (a ``ManualClock``
in a test) measures buckets, not outages.

Every lock here guards a few fields for a few instructions: none is ever held
across a network call or an ``await``, and nothing is logged under one.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import operator
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Final, Literal, cast

from bucketlimit._core import Decision, TokenBucketLimiter
from bucketlimit._histogram import fork_safe

logger = logging.getLogger("bucketlimit")

#: An ``on_store_error`` policy, as a type: ``"locl"`` does not type-check.
Policy = Literal["local", "open", "closed", "raise"]

#: The ``on_store_error`` policies.
LOCAL: Final = "local"
OPEN: Final = "open"
CLOSED: Final = "closed"
RAISE: Final = "raise"
POLICIES: Final = (LOCAL, OPEN, CLOSED, RAISE)

#: Refused keys remembered at most (oldest dropped first): about 250 bytes each,
#: whatever the key's length (a key is remembered by a 16-byte digest).
REFUSAL_CACHE_SIZE: Final = 10_000

#: Seconds a remembered refusal is trusted at most, however long the store said
#: to wait: this bounds the one staleness of the cache (tokens given back by
#: another process, by ``reset`` or ``refund``) and still turns a flood from one
#: refused key into at most one store command per second and process.
REFUSAL_CACHE_MAX_AGE: Final = 1.0


def _less(wait: float, elapsed: float) -> float:
    """A wait from the store (whole µs, or inf) less ``elapsed`` seconds, in whole µs.

    ``elapsed`` is rounded to the nearest µs: it is a difference of two float clock
    readings, a hair off (0.2 reads 0.1999999999999993).
    """
    if math.isinf(wait):
        return wait
    return max(0, round(wait * 1_000_000) - round(elapsed * 1_000_000)) / 1_000_000


# The limiters' failure settings, checked as the core checks its own (docs/design.md §3):
# TypeError for the wrong type, ValueError for the wrong value.


def check_processes(processes: object) -> int | None:
    """``processes``: ``None`` (learned from the store) or an int >= 1."""
    if processes is None:
        return None
    if isinstance(processes, (bool, float)):
        raise TypeError(f"processes must be an int, got {type(processes).__name__}")
    try:
        value = operator.index(processes)  # type: ignore[arg-type]  # checked by the call
    except TypeError:
        raise TypeError(f"processes must be an int, got {type(processes).__name__}") from None
    if value < 1:
        raise ValueError(f"processes must be >= 1, got {value}")
    return value


def check_retry_interval(retry_interval: object) -> float:
    if isinstance(retry_interval, bool) or not isinstance(retry_interval, (int, float)):
        raise TypeError(
            f"retry_interval must be an int or float, got {type(retry_interval).__name__}"
        )
    if not 0 <= retry_interval < math.inf:
        raise ValueError(
            f"retry_interval must be finite and >= 0 (seconds), got {retry_interval!r}"
        )
    return float(retry_interval)


def check_policy(on_store_error: object) -> Policy:
    if not isinstance(on_store_error, str):
        raise TypeError(f"on_store_error must be a str, got {type(on_store_error).__name__}")
    if on_store_error not in POLICIES:
        raise ValueError(
            f"on_store_error must be one of {', '.join(map(repr, POLICIES))}, "
            f"got {on_store_error!r}"
        )
    return cast("Policy", on_store_error)


#: Seconds between two heartbeats of a process sharing a limiter once its count has
#: settled (at most one a process and limiter per interval, sent after a call the
#: store answered).
HEARTBEAT_INTERVAL: Final = 10.0
#: Seconds between two heartbeats while the count has not settled: processes started
#: together count each other within a few of these.
SETTLE_INTERVAL: Final = 1.0
#: Seconds a process counts as live after its last heartbeat.
PROCESS_TTL: Final = 30.0


def _member() -> str:
    """This process's name among the processes sharing a limiter: new in each fork."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(6).hex()}"


class Processes:
    """How many processes share a limiter, which sets the ``"local"`` share.

    ``processes=N`` fixes it. By default (``None``) it is learned from the store
    while the store is up (docs/design.md §6, "How many processes"): a process says
    it is alive after its first call the store answers, and the store answers how
    many count now. The count is *known* once two heartbeats at least
    :data:`SETTLE_INTERVAL` apart read the same number (processes started together
    each read a different one first); heartbeats then go every
    :data:`HEARTBEAT_INTERVAL` seconds, and a process counts for :data:`PROCESS_TTL`
    seconds after its last. A count that grows is taken at once, one that shrinks
    once it has settled, so the share only ever errs on the small side. Until the
    count is known, ``"local"`` refuses (it fails closed: no share can be told).
    """

    def __init__(self, fixed: int | None) -> None:
        self.fixed = fixed
        self.count = 1 if fixed is None else fixed
        self.known = fixed is not None
        self.refused = False  # the store refused the heartbeat (an ACL): never counted
        self.member = _member()
        self._read: int | None = None  # what the last heartbeat read
        self._next = 0.0  # time.monotonic() when the next heartbeat is due: at once

    def forked(self) -> None:
        """In a forked child, another process: it counts itself, and is counted, anew."""
        self.member = _member()
        if self.fixed is None:
            self.count, self.known, self._read, self._next = 1, False, None, 0.0

    def pending(self) -> bool:
        """Whether a heartbeat is due (``due`` claims it); changes nothing."""
        return self.fixed is None and time.monotonic() >= self._next

    def due(self) -> bool:
        """True once an interval (to the call that asks first): send a heartbeat."""
        if self.fixed is not None:
            return False
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + (HEARTBEAT_INTERVAL if self.known else SETTLE_INTERVAL)
        return True

    def learned(self, count: int) -> bool:
        """A heartbeat read ``count`` live processes; True when the share changes."""
        count = max(1, count)
        settled, self._read = count == self._read, count
        if not settled:
            self._next = time.monotonic() + SETTLE_INTERVAL
            if not self.known or count <= self.count:
                return False
            self.count = count  # more than the share counts: fewer tokens each, at once
            return True
        self._next = time.monotonic() + HEARTBEAT_INTERVAL
        changed = not self.known or count != self.count
        self.count, self.known = count, True
        return changed

    def describe(self) -> str:
        if self.fixed is not None:
            return f"with processes={self.fixed} fixed"
        if self.known:
            return f"with {self.count} live processes counted by the store"
        if self.refused:
            return (
                "the store refused the heartbeat that counts the processes sharing the "
                "limit, so no share can be told (pass processes=N to fix the number)"
            )
        return (
            "the store has not counted the processes sharing the limit yet, so no share "
            "can be told (a process is counted from its first answered call, within a "
            "few seconds; pass processes=N to fix the number)"
        )


class Gate(enum.Enum):
    """What the breaker lets a call do."""

    STORE = "store"  # the breaker is closed: ask the store
    PROBE = "probe"  # the breaker is open and this call is the one probing the store
    SKIP = "skip"  # the breaker is open: answer without the store


# As module constants (an Enum member read through its class costs ~80 ns).
STORE, PROBE, SKIP = Gate.STORE, Gate.PROBE, Gate.SKIP


class Breaker:
    """Skips a failing store for ``retry_interval`` seconds, then lets one call probe it.

    Any answer from the store closes the breaker, except after ``READONLY``: a
    demoted primary still answers what writes nothing (a refusal, a peek), so the
    store counts as failing until a write succeeds (``succeeded(gate, wrote=True)``),
    and one outage is one opening, not one per refusal. A store failure opens it
    (or, for a failed probe, keeps it open for another interval). Opening logs one
    WARNING and closing one INFO line per outage, on the ``bucketlimit`` logger.
    ``retry_interval == 0`` turns the skipping off: every call asks the store
    (the outage is still counted and logged once).
    """

    def __init__(
        self,
        retry_interval: float,
        name: str,
        fallback: str | Callable[[], str],
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.retry_interval = retry_interval
        self._monotonic = monotonic  # a parameter for the tests; never the limiter's clock
        self._name = name  # says which limiter in the logs
        self._fallback = fallback  # says what answers meanwhile, in the logs
        self._lock = threading.Lock()
        # Read without the lock by the limiters' common case: while it is False a
        # call goes to the store with no other step (admit() would say STORE).
        self.open = False
        self._probing = False
        self._retry_at = 0.0  # time.monotonic() at which a probe may go
        self.opened_at = 0.0
        self._skipped = 0  # calls answered without the store in this outage
        self._last_error = ""
        self._until_write = False  # opened by READONLY: only a write closes it
        self.openings = 0
        fork_safe(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._probing = False  # the probing thread, if any, is not in this process

    def admit(self) -> Gate:
        # Unlocked fast path: a call racing with the opening is the call that was
        # already on its way when the store failed (at most one per thread).
        if not self.open or self.retry_interval == 0:
            return STORE
        with self._lock:
            if not self.open:
                return STORE
            if self._probing or self._monotonic() < self._retry_at:
                self._skipped += 1
                return SKIP
            self._probing = True
            return PROBE

    def skips(self) -> bool:
        """Whether a call asking now would be answered without the store (open, and
        not yet time for a probe); changes nothing."""
        return self.open and self.retry_interval > 0 and self._monotonic() < self._retry_at

    def succeeded(self, gate: Gate, *, wrote: bool = True) -> None:
        """The store answered (even with an error reply about one key); ``wrote``:
        the answer was a write (an allow that spent, a refund, a reset)."""
        if not self.open and gate is not PROBE:
            return
        with self._lock:
            if gate is PROBE:
                self._probing = False
            if not self.open:
                return
            if self._until_write and not wrote:
                # Still read-only as far as we know: probe again after an interval.
                self._retry_at = self._monotonic() + self.retry_interval
                return
            self.open = False
            self._until_write = False
            outage = self._monotonic() - self.opened_at
            skipped, self._skipped = self._skipped, 0
        # INFO where the application configured logging; where it configured none,
        # a WARNING, which logging's last resort writes to stderr, as it wrote the
        # outage's start: an outage's end is never silent either.
        logger.log(
            logging.INFO if logger.hasHandlers() else logging.WARNING,
            "%s: the store answers again after %.1f s; %d calls were answered without it",
            self._name,
            outage,
            skipped,
        )

    def failed(self, gate: Gate, error: BaseException, *, read_only: bool = False) -> None:
        """The store failed (a timeout, a lost connection, a busy or read-only server);
        ``read_only``: it said ``READONLY``, so only a write will close the breaker."""
        now = self._monotonic()
        with self._lock:
            if gate is PROBE:
                self._probing = False
            self._retry_at = now + self.retry_interval
            self._last_error = f"{type(error).__name__}: {error}"
            self._until_write = self._until_write or read_only
            if self.open:
                return
            self.open = True
            self.opened_at = now
            self.openings += 1
        logger.warning(
            "%s: the store failed (%s); %s until one call asks it again after %g s",
            self._name,
            self._last_error,
            self._fallback() if callable(self._fallback) else self._fallback,
            self.retry_interval,
        )

    def release(self, gate: Gate) -> None:
        """The call ended without telling whether the store works (cancelled, or an
        error that is not a store failure): another call may probe."""
        if gate is PROBE:
            with self._lock:
                self._probing = False

    def describe(self) -> str:
        """Why a call was not sent, for the error raised under ``on_store_error="raise"``."""
        now = self._monotonic()
        with self._lock:
            since = now - self.opened_at
            wait = max(0.0, self._retry_at - now)
            last = self._last_error
        return (
            f"{self._name}: the store failed {since:.1f} s ago ({last}); it is asked again "
            f"in {wait:.1f} s (retry_interval={self.retry_interval:g})"
        )


class _Refusal:
    __slots__ = ("cost", "decision", "expires", "started")

    def __init__(self, cost: int, decision: Decision, started: float, expires: float) -> None:
        self.cost = cost
        self.decision = decision
        self.started = started
        self.expires = expires


class RefusalCache:
    """Keys the store refused, refused again here until their wait has passed.

    Sound because tokens only appear by refill: if the store refused ``cost`` and
    said to wait ``r``, the same or a larger cost cannot pass before ``r`` has
    passed, whatever other processes do, except give tokens back (``reset``,
    ``refund``). ``started`` is read before the command is sent, so a slow reply
    never stretches the wait. Bounded: :data:`REFUSAL_CACHE_SIZE` keys, oldest
    first out; an entry lives at most :data:`REFUSAL_CACHE_MAX_AGE` seconds.
    """

    def __init__(
        self, size: int = REFUSAL_CACHE_SIZE, max_age: float = REFUSAL_CACHE_MAX_AGE
    ) -> None:
        self._size = size
        self._max_age = max_age
        self._lock = threading.Lock()
        # Insertion-ordered: the first entry is the oldest. Read without the lock by
        # the limiters' common case: while it is empty there is nothing to look up.
        self.entries: dict[bytes, _Refusal] = {}
        fork_safe(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    @staticmethod
    def _digest(key: bytes) -> bytes:
        # Keys may be 4 KB long; a 128-bit digest bounds memory per entry.
        return hashlib.blake2b(key, digest_size=16).digest()

    def get(self, key: bytes, cost: int, now: float) -> Decision | None:
        """The refusal still in force for ``key`` at ``cost``, with the wait left."""
        if not self.entries:
            return None  # the common case: no digest to compute
        digest = self._digest(key)
        with self._lock:
            entry = self.entries.get(digest)
            if entry is None:
                return None
            if now >= entry.expires:
                del self.entries[digest]
                return None
        if cost < entry.cost:
            return None  # a smaller cost might pass: only the store knows
        stored = entry.decision
        elapsed = now - entry.started
        retry_after = _less(stored.retry_after, elapsed)
        reset_after = max(retry_after, _less(stored.reset_after, elapsed))
        return Decision(False, retry_after, stored.remaining, reset_after, stored.limit)

    def put(self, key: bytes, cost: int, refusal: Decision, started: float) -> None:
        lifetime = min(refusal.retry_after, self._max_age)
        if not lifetime > 0:
            return
        digest = self._digest(key)
        entry = _Refusal(cost, refusal, started, started + lifetime)
        with self._lock:
            self.entries.pop(digest, None)  # re-inserted last: the newest
            self.entries[digest] = entry
            if len(self.entries) > self._size:
                del self.entries[next(iter(self.entries))]

    def drop(self, key: bytes) -> None:
        if not self.entries:
            return  # the common case: no digest to compute
        digest = self._digest(key)
        with self._lock:
            self.entries.pop(digest, None)

    def __len__(self) -> int:
        return len(self.entries)


class Fallback:
    """The answers of an ``on_store_error`` policy other than ``"raise"``.

    - ``"local"``: an in-process bucket per key holding this process's share,
      ``max(1, capacity // processes)`` tokens refilled at exactly
      ``rate / processes``, on the limiter's clock; a cost above the share (legal,
      since it is at most the capacity) is charged at the share.
    - ``"open"``: allowed.
    - ``"closed"``: refused; ``retry_after`` is ``retry_interval``, when the store
      is asked again.

    Every answer has ``degraded=True``. Nothing is known of the shared bucket, so
    ``open`` and ``closed`` report ``remaining=0`` and ``limit=capacity``.
    """

    def __init__(
        self,
        policy: str,
        capacity: int,
        p: int,
        unit: int,
        *,
        processes: int,
        retry_interval: float,
        clock: Callable[[], float] | None,
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self.share = max(1, capacity // processes)
        self.local: TokenBucketLimiter | None = None
        if policy == LOCAL:
            # p units a microsecond with unit = q * 10**6 units a token is p/q tokens
            # a second; p per q*processes seconds is exactly the share of the rate.
            per = unit // 1_000_000 * processes
            try:
                self.local = TokenBucketLimiter._fallback(self.share, p, clock, per=per)
            except ValueError as e:
                raise ValueError(
                    f"processes={processes}: the local fallback's share of the rate "
                    f"({p} tokens per {per} s) is beyond the exact range: {e}"
                ) from None
        #: What answers while the store is skipped, for the breaker's log line.
        self.description = {
            LOCAL: "calls are answered from this process's share of each bucket",
            OPEN: "calls are allowed",
            CLOSED: "calls are refused",
            RAISE: "calls raise StoreUnavailableError",
        }[policy]
        wait = float(retry_interval)
        self._open = Decision(True, 0.0, 0, 0.0, capacity, True)
        self._closed = Decision(False, wait, 0, wait, capacity, True)

    def refusal(self) -> Decision:
        """A refusal without the store: ``closed``, and a corrupt bucket under any policy."""
        return self._closed

    def decide(self, key: str, cost: int, *, peek: bool) -> Decision:
        if self.local is None:
            return self._open if self.policy == OPEN else self._closed
        charged = min(cost, self.share)
        return self.local.peek(key, charged) if peek else self.local.allow(key, charged)

    def charge(self, key: str, cost: int) -> Decision:
        """A charge without the store: recorded in this process's share under
        ``"local"`` (debt allowed there too); ``open`` and ``closed`` answer as for
        an allow and record nothing."""
        if self.local is None:
            return self._open if self.policy == OPEN else self._closed
        return self.local.charge(key, cost)

    def refund(self, key: str, cost: int) -> None:
        if self.local is not None:
            self.local.refund(key, min(cost, self.share))

    def reset(self, key: str) -> None:
        if self.local is not None:
            self.local.reset(key)
