"""``concurrency=`` on the Redis concurrency limiters, on a real redis-server: Flask with
``RedisConcurrencyLimiter`` (a streamed body holds its permit until the server closes
it; ``max_wait`` threads served in turn), FastAPI with ``AsyncRedisConcurrencyLimiter``
(its coroutines and its permits' awaited release; a hang-up mid-stream and while
waiting). The adapters use only the limiters' public methods, so these are the
in-process tests' twins on the store. They need ``bucketlimit.redis``'s concurrency
limiters."""

# No `from __future__ import annotations`: FastAPI must see the annotations of routes
# defined inside tests.
import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
from fastapi import FastAPI
from flask import Flask, Response
from starlette.responses import StreamingResponse

from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit import redis as bl_redis
from tests.web.exchange import Exchange, until

pytestmark = pytest.mark.redis

PEER = "192.0.2.10"
DEADLINE = 10.0


def prefix() -> str:
    return f"webperm-{uuid.uuid4().hex}:"


def test_flask_holds_a_redis_permit_through_a_streamed_body(redis_url: str) -> None:
    inflight = bl_redis.RedisConcurrencyLimiter.from_url(redis_url, 1, prefix=prefix())
    app = Flask(__name__)

    @app.get("/stream")
    @bl_flask.Limit(concurrency=inflight, name="inflight", max_wait=30)
    def stream() -> Response:
        return Response(iter([b"a", b"b"]))

    holder = app.test_client().get("/stream")
    assert holder.headers["RateLimit-Policy"] == '"inflight";q=1;qu="concurrent-requests"'
    assert inflight.in_flight("127.0.0.1") == 1
    served: list[Any] = []
    waiter = threading.Thread(target=lambda: served.append(app.test_client().get("/stream")))
    waiter.start()
    deadline = time.monotonic() + DEADLINE
    while inflight.stats()["waiting"] != 1:  # it waits for the permit the first holds
        assert time.monotonic() < deadline, "the second request never waited"
        time.sleep(0.001)  # polling interval, not a timing assumption
    assert not served
    holder.close()  # the WSGI server is done with the first: the waiter's turn
    waiter.join(DEADLINE)
    assert served[0].status_code == 200
    assert inflight.in_flight("127.0.0.1") == 1
    served[0].close()
    assert inflight.in_flight("127.0.0.1") == 0
    inflight.close()


@pytest.mark.anyio
async def test_fastapi_on_the_asyncio_redis_limiter(redis_url: str) -> None:
    inflight = bl_redis.AsyncRedisConcurrencyLimiter.from_url(redis_url, 1, prefix=prefix())
    gate = asyncio.Event()
    app = FastAPI()
    app.add_middleware(
        bl_fastapi.RateLimitMiddleware,
        limit=bl_fastapi.Limit(concurrency=inflight, name="inflight", max_wait=30),
    )

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body() -> Any:
            yield b"a"
            await gate.wait()
            yield b"b"

        return StreamingResponse(body())

    async def in_flight() -> int:
        return int(await inflight.in_flight(PEER))

    holder = Exchange(app, "/stream", peer=PEER)
    assert await holder.start() == 200
    await holder.chunk()
    assert await in_flight() == 1

    def waiting() -> int:
        return int(inflight.stats()["waiting"])

    leaver = Exchange(app, "/stream", peer=PEER)  # waits, then hangs up
    await until(waiting, 1, "the first waiter queued")
    waiter = Exchange(app, "/stream", peer=PEER)  # waits, and is served
    await until(waiting, 2, "the second waiter queued")
    leaver.hang_up()
    await leaver.done()
    gate.set()
    assert await holder.rest() == b"b"
    assert await waiter.start() == 200  # the slot skipped the one that left
    assert await waiter.rest() == b"ab"
    await until(lambda: inflight.stats()["granted"], 2, "two grants")
    assert await in_flight() == 0
    streamed = Exchange(app, "/stream", peer=PEER)  # and one that hangs up mid-stream
    assert await streamed.start() == 200
    gate.clear()
    await streamed.chunk()
    streamed.hang_up()
    await streamed.done()
    assert await in_flight() == 0
    await inflight.aclose()
