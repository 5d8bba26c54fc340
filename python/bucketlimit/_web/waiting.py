"""The steps of a request that waits (``max_wait``): for its tokens or for a permit,
a blocking call in a synchronous driver, awaited in an async one, where a client
that disconnects while it waits leaves the queue and gets nothing
(docs/web.md, "Waiting instead of refusing")."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, cast

from bucketlimit._reservations import AsyncReservationLike, ReservationLike
from bucketlimit._web.limiters import AnyLimiter, ConcurrencyLimiterLike


class ClientDisconnected(Exception):
    """The client went away while its request waited for tokens or a permit
    (``max_wait``): the wait was cancelled (it left the queue) and every token and
    permit the request held given back. An ASGI adapter raises it instead of
    answering: there is nobody to answer."""


class Waiting:
    """A step that may wait for tokens or a permit: :func:`run` calls ``sync`` (the
    thread sleeps), :func:`run_async` calls ``asynchronous`` and awaits it. Both wait
    on the limiter's clock when it can (a ``ManualClock`` advances instead of
    sleeping)."""

    __slots__ = ("asynchronous", "sync")

    def __init__(
        self, sync: Callable[..., Any], asynchronous: Callable[..., Awaitable[Any]]
    ) -> None:
        self.sync = sync
        #: ``asynchronous(*args, disconnected)`` (``key, cost`` for tokens, ``key`` for
        #: a permit): ``disconnected`` is ``None`` or a function returning an
        #: awaitable that ends when the client goes away.
        self.asynchronous = asynchronous

    def __call__(self, *args: Any) -> Any:
        return self.sync(*args)


def token_waiting(limiter: AnyLimiter, max_wait: float) -> Waiting:
    """The step that waits up to ``max_wait`` seconds for the tokens: the limiter's
    ``reserve``, then the reservation's ``wait`` (a synchronous driver) or its
    awaited twin (an async one), so that the request settles through the
    reservation and a give-back keeps its place in the queue. An async driver
    given a ``disconnected`` watch cancels the wait when the client goes away
    (the reservation gives its tokens back) and raises
    :class:`ClientDisconnected`. A limiter of your own with ``acquire`` but no
    ``reserve`` is asked ``acquire`` (or ``acquire_async``) and answers a
    ``Decision``."""
    waits: Any = limiter
    timeout = max_wait
    reserve = getattr(waits, "reserve", None)
    if not callable(reserve):
        acquire = waits.acquire
        acquire_async = getattr(waits, "acquire_async", acquire)

        async def acquiring(key: str, cost: int, disconnected: Any = None) -> Any:
            answer = acquire_async(key, cost, timeout=timeout)
            return await answer if inspect.isawaitable(answer) else answer

        return Waiting(lambda key, cost: acquire(key, cost, timeout=timeout), acquiring)

    def sync(key: str, cost: int) -> ReservationLike:
        reservation: ReservationLike = reserve(key, cost, max_wait=timeout)
        reservation.wait()
        return reservation

    async def asynchronous(
        key: str, cost: int, disconnected: Callable[[], Awaitable[object]] | None = None
    ) -> ReservationLike | AsyncReservationLike:
        reserved = reserve(key, cost, max_wait=timeout)
        if inspect.isawaitable(reserved):  # an asyncio limiter's reservation
            held: AsyncReservationLike = await reserved
            await _wait_unless_gone(held, held.wait, disconnected)
            return held
        await _wait_unless_gone(reserved, reserved.wait_async, disconnected)
        return cast(ReservationLike, reserved)

    return Waiting(sync, asynchronous)


def permit_waiting(concurrency: ConcurrencyLimiterLike, max_wait: float) -> Waiting:
    """The step that waits up to ``max_wait`` seconds for a permit (the procedure
    asked ``try_acquire`` first): ``acquire(key, timeout=max_wait)`` in a
    synchronous driver (the thread waits), and in an async one ``acquire_async``
    (or the asyncio limiter's ``acquire``) raced against ``disconnected``: a client
    that goes away leaves the queue (a permit handed to it meanwhile is released)
    and :class:`ClientDisconnected` is raised."""
    timeout = max_wait
    waits: Any = concurrency

    def sync(key: str) -> Any:
        return waits.acquire(key, timeout=timeout)

    async def asynchronous(
        key: str, disconnected: Callable[[], Awaitable[object]] | None = None
    ) -> Any:
        acquire = getattr(waits, "acquire_async", None)
        answer = (acquire if callable(acquire) else waits.acquire)(key, timeout=timeout)
        if not inspect.isawaitable(answer):
            return answer
        return await _permit_unless_gone(answer, disconnected)

    return Waiting(sync, asynchronous)


async def _wait_unless_gone(
    reservation: Any,
    wait: Callable[[], Awaitable[object]],
    disconnected: Callable[[], Awaitable[object]] | None,
) -> None:
    """Awaits ``wait()``; when ``disconnected()`` ends first (the client went away),
    cancels the wait, which gives the reservation's tokens back, and raises
    :class:`ClientDisconnected`. Without a watch, or with nothing to wait for, it is
    ``await wait()``."""
    if disconnected is None or not reservation or not reservation.delay > 0:
        await wait()
        return
    waiting = asyncio.ensure_future(wait())
    watching = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({waiting, watching}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task was cancelled: so are both, the wait given back first
        watching.cancel()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        raise
    if waiting in done:
        watching.cancel()
        waiting.result()  # its exception, if any
        return
    waiting.cancel()  # wait()/wait_async() give the tokens back when cancelled
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    raise ClientDisconnected("the client disconnected while its request waited for tokens")


async def _permit_unless_gone(
    acquiring: Awaitable[Any], disconnected: Callable[[], Awaitable[object]] | None
) -> Any:
    """Awaits the permit ``acquiring`` answers; when ``disconnected()`` ends first,
    cancels the wait (the waiter leaves the queue; a permit handed to it meanwhile is
    released) and raises :class:`ClientDisconnected`."""
    if disconnected is None:
        return await acquiring
    waiting = asyncio.ensure_future(acquiring)
    watching = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({waiting, watching}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task was cancelled: so are both, nothing kept
        watching.cancel()
        waiting.cancel()
        await _release_granted(waiting)
        raise
    if waiting in done:
        watching.cancel()
        return waiting.result()
    waiting.cancel()
    await _release_granted(waiting)
    raise ClientDisconnected("the client disconnected while its request waited for a permit")


async def _release_granted(waiting: asyncio.Future[Any]) -> None:
    """Releases the permit a cancelled wait answered all the same (it was granted
    before the cancellation reached it)."""
    outcomes: tuple[Any] = await asyncio.gather(waiting, return_exceptions=True)
    outcome = outcomes[0]
    if not isinstance(outcome, BaseException) and outcome:
        answer = outcome.release()
        if inspect.isawaitable(answer):
            await answer
