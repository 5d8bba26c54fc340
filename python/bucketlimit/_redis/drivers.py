"""The two drivers of every flow (docs/design.md §6): one blocking loop, one asyncio loop.

They are the only loops of the Redis layer. A flow yields steps: a command, which
the driver sends to the limiter's client; a ``Wait``, which it waits on through
the step's handle (a permit's waiter: ``wakeups.Waiting``), never reaching into
a feature's state; a ``Local``, an answer from in process. The driver gives the
flow what came back, or throws the error in at its ``yield``; the flow's return
value is the operation's answer. What a reply or an error means is the flow's
(``bucketlimit._redis.flows``). A flow is driven as a
:class:`~bucketlimit._redis.flows.Flowing` (the common allow, ``buckets.Allow``,
which needs no generator), so a step costs no exception. The asyncio driver is
cancel-safe for the flows that hold something once answered (``undo``). Shared
round trips, which drive many flows at once, are ``bucketlimit._redis.batching``.

Sending is more than a call in three places: a command waits for a connection
while its client's pool is full (:data:`POOL_WAIT`), an asyncio cluster client
lost among the redirections of a slot being migrated is followed here
(:func:`follow_asks`), and one that could not start sends to the key's node
(:func:`unstarted_node`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from bucketlimit._redis import module
from bucketlimit._redis.clients import LIBRARIES
from bucketlimit._redis.errors import (
    REDIRECTED,
    AskError,
    ClientConnectionError,
    ClusterError,
    LibraryError,
    MaxConnectionsError,
    MovedError,
    SlotNotCoveredError,
    TryAgainError,
    classify,
)
from bucketlimit._redis.flows import Command, Flow, Flowing, Local, Outcome, Wait
from bucketlimit._redis.state import Store
from bucketlimit._redis.timing import with_time

T = TypeVar("T")

#: The commands that run a script: their time may be the limiter's to send.
SCRIPT_CALLS: Final = ("EVALSHA", "EVAL")

logger = logging.getLogger("bucketlimit")

#: Seconds a command waits for a connection when its client's pool is full and says
#: so at once (redis-py's ``MaxConnectionsError``: nothing was sent), in steps of
#: POOL_STEP: the limiter's own callers filling their pool are not an outage, and
#: answering them by the policy (a "local" share) would admit beyond the limit. A
#: blocking pool waits by itself (its own timeout).
POOL_WAIT: Final = 1.0
POOL_STEP: Final = 0.002


def drive(flowing: Flowing, state: Store) -> Outcome:
    """The one blocking loop: for each step ``flowing`` waits on, sends the command
    to the state's client, waits (:class:`~bucketlimit._redis.flows.Wait`: its
    handle), or calls in process (``Local``), and feeds it what came back, or the
    error thrown in (a ``KeyboardInterrupt`` too: the flow gives back what it held
    first), until it has its outcome."""
    while (step := flowing.command) is not None:
        try:
            kind = step.__class__
            if kind is Wait:
                reply = step.handle.wait(step.seconds)
            elif kind is Local:
                reply = step.call()
            else:
                reply = send(state, step)
        except BaseException as error:  # the flow decides what a failure means
            flowing.feed(error, thrown=True)
        else:
            flowing.feed(reply, thrown=False)
    return flowing.outcome


async def drive_async(
    flowing: Flowing,
    state: Store,
    *,
    blocking: bool = False,
    undo: Callable[[Any], Awaitable[None]] | None = None,
) -> Outcome:
    """The one asyncio loop: :func:`drive`, each step awaited (``blocking``: the
    commands sent with blocking calls, the sync limiters' ``*_async`` methods). An
    outcome reached without any step (a cached refusal, the policy while the
    breaker skips the store) still yields to the event loop once, so a task calling
    a degraded limiter in a loop cannot starve the others.

    A cancellation is thrown into the flow, which counts it; except with ``undo``
    (a flow that holds something once answered: a permit, a place in a queue),
    where the flow is cancel-safe: a command on its way is shielded, and once
    cancelled the rest of the flow runs in a task of its own (:func:`finish`: the
    reply lands, every later wait is cancelled at once, so the flow leaves its
    queue), then ``undo`` gives back what it got; the cancellation goes on at once."""
    if flowing.command is None:
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            if undo is not None:  # answered already (in process): undone all the same
                finish(flowing, state, None, undo, blocking=blocking)
            raise
    while (step := flowing.command) is not None:
        task: asyncio.Future[Any] | None = None
        try:
            kind = step.__class__
            if kind is Wait:
                reply = await step.handle.wait_async(step.seconds)
            elif kind is Local:
                reply = await step.call_async()
            elif blocking:
                reply = send(state, step)
            elif undo is None:
                reply = await send_async(state, step)
            else:
                task = asyncio.ensure_future(send_async(state, step))
                reply = await asyncio.shield(task)
        except asyncio.CancelledError as cancelled:
            if undo is not None:
                finish(flowing, state, task, undo, blocking=blocking)
                raise
            flowing.feed(cancelled, thrown=True)  # the flow counts it
        except BaseException as error:  # the flow decides what a failure means
            flowing.feed(error, thrown=True)
        else:
            flowing.feed(reply, thrown=False)
    return flowing.outcome


#: The rests of cancelled flows, held until they end (the loop keeps weak references).
_FINISHING: set[asyncio.Future[None]] = set()


def finish(
    flowing: Flowing,
    state: Store,
    task: asyncio.Future[Any] | None,
    undo: Callable[[Any], Awaitable[None]],
    *,
    blocking: bool,
) -> None:
    """A cancelled flow's rest, in a task of its own: the reply of the command on its
    way lands (``task``), every later wait or in-process call is cancelled at once
    (the flow leaves its queue), and what the flow got is undone."""

    async def rest() -> None:
        try:
            if task is not None:
                try:
                    reply = await task
                except BaseException as raised:
                    flowing.feed(raised, thrown=True)
                else:
                    flowing.feed(reply, thrown=False)
            while (step := flowing.command) is not None:
                if step.__class__ in (Wait, Local):
                    flowing.feed(asyncio.CancelledError(), thrown=True)
                    continue
                try:
                    reply = send(state, step) if blocking else await send_async(state, step)
                except BaseException as raised:
                    flowing.feed(raised, thrown=True)
                else:
                    flowing.feed(reply, thrown=False)
            value, error = flowing.outcome
            if error is None and value is not None:
                await undo(value)
        except Exception:
            logger.debug("%s: a cancelled call could not end cleanly", state.name, exc_info=True)

    ending = asyncio.ensure_future(rest())
    _FINISHING.add(ending)
    ending.add_done_callback(_FINISHING.discard)


def send(state: Store, command: Command) -> Any:
    """``command`` sent on the state's client (connected on first use), timed into
    ``state.round_trips`` (answered or failed) once something reads it. While it
    is on its way it is in ``state.flying``, so that ``close()`` lets it land; once
    the limiter is closed nothing is sent (a ``RuntimeError``). The command is added
    before ``closed`` is read: ``close()`` sets ``closed``, then waits for the set
    to empty, so no command slips between the two."""
    flying = state.flying
    flying.add(command)
    try:
        if state.closed:
            raise RuntimeError(state.closing())
        client = state.client if state.client is not None else state.connect()
        call = getattr(client, command.name)
        if command.direct and state.cluster:
            node = node_of(client, command)
            if node is not None:
                call = getattr(client.get_redis_connection(node), command.name)
        argv = command.argv
        if state.time.supplied and argv and argv[0] in SCRIPT_CALLS:
            if state.time.stale():
                before = time.monotonic_ns()
                state.time.read(client.time(), before, time.monotonic_ns())
            argv = with_time(argv, state.layout(argv[1]), state.time.micros())
        twin = module.twin(state, argv) if state.engine.module else None
        waited = 0.0
        timed = state.round_trips.wanted  # timed once the histogram is read (histograms())
        sent = time.perf_counter() if timed else 0.0
        try:
            while True:
                try:
                    if twin is not None:
                        return module.parsed(call(*twin))
                    return call(*argv)
                except MaxConnectionsError:
                    if waited >= POOL_WAIT:
                        raise
                    time.sleep(POOL_STEP)
                    waited += POOL_STEP
                except LibraryError as error:
                    without_module(state, twin, error)
                    twin = None
        finally:
            if timed:
                state.round_trips.observe(time.perf_counter() - sent)
    finally:
        flying.discard(command)


def without_module(state: Store, twin: tuple[Any, ...] | None, error: BaseException) -> None:
    """A module command the server does not know (nothing ran): under ``engine="auto"``
    the script goes instead (returns, the caller sends it); else ``error`` goes on."""
    if twin is None or not module.unknown(error) or not state.engine.absent(state.name, error):
        raise error


async def send_async(state: Store, command: Command) -> Any:
    """``command`` awaited on the state's asyncio client (in ``state.flying`` while on
    its way, as :func:`send`); a redirection storm of a cluster client is followed
    once more here (:func:`follow_asks`)."""
    flying = state.flying
    flying.add(command)
    try:
        if state.closed:
            raise RuntimeError(state.closing())
        client = state.client if state.client is not None else state.connect()
        call = getattr(client, command.name)
        if command.direct and state.cluster:
            node = node_of(client, command)
            if node is None:  # it starts at its first command: now
                try:
                    await client.initialize()
                except Exception:  # the send below meets it again and says what it is
                    logger.debug("%s: the cluster client did not start", state.name)
                node = node_of(client, command)
            if node is not None:
                call = node.execute_command
        argv = command.argv
        if state.time.supplied and argv and argv[0] in SCRIPT_CALLS:
            if state.time.stale():
                before = time.monotonic_ns()
                state.time.read(await client.time(), before, time.monotonic_ns())
            argv = with_time(argv, state.layout(argv[1]), state.time.micros())
        twin = module.twin(state, argv) if state.engine.module else None
        timed = state.round_trips.wanted  # timed once the histogram is read (histograms())
        sent = time.perf_counter() if timed else 0.0
        try:
            if twin is not None:
                try:
                    return module.parsed(await _sent_on(client, command, call, twin))
                except LibraryError as error:
                    without_module(state, twin, error)
            return await _sent_on(client, command, call, argv)
        finally:
            if timed:
                state.round_trips.observe(time.perf_counter() - sent)
    finally:
        flying.discard(command)


async def _sent_on(client: Any, command: Command, call: Any, argv: tuple[Any, ...]) -> Any:
    """``argv`` (the command's, or its module twin) awaited by ``call`` (the client's,
    or its node's for a command sent there directly), following a cluster client's
    redirection storm or unstarted node (see below)."""
    try:
        return await _sent_async(call, argv)
    except ClusterError as storm:
        if command.name != "execute_command" or not command.keys or classify(storm) != REDIRECTED:
            raise
        return await follow_asks(client, argv, command.keys[0], storm)
    except ClientConnectionError as refused:
        node = unstarted_node(client, command, refused)
        if node is None:
            raise
        return await node.execute_command(*argv)


async def _sent_async(call: Any, argv: tuple[Any, ...]) -> Any:
    """``call(*argv)`` awaited, waiting for a free connection while the client's pool
    is full (as :func:`send` does)."""
    waited = 0.0
    while True:
        try:
            return await call(*argv)
        except MaxConnectionsError:
            if waited >= POOL_WAIT:
                raise
            await asyncio.sleep(POOL_STEP)
            waited += POOL_STEP


def node_of(client: Any, command: Command) -> Any:
    """The node of ``command``'s (first) key in a cluster ``client``'s slot map, or
    ``None`` while it has none (an asyncio client starts at its first command)."""
    try:
        return client.get_node_from_key(command.keys[0])
    except SlotNotCoveredError:
        return None


def unstarted_node(client: Any, command: Command, refused: BaseException) -> Any:
    """The node of ``command``'s key, to send it to directly, when an asyncio cluster
    ``client`` could not connect (``refused``: nothing was sent) and knows the
    slot's node; else ``None``.

    redis-py's and valkey-py's asyncio cluster clients start at their first command
    by asking COMMAND of their default node, the master of slot 0: while it is
    down every command fails with its connection error, whatever node its key is
    on, and would degrade every key. The slot map is read before that, so the
    key's own node is known: a connection that failed before sending anything
    makes the direct send safe (a timeout would not: it may have run)."""
    if (
        command.name != "execute_command"
        or not command.keys
        or "connecting to" not in str(refused)
        or not any(isinstance(client, lib.asyncio.cluster) for lib in LIBRARIES)
    ):
        return None
    return client.get_node_from_key(command.keys[0])


#: As many sends as the cluster clients' own ``RedisClusterRequestTTL``.
REDIRECTS = 16


async def follow_asks(client: Any, argv: tuple[Any, ...], key: bytes, storm: BaseException) -> Any:
    """The reply to ``argv`` (a command naming ``key``, which its asyncio cluster
    ``client`` gave up on with ``storm``: "TTL exhausted."), following MOVED and ASK
    here, or ``storm`` raised again if they do not settle (docs/design.md §6).

    redis-py's and valkey-py's asyncio cluster clients send the ``ASKING`` an ASK
    calls for on one pooled connection of the target node and the command on
    another: the pool hands out its oldest free connection, so whenever the target
    has two free, it never sees the two together, answers MOVED back to the source,
    which answers ASK again, until the client gives up. Nothing has run, so the
    command may go again: here ``ASKING`` and it go in one write on one connection
    (the node's ``execute_pipeline``). A TRYAGAIN (keys of one command that the
    migration has split between the nodes) is not waited on: ``storm`` is raised,
    and a batch is split by its caller."""
    library = next(lib for lib in LIBRARIES if isinstance(client, lib.asyncio.cluster))
    node, asked = client.get_node_from_key(key), None
    for _ in range(REDIRECTS):
        try:
            if asked is not None:
                return await sent_asking(library.node_command, asked, argv)
            if node is None:  # a node the client does not know (yet)
                break
            return await node.execute_command(*argv)
        except MovedError as moved:
            node, asked = named(client, moved), None
        except AskError as ask:
            asked = named(client, ask)
            if asked is None:
                break
        except TryAgainError:
            break
    raise storm


def named(client: Any, redirection: Any) -> Any:
    """The node a MOVED or ASK names, or ``None`` when the client does not know it."""
    return client.get_node(host=redirection.host, port=redirection.port)


async def sent_asking(node_command: type[Any], node: Any, argv: tuple[Any, ...]) -> Any:
    """The reply to ``argv`` sent to ``node`` right after ``ASKING``, the two in one
    write on one of its connections; an error reply raised."""
    asking, command = node_command(0, "ASKING"), node_command(1, *argv)
    await node.execute_pipeline([asking, command])
    for sent in (asking, command):
        if isinstance(sent.result, BaseException):
            raise sent.result
    return command.result


def answer(outcome: Outcome) -> Any:
    """An outcome's answer, or its error raised."""
    value, error = outcome
    if error is not None:
        raise error
    return value


def run(flow: Flow[T], state: Store) -> T:
    """Drives ``flow`` to its answer with blocking calls."""
    return answer(drive(Flowing(flow), state))  # type: ignore[no-any-return]


async def run_async(
    flow: Flow[T],
    state: Store,
    *,
    blocking: bool = False,
    undo: Callable[[Any], Awaitable[None]] | None = None,
) -> T:
    """Drives ``flow`` to its answer, awaited (:func:`drive_async`'s options)."""
    outcome = await drive_async(Flowing(flow), state, blocking=blocking, undo=undo)
    return answer(outcome)  # type: ignore[no-any-return]


def run_flowing(flowing: Flowing, state: Store) -> Any:
    """Drives a flow written without a generator (``buckets.Allow``, the common
    allow: one command) to its answer with blocking calls."""
    return answer(drive(flowing, state))


async def run_flowing_async(flowing: Flowing, state: Store) -> Any:
    """:func:`run_flowing`, awaited."""
    return answer(await drive_async(flowing, state))
