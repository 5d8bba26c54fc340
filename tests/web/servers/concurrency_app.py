"""Slow streamed responses behind ``Limit(concurrency=N)``, for
tests/web/test_concurrency_servers.py: ``fastapi_app`` (uvicorn) and ``flask_app``
(gunicorn).

``GET /slow`` streams ``start`` at once, then a ``.`` every 50 ms until the file
``$STATE_DIR/open`` exists, then ``end``. While its body runs it holds a place in
``$STATE_DIR/counters.json`` (raised when the body starts, lowered when it ends,
under a file lock, so every worker process counts in one place): ``now`` and the
``max`` of all workers together, and each worker's own (``pid:<pid>``). That is
the in-flight count measured on the server side, inside the permit's hold.

Environment: ``BUCKETLIMIT_CONCURRENCY`` (default 3), ``MAX_WAIT`` (seconds, default
0), ``STATE_DIR`` (required), ``REDIS_URL`` (the Redis concurrency limiter, shared by
every worker; empty: an in-process ``ConcurrencyLimiter`` per worker).
``GET /health`` (not limited) answers the worker's pid, ``GET /state`` its limiter's
``stats()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from flask import Flask, Response
from starlette.responses import StreamingResponse

from bucketlimit import ConcurrencyLimiter
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask

STATE = Path(os.environ["STATE_DIR"])
LIMIT = int(os.environ.get("BUCKETLIMIT_CONCURRENCY", "3"))
MAX_WAIT = float(os.environ.get("MAX_WAIT", "0"))
REDIS_URL = os.environ.get("REDIS_URL")
TICK = 0.05  # seconds between the dots of a slow body


def concurrency(asyncio_client: bool) -> Any:
    """The limit's concurrency limiter: on Redis when ``REDIS_URL`` is set."""
    if not REDIS_URL:
        return ConcurrencyLimiter(LIMIT, ttl=60)
    from bucketlimit import redis as bl_redis

    client = bl_redis.client_from_url(REDIS_URL, asyncio=asyncio_client)
    if asyncio_client:
        return bl_redis.AsyncRedisConcurrencyLimiter(
            client, LIMIT, ttl=60, prefix="test-concurrency:"
        )
    return bl_redis.RedisConcurrencyLimiter(client, LIMIT, ttl=60, prefix="test-concurrency:")


@contextlib.contextmanager
def counted() -> Iterator[None]:
    """Holds a place in the shared counters while the block runs."""
    change(+1)
    try:
        yield
    finally:
        change(-1)


def change(step: int) -> None:
    with (STATE / "counters.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = STATE / "counters.json"
        counters = json.loads(path.read_text()) if path.exists() else {}
        mine = f"pid:{os.getpid()}"
        for name in ("all", mine):
            entry = counters.setdefault(name, {"now": 0, "max": 0})
            entry["now"] += step
            entry["max"] = max(entry["max"], entry["now"])
        path.write_text(json.dumps(counters))


def gate_open() -> bool:
    return (STATE / "open").exists()


def exempt(path: str) -> bool:
    return path != "/slow"


# -- FastAPI under uvicorn --------------------------------------------------------------------

fastapi_limit = bl_fastapi.Limit(
    concurrency=concurrency(asyncio_client=True),
    name="inflight",
    max_wait=MAX_WAIT,
    exempt=lambda request: exempt(request.url.path),
)
fastapi_app = FastAPI()
fastapi_app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=fastapi_limit)


@fastapi_app.get("/health")
async def fastapi_health() -> dict[str, int]:
    return {"pid": os.getpid()}


@fastapi_app.get("/state")
async def fastapi_state() -> Any:
    stats = fastapi_limit.concurrency.stats()  # type: ignore[union-attr]
    return await stats if asyncio.iscoroutine(stats) else stats


@fastapi_app.get("/slow")
async def fastapi_slow() -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        with counted():
            yield b"start\n"
            while not gate_open():
                await asyncio.sleep(TICK)
                yield b"."
            yield b"\nend\n"

    return StreamingResponse(body(), media_type="text/plain")


# -- Flask under gunicorn ---------------------------------------------------------------------

flask_app = Flask(__name__)
flask_limit = bl_flask.Limit(
    concurrency=concurrency(asyncio_client=False),
    name="inflight",
    max_wait=MAX_WAIT,
    exempt=lambda request: exempt(request.path),
)
bl_flask.RateLimit(flask_limit, flask_app)


@flask_app.get("/health")
def flask_health() -> dict[str, int]:
    return {"pid": os.getpid()}


@flask_app.get("/state")
def flask_state() -> Any:
    return flask_limit.concurrency.stats()  # type: ignore[union-attr]


@flask_app.get("/slow")
def flask_slow() -> Response:
    def body() -> Iterator[bytes]:
        with counted():
            yield b"start\n"
            while not gate_open():
                time.sleep(TICK)
                yield b"."
            yield b"\nend\n"

    return Response(body(), mimetype="text/plain")
