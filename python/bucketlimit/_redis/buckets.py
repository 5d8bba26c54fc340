"""The token buckets' operations on Redis, each written once, as a flow
(docs/design.md §6): the common allow (:class:`Allow`, without a generator),
:func:`decide`, :func:`reserve`, :func:`give_back`, :func:`reset`,
:func:`charge`, :func:`observe`, the general script over several buckets
(:func:`general`) and a reservation's give-backs or charges in it
(:func:`change_all`); ``allow_all`` and ``reserve_all`` are ``combined``'s.
Each says what its answer is with the store and without it; the kernel
(``bucketlimit._redis.flows``) sends, resends and classifies.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._redis.flows import (
    NO_OUTCOME,
    Command,
    Corrupt,
    Flow,
    Flowing,
    ScriptCommand,
    Unanswered,
    answered,
    ask,
    check_store,
    check_wait,
    corrupt,
    guarded,
    not_given_back,
    spent,
    unanswered,
)
from bucketlimit._redis.keys import check_one_slot
from bucketlimit._redis.resilience import (
    RAISE,
    SKIP,
    STORE,
    Breaker,
    Gate,
)
from bucketlimit._redis.script import (
    ALLOW,
    CHARGE,
    LUA_EXACT,
    NONE,
    OBSERVE,
    PEEK,
    REFUND,
    RESERVE,
    SERVER_TIME,
    Mode,
    lease_hash,
)
from bucketlimit._redis.state import LimiterState

logger = logging.getLogger("bucketlimit")


# -- one bucket -------------------------------------------------------------------


def own_args(state: LimiterState, mode: Mode, cost: int) -> tuple[Any, ...]:
    """The arguments of a limiter's own script: cost, mode and now, each only when
    needed (the script takes cost 1, an allow and the server's TIME when absent)."""
    if state.clock is not None:
        return cost, mode.value, state.now()
    if mode is not ALLOW:
        return cost, mode.value
    return (cost,) if cost != 1 else ()


def decide(state: LimiterState, key: str, cost: object, *, peek: bool = False) -> Flow[Decision]:
    """``allow(key, cost)``: refill the bucket and spend ``cost`` if it holds that many;
    with ``peek``, what allow would answer, writing nothing. A refusal remembered
    answers at once; then the breaker, and :func:`decided`."""
    cost = state.cost(cost)
    bucket = state.keys.bucket(key)
    args = own_args(state, PEEK if peek else ALLOW, cost)
    refusals = state.refusals
    started = 0.0
    if refusals is not None:
        started = time.monotonic()  # before sending: a slow reply never stretches a wait
        cached = refusals.get(bucket, cost, started)
        if cached is not None:
            state.counters.event("refusal_cache_hits")
            state.counters.add(0, None if peek else False)  # counted as a refused allow
            return cached
    breaker = state.breaker(bucket)
    gate = breaker.admit()
    keys = state.bucket_keys(bucket)
    joins = None if peek or len(keys) > 1 else (cost, args[2] if len(args) > 2 else SERVER_TIME)
    command = ScriptCommand(state.own, keys, args, joins=joins)
    return (yield from decided(state, key, cost, command, started, breaker, gate, peek=peek))


def decided(
    state: LimiterState,
    key: str,
    cost: int,
    command: ScriptCommand,
    started: float,
    breaker: Breaker,
    gate: Gate,
    *,
    peek: bool = False,
    failed: BaseException | None = None,
) -> Flow[Decision]:
    """The rest of :func:`decide` once its gate is known: the script, then the answer
    from the reply, or the failure policy's. ``failed``: the command was sent already
    and raised this (:class:`Allow`, the common allow, goes on here)."""
    if gate is SKIP:
        return by_policy(state, key, cost, Unanswered(None, 0), breaker, peek=peek)
    try:
        reply, sent = yield from ask(state, breaker, gate, command, failed=failed)
    except Unanswered as failure:
        return by_policy(state, key, cost, failure, breaker, peek=peek)
    except Corrupt as failure:
        decision = corrupt(state, failure, breaker)
        state.counters.add(failure.sent, None if peek else False)
        return decision
    decision = state.decision(reply)
    answered(breaker, gate, wrote=decision.allowed and not peek)
    refusals = state.refusals
    if refusals is not None:
        if not decision.allowed:
            refusals.put(command.keys[0], cost, decision, started)
        elif refusals.entries:
            refusals.drop(command.keys[0])
    state.counters.add(sent, None if peek else decision.allowed)
    return decision


def by_policy(
    state: LimiterState,
    key: str,
    cost: int,
    failure: Unanswered,
    breaker: Breaker,
    *,
    peek: bool = False,
) -> Decision:
    """The failure policy's answer to an allow (or peek) the store did not answer, or
    that its breaker skipped (``failure.error`` is ``None``)."""
    unanswered(state, failure, breaker)
    decision = state.fallback.decide(key, cost, peek=peek)
    state.counters.add(failure.sent, None if peek else decision.allowed)
    return decision


# -- the common allow, without a generator -------------------------------------------
#
# An allow whose cost is an int within the capacity, while its breaker is closed, no
# refusal is remembered and no heartbeat is due, is one command and its answer from
# the reply, exactly as `decide` would send and give them. `Allow` answers it without
# a flow's generators, and is its own command (`argv`, `keys`, `joins`), so that the
# common allow costs one object (benches/client_instructions.py measures it). While
# its breaker skips the store, the same allow is the policy's answer (`by_policy`, as
# `decided` gives it), without a flow either. Anything else, and any error of its
# command, goes to `decide` / `decided`. Held to `decide` by
# tests/redis/test_redis_quick.py.


class Allow(Flowing):
    """``allow(key, cost)``, driven: the common allow (see above), or :func:`decide`."""

    __slots__ = ("_cost", "_key", "_started", "_state", "argv", "joins", "keys")

    #: As a command: what the drivers send (its own script by EVALSHA, one key).
    name = "execute_command"
    whole = False
    direct = False

    def __init__(self, state: LimiterState, key: str, cost: object) -> None:
        self._state = state
        self._key = key
        self._cost = cost
        self.outcome = NO_OUTCOME
        refusals = state.refusals
        if (
            type(cost) is int
            and 0 < cost <= state.capacity
            and (refusals is None or not refusals.entries)
        ):
            bucket = state.keys.bucket(key)
            breaker = state.breaker(bucket)
            if breaker.open:  # an outage: between probes, the policy answers at once
                gate = breaker.admit()
                if gate is SKIP:
                    self._flow, self.command = None, None
                    try:
                        answer = by_policy(state, key, cost, Unanswered(None, 0), breaker)
                    except BaseException as error:  # "raise": its outcome, as a flow's
                        self.outcome = (None, error)
                    else:
                        self.outcome = (answer, None)
                    return
                breaker.release(gate)  # a probe is due (or it closed): decide asks again
            elif not state.processes.pending():
                self._flow = None
                self._started = time.monotonic() if refusals is not None else 0.0
                args = own_args(state, ALLOW, cost)
                self.argv = (*state.evalsha, bucket, *args)
                self.keys = (bucket,)
                self.joins = (cost, args[2] if len(args) > 2 else SERVER_TIME)
                self.command = self  # it has a command's shape
                return
        super().__init__(decide(state, key, cost))

    def feed(self, value: Any, *, thrown: bool) -> None:
        if self._flow is not None:
            super().feed(value, thrown=thrown)
            return
        state, cost, bucket = self._state, self._cost, self.keys[0]
        assert type(cost) is int
        if thrown:  # its command failed: decided answers, with what was sent
            args = self.argv[4:]
            command = ScriptCommand(state.own, self.keys, args, joins=self.joins)
            breaker = state.breaker(bucket)
            flow = decided(
                state, self._key, cost, command, self._started, breaker, STORE, failed=value
            )
            self._flow = flow
            super().feed(None, thrown=False)
            return
        self.command = None
        decision = state.decision(value)
        answered(state.breaker(bucket), STORE, wrote=decision.allowed)
        refusals = state.refusals
        if refusals is not None:
            if not decision.allowed:
                refusals.put(bucket, cost, decision, self._started)
            elif refusals.entries:
                refusals.drop(bucket)
        state.counters.add(1, decision.allowed)
        self.outcome = (decision, None)


def give_back(
    state: LimiterState,
    key: str,
    cost: int,
    line: Line | None = None,
    reserved: int = 0,
    *,
    degraded: bool = False,
) -> Flow[None]:
    """``refund(key, cost)``, and a reservation's give-back (``cancel``, ``settle``
    below its cost) with its ``line`` where it waited and the ``reserved`` cost
    (docs/design.md §4, "Giving back"): never above capacity. A give-back that
    cannot reach the store is counted (``lost_refunds``) and logged, never sent
    again (it may have run); the store keeps those tokens spent. ``degraded``: the
    tokens were taken by an answer given without the store, so they go back where
    its policy took them (this process's share under ``"local"``, else nowhere) and
    never to the store, which never had them."""
    if degraded:
        state.fallback.refund(key, cost)
        return
    bucket = state.keys.bucket(key)
    args: tuple[Any, ...] = (cost, REFUND.value, state.now())
    if line is not None:
        args += (*line, reserved)
    if state.refusals is not None:
        state.refusals.drop(bucket)  # this process gives tokens back
    breaker = state.breaker(bucket)
    try:
        command = ScriptCommand(state.own, state.bucket_keys(bucket), args)
        _, sent = yield from guarded(state, breaker, command, wrote=True)
    except Unanswered as failure:
        lost(state, [(key, cost)], failure.error)
        not_given_back(state, failure, breaker, raises=state.policy == RAISE)
        state.fallback.refund(key, cost)  # this process's share gets them (at most the share)
        return
    except Corrupt as failure:
        not_given_back(state, failure, breaker, raises=state.policy == RAISE)
        return
    state.counters.add(sent)


def lost(
    state: LimiterState, parts: Sequence[tuple[str, int]], error: BaseException | None
) -> None:
    """Give-backs that did not reach the store: counted and logged, never resent."""
    why = "the store is skipped" if error is None else f"{type(error).__name__}: {error}"
    for key, cost in parts:
        state.counters.event("lost_refunds")
        logger.warning(
            "%s: a give-back of %d tokens to key %r did not reach the store (%s); "
            "its bucket keeps them spent",
            state.name,
            cost,
            key,
            why,
        )


def reset(state: LimiterState, key: str) -> Flow[None]:
    """``reset(key)``: the bucket is full again (its key deleted), and so is this
    process's share of it, for the next outage."""
    bucket = state.keys.bucket(key)
    state.fallback.reset(key)
    if state.refusals is not None:
        state.refusals.drop(bucket)
    breaker = state.breaker(bucket)
    try:
        _, sent = yield from guarded(
            state, breaker, Command("delete", (bucket,), [bucket]), wrote=True
        )
    except Unanswered as failure:
        not_given_back(state, failure, breaker, raises=state.policy == RAISE)
        return  # lost for the store; the local bucket is full already
    state.counters.add(sent)


def charge(state: LimiterState, key: str, cost: object) -> Flow[Decision]:
    """``charge(key, cost)``: use that already happened, any cost >= 1, debt allowed
    down to the bound, where it stops. Answers the bucket after it."""
    checked = _core.check_charge(cost)
    bucket = state.keys.bucket(key)
    args = (state.charged(checked), CHARGE.value, state.now())
    return (
        yield from one_bucket(
            state, bucket, args, wrote=True, without=lambda: state.fallback.charge(key, checked)
        )
    )


def observe(
    state: LimiterState,
    key: str,
    remaining: object,
    limit: object,
    reset_after: object,
    retry_after: object,
    at: object,
) -> Flow[Decision]:
    """``observe(key, remaining, ...)``: an upstream's report (docs/design.md §4,
    "Following the upstream"), reduced to its cap by the core's rule and sent with
    its age, so the script bounds the bucket on its own clock. ``at`` is a reading of
    the limiter's clock (``time.monotonic()`` for the store's). Without the store the
    report is not applied: the policy answers (this process's share, as it stands)."""
    cap = _core.observation_cap(
        state.capacity,
        state.p,
        state.unit,
        remaining,  # type: ignore[arg-type]
        limit=limit,  # type: ignore[arg-type]
        reset_after=reset_after,  # type: ignore[arg-type]
        retry_after=retry_after,  # type: ignore[arg-type]
    )
    age = 0
    if at is not None:
        try:
            then = _core.clock_to_micros(at)
        except (TypeError, ValueError) as e:
            raise type(e)(
                "at must be a reading of the limiter's clock (finite seconds as an int or "
                f"float), got {at!r}"
            ) from None
        age = max(0, _core.clock_to_micros((state.clock or time.monotonic)()) - then)
    bucket = state.keys.bucket(key)
    cap = max(cap, -state.debt_capacities * state.full)  # the script's own debt bound
    args = (cap, OBSERVE.value, state.now(), min(age, LUA_EXACT - 1))
    return (
        yield from one_bucket(
            state,
            bucket,
            args,
            wrote=False,
            without=lambda: state.fallback.decide(key, 1, peek=True),
        )
    )


def one_bucket(
    state: LimiterState,
    bucket: bytes,
    args: Sequence[Any],
    *,
    wrote: bool,
    without: Callable[[], Decision],
) -> Flow[Decision]:
    """One script call on one bucket, answered as a ``Decision``: the store's reply,
    ``without()`` (the policy) when the store fails or is skipped, or a corrupt
    bucket's refusal. ``wrote``: whether an answer is a write (after ``READONLY``
    only a write closes the breaker)."""
    breaker = state.breaker(bucket)
    try:
        command = ScriptCommand(state.own, state.bucket_keys(bucket), args)
        reply, sent = yield from guarded(state, breaker, command, wrote=wrote)
    except Unanswered as failure:
        unanswered(state, failure, breaker)
        state.counters.add(failure.sent)
        return without()
    except Corrupt as failure:
        decision = corrupt(state, failure, breaker)
        state.counters.add(failure.sent)
        return decision
    state.counters.add(sent)
    return state.decision(reply)


#: Where a waiting reservation left a bucket's cap line: the bucket's time and
#: balance right after it, and the headroom before it (docs/design.md §4, "Giving
#: back"); its give-back sends it, with the reservation's cost.
Line = tuple[int, int, int]


class Reserved:
    """A reservation's answer: the decision, the delay in seconds (for a refusal the
    wait it would have needed; ``math.inf``: never), the line of each bucket it
    waits in (``None`` where it does not), and where its tokens were taken: from
    the store (``stored``), in process under ``on_store_error="local"`` (``local``,
    the core's reservation made instead), or nowhere (``"open"``): its give-backs
    and charges go there and nowhere else."""

    __slots__ = ("decision", "delay", "lines", "local", "stored")

    def __init__(
        self,
        decision: Decision,
        delay: float,
        lines: list[Line | None],
        *,
        stored: bool = True,
        local: _core.Reservation | None = None,
    ) -> None:
        self.decision = decision
        self.delay = delay
        self.lines = lines
        self.stored = stored
        self.local = local


def reserve(
    state: LimiterState, key: str, cost: object, max_wait: object, name: str = "max_wait"
) -> Flow[Reserved]:
    """``reserve(key, cost, max_wait=...)``: take ``cost`` now, in debt if need be, on
    the store's clock; the delay says when the tokens are the caller's. Refused at
    once, spending nothing, past ``max_wait`` (µs) or the debt bound. ``name`` is what
    the caller calls ``max_wait`` (acquire: ``timeout``)."""
    cost = state.cost(cost)
    wait = check_wait(max_wait, name)
    bucket = state.keys.bucket(key)
    args = (cost, RESERVE.value, state.now(), NONE if wait is None else wait)
    refusals = state.refusals
    started = 0.0
    if refusals is not None:
        started = time.monotonic()
        if wait is not None:
            cached = cached_reservation(refusals.get(bucket, cost, started), wait)
            if cached is not None:
                state.counters.event("refusal_cache_hits")
                state.counters.add(0, False)
                return cached
    breaker = state.breaker(bucket)
    try:
        command = ScriptCommand(state.own, state.bucket_keys(bucket), args)
        reply, sent = yield from guarded(state, breaker, command, wrote=spent)
    except Unanswered as failure:
        unanswered(state, failure, breaker)
        reserved = reserved_without_store(state, key, cost, wait)
        state.counters.add(failure.sent, reserved.decision.allowed)
        return reserved
    except Corrupt as failure:
        refusal = corrupt(state, failure, breaker)
        state.counters.add(failure.sent, False)
        return Reserved(refusal, refusal.retry_after, [None])
    reserved = reserved_of(state, reply, 1)
    if refusals is not None:
        if not reserved.decision.allowed:
            # Remembered as the allow it implies: this cost waits `delay`.
            d = reserved.decision
            implied = Decision(False, reserved.delay, d.remaining, d.reset_after, d.limit)
            refusals.put(bucket, cost, implied, started)
        elif refusals.entries:
            refusals.drop(bucket)
    state.counters.add(sent, reserved.decision.allowed)
    return reserved


def reserved_of(state: LimiterState, reply: Any, buckets: int) -> Reserved:
    """A reservation's reply ``{retry_after, remaining, reset_after, limit, delay, line
    per bucket}`` (a bucket it does not wait in has nil, read as None, or no line),
    or an allow's, which ends with its decision (no delay: an allow never waits)."""
    decision = state.decision(reply)
    delay = 0.0
    if len(reply) > 4:
        delay = reply[4] / 1_000_000 if reply[4] >= 0 else math.inf
    lines: list[Line | None] = [None] * buckets
    for i, line in enumerate(reply[5:]):
        if line:
            lines[i] = (line[0], line[1], line[2])
    return Reserved(decision, delay, lines)


def cached_reservation(cached: Decision | None, max_wait: int) -> Reserved | None:
    """A reservation refused from the refusal cache: ``cached`` says this cost waits
    at least ``retry_after``; past ``max_wait`` (µs) the store would refuse too."""
    if cached is None:
        return None
    if math.isinf(cached.retry_after):
        return Reserved(cached, math.inf, [None])
    wait = round(cached.retry_after * 1_000_000)
    if wait <= max_wait:
        return None  # it might be granted: only the store knows
    refusal = Decision(
        False, (wait - max_wait) / 1_000_000, cached.remaining, cached.reset_after, cached.limit
    )
    return Reserved(refusal, wait / 1_000_000, [None])


def reserved_without_store(
    state: LimiterState, key: str, cost: int, max_wait: int | None
) -> Reserved:
    """A reservation without the store: ``"closed"`` refuses, ``"open"`` grants at once
    taking nothing anywhere, ``"local"`` reserves from this process's share (in
    process, degraded; its cancel and settle act there)."""
    fallback = state.fallback
    if fallback.local is None:  # "open" or "closed"
        decision = fallback.decide(key, cost, peek=False)
        delay = 0.0 if decision.allowed else decision.retry_after
        return Reserved(decision, delay, [None], stored=False)
    wait = None if max_wait is None else max_wait / 1_000_000
    share = [(fallback.local, key, min(cost, fallback.share))]
    local = _core.reserve_all(share, max_wait=wait)
    return Reserved(local.decision, local.delay, [None], stored=False, local=local)


# -- several buckets: the general script ---------------------------------------------

#: One bucket of a call over several: its limiter's state, the key, the cost.
Part = tuple[LimiterState, str, int]


#: The general script's 4 more values per bucket: a reservation's max_wait, or a
#: give-back's line and the reservation's cost (none: all four empty).
NO_MORE: Final = (NONE, NONE, NONE, NONE)


def general(parts: Sequence[Part], mode: Mode, more: Sequence[tuple[Any, ...]]) -> ScriptCommand:
    """The general script over ``parts`` (checked already): per bucket its key and
    lease hash, and its now, configuration, cost and 4 more values (scripts.md). On
    a cluster the keys must share a hash slot: said before anything is sent."""
    keys: list[bytes] = []
    args: list[Any] = [NONE, mode.value]
    for (state, key, cost), extra in zip(parts, more, strict=True):
        bucket = state.keys.bucket(key)
        if bucket in keys:
            # Two limiters with one prefix: the script would read the bucket twice
            # and charge it once.
            raise ValueError(
                f"the call names the Redis key {bucket!r} twice: limiters sharing a "
                "client need different prefixes"
            )
        keys += (bucket, lease_hash(bucket))
        sent = state.charged(cost) if mode is CHARGE else cost
        args += [state.now(), *state.config_args, sent, *extra]
    if parts[0][0].cluster:
        check_one_slot(keys)
    return ScriptCommand(parts[0][0].script, keys, args)


def change_all(parts: Sequence[Part], mode: Mode, more: Sequence[tuple[Any, ...]]) -> Flow[None]:
    """The give-backs (``REFUND``, each with its line) or the charges (``CHARGE``) of a
    reservation over several buckets, in one script. Without the store they are
    lost for it (give-backs counted and logged, as :func:`give_back`'s)."""
    first = parts[0][0]
    command = general(parts, mode, more)
    if mode is REFUND:
        for state, key, _ in parts:
            if state.refusals is not None:
                state.refusals.drop(state.keys.bucket(key))
    breaker = first.breaker(command.keys[0])
    try:
        _, sent = yield from guarded(first, breaker, command, wrote=True)
    except (Unanswered, Corrupt) as failure:
        if mode is REFUND:
            for state, key, cost in parts:
                lost(state, [(key, cost)], failure.error)
        not_given_back(first, failure, breaker, raises=any(s.policy == RAISE for s, _, _ in parts))
        return
    first.counters.add(sent)  # no decision: the commands, on the limiter they went through


def check(state: LimiterState) -> Flow[None]:
    """``check()``: the script as a peek at a key no bucket has (nothing is written),
    then ``INFO server``, refusing a server older than 5.0. Raises
    ``ConfigurationError`` for what no retry will fix and the client's error
    otherwise; the failure policy never applies, and the breaker is not asked."""
    probe = state.keys.probe()
    return check_store(state, ScriptCommand(state.own, [probe], own_args(state, PEEK, 1)))
