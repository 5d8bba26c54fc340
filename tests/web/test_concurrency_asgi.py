"""``concurrency=`` in the ASGI adapters (the middleware, FastAPI's dependency,
Litestar), on real apps driven message by message (tests/web/exchange.py): the
permit is held for the whole request, its streamed body included, and released
when the last chunk is sent, when the client disconnects, or when the app fails;
``max_wait`` queues in arrival order and a waiter that hangs up leaves the queue;
the fields say ``qu="concurrent-requests"``."""

# No `from __future__ import annotations`: FastAPI must see the annotations of routes
# defined inside tests.
import asyncio
import json
from typing import Any

import httpx
import pytest
from fastapi import BackgroundTasks, Depends, FastAPI, Request
from litestar import Litestar, get
from litestar.response import Stream
from litestar.testing import TestClient as LitestarClient
from starlette.responses import Response, StreamingResponse

from bucketlimit import ConcurrencyLimiter, Permit, TokenBucketLimiter
from bucketlimit import asgi as bl_asgi
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import litestar as bl_litestar
from bucketlimit.testing import ManualClock
from tests.web import sf
from tests.web.exchange import Exchange, http_scope, until
from tests.web.problem import assert_problem

pytestmark = pytest.mark.anyio

PEER = "192.0.2.10"


def tokens(limiter: TokenBucketLimiter, key: str = PEER) -> int:
    decision = limiter.peek(key)
    return decision.remaining + decision.allowed


def streaming_app(
    gate: asyncio.Event,
    *route_limits: bl_fastapi.Limit,
    limit: bl_fastapi.Limit | None = None,
    seen: list[int] | None = None,
    inflight: ConcurrencyLimiter | None = None,
    started: list[str] | None = None,
) -> FastAPI:
    """GET /stream sends "a", waits for ``gate``, then sends "b"; ``seen`` records the
    permits held (``inflight.in_flight``) at each step and in a background task,
    ``started`` the ``x-n`` header of each request the route ran."""
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=limit)

    def note() -> None:
        if seen is not None and inflight is not None:
            seen.append(inflight.in_flight(PEER))

    @app.get("/stream", dependencies=[Depends(one) for one in route_limits])
    async def stream(request: Request, background: BackgroundTasks) -> StreamingResponse:
        if started is not None:
            started.append(request.headers["x-n"])

        async def body() -> Any:
            note()
            yield b"a"
            await gate.wait()
            note()
            yield b"b"

        background.add_task(note)  # runs after the last chunk was sent
        return StreamingResponse(body())

    @app.get("/fail", dependencies=[Depends(one) for one in route_limits])
    async def fail() -> None:
        raise RuntimeError("the handler failed")

    return app


async def fetch(app: Any, path: str = "/stream") -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=(PEER, 1), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path)


# -- the fields -------------------------------------------------------------------------------


async def test_the_fields_name_the_quota_unit_concurrent_requests() -> None:
    gate = asyncio.Event()
    gate.set()
    inflight = ConcurrencyLimiter(3)
    app = streaming_app(gate, limit=bl_fastapi.Limit(concurrency=inflight, name="inflight"))
    answer = await fetch(app)
    assert answer.status_code == 200
    policy = sf.ratelimit_policy(answer.headers["RateLimit-Policy"])
    assert policy["inflight"].params == {"q": 3, "qu": "concurrent-requests"}  # no window
    assert sf.ratelimit(answer.headers["RateLimit"])["inflight"].params == {"r": 2}  # no t
    assert inflight.in_flight(PEER) == 0


async def test_one_limit_with_a_rate_and_a_concurrency_is_two_policies() -> None:
    gate = asyncio.Event()
    gate.set()
    rate = TokenBucketLimiter(10, 1)
    limit = bl_fastapi.Limit(rate, concurrency=2, name="api")
    assert limit.concurrency_name == "api-concurrency"
    answer = await fetch(streaming_app(gate, limit=limit))
    policy = sf.ratelimit_policy(answer.headers["RateLimit-Policy"])
    assert {name: item.params for name, item in policy.items()} == {
        "api-concurrency": {"q": 2, "qu": "concurrent-requests"},
        "api": {"q": 10, "w": 10},
    }
    assert sf.ratelimit(answer.headers["RateLimit"])["api-concurrency"].params == {"r": 1}


# -- held through the streamed body -----------------------------------------------------------


async def test_the_permit_is_held_until_the_last_chunk_is_sent() -> None:
    gate = asyncio.Event()
    inflight = ConcurrencyLimiter(1)
    seen: list[int] = []
    limit = bl_fastapi.Limit(concurrency=inflight, name="inflight")
    app = streaming_app(gate, limit=limit, seen=seen, inflight=inflight)
    first = Exchange(app, "/stream", peer=PEER)
    assert await first.start() == 200
    assert await first.chunk() == (b"a", True)
    second = Exchange(app, "/stream", peer=PEER)  # while the first still streams
    assert await second.start() == 429
    assert second.headers["retry-after"] == "1"
    body = await second.rest()
    assert_problem(json.loads(body), 429, "inflight", 1)
    assert inflight.in_flight(PEER) == 1
    gate.set()
    assert await first.rest() == b"b"
    # Held at the first and the last chunk; released once the last was sent, before
    # the background task ran.
    assert seen == [1, 1, 0]
    assert inflight.in_flight(PEER) == 0
    assert inflight.stats()["released"] == 1


async def test_a_client_that_disconnects_mid_stream_frees_its_permit() -> None:
    gate = asyncio.Event()  # never set: the stream would wait for ever
    inflight = ConcurrencyLimiter(1)
    app = streaming_app(gate, limit=bl_fastapi.Limit(concurrency=inflight, name="inflight"))
    exchange = Exchange(app, "/stream", peer=PEER)
    assert await exchange.start() == 200
    await exchange.chunk()
    assert inflight.in_flight(PEER) == 1
    exchange.hang_up()  # Starlette's stream listens for http.disconnect and stops
    await exchange.done()
    assert inflight.in_flight(PEER) == 0
    gate.set()
    assert (await fetch(app)).status_code == 200  # the slot is free again


async def test_an_app_that_ignores_the_disconnect_frees_the_permit_when_its_send_fails() -> None:
    inflight = ConcurrencyLimiter(1)

    async def endless(scope: Any, receive: Any, send: Any) -> None:  # never reads receive
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while True:
            await send({"type": "http.response.body", "body": b".", "more_body": True})
            await asyncio.sleep(0)

    limit = bl_asgi.Limit(concurrency=inflight, name="inflight")
    app = bl_asgi.RateLimitMiddleware(endless, limit=limit)
    exchange = Exchange(app, "/", peer=PEER, spec_version="2.4")  # send raises once gone
    assert await exchange.start() == 200
    await exchange.chunk()
    assert inflight.in_flight(PEER) == 1
    exchange.hang_up()
    with pytest.raises(OSError, match="disconnected"):
        await exchange.done()
    assert inflight.in_flight(PEER) == 0


async def test_a_handler_that_raises_releases_its_permit() -> None:
    inflight = ConcurrencyLimiter(1)
    route = bl_fastapi.Limit(concurrency=inflight, name="inflight")
    app = streaming_app(asyncio.Event(), route)
    answer = await fetch(app, "/fail")
    assert answer.status_code == 500
    assert inflight.in_flight(PEER) == 0
    assert inflight.stats()["released"] == 1


def dependency_app(gate: asyncio.Event, limit: bl_fastapi.Limit, seen: list[int]) -> FastAPI:
    """No middleware: GET /stream streams "a", waits for ``gate``, sends "b"; ``seen``
    records the permits held in a background task, after the body."""
    inflight = limit.concurrency
    assert isinstance(inflight, ConcurrencyLimiter)
    app = FastAPI()

    @app.get("/stream", dependencies=[Depends(limit)])
    async def stream(background: BackgroundTasks) -> StreamingResponse:
        async def body() -> Any:
            yield b"a"
            await gate.wait()
            yield b"b"

        background.add_task(lambda: seen.append(inflight.in_flight(PEER)))
        return StreamingResponse(body())

    @app.get("/fail", dependencies=[Depends(limit)])
    async def fail() -> None:
        raise RuntimeError("the handler failed")

    return app


async def test_without_the_middleware_fastapi_releases_the_permit_after_the_response() -> None:
    """FastAPI (0.118 and later) closes the exit stack of a request's dependencies once
    the response has been sent: the dependency's permit is released there."""
    gate = asyncio.Event()
    inflight = ConcurrencyLimiter(1)
    seen: list[int] = []
    app = dependency_app(gate, bl_fastapi.Limit(concurrency=inflight, name="inflight"), seen)
    first = Exchange(app, "/stream", peer=PEER)
    assert await first.start() == 200  # (FastAPI drops a dependency's fields here: the
    await first.chunk()  # route returns its own Response; the middleware writes them)
    refused = await fetch(app)
    assert refused.status_code == 429
    assert_problem(refused.json(), 429, "inflight", 1)
    gate.set()
    assert await first.rest() == b"b"
    assert seen == [1]  # held through the body and its background task, then released
    assert inflight.in_flight(PEER) == 0
    assert (await fetch(app, "/fail")).status_code == 500
    assert inflight.in_flight(PEER) == 0
    assert inflight.stats()["granted"] == inflight.stats()["released"] == 2


async def test_without_fastapis_exit_stack_the_dependency_asks_for_the_middleware() -> None:
    """An older FastAPI (before 0.118) closed its dependencies before the response was
    sent: with no stack to hand the release to, the dependency refuses to take a
    permit it could not give back."""
    inflight = ConcurrencyLimiter(1)
    limit = bl_fastapi.Limit(concurrency=inflight, name="inflight")
    scope = http_scope("/", peer=PEER)  # a request outside FastAPI: no exit stack
    with pytest.raises(bl_fastapi.ConfigurationError, match="RateLimitMiddleware"):
        await limit(Request(scope), Response())
    assert inflight.stats()["granted"] == 0


async def test_a_dependency_under_a_middleware_without_a_limit_of_its_own() -> None:
    gate = asyncio.Event()
    inflight = ConcurrencyLimiter(1)
    route = bl_fastapi.Limit(concurrency=inflight, name="inflight")
    app = streaming_app(gate, route, seen=[], inflight=inflight)
    first = Exchange(app, "/stream", peer=PEER)
    assert await first.start() == 200
    assert first.headers["ratelimit"] == '"inflight";r=0'
    await first.chunk()
    assert (await fetch(app)).status_code == 429
    gate.set()
    await first.rest()
    assert inflight.in_flight(PEER) == 0


# -- together with rate limits ----------------------------------------------------------------


async def test_a_concurrency_refusal_refunds_the_rate_limit_that_charged() -> None:
    gate = asyncio.Event()
    rate = TokenBucketLimiter(10, 0)
    inflight = ConcurrencyLimiter(1)
    app = streaming_app(
        gate,
        bl_fastapi.Limit(concurrency=inflight, name="inflight"),
        limit=bl_fastapi.Limit(rate, name="requests"),  # app-wide, decides first
    )
    first = Exchange(app, "/stream", peer=PEER)
    assert await first.start() == 200
    await first.chunk()
    assert tokens(rate) == 9
    refused = await fetch(app)
    assert refused.status_code == 429
    assert refused.json()["violated-policies"] == ["inflight"]
    assert tokens(rate) == 9  # charged, then refunded: the request did not run
    gate.set()
    await first.rest()


async def test_a_rate_refusal_releases_the_permit_it_took_first() -> None:
    rate = TokenBucketLimiter(1, 0)
    inflight = ConcurrencyLimiter(5)
    gate = asyncio.Event()
    gate.set()
    app = streaming_app(gate, limit=bl_fastapi.Limit(rate, concurrency=inflight, name="api"))
    assert (await fetch(app)).status_code == 200
    refused = await fetch(app)
    assert refused.status_code == 403  # rate 0: the quota is spent
    assert refused.json()["violated-policies"] == ["api"]
    assert inflight.in_flight(PEER) == 0
    assert inflight.stats()["granted"] == inflight.stats()["released"] == 2


async def test_in_shadow_mode_a_concurrency_limit_never_refuses() -> None:
    gate = asyncio.Event()
    inflight = ConcurrencyLimiter(1)
    limit = bl_fastapi.Limit(concurrency=inflight, name="inflight", shadow=True)
    app = streaming_app(gate, limit=limit)
    first = Exchange(app, "/stream", peer=PEER)
    await first.start()
    await first.chunk()
    gate.set()
    second = await fetch(app)
    assert second.status_code == 200  # would have been refused
    assert sf.ratelimit(second.headers["RateLimit"])["inflight"].params == {"r": 0}
    assert limit.shadow_refusals == 1
    await first.rest()
    assert inflight.in_flight(PEER) == 0


# -- max_wait: queued, first come first served ------------------------------------------------


async def test_max_wait_queues_requests_in_arrival_order() -> None:
    gate = asyncio.Event()
    inflight = ConcurrencyLimiter(1)
    started: list[str] = []
    limit = bl_fastapi.Limit(concurrency=inflight, name="inflight", max_wait=30)
    app = streaming_app(gate, limit=limit, started=started)
    holder = Exchange(app, "/stream", peer=PEER, headers={"x-n": "holder"})
    assert await holder.start() == 200
    await holder.chunk()
    waiters = []

    def waiting() -> int:
        return inflight.stats()["waiting"]

    for n in range(1, 4):  # each queued before the next arrives
        waiters.append(Exchange(app, "/stream", peer=PEER, headers={"x-n": str(n)}))
        await until(waiting, n, f"{n} waiting")
    assert started == ["holder"]
    gate.set()
    await holder.rest()
    for waiter in waiters:
        assert await waiter.start() == 200
        assert await waiter.rest() == b"ab"
    assert started == ["holder", "1", "2", "3"]  # granted in the order they asked
    assert inflight.in_flight(PEER) == 0
    assert inflight.stats()["granted"] == 4


async def test_a_client_that_hangs_up_while_it_waits_leaves_the_queue() -> None:
    gate = asyncio.Event()
    rate = TokenBucketLimiter(10, 0)
    inflight = ConcurrencyLimiter(1)
    app = streaming_app(
        gate,
        bl_fastapi.Limit(concurrency=inflight, name="inflight", max_wait=30),
        limit=bl_fastapi.Limit(rate, name="requests"),
    )
    holder = Exchange(app, "/stream", peer=PEER)
    await holder.start()
    await holder.chunk()
    waiter = Exchange(app, "/stream", peer=PEER)
    await until(lambda: inflight.stats()["waiting"], 1, "the second request waiting")
    assert tokens(rate) == 8
    waiter.hang_up()
    await waiter.done()  # nothing answered: nobody is there
    assert inflight.stats()["waiting"] == 0
    assert inflight.stats()["abandoned"] == 1
    assert tokens(rate) == 9  # its request's charge given back too
    gate.set()
    await holder.rest()
    assert inflight.in_flight(PEER) == 0  # the wait that left holds nothing


async def test_a_wait_longer_than_max_wait_is_refused_holding_nothing() -> None:
    clock = ManualClock()
    inflight = ConcurrencyLimiter(1, ttl=60, clock=clock)
    limit = bl_fastapi.Limit(concurrency=inflight, name="inflight", max_wait=5)
    gate = asyncio.Event()
    app = streaming_app(gate, limit=limit)
    holder = Exchange(app, "/stream", peer=PEER)
    await holder.start()
    await holder.chunk()
    refused = await fetch(app)  # waits 5 s on the manual clock, then gives up
    assert refused.status_code == 429
    assert clock.now == 5.0
    assert inflight.in_flight(PEER) == 1
    assert inflight.stats()["waiting"] == 0
    gate.set()
    await holder.rest()


# -- an asyncio concurrency limiter (coroutine methods), as the asyncio Redis one -------------


class AsyncPermit:
    def __init__(self, inner: Permit) -> None:
        self.inner = inner
        self.decision = inner.decision
        self.token = inner.token

    def __bool__(self) -> bool:
        return bool(self.inner)

    async def release(self) -> None:
        self.inner.release()

    async def renew(self) -> bool:
        return self.inner.renew()


class AsyncConcurrency:
    """An in-process concurrency limiter behind coroutine methods (the awaited path)."""

    def __init__(self, inner: ConcurrencyLimiter) -> None:
        self.inner = inner

    @property
    def limit(self) -> int:
        return self.inner.limit

    @property
    def ttl(self) -> float:
        return self.inner.ttl

    async def try_acquire(self, key: str) -> AsyncPermit:
        return AsyncPermit(self.inner.try_acquire(key))

    async def acquire(self, key: str, *, timeout: float | None = None) -> AsyncPermit:
        return AsyncPermit(await self.inner.acquire_async(key, timeout=timeout))


@pytest.mark.parametrize("max_wait", [0, 30])
async def test_an_asyncio_concurrency_limiter_is_awaited(max_wait: float) -> None:
    gate = asyncio.Event()
    inner = ConcurrencyLimiter(1)
    limit = bl_fastapi.Limit(
        concurrency=AsyncConcurrency(inner), name="inflight", max_wait=max_wait
    )
    app = streaming_app(gate, limit=limit)
    first = Exchange(app, "/stream", peer=PEER)
    assert await first.start() == 200
    await first.chunk()
    assert inner.in_flight(PEER) == 1
    second = Exchange(app, "/stream", peer=PEER)
    if max_wait:
        await until(lambda: inner.stats()["waiting"], 1, "the second waiting")
        gate.set()
        await first.rest()
        assert await second.start() == 200
        await second.rest()
    else:
        assert await second.start() == 429
        await second.rest()
        gate.set()
        await first.rest()
    assert inner.in_flight(PEER) == 0


# -- long streams renew their permits ---------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_stream_longer_than_the_ttl_keeps_its_permit() -> None:
    """A real clock (the renewals are paced by time.monotonic): a ttl of 2 s and a body
    that streams for 4 s. Unrenewed, the permit would expire half-way through and a
    second request would be admitted."""
    inflight = ConcurrencyLimiter(1, ttl=2)

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(16):
            await send({"type": "http.response.body", "body": b".", "more_body": True})
            await asyncio.sleep(0.25)  # the slow upstream this test is about
        await send({"type": "http.response.body", "body": b""})

    app = bl_asgi.RateLimitMiddleware(slow, limit=bl_asgi.Limit(concurrency=inflight))
    exchange = Exchange(app, "/", peer=PEER)
    control = inflight.try_acquire("control")  # taken with the stream's, never renewed
    assert await exchange.start() == 200
    chunks = 0
    while True:
        _, more = await exchange.chunk()
        if not more:
            break
        chunks += 1
        assert inflight.in_flight(PEER) == 1, f"the stream's permit expired after {chunks} chunks"
        assert not inflight.try_acquire(PEER)
    await exchange.done()
    assert not control.valid(), "the stream outlived the ttl: an unrenewed permit expired"
    assert inflight.in_flight(PEER) == 0, "released when the stream ended"


# -- WebSockets -------------------------------------------------------------------------------


async def test_a_websocket_holds_its_permit_until_it_closes() -> None:
    inflight = ConcurrencyLimiter(1)

    async def echo(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        while (await receive())["type"] != "websocket.disconnect":
            pass

    app = bl_asgi.RateLimitMiddleware(echo, limit=bl_asgi.Limit(concurrency=inflight, name="ws"))
    first = Exchange(app, "/ws", peer=PEER, kind="websocket")
    assert await first.start() == 101
    assert first.headers["ratelimit"] == '"ws";r=0'
    second = Exchange(app, "/ws", peer=PEER, kind="websocket")
    closed = await second.message()  # no websocket.http.response: closed before accept
    assert closed == {"type": "websocket.close", "code": 1008, "reason": "rate limited"}
    await second.done()
    assert inflight.in_flight(PEER) == 1
    first.hang_up()
    await first.done()
    assert inflight.in_flight(PEER) == 0


# -- Litestar ---------------------------------------------------------------------------------


async def test_litestar_holds_the_permit_through_a_streamed_body() -> None:
    gate = asyncio.Event()
    inflight = ConcurrencyLimiter(1)
    limit = bl_litestar.Limit(concurrency=inflight, name="inflight")

    async def body() -> Any:
        yield b"a"
        await gate.wait()
        yield b"b"

    @get("/stream", middleware=[limit.middleware])
    async def stream() -> Stream:
        return Stream(body())

    app = Litestar([stream])
    first = Exchange(app, "/stream", peer=PEER)
    assert await first.start() == 200
    assert first.headers["ratelimit"] == '"inflight";r=0'
    assert (await first.chunk())[0] == b"a"
    second = Exchange(app, "/stream", peer=PEER)
    assert await second.start() == 429
    await second.rest()
    gate.set()
    assert b"b" in await first.rest()
    assert inflight.in_flight(PEER) == 0


def test_litestar_test_client_sees_the_refusal() -> None:
    inflight = ConcurrencyLimiter(1)
    limit = bl_litestar.Limit(concurrency=inflight, name="inflight")
    held = inflight.try_acquire("testclient")  # another request of the key in flight

    @get("/", middleware=[limit.middleware])
    async def index() -> str:
        return "hi"

    with LitestarClient(Litestar([index])) as client:
        refused = client.get("/")
        assert refused.status_code == 429
        assert_problem(refused.json(), 429, "inflight", 1)
        held.release()
        allowed = client.get("/")
        assert allowed.status_code == 200
        assert allowed.headers["RateLimit-Policy"] == '"inflight";q=1;qu="concurrent-requests"'
    assert inflight.in_flight("testclient") == 0
