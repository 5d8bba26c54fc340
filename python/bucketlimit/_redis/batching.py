"""Shared round trips (docs/design.md §6): many allows of one limiter in one script.

An allow asked while another of the same node's round trips is in flight waits,
and the waiting allows go together in the next one (group commit). Each allow is
its own ``buckets.Allow``, waiting on its command; a *flight* (:func:`flight`) is a
flow over all of them: it puts the commands that may share a round trip (one-key
allows of the limiter's own script, of one hash slot and one ``now``, 256 at most)
into one batch of that script, feeds each allow its part of the reply (or the error,
for each to answer by its own policy), and sends whatever else an allow asks one
by one. So the one blocking driver and the one asyncio driver send flights as they
send any flow.

- Flights are per node (the breaker of the bucket's node: one for a standalone
  store), so an allow never waits for a node it does not need.
- A batch that gets TRYAGAIN or ASK (a slot being migrated) or a second
  redirection storm is split: each allow leaves the flight and is sent alone by
  its own caller (side by side: each thread or task sends its own), answered as
  if it had never waited (nothing of the batch ran). So is an allow whose bucket has leases
  out, which a batch does not read: it goes alone with the bucket's lease hash
  (docs/design.md §6, "Hot keys: leases").
- Before a batch goes, its breaker is asked again: opened meanwhile, nothing is
  sent and each allow gets the policy's answer.
- An interruption of the thread that sends (KeyboardInterrupt) is that thread's:
  the other allows of the round trip get the policy's answer for a lost reply,
  never the interruption.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, SupportsIndex

from bucketlimit._core import Decision
from bucketlimit._histogram import fork_safe
from bucketlimit._redis import flows
from bucketlimit._redis.buckets import Allow
from bucketlimit._redis.drivers import answer, drive, drive_async, run, run_async
from bucketlimit._redis.errors import (
    REDIRECTED,
    AskError,
    ClusterError,
    MovedError,
    StoreUnavailableError,
    TryAgainError,
    classify,
    leased_bucket,
)
from bucketlimit._redis.flows import BatchCommand, Command, Flow, Flowing, Outcome
from bucketlimit._redis.keys import key_slot
from bucketlimit._redis.resilience import Breaker
from bucketlimit._redis.script import MANY, NONE
from bucketlimit._redis.state import LimiterState

#: The most allows one shared round trip decides (a batch, scripts.md): a script
#: blocks the server while it runs, about 4-5 µs an allow, so 256 is about a
#: millisecond; more waiting allows go in the next one.
MAX_BATCH: Final = 256


#: A waiter's outcome when its round trip never happened (an error of the driver).
NOT_SENT: Final[Outcome] = (None, StoreUnavailableError("the shared round trip was not sent"))


def joinable(command: Command | None) -> tuple[int, Any] | None:
    """``(cost, now)`` when ``command`` is a one-key allow that may share a round trip."""
    return None if command is None else command.joins


#: A member of a flight waiting on its command: its place, and the member.
Pending = tuple[int, Flowing]


def groups(state: LimiterState, pending: Sequence[Pending]) -> list[list[Pending]]:
    """The commands of a flight as round trips, in arrival order: joinable allows of
    one hash slot (a cluster's: one script's keys share a slot), one ``now`` (an
    injected clock read between them starts another) and one form (EVALSHA or
    EVAL) together, at most MAX_BATCH; everything else one by one."""
    found: dict[tuple[int, Any, bool], list[Pending]] = {}
    out: list[list[Pending]] = []
    for item in pending:
        command = item[1].command
        joins = joinable(command)
        if joins is None:
            out.append([item])
            continue
        assert command is not None
        slot = key_slot(command.keys[0]) if state.cluster else 0
        group_key = (slot, joins[1], command.whole)
        group = found.get(group_key)
        if group is None or len(group) == MAX_BATCH:
            group = found[group_key] = []
            out.append(group)
        group.append(item)
    return out


def batch_command(state: LimiterState, group: Sequence[Pending]) -> Command:
    """The one command of a round trip: a lone command as it is; several allows as
    a batch of the limiter's own script over their keys in arrival order, at one
    now, the costs in ARGV (none when all are 1)."""
    commands: list[Any] = [member.command for _, member in group]
    first = commands[0]
    if len(commands) == 1:
        lone: Command = first
        return lone
    costs: list[Any] = [NONE if command.joins[0] == 1 else command.joins[0] for command in commands]
    while costs and costs[-1] is NONE:
        costs.pop()  # an absent cost is 1: the common batch sends 3 arguments
    keys = [command.keys[0] for command in commands]
    now = first.joins[1]
    return BatchCommand(state.own, keys, (NONE, MANY.value, now, *costs), whole=first.whole)


def splits(error: BaseException) -> bool:
    """A batch's error that is its keys' own, not the store's: a slot being migrated
    or moved (TRYAGAIN, ASK, MOVED: a batch goes to its node only) or a redirection
    storm. Each allow is then sent alone, the client following its redirections."""
    return isinstance(error, (*TryAgainError, *AskError, *MovedError)) or (
        isinstance(error, ClusterError) and classify(error) == REDIRECTED
    )


def flight(
    state: LimiterState, members: Sequence[Flowing], *, own: int | None = None
) -> Flow[list[Flowing]]:
    """Drives ``members`` (each waiting on its command) sharing round trips, until
    each has its outcome, or must go alone: those it answers, still waiting on
    their command, nothing of them having run, for their callers to send
    (:func:`send_alone`, or each waiter its own). ``own``: the member of the
    caller that drives this flight (the sync leader), which alone gets an
    interruption of it (a KeyboardInterrupt, or the asyncio task's cancellation:
    every other member gets the policy's answer for a lost reply, and the flight
    ends without sending more).

    The members count the commands they waited on; a flight counts the commands
    really sent, and corrects the difference once, at its end.
    """
    pending: list[Pending] = [(i, m) for i, m in enumerate(members) if m.command is not None]
    alone: list[Flowing] = []
    sent = answered = 0
    interrupted: BaseException | None = None

    def feed(index: int, member: Flowing, value: Any, *, thrown: bool) -> list[Pending]:
        """Hands a member its reply (or error): still pending if it waits again."""
        nonlocal answered
        answered += 1
        member.feed(value, thrown=thrown)
        return [(index, member)] if member.command is not None else []

    while pending:
        later: list[Pending] = []
        for group in groups(state, pending):
            if interrupted is not None:
                # The driving caller was interrupted: nothing more is sent; each other
                # member answers as for a lost reply, the caller's gets the interruption.
                for index, member in group:
                    lost = interrupted if index == own else flows.Lost(interrupted)
                    later += feed(index, member, lost, thrown=True)
                continue
            first = group[0][1].command
            assert first is not None
            if joinable(first) is not None and state.breaker(first.keys[0]).skips():
                # Opened while these waited (another round trip failed): none is sent.
                for index, member in group:
                    later += feed(index, member, flows.Skipped(), thrown=True)
                continue
            command = batch_command(state, group)
            redirected = False
            while True:
                sent += 1
                try:
                    reply = yield command
                except BaseException as error:
                    if len(group) == 1:
                        if not isinstance(error, Exception):
                            interrupted = error
                            if group[0][0] != own:
                                error = flows.Lost(error)
                        index, member = group[0]
                        later += feed(index, member, error, thrown=True)
                        break
                    again = flows.resent(state, command, error, redirected)
                    if again is not None:
                        redirected = redirected or again is command
                        command = again
                        continue
                    if not isinstance(error, Exception):
                        interrupted = error
                        for index, member in group:
                            lost = error if index == own else flows.Lost(error)
                            later += feed(index, member, lost, thrown=True)
                    elif splits(error):
                        alone += (member for _, member in group)
                    else:
                        for index, member in group:
                            later += feed(index, member, error, thrown=True)
                    break
                else:
                    if len(group) == 1:
                        index, member = group[0]
                        later += feed(index, member, reply, thrown=False)
                    else:
                        for k, item in enumerate(group):
                            index, member = item
                            value = reply[3 * k]
                            answered += 1
                            if leased_bucket(value):
                                # Nothing ran for it: it goes alone, with the lease
                                # hash (flows.resent).
                                member.feed(value, thrown=True)
                                if member.command is not None:
                                    alone.append(member)
                                continue
                            if isinstance(value, BaseException):  # its key holds no bucket
                                member.feed(value, thrown=True)
                            else:
                                member.feed(reply[3 * k : 3 * k + 3], thrown=False)
                            if member.command is not None:
                                later.append(item)
                    break
        pending = later
    if sent != answered:
        state.counters.add(sent - answered)
    if interrupted is not None and own is not None:
        members[own].outcome = (None, interrupted)  # the caller's, even when its answer came
    return alone


def send_alone(members: Iterable[Flowing], state: LimiterState) -> None:
    """The members a flight left to go alone, one after the other (``allow_many``)."""
    for member in members:
        drive(member, state)


def not_sent(member: Flowing) -> None:
    """A member whose flight failed before it was sent: closed, answered NOT_SENT."""
    if member.command is not None:
        member.close()
        member.command, member.outcome = None, NOT_SENT


def started(state: LimiterState, requests: object) -> list[Allow]:
    """``allow_many``'s allows, every pair checked before anything is sent."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise TypeError(
            f"allow_many takes a sequence of (key, cost) pairs, got {type(requests).__name__}"
        )
    pairs = []
    for item in requests:
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                f"allow_many takes (key, cost) pairs, got {item!r} ({type(item).__name__})"
            )
        key, cost = item
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        state.cost(cost)
        state.keys.bucket(key)
        pairs.append((key, cost))
    return [Allow(state, key, cost) for key, cost in pairs]


def by_node(state: LimiterState, members: Sequence[Flowing]) -> list[list[Flowing]]:
    """The members waiting on a command, per node (by its breaker), in arrival order."""
    nodes: dict[Breaker, list[Flowing]] = {}
    for member in members:
        if member.command is not None:
            nodes.setdefault(state.breaker(member.command.keys[0]), []).append(member)
    return list(nodes.values())


def allow_many(
    state: LimiterState, requests: Iterable[tuple[str, SupportsIndex]]
) -> list[Decision]:
    """The sync class's ``allow_many``: the nodes one after the other; the first
    call whose policy raises raises."""
    members = started(state, requests)
    for node in by_node(state, members):
        send_alone(run(flight(state, node), state), state)
    return [answer(member.outcome) for member in members]


async def allow_many_async(
    state: LimiterState, requests: Iterable[tuple[str, SupportsIndex]]
) -> list[Decision]:
    """The asyncio class's ``allow_many``: the nodes side by side."""
    members = started(state, requests)
    nodes = by_node(state, members)
    if not nodes:
        await asyncio.sleep(0)
    await asyncio.gather(*(_fly_async(state, node) for node in nodes))
    return [answer(member.outcome) for member in members]


async def _fly_async(state: LimiterState, members: Sequence[Flowing]) -> None:
    """One flight for ``members``, then those it left to go alone, side by side."""
    alone = await run_async(flight(state, members), state)
    await asyncio.gather(*(drive_async(member, state) for member in alone))


class Queued:
    """An allow waiting for a shared round trip: ``member`` (its ``Allow``, waiting on
    its command) and ``wake`` (a ``threading.Event`` or an asyncio future) set when
    it has its outcome, or, for the sync class, when it must send the next round
    trip itself (``lead``: every waiter of that round trip, itself first)."""

    __slots__ = ("gone", "lead", "member", "wake")

    def __init__(self, member: Allow, wake: Any) -> None:
        self.member = member
        self.wake = wake
        self.lead: list[Queued] | None = None
        # A sync waiter interrupted while it waited (KeyboardInterrupt): its allow
        # is not sent, and it is never made the one that sends (set under the lock).
        self.gone = False


class Flights:
    """Per node: whether a round trip is in flight, and the allows waiting for the
    next one. ``join`` answers ``None`` when nothing is in flight (send it now, then
    call ``landed``); else the waiter, queued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flying: set[Breaker] = set()
        self._queues: dict[Breaker, list[Queued]] = {}

    def after_fork(self) -> None:
        """In a forked child: nothing of the parent's is in flight here."""
        self._lock = threading.Lock()
        self._flying = set()
        self._queues = {}

    def join(self, node: Breaker, member: Allow, wake: Callable[[], Any]) -> Queued | None:
        with self._lock:
            if node not in self._flying:
                self._flying.add(node)
                return None
            waiter = Queued(member, wake())
            self._queues.setdefault(node, []).append(waiter)
            return waiter

    def landed(self, node: Breaker) -> list[Queued] | None:
        """A round trip of ``node`` ended: the waiters of the next one, or None when
        none waits (then nothing of it is in flight)."""
        with self._lock:
            waiters = self._queues.pop(node, None)
            if not waiters:
                self._flying.discard(node)
                return None
            return waiters

    def lead(self, waiters: list[Queued]) -> Queued | None:
        """The first waiter still there is made the one to send (sync class)."""
        with self._lock:
            lead = next((waiter for waiter in waiters if not waiter.gone), None)
            if lead is not None:
                lead.lead = waiters
            return lead

    def leave(self, waiter: Queued) -> list[Queued] | None:
        """An interrupted sync waiter: never sent, never made the sender; what it must
        send for the others first, if it was made the sender already."""
        with self._lock:
            waiter.gone = True
            return waiter.lead


class GroupCommit:
    """The sync class's shared round trips (``batching=True``): a thread that finds a
    round trip of its node in flight queues; when it lands, the first queued thread
    sends the next one for all of them."""

    def __init__(self, state: LimiterState) -> None:
        self.state = state
        self.flights = Flights()
        fork_safe(self)

    def _after_fork(self) -> None:
        self.flights.after_fork()

    def allow(self, key: str, cost: object) -> Decision:
        state = self.state
        member = Allow(state, key, cost)
        if member.command is None:  # answered without the store
            return answer(member.outcome)  # type: ignore[no-any-return]
        node = state.breaker(member.command.keys[0])
        waiter = self.flights.join(node, member, threading.Event)
        if waiter is None:
            try:
                return answer(drive(member, state))  # type: ignore[no-any-return]
            finally:
                self._hand_over(node)
        try:
            waiter.wake.wait()
        except BaseException:
            # Interrupted: this allow is not sent; but if this thread was just made
            # the one to send the next round trip, it sends it for the others first,
            # so that no thread waits for ever.
            leading = self.flights.leave(waiter)
            if leading is not None:
                try:
                    self._fly(leading, None)
                finally:
                    self._hand_over(node)
            raise
        if waiter.lead is not None:  # this thread sends the next round trip
            try:
                self._fly(waiter.lead, waiter)
            finally:
                self._hand_over(node)
        if member.command is not None:  # split from its round trip: sent alone
            return answer(drive(member, state))  # type: ignore[no-any-return]
        return answer(member.outcome)  # type: ignore[no-any-return]

    def _hand_over(self, node: Breaker) -> None:
        """A round trip landed: the first waiter still there sends the next one (when
        every waiter was interrupted, their allows are dropped)."""
        while (waiters := self.flights.landed(node)) is not None:
            lead = self.flights.lead(waiters)
            if lead is not None:
                lead.wake.set()
                return
            for waiter in waiters:
                waiter.member.close()

    def _fly(self, waiters: list[Queued], me: Queued | None) -> None:
        """One flight for ``waiters``, sent by this thread (``me``: its own waiter,
        unless it was interrupted); each gets its outcome."""
        live = []
        for waiter in waiters:
            if waiter.gone:
                waiter.member.close()  # never sent
            else:
                live.append(waiter)
        own = next((i for i, waiter in enumerate(live) if waiter is me), None)
        try:
            # Those it leaves to go alone are sent by their own threads, once woken.
            run(flight(self.state, [waiter.member for waiter in live], own=own), self.state)
        except BaseException:
            for waiter in live:
                not_sent(waiter.member)  # the flight itself failed
            raise
        finally:
            for waiter in live:
                if waiter.lead is None:
                    waiter.wake.set()


# Shared round trips in flight: held until they land (the event loop keeps only weak
# references to tasks).
_FLIGHTS: set[asyncio.Future[None]] = set()


class Batcher:
    """The asyncio class's shared round trips (``batching=True``): an allow asked
    while a round trip of its node is in flight waits, and goes in the next one,
    sent in a task of its own (no waiter's cancellation can stop it)."""

    def __init__(self, state: LimiterState) -> None:
        self.state = state
        self.flights = Flights()
        fork_safe(self)

    def _after_fork(self) -> None:
        self.flights.after_fork()

    async def allow(self, key: str, cost: object) -> Decision:
        state = self.state
        member = Allow(state, key, cost)
        if member.command is None:  # answered without the store: still a yield
            await asyncio.sleep(0)
            return answer(member.outcome)  # type: ignore[no-any-return]
        node = state.breaker(member.command.keys[0])
        waiter = self.flights.join(node, member, asyncio.get_running_loop().create_future)
        if waiter is None:
            try:
                return answer(await drive_async(member, state))  # type: ignore[no-any-return]
            finally:
                self._next(node)
        await waiter.wake  # cancelled before it is sent: the flight drops it
        if member.command is not None:  # split from its round trip: sent alone
            return answer(await drive_async(member, state))  # type: ignore[no-any-return]
        return answer(member.outcome)  # type: ignore[no-any-return]

    def _next(self, node: Breaker) -> None:
        waiters = self.flights.landed(node)
        if waiters is not None:
            task = asyncio.ensure_future(self._fly(node, waiters))
            _FLIGHTS.add(task)
            task.add_done_callback(_FLIGHTS.discard)

    async def _fly(self, node: Breaker, waiters: list[Queued]) -> None:
        live = []
        for waiter in waiters:
            if waiter.wake.done():  # cancelled while it waited: never sent
                waiter.member.close()
            else:
                live.append(waiter)
        try:
            # Those it leaves to go alone are sent by their own tasks, once woken.
            await run_async(flight(self.state, [waiter.member for waiter in live]), self.state)
        except BaseException:
            for waiter in live:
                not_sent(waiter.member)  # the flight itself failed
            raise
        finally:
            for waiter in live:
                if not waiter.wake.done():
                    waiter.wake.set_result(None)
                elif waiter.member.command is not None:  # cancelled meanwhile: not sent
                    waiter.member.close()
            self._next(node)
