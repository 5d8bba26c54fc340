"""Checking the stores behind an app's limits (docs/web.md, "Checking the store at
start-up").

A Redis limiter sends nothing until its first call, so a wrong ``REDIS_URL`` or a
store that is down would show only in the answers (degraded, or errors) of the
first requests. Every limit asks its limiter's ``check()`` once per process
before that limiter first decides (a step of the request procedure), and the
adapters ask earlier where the app has a start-up (Flask's ``init_app``, the ASGI
middleware's lifespan start-up, Django's middleware, Litestar's ``on_startup``). A
store that does not answer raises :class:`StoreCheckError`, naming the limit: the
start fails, or the request does (a 500) and the next one asks again. A limit
made with ``check_store=False`` is never asked. Limiters without ``check()`` (in
process) have nothing to ask; plan functions are not called at start-up (the
limiters they choose are asked before their first decision).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import weakref
from collections.abc import Awaitable, Iterable
from typing import Any

from bucketlimit._core import ConcurrencyLimiter, TokenBucketLimiter

logger = logging.getLogger("bucketlimit")

#: The limiters whose store answered ``check()`` in this process. A child process
#: (a forked worker) asks again: it is another process of the store's count.
_ANSWERED: weakref.WeakSet[Any] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ANSWERED.clear)
#: In-process limiters: no store to ask.
_IN_PROCESS = frozenset({TokenBucketLimiter, ConcurrencyLimiter})


class StoreCheckError(RuntimeError):
    """A store behind a limit did not answer when the app started, or before the
    limit first decided (the cause is chained). Fix the URL or start the store; or
    opt out of the check (a limit's ``check_store=False``, the app's
    ``check_store=False``, Django's ``BUCKETLIMIT_CHECK_STORE = False``) to start
    anyway and let the limiter's ``on_store_error`` policy answer."""


def unchecked(limiter: object) -> bool:
    """Whether ``limiter`` has a store (``check()``) that has not answered in this
    process yet."""
    if limiter is None or limiter.__class__ in _IN_PROCESS:
        return False
    return callable(getattr(limiter, "check", None)) and limiter not in _ANSWERED


#: When a request asks: in the message of its StoreCheckError.
FIRST_DECISION = "before the limit first decided"
STARTUP = "at start-up"


def check_now(limit: Any, limiter: Any, when: str = FIRST_DECISION) -> Awaitable[None] | None:
    """Asks ``limiter``'s store (``check()``) for ``limit``: ``None`` once it answered,
    or an awaitable to await for an asyncio limiter. A store that does not answer
    raises :class:`StoreCheckError`. A step of the request procedure, before the
    limiter first decides."""
    try:
        answer = limiter.check()
    except Exception as error:
        raise _failed(limit, limiter, error, when) from error
    if inspect.isawaitable(answer):
        return _answer(limit, limiter, answer, when)
    _answered(limiter)
    return None


async def _answer(limit: Any, limiter: Any, answer: Awaitable[object], when: str) -> None:
    try:
        await answer
    except Exception as error:
        raise _failed(limit, limiter, error, when) from error
    _answered(limiter)


def _answered(limiter: object) -> None:
    # A limiter of one's own without weak references is asked each time.
    with contextlib.suppress(TypeError):
        _ANSWERED.add(limiter)


def _checks(limits: Iterable[Any]) -> list[tuple[Any, Any]]:
    """``(limit, limiter)`` of each limiter (and concurrency limiter) whose store has
    not answered yet, each limiter once (a limit of several: each part's); limits
    made with ``check_store=False`` are left out."""
    seen: set[int] = set()
    found = []
    for limit in [part for each in limits for part in (getattr(each, "parts", ()) or (each,))]:
        if not getattr(limit, "checks_store", True):
            continue
        for limiter in (limit.limiter, getattr(limit, "concurrency", None)):
            if not unchecked(limiter) or id(limiter) in seen:
                continue
            seen.add(id(limiter))
            found.append((limit, limiter))
    return found


def _failed(limit: Any, limiter: Any, error: BaseException, when: str) -> StoreCheckError:
    message = (
        f"the store of limit {limit.name!r} ({limiter!r}) did not answer {when}: "
        f"{type(error).__name__}: {error}"
    )
    logger.error("bucketlimit: %s", message)
    return StoreCheckError(message)


def check_stores(limits: Iterable[Any]) -> int:
    """Calls ``check()`` on the limiter of each limit that has one (a Redis
    limiter) and has not answered in this process; the first that fails raises
    :class:`StoreCheckError`. Returns how many stores were asked. An asyncio
    limiter's check is a coroutine: use :func:`check_stores_async` for those (here
    they are skipped)."""
    asked = 0
    for limit, limiter in _checks(limits):
        if inspect.iscoroutinefunction(limiter.check):
            continue
        check_now(limit, limiter, STARTUP)
        asked += 1
    return asked


async def check_stores_async(limits: Iterable[Any]) -> int:
    """:func:`check_stores` in async code: a coroutine ``check()`` is awaited."""
    asked = 0
    for limit, limiter in _checks(limits):
        answer = check_now(limit, limiter, STARTUP)
        if answer is not None:
            await answer
        asked += 1
    return asked
