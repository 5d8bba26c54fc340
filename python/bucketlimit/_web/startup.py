"""Checking the stores behind an app's limits when it starts (docs/web.md, "Checking
the store at start-up").

A Redis limiter sends nothing until its first call, so a wrong ``REDIS_URL`` or a
store that is down would show only in the answers (degraded, or errors) of the
first requests. The adapters call each limiter's ``check()`` when the app starts
(Flask's ``init_app``, the ASGI middleware's lifespan start-up, Django's
middleware, Litestar's ``on_startup``): a store that does not answer stops the
start with :class:`StoreCheckError`, naming the limit. Limiters without
``check()`` (in process) are skipped; plan functions are not called.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("bucketlimit")


class StoreCheckError(RuntimeError):
    """A store behind a limit did not answer when the app started (the cause is
    chained). Fix the URL or start the store; or opt out of the check (each
    adapter's ``check_store=False``, Django's ``BUCKETLIMIT_CHECK_STORE = False``)
    to start anyway and let the limiter's ``on_store_error`` policy answer."""


def _checks(limits: Iterable[Any]) -> list[tuple[Any, Any]]:
    """``(limit, limiter)`` of each limiter (and concurrency limiter) with ``check()``,
    each limiter once."""
    seen: set[int] = set()
    found = []
    for limit in limits:
        for limiter in (limit.limiter, getattr(limit, "concurrency", None)):
            check = getattr(limiter, "check", None)
            if not callable(check) or id(limiter) in seen:
                continue
            seen.add(id(limiter))
            found.append((limit, limiter))
    return found


def _failed(limit: Any, limiter: Any, error: BaseException) -> StoreCheckError:
    message = (
        f"the store of limit {limit.name!r} ({limiter!r}) did not answer at start-up: "
        f"{type(error).__name__}: {error}"
    )
    logger.error("bucketlimit: %s", message)
    return StoreCheckError(message)


def check_stores(limits: Iterable[Any]) -> int:
    """Calls ``check()`` on the limiter of each limit that has one (a Redis
    limiter); the first that fails raises :class:`StoreCheckError`. Returns how
    many stores were asked. An asyncio limiter's check is a coroutine: use
    :func:`check_stores_async` for those (here they are skipped)."""
    asked = 0
    for limit, limiter in _checks(limits):
        if inspect.iscoroutinefunction(limiter.check):
            continue
        try:
            limiter.check()
        except Exception as error:
            raise _failed(limit, limiter, error) from error
        asked += 1
    return asked


async def check_stores_async(limits: Iterable[Any]) -> int:
    """:func:`check_stores` in async code: a coroutine ``check()`` is awaited."""
    asked = 0
    for limit, limiter in _checks(limits):
        try:
            answer = limiter.check()
            if inspect.isawaitable(answer):
                await answer
        except Exception as error:
            raise _failed(limit, limiter, error) from error
        asked += 1
    return asked
