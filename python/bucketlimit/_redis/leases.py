"""Leases for hot keys (docs/design.md §6, "Hot keys: leases"; docs/redis.md).

With ``lease=True`` a Redis limiter takes tokens of a key ahead of use: one script
call (a ``lease`` of the limiter's script, scripts.md) charges the shared bucket
``n`` tokens, exactly as an allow of ``n`` would (or, when the bucket is short, as a
reservation of ``n`` waiting its turn), and records the lease with an expiry on the
store's clock. ``allow()`` for that key is then answered in process, from the lease,
until it is spent or its period is over. While leases are out, their tokens lower
the shared bucket's cap, so the bucket and every lease together never hold more than
the capacity: the bound ``capacity + rate * T`` holds for what every process uses,
in every window.

Here, apart from I/O:

- :class:`LeasePolicy`: the knobs and the sizing rule.
- :class:`LeaseState`: one limiter's leases in this process: the native ledger
  (``bucketlimit._core.Leases``, the fast path), the name its leases are recorded
  under, the counters ``stats()`` reports; a forked child starts with none, and the
  interpreter gives back what is left when it exits.
- The flows (``bucketlimit._redis.flows``' shape): :func:`allow`, the slow path of a
  leased ``allow()`` (renewing the lease); :func:`give_back_all` (``close()``, exit);
  leases past their period given back on the way (:func:`give_back_due`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._histogram import fork_safe
from bucketlimit._redis import buckets, flows
from bucketlimit._redis.flows import Corrupt, Flow, ScriptCommand, Unanswered
from bucketlimit._redis.script import LEASE, lease_hash
from bucketlimit._redis.state import Counters, LimiterState

logger = logging.getLogger("bucketlimit")

#: The shortest window demand is measured over (µs): two calls a microsecond apart
#: are not a million calls a second.
MIN_WINDOW_US: Final = 1_000
#: Leases past their period given back by one slow-path call at most (the others on
#: later calls): a call pays at most this many extra round trips.
GIVE_BACKS_PER_CALL: Final = 2
#: The longest period a policy may have, in seconds.
MAX_PERIOD: Final = 3600.0


def _seconds(value: object, name: str, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int or float, got {type(value).__name__}")
    low = value > 0 if positive else value >= 0
    if not low or not value <= MAX_PERIOD:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(
            f"{name} must be {bound} and at most {MAX_PERIOD:g} seconds, got {value!r}"
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class LeasePolicy:
    """How a limiter leases (``lease=LeasePolicy(...)``; ``lease=True`` is the default
    policy). The defaults need no tuning for fleets of 1 to 100 processes.

    - ``period``: seconds a lease is used at most, from when it starts. Its record in
      the store lives twice as long, so a lease given back at the end of its period
      is still there to take its tokens back; a process that dies holds its lease's
      tokens that long at most.
    - ``share``: the fraction of the capacity that every process's leases together
      may hold: one process's lease is at most ``share * capacity / processes``
      tokens (``processes``: the live processes the store counts, or the leases of
      the key it counts, whichever is more), so outstanding leases never starve
      the others, and a newcomer always finds the rest in the shared bucket.
    - ``max_wait``: seconds a lease may wait its turn in the shared bucket when it is
      short (a reservation: FIFO with every other waiter). 0 takes only what the
      bucket holds now.

    A lease holds half a period of this process's demand for the key (the tokens it
    was asked since its last lease, per second, refusals included), within the
    share, and at least the cost of the call that takes it. A key's first call takes
    a lease of its own cost (the store's exact answer), so a key asked once costs
    nothing more than without leasing; its second call is sized from the first.
    """

    period: float = 1.0
    share: float = 0.5
    max_wait: float = 0.25

    def __post_init__(self) -> None:
        _seconds(self.period, "period", positive=True)
        _seconds(self.max_wait, "max_wait", positive=False)
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)):
            raise TypeError(f"share must be an int or float, got {type(self.share).__name__}")
        if not 0 < self.share <= 1:
            raise ValueError(f"share must be > 0 and <= 1, got {self.share!r}")
        if self.max_wait > self.period:
            raise ValueError(
                f"max_wait ({self.max_wait!r} s) must not exceed the period ({self.period!r} s)"
            )

    def size(self, capacity: int, cost: int, processes: int, asked: int, elapsed: int) -> int:
        """Tokens to ask for: ``asked`` tokens were asked over ``elapsed`` µs (-1: no
        lease yet, a lease of ``cost``), within this process's share of ``capacity``
        among ``processes``, and at least ``cost``."""
        if elapsed < 0:
            return cost
        share = max(1, math.floor(capacity * self.share) // max(1, processes))
        demand = asked * 1_000_000 / max(elapsed, MIN_WINDOW_US)  # tokens a second
        return max(cost, min(math.ceil(demand * self.period / 2), share))


def check_lease(lease: object) -> LeasePolicy | None:
    """``lease``: ``False`` or ``None`` (no leasing), ``True`` (the default policy) or a
    :class:`LeasePolicy`."""
    if lease is None or lease is False:
        return None
    if lease is True:
        return LeasePolicy()
    if isinstance(lease, LeasePolicy):
        return lease
    raise TypeError(f"lease must be a bool or a LeasePolicy, got {type(lease).__name__}")


class LeaseState:
    """One limiter's leases in this process (see the module docstring).

    ``name``: what its leases are recorded under in the store, one lease per name and
    key: this process's name (``Processes.member``, new in a forked child) and one of
    this object's, so that two limiters of one process sharing a prefix never take
    each other's leases.
    """

    def __init__(self, state: LimiterState, policy: LeasePolicy) -> None:
        self.policy = policy
        self.ledger = _core.Leases(state.capacity, state.clock)
        self.period = round(policy.period * 1_000_000)
        self.max_wait = round(policy.max_wait * 1_000_000)
        self._suffix = os.urandom(4).hex()
        self._exit: weakref.WeakMethod[Callable[[], None]] | None = None
        _HOLDERS.add(self)
        fork_safe(self)

    def _after_fork(self) -> None:
        # A child never inherits a lease: the parent's stay the parent's, in use there.
        self.ledger.clear()
        self._suffix = os.urandom(4).hex()

    def name(self, state: LimiterState) -> str:
        return f"{state.processes.member}/{self._suffix}"

    def at_exit(self, give_back: Callable[[], None]) -> None:
        """``give_back`` (a bound method of the limiter) runs when the interpreter
        exits, while the limiter lives."""
        self._exit = weakref.WeakMethod(give_back)

    def exiting(self) -> None:
        give_back = self._exit() if self._exit is not None else None
        if give_back is not None:
            give_back()

    def stats(self, counters: Counters) -> dict[str, int]:
        """The ``lease_*`` counters of ``stats()``: the limiter's ``counters``, and
        the hits its ledger counts."""
        return {"lease_hits": self.ledger.hits, **counters.snapshot(LEASE_COUNTERS)}


#: What the limiter's counters hold of its leases (tokens leased, given back,
#: expired unused; round trips).
LEASE_COUNTERS: Final = (
    "lease_round_trips",
    "lease_tokens",
    "lease_tokens_returned",
    "lease_tokens_expired",
)

#: The keys of ``stats()`` a limiter without leases reports as 0.
NO_LEASE_STATS: Final = {
    "lease_hits": 0,
    "lease_round_trips": 0,
    "lease_tokens": 0,
    "lease_tokens_returned": 0,
    "lease_tokens_expired": 0,
}

_HOLDERS: weakref.WeakSet[LeaseState] = weakref.WeakSet()


@atexit.register
def _give_back_at_exit() -> None:
    """Interpreter exit: every live limiter gives its leases back (one round trip a
    key); a failure only leaves those tokens spent until their records expire."""
    for leases in list(_HOLDERS):
        try:
            leases.exiting()
        except Exception as error:  # exiting: say so, and let the others give back theirs
            logger.warning("leases could not be given back at exit: %r", error)


# -- the flows --------------------------------------------------------------------


def allow(state: LimiterState, leases: LeaseState, key: str, cost: object) -> Flow[Decision]:
    """``allow(key, cost)`` when the lease did not answer (none, spent, past its
    period): the refusal cache first, then one caller renews the key's lease (the
    others, meanwhile, ask the shared bucket: :func:`buckets.decide`)."""
    cost = state.cost(cost)
    bucket = state.keys.bucket(key)  # checks the key
    yield from give_back_due(state, leases)
    refusals = state.refusals
    started = 0.0
    if refusals is not None:
        started = time.monotonic()
        cached = refusals.get(bucket, cost, started)
        if cached is not None:
            leases.ledger.ask(key, cost)
            state.counters.event("refusal_cache_hits")
            state.counters.add(0, False)
            return cached
    plan = leases.ledger.begin(key, cost)
    if plan is None:  # another caller renews this key's lease now
        return (yield from buckets.decide(state, key, cost))
    if isinstance(plan, Decision):  # renewed meanwhile
        return plan
    unused, asked, elapsed, holders = plan
    processes = max(state.processes.count, holders)
    want = leases.policy.size(state.capacity, cost, processes, asked, elapsed)
    return (yield from renew(state, leases, key, bucket, cost, want, unused, started))


def renew(
    state: LimiterState,
    leases: LeaseState,
    key: str,
    bucket: bytes,
    cost: int,
    want: int,
    unused: int,
    started: float,
) -> Flow[Decision]:
    """One round trip: the key's old lease ends (``unused`` tokens go back while its
    record lives) and a new one of up to ``want`` tokens is taken; this call's cost
    comes out of it. Answers this call: allowed (from the new lease), refused while
    the new lease waits its turn (``retry_after``: the store's delay), or refused by
    the shared bucket (the wait for ``cost`` there). Without the store, the policy
    answers (the lease held until now kept serving, ``degraded`` only from here)."""
    ledger = leases.ledger
    sent_at = ledger.now()  # before sending: the period never starts before the store's
    args = (
        cost,
        LEASE.value,
        state.now(),
        want,
        leases.name(state),
        leases.period,
        unused,
        leases.max_wait,
    )
    breaker = state.breaker(bucket)
    renewed = False
    try:
        command = ScriptCommand(state.own, [bucket, lease_hash(bucket)], args)
        reply, sent = yield from flows.guarded(state, breaker, command, wrote=True)
        renewed = True
    except Unanswered as failure:
        state.counters.leased(failure.sent, expired=unused)
        flows.unanswered(state, failure, breaker)  # raises under "raise"
        decision = state.fallback.decide(key, cost, peek=False)
        state.counters.add(failure.sent, decision.allowed)
        return decision
    except Corrupt as failure:
        state.counters.leased(failure.sent, expired=unused)
        decision = flows.corrupt(state, failure, breaker)
        state.counters.add(failure.sent, False)
        return decision
    except BaseException:  # a configuration error, an interruption: lost with the reply
        state.counters.leased(1, expired=unused)
        raise
    finally:
        if not renewed:
            ledger.end(key)
    try:
        decision = renewed_lease(state, leases, key, bucket, cost, reply, sent_at, unused, started)
    except BaseException:  # a reply not of this script's shape: the key is free again
        ledger.end(key)
        raise
    state.counters.add(sent, decision.allowed)
    state.counters.leased(sent)
    return decision


def renewed_lease(
    state: LimiterState,
    leases: LeaseState,
    key: str,
    bucket: bytes,
    cost: int,
    reply: Any,
    sent_at: int,
    unused: int,
    started: float,
) -> Decision:
    """The store's answer to a renewal (``reply``: a ``lease``'s, scripts.md): the new
    lease in the ledger (which frees the key), and this call's decision."""
    ledger = leases.ledger
    received = ledger.now()
    retry, remaining, reset_after, granted, delay, returned, holders = reply
    state.counters.leased(0, granted, returned, unused - returned)
    reset_at = received + reset_after if reset_after >= 0 else NEVER
    seconds_to_full = reset_after / 1_000_000 if reset_after >= 0 else math.inf
    refusals = state.refusals
    if not granted:
        ledger.grant(key, 0, received, received, reset_at, holders)
        decision = state.decision((retry, remaining, reset_after))
        if refusals is not None:
            refusals.put(bucket, cost, decision, started)
    elif not delay:
        left = granted - cost
        ledger.grant(key, left, received, sent_at + leases.period, reset_at, holders)
        # A lease of this call's cost alone (the store recorded none): the store's answer.
        lent = remaining if left == 0 else left
        decision = Decision(True, 0.0, lent, seconds_to_full, state.capacity)
        if refusals is not None and refusals.entries:
            refusals.drop(bucket)
    else:
        start, deadline = received + delay, sent_at + delay + leases.period
        ledger.grant(key, granted, start, deadline, reset_at, holders)
        wait = delay / 1_000_000
        decision = Decision(False, wait, 0, max(wait, seconds_to_full), state.capacity)
    return decision


#: A lease's ``reset_at`` when the bucket never fills (rate 0).
NEVER: Final = 2**63 - 1


def give_back(state: LimiterState, leases: LeaseState, key: str, unused: int) -> Flow[None]:
    """``key``'s lease ends: its record goes, and ``unused`` tokens go back to the
    shared bucket while it lives (within the headroom, docs/design.md §4). Without
    the store they stay spent until the record expires: counted, logged, never sent
    again; a give-back never raises for the policy (it runs on another key's call,
    at close, at exit)."""
    bucket = state.keys.bucket(key)
    args = (1, LEASE.value, state.now(), 0, leases.name(state), leases.period, unused, 0)
    breaker = state.breaker(bucket)
    try:
        command = ScriptCommand(state.own, [bucket, lease_hash(bucket)], args)
        reply, sent = yield from flows.guarded(state, breaker, command, wrote=True)
    except (Unanswered, Corrupt) as failure:
        state.counters.leased(failure.sent, expired=unused)
        buckets.lost(state, [(key, unused)], failure.error)
        state.counters.add(failure.sent)
        return
    finally:
        leases.ledger.end(key)
    returned = reply[5]
    state.counters.leased(sent, returned=returned, expired=unused - returned)
    state.counters.add(sent)


def give_back_due(state: LimiterState, leases: LeaseState) -> Flow[None]:
    """Leases past their period that still hold tokens (their keys gone quiet) go
    back, a few per call; nothing to do costs one native call."""
    for key, unused in leases.ledger.due(GIVE_BACKS_PER_CALL, 2 * leases.period):
        yield from give_back(state, leases, key, unused)


def give_back_all(state: LimiterState, leases: LeaseState) -> Flow[None]:
    """Every lease this limiter holds goes back (``close()``, ``aclose()``, exit),
    spent ones too: their records end, so none lowers the shared cap after it."""
    held = leases.ledger.drain()
    try:
        while held:
            key, unused = held.pop(0)
            yield from give_back(state, leases, key, unused)
    finally:
        for key, unused in held:  # interrupted: what was not sent stays spent
            state.counters.leased(0, expired=unused)
            leases.ledger.end(key)
