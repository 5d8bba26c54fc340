"""Wake-ups for the waiters of a Redis concurrency limiter (docs/design.md §6,
"Concurrency permits"), without polling.

A slot freed on the store (a release, an expiry some call noticed) is handed to
the key's first waiter inside the script, which records the grant and tells the
waiter with a message on its channel (``PUBLISH``, from the script). A channel
is one limiter object's in one process: one subscription, one connection,
whatever the number of its waiters. :class:`Wakeups` is that channel's table of
waiters, free of I/O; a listener reads the messages and wakes each waiter: a
thread for the blocking client (:func:`listen`), a task for the asyncio one
(:func:`listen_async`). It runs while someone waits, and stops once nobody has
waited for :data:`IDLE` seconds.

Pub/sub may lose a message (a connection that dropped, or went silent while
open, a subscription not confirmed yet); the grant is never lost with it, since
it is recorded on the store. A listener with waiters that hears nothing for
:data:`SILENCE` seconds sends a PING; unanswered, the subscription is lost. So
a waiter registered while the channel was not heard, or when the subscription
was lost, is woken with :data:`RESYNC`: it asks the store once.
While no subscription is heard a waiter asks the store every
:data:`POLL_WITHOUT_WAKEUPS` seconds, so a wait of 3 s or more costs at most
two commands a second, its first and last included; with it, a waiter asks
only when a slot is sure to free by expiry (a holder that died tells nobody).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any, Final

from bucketlimit._histogram import fork_safe

logger = logging.getLogger("bucketlimit")

#: A wake-up without a grant: the waiter asks the store (a message may be lost).
RESYNC: Final = ("resync",)

#: Seconds between a waiter's questions to the store while no subscription is
#: heard: 1.33 a second, so with the call that queued it and the one that gives
#: up a wait of 3 s or more costs at most 2 commands a second.
POLL_WITHOUT_WAKEUPS: Final = 0.75

#: Seconds a listener runs on with nobody waiting, then unsubscribes.
IDLE: Final = 10.0

#: Seconds a listener waits for a message before it looks at its state again.
LISTEN_STEP: Final = 0.25

#: Seconds of silence after which a listener with waiters asks its connection
#: whether it still works (a PING on it), and then waits at most for its PONG
#: before it takes the subscription as lost: a connection that stays open but
#: delivers nothing (a black-holed path) must not leave a freed slot idle until an
#: expiry, nor a waiter asleep until its timeout.
SILENCE: Final = 1.0

#: Seconds a listener waits before subscribing again after a failure.
RETRY: Final = 1.0

#: A grant told in a message: token, remaining, reset_after (µs).
Grant = tuple[int, int, int]


class Waiter:
    """One waiting call: woken with a :data:`Grant` or :data:`RESYNC`, from any
    thread. A thread waits on a lock of its own, a task on a future of its own."""

    __slots__ = ("_future", "_got", "_lock", "_loop", "_mutex", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._mutex = threading.Lock()
        self._got: Grant | tuple[str] | None = None
        self._lock: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: asyncio.Future[None] | None = None

    def wake(self, got: Grant | tuple[str]) -> None:
        with self._mutex:
            if self._got is None or self._got is RESYNC:
                self._got = got  # a grant is never replaced by a resync
            lock, self._lock = self._lock, None
            future, loop = self._future, self._loop
            self._future = self._loop = None
        if lock is not None:
            lock.release()
        if future is not None and loop is not None:
            # A closed loop (RuntimeError): nobody waits there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    def _take(self) -> Grant | tuple[str] | None:
        with self._mutex:
            got, self._got = self._got, None
            self._lock = self._future = self._loop = None
            return got

    def wait(self, seconds: float) -> Grant | tuple[str] | None:
        """Blocks up to ``seconds`` for a wake-up; what it was woken with, or None."""
        with self._mutex:
            if self._got is not None:
                got, self._got = self._got, None
                return got
            lock = threading.Lock()
            lock.acquire()
            self._lock = lock
        lock.acquire(timeout=min(seconds, threading.TIMEOUT_MAX))
        return self._take()

    async def wait_async(self, seconds: float) -> Grant | tuple[str] | None:
        """:meth:`wait` for a task."""
        loop = asyncio.get_running_loop()
        with self._mutex:
            if self._got is not None:
                got, self._got = self._got, None
                return got
            future: asyncio.Future[None] = loop.create_future()
            self._future, self._loop = future, loop
        try:
            await asyncio.wait((future,), timeout=seconds)
        finally:
            woken = self._take()
        return woken


class WaitHandle:
    """One waiting call's handle, for the drivers (a ``Wait`` step's ``handle``): its
    waiter, registered with the limiter's wake-ups now (before the call's first
    command, so a wake-up sent once it is queued finds it) until :meth:`close`.
    It waits with the limiter's clock when the clock can sleep (a ManualClock:
    ``sleep`` / ``sleep_async``), else on its wake-ups, starting their listener: a
    thread for a blocking client (``threaded``), a task for an asyncio one. While
    no subscription is heard it waits at most :data:`POLL_WITHOUT_WAKEUPS`."""

    __slots__ = ("_clock", "_connect", "_threaded", "_waiter", "_wakeups", "name")

    def __init__(self, wakeups: Wakeups, clock: Any, connect: Any, *, threaded: bool) -> None:
        self._wakeups = wakeups
        self._clock = clock
        self._connect = connect
        self._threaded = threaded
        self._waiter = wakeups.register()
        self.name = self._waiter.name

    def _seconds(self, seconds: float) -> float:
        return seconds if self._wakeups.heard else min(seconds, POLL_WITHOUT_WAKEUPS)

    def wait(self, seconds: float) -> Grant | tuple[str] | None:
        sleep = getattr(self._clock, "sleep", None)
        if callable(sleep):
            sleep(seconds)
            return None
        start_thread(self._wakeups, self._connect())
        return self._waiter.wait(self._seconds(seconds))

    async def wait_async(self, seconds: float) -> Grant | tuple[str] | None:
        sleep = getattr(self._clock, "sleep_async", None)
        if callable(sleep):
            await sleep(seconds)
            return None
        if self._threaded:
            start_thread(self._wakeups, self._connect())
        else:
            start_task(self._wakeups, self._connect())
        return await self._waiter.wait_async(self._seconds(seconds))

    def close(self) -> None:
        """The call ended: its waiter leaves the wake-ups."""
        self._wakeups.unregister(self._waiter)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Wakeups:
    """The channel of one limiter object in this process and its waiters.

    ``heard`` is True while the listener's subscription is confirmed: a message
    published then reaches every waiter registered then.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._numbers = itertools.count(1)
        self._fresh()
        fork_safe(self)

    def _fresh(self) -> None:
        self.channel = f"{self._prefix}{{bucketlimit-wake}}:{os.urandom(8).hex()}"
        self._lock = threading.Lock()
        self._waiters: dict[str, Waiter] = {}
        self.heard = False
        self._running = False  # a listener is running (or starting)
        self._stopping = False
        self._idle_since = time.monotonic()
        self.messages = 0  # wake-ups with a grant heard

    def _after_fork(self) -> None:
        # The child is another process: another channel, no listener, no waiter.
        self._fresh()

    def register(self) -> Waiter:
        """A new waiter, heard from now on if the channel is (else it gets RESYNC
        once the subscription is confirmed)."""
        waiter = Waiter(f"{self.channel}#{next(self._numbers)}")
        with self._lock:
            self._waiters[waiter.name] = waiter
        return waiter

    def unregister(self, waiter: Waiter) -> None:
        with self._lock:
            if self._waiters.pop(waiter.name, None) is not None and not self._waiters:
                self._idle_since = time.monotonic()

    def waiting(self) -> int:
        return len(self._waiters)

    def start(self) -> bool:
        """True when the caller must start a listener (none runs); claims it."""
        with self._lock:
            if self._running:
                return False
            self._running = True
            self._stopping = False
            return True

    def stop(self) -> None:
        """The limiter closes: the listener stops at its next step."""
        with self._lock:
            self._stopping = True

    def done(self) -> bool:
        """Whether the listener should stop now (closing, or nobody waited for
        :data:`IDLE` seconds); if so it is marked stopped, under the same lock a
        waiter starting one takes."""
        with self._lock:
            stop = self._stopping or (
                not self._waiters and time.monotonic() - self._idle_since > IDLE
            )
            if stop:
                self._running = False
                self.heard = False
            return stop

    def crashed(self) -> None:
        """The listener stopped on an error of its own: the next waiter starts
        another, and those waiting now ask the store."""
        with self._lock:
            self._running = False
        self.lost(None)

    def subscribed(self) -> None:
        """The subscription is confirmed: every waiter registered before asks the
        store once (a message before it was lost)."""
        with self._lock:
            self.heard = True
            waiters = list(self._waiters.values())
        for waiter in waiters:
            waiter.wake(RESYNC)

    def lost(self, error: BaseException | None) -> None:
        """The subscription broke (or could not be made): if it was heard, every
        waiter asks the store once; until it is confirmed again they ask every
        :data:`POLL_WITHOUT_WAKEUPS` seconds."""
        with self._lock:
            was, self.heard = self.heard, False
            waiters = list(self._waiters.values()) if was else []
        if error is not None:
            logger.debug("the wake-ups of %s were lost: %r", self.channel, error)
        for waiter in waiters:
            waiter.wake(RESYNC)

    def deliver(self, data: object) -> None:
        """A message: ``name token remaining reset_after_us`` from the script."""
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        parts = text.rsplit(" ", 3)
        if len(parts) != 4:
            return
        name, *numbers = parts
        try:
            token, remaining, reset = (int(v) for v in numbers)
        except ValueError:
            return
        with self._lock:
            waiter = self._waiters.get(name)
        if waiter is not None:
            self.messages += 1
            waiter.wake((token, remaining, reset))


class Silent(Exception):
    """A subscription that answered neither a message nor a PING: taken as lost."""


class Liveness:
    """Whether a listener's subscription still delivers (see :data:`SILENCE`): what
    its listener does after a wait that brought nothing. Shared by both listeners;
    times are ``time.monotonic()``."""

    __slots__ = ("_heard", "_pinged")

    def __init__(self) -> None:
        self._heard = time.monotonic()
        self._pinged: float | None = None

    def heard(self) -> None:
        """Something came on the connection (a message, a subscription, a PONG)."""
        self._heard, self._pinged = time.monotonic(), None

    def quiet(self, waiting: bool) -> bool:
        """Nothing came for a while: True when a PING is due now; raises
        :class:`Silent` when the last PING went unanswered for :data:`SILENCE`."""
        now = time.monotonic()
        if self._pinged is not None:
            if now - self._pinged >= SILENCE:
                raise Silent(f"no answer to a PING for {SILENCE:g} s")
            return False
        if waiting and now - self._heard >= SILENCE:
            self._pinged = now
            return True
        return False


def _kind(message: Any) -> tuple[str, Any]:
    kind = message.get("type")
    if isinstance(kind, bytes):
        kind = kind.decode()
    return str(kind), message.get("data")


def listen(wakeups: Wakeups, client: Any) -> None:
    """The listener of a blocking client: subscribes, wakes the waiters named by
    each message, resubscribes after a failure or a silence its PING does not
    break (:class:`Liveness`), and stops once idle. Runs in a daemon thread of its
    own; it never raises."""
    pubsub: Any = None
    liveness = Liveness()
    try:
        while not wakeups.done():
            try:
                if pubsub is None:
                    pubsub = client.pubsub()
                    pubsub.subscribe(wakeups.channel)
                    liveness = Liveness()
                message = pubsub.get_message(timeout=LISTEN_STEP)
                if message is None:
                    if liveness.quiet(wakeups.waiting() > 0):
                        pubsub.ping()
                    continue
            except Exception as error:
                wakeups.lost(error)
                _closed(pubsub)
                pubsub = None
                time.sleep(RETRY)
                continue
            liveness.heard()
            kind, data = _kind(message)
            if kind == "subscribe":
                wakeups.subscribed()
            elif kind == "message":
                wakeups.deliver(data)
    except BaseException as error:  # never out of a thread: the waiters poll instead
        logger.debug("the wake-up listener of %s stopped: %r", wakeups.channel, error)
        wakeups.crashed()
    finally:
        _closed(pubsub)


def _closed(pubsub: Any) -> None:
    if pubsub is not None:
        try:
            pubsub.close()
        except Exception:  # closing a broken connection
            logger.debug("closing a wake-up subscription failed", exc_info=True)


async def listen_async(wakeups: Wakeups, client: Any) -> None:
    """:func:`listen` for an asyncio client, in a task of its own."""
    pubsub: Any = None
    liveness = Liveness()
    try:
        while not wakeups.done():
            try:
                if pubsub is None:
                    pubsub = client.pubsub()
                    await pubsub.subscribe(wakeups.channel)
                    liveness = Liveness()
                message = await pubsub.get_message(timeout=LISTEN_STEP)
                if message is None:
                    if liveness.quiet(wakeups.waiting() > 0):
                        await pubsub.ping()
                    continue
            except Exception as error:
                wakeups.lost(error)
                await _closed_async(pubsub)
                pubsub = None
                await asyncio.sleep(RETRY)
                continue
            liveness.heard()
            kind, data = _kind(message)
            if kind == "subscribe":
                wakeups.subscribed()
            elif kind == "message":
                wakeups.deliver(data)
    except BaseException as error:
        logger.debug("the wake-up listener of %s stopped: %r", wakeups.channel, error)
        wakeups.crashed()
        if isinstance(error, asyncio.CancelledError):
            raise
    finally:
        await _closed_async(pubsub)


async def _closed_async(pubsub: Any) -> None:
    if pubsub is not None:
        try:
            await pubsub.aclose()
        except Exception:
            logger.debug("closing a wake-up subscription failed", exc_info=True)


def start_thread(wakeups: Wakeups, client: Any) -> None:
    """Starts the blocking listener if none runs."""
    if wakeups.start():
        thread = threading.Thread(
            target=listen, args=(wakeups, client), name="bucketlimit-wakeups", daemon=True
        )
        thread.start()


#: Listener tasks, held until they end (the event loop keeps only weak references).
_TASKS: set[asyncio.Task[None]] = set()


def start_task(wakeups: Wakeups, client: Any) -> None:
    """Starts the asyncio listener on the running loop if none runs."""
    if wakeups.start():
        task = asyncio.get_running_loop().create_task(listen_async(wakeups, client))
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)
