"""The two drivers of every flow (docs/design.md §6): one blocking loop, one asyncio loop.

A driver sends each command a flow waits on to the limiter's client and gives the
flow the reply, or throws the client's error in at its ``yield``; the flow's
return value is the operation's answer. That is all a driver does: what a reply
or an error means is the flow's (``bucketlimit._redis.flows``). A flow is driven
as a :class:`~bucketlimit._redis.flows.Flowing` (the common allow as
``flows.Allow``, which needs no generator), so a step costs no exception. Shared
round trips, which drive many flows at once, are ``bucketlimit._redis.batching``.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from bucketlimit._core import Decision
from bucketlimit._redis import flows
from bucketlimit._redis.flows import Flow, Flowing, Outcome
from bucketlimit._redis.state import LimiterState, Store

T = TypeVar("T")


def drive(flowing: Flowing, state: Store) -> Outcome:
    """The one blocking loop: sends each command ``flowing`` waits on to the state's
    client and feeds it the reply or the error, until it has its outcome."""
    while (command := flowing.command) is not None:
        try:
            client = state.client if state.client is not None else state.connect()
            reply = getattr(client, command.name)(*command.argv)
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
            client = state.client if state.client is not None else state.connect()
            reply = await getattr(client, command.name)(*command.argv)
        except BaseException as error:  # CancelledError too: the flow counts it
            flowing.feed(error, thrown=True)
        else:
            flowing.feed(reply, thrown=False)
    return flowing.outcome


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
