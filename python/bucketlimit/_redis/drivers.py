"""The two drivers of every flow (docs/design.md §6): one blocking loop, one asyncio loop.

A driver sends each command a flow waits on to the limiter's client and gives the
flow the reply, or throws the client's error in at its ``yield``; the flow's
return value is the operation's answer. That is all a driver does: what a reply
or an error means is the flow's (``bucketlimit._redis.flows``). A flow is driven
as a :class:`~bucketlimit._redis.flows.Flowing` (the common allow as
``flows.Allow``, which needs no generator), so a step costs no exception. Shared
round trips, which drive many flows at once, are ``bucketlimit._redis.batching``.

One piece of I/O is more than a call: an asyncio cluster client lost among the
redirections of a slot being migrated is followed here (:func:`follow_asks`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Final, TypeVar

from bucketlimit._core import Decision
from bucketlimit._redis import flows, module
from bucketlimit._redis.clients import LIBRARIES
from bucketlimit._redis.errors import (
    REDIRECTED,
    AskError,
    ClientConnectionError,
    ClusterError,
    LibraryError,
    MaxConnectionsError,
    MovedError,
    TryAgainError,
    classify,
)
from bucketlimit._redis.flows import Command, Flow, Flowing, Outcome
from bucketlimit._redis.state import LimiterState, Store

T = TypeVar("T")

#: Seconds a command waits for a connection when its client's pool is full and says
#: so at once (redis-py's ``MaxConnectionsError``: nothing was sent), in steps of
#: POOL_STEP: the limiter's own callers filling their pool are not an outage, and
#: answering them by the policy (a "local" share) would admit beyond the limit. A
#: blocking pool waits by itself (its own timeout).
POOL_WAIT: Final = 1.0
POOL_STEP: Final = 0.002


def drive(flowing: Flowing, state: Store) -> Outcome:
    """The one blocking loop: sends each command ``flowing`` waits on to the state's
    client and feeds it the reply or the error, until it has its outcome."""
    while (command := flowing.command) is not None:
        try:
            reply = send(state, command)
        except BaseException as error:  # the flow decides what a failure means
            flowing.feed(error, thrown=True)
        else:
            flowing.feed(reply, thrown=False)
    return flowing.outcome


async def drive_async(flowing: Flowing, state: Store) -> Outcome:
    """The one asyncio loop: :func:`drive`, each command awaited on the state's
    asyncio client. An outcome reached without any command (a cached refusal, the
    policy while the breaker skips the store) still yields to the event loop once,
    so a task calling a degraded limiter in a loop cannot starve the others."""
    if flowing.command is None:
        await asyncio.sleep(0)
    while (command := flowing.command) is not None:
        try:
            reply = await send_async(state, command)
        except BaseException as error:  # CancelledError too: the flow counts it
            flowing.feed(error, thrown=True)
        else:
            flowing.feed(reply, thrown=False)
    return flowing.outcome


def send(state: Store, command: Command) -> Any:
    """``command`` sent on the state's client (connected on first use). While it is
    on its way it is in ``state.flying``, so that ``close()`` lets it land; once the
    limiter is closed nothing is sent (a ``RuntimeError``). The command is added
    before ``closed`` is read: ``close()`` sets ``closed``, then waits for the set
    to empty, so no command slips between the two."""
    flying = state.flying
    flying.add(command)
    try:
        if state.closed:
            raise RuntimeError(state.closing())
        client = state.client if state.client is not None else state.connect()
        call = getattr(client, command.name)
        argv = command.argv
        twin = module.twin(state, argv) if state.engine.module else None
        waited = 0.0
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
        twin = module.twin(state, command.argv) if state.engine.module else None
        if twin is not None:
            try:
                return module.parsed(await _sent_on(client, command, twin))
            except LibraryError as error:
                without_module(state, twin, error)
        return await _sent_on(client, command, command.argv)
    finally:
        flying.discard(command)


async def _sent_on(client: Any, command: Command, argv: tuple[Any, ...]) -> Any:
    """``argv`` (the command's, or its module twin) awaited on ``client``, following
    a cluster client's redirection storm or unstarted node (see below)."""
    try:
        return await _sent_async(getattr(client, command.name), argv)
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


async def run_async(flow: Flow[T], state: Store) -> T:
    """Drives ``flow`` to its answer, awaited."""
    return answer(await drive_async(Flowing(flow), state))  # type: ignore[no-any-return]


def allow(state: LimiterState, key: str, cost: object) -> Decision:
    """``allow`` with blocking calls (``flows.Allow``: the common allow, one command)."""
    return answer(drive(flows.Allow(state, key, cost), state))  # type: ignore[no-any-return]


async def allow_async(state: LimiterState, key: str, cost: object) -> Decision:
    """:func:`allow`, awaited."""
    return answer(await drive_async(flows.Allow(state, key, cost), state))  # type: ignore[no-any-return]
