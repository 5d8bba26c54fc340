"""The calls over several limiters, one script each (docs/design.md §4, "Permits
with tokens"): ``allow_all`` and ``reserve_all`` over token buckets with or
without concurrency permits among them (:func:`reserve_all`), ``acquire_all``
with permits (:func:`acquire_all`, waiting its turn at a busy permit), and the
give-backs of their reservations, which release the permits in the same script
(:class:`ReservedPermits`). The decisions combine by ``_core.combine``, the rule
of the in-process ``*_all``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._redis.buckets import (
    Line,
    Part,
    Reserved,
    change_all,
    general,
    give_back,
    lost,
    reserved_of,
)
from bucketlimit._redis.flows import (
    Corrupt,
    Flow,
    Local,
    ScriptCommand,
    Unanswered,
    guarded,
    refuse,
    spent,
    unanswered,
)
from bucketlimit._redis.keys import check_one_slot
from bucketlimit._redis.permit_flows import Waits, ask_about, lost_release, wait_for
from bucketlimit._redis.permits import (
    FREE,
    GRANTED,
    KEPT,
    QUEUED,
    Held,
    PermitHolder,
    PermitState,
    degraded,
    granted_decision,
    refused_decision,
)
from bucketlimit._redis.resilience import CLOSED, RAISE
from bucketlimit._redis.script import (
    ALLOW,
    NONE,
    REFUND,
    RELEASE,
    RESERVE,
    Mode,
    permit_keys,
)
from bucketlimit._redis.wakeups import WaitHandle

logger = logging.getLogger("bucketlimit")


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
    """The general script over the buckets (``buckets.general``, which is all of it
    without permits) and then the permit keys in ``order`` (each its four keys),
    each with its member (a permit the call holds) or name (a waiter queued there if
    it is busy). On a cluster every key must share one slot: said before anything
    is sent."""
    if not permit_parts:
        return general(parts, mode, more)
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
    call held already (a waiting acquire_all's), which answer with their grants.
    Without permits the script answers as over buckets alone (``buckets.reserved_of``)."""
    if not permit_parts:
        return Combined(reserved_of(parts[0][0], reply, len(parts)), [])
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
    """A call over several: its commands once (on the state it went through, the
    first), its decision once per check on the check's limiter, as the in-process
    ``*_all`` counts (two keys of one limiter: twice)."""
    states = [s for s, _, _ in parts] + [s for s, _ in permit_parts]
    states[0].counters.add(sent, allowed)
    for state in states[1:]:
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
    ``Unanswered`` / ``Corrupt`` for the caller to answer by the policies. After
    ``READONLY`` only a write closes the breaker: over buckets alone only an
    allowed answer wrote (``flows.spent``); with permits every answer counts as
    one, as a permit's own calls do."""
    order = ordered(permit_parts)
    more = [(NONE if max_wait is None else max_wait, NONE, NONE, NONE)] * len(parts)
    members = [None if held is None else held.member for held in before]
    command = combined_command(parts, more, permit_parts, order, mode, members, names)
    first = store_of(parts, permit_parts)
    breaker = first.breaker(command.keys[0])
    wrote = True if permit_parts else spent
    reply, sent = yield from guarded(first, breaker, command, wrote=wrote)
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
        first.degraded(failure.error, logged=False, refused=True)
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
    mode: Mode,
    max_wait: int | None,
    *,
    wait: bool,
) -> Waits:
    """A call over several without the store, each limiter's policy, all or nothing;
    every answer is degraded. Any ``"closed"`` limiter refuses the call, answered
    as the call's first limiter (:func:`refused_all`: its breaker is the one that
    says when the store is asked again, and a corrupt key refuses so too); when
    all are ``"open"`` it is granted, taking nothing, answered as the first
    limiter too; ``"open"`` ones among others take nothing. The ``"local"`` ones
    decide together in process, on this process's shares: each check charged at
    most its limiter's share, by ``_core.reserve_all``, or with ``wait``
    ``_core.acquire_all`` (its permits waited for). ``allow_all`` over buckets
    alone answers a decision and holds nothing: ``_core.allow_all``, and with one
    cost for every check (pairs) each is charged at most the smallest of the
    local shares, so that all are charged the same cost, as the call asked."""
    first = store_of(parts, permit_parts)
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
        granted = (
            first.fallback.open
            if isinstance(first, PermitState)
            else first.fallback.decide("", 1, peek=False)
        )
        return Combined(Reserved(granted, 0.0, lines, stored=False), helds)
    if mode is ALLOW and not permit_parts:
        costs = {cost for _, _, cost in parts}
        if len(costs) == 1:
            shares = [s.fallback.share for s, _, _ in parts if s.fallback.local is not None]
            one = min(costs.pop(), *shares)
            local = [(limiter, key, one) for limiter, key, _ in local]
        decision = _core.allow_all(local)  # the local limiters answer degraded
        return Combined(Reserved(decision, 0.0, lines, stored=False), [])
    # An allow never waits: without the store, as with it, what is not there now is refused.
    seconds = 0.0 if mode is ALLOW else None if max_wait is None else max_wait / 1_000_000
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
    """``allow_all`` (``ALLOW``) and ``reserve_all`` (``RESERVE``) over token buckets
    and permits (``permit_parts`` may be empty): one script decides every bucket
    and every permit at one moment, all or nothing; a permit is taken only if it
    is free now (a reservation never queues for one), and lives ``ttl`` from when
    the tokens are ready. Without the store, each limiter's policy
    (:func:`all_without_store`); a corrupt key refuses (:func:`refused_all`)."""
    try:
        no = [None] * len(permit_parts)
        combined, sent = yield from combined_call(parts, permit_parts, mode, max_wait, no, no)
    except (Unanswered, Corrupt) as failure:
        failed_all(parts, permit_parts, failure)
        if isinstance(failure, Corrupt):
            combined = refused_all(parts, permit_parts)
        else:
            combined = yield from all_without_store(parts, permit_parts, mode, max_wait, wait=False)
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
            combined = yield from all_without_store(parts, permit_parts, RESERVE, wait, wait=True)
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
