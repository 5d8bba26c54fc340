"""What a web limit counts (``Limit.stats()``, ``Limit.histograms()``), one outcome
per request: ``allowed`` once the request runs, ``refused`` by the limit that
refused it, ``given_back`` by the limits before it (their charge came back),
``abandoned`` when the client left while it waited. A limiter's own ``allowed``
counts a charge later given back as an admission; the limit's does not.

Real apps (FastAPI with and without the middleware, Flask), driven message by
message where the moment matters (tests/web/exchange.py)."""

# No `from __future__ import annotations`: FastAPI must see the annotations of routes
# defined inside tests.
import asyncio
from typing import Any

import flask
import httpx
import pytest
from fastapi import Depends, FastAPI
from starlette.responses import StreamingResponse

from bucketlimit import ConcurrencyLimiter, TokenBucketLimiter
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit.testing import ManualClock
from tests.web.exchange import Exchange, until

pytestmark = pytest.mark.anyio

PEER = "192.0.2.20"
OUTCOMES = ("requests_allowed", "requests_refused", "requests_given_back", "requests_abandoned")


def outcomes(limit: Any) -> dict[str, int]:
    stats = limit.stats()
    return {name.removeprefix("requests_"): stats[name] for name in OUTCOMES}


def two_limits(clock: ManualClock) -> tuple[TokenBucketLimiter, TokenBucketLimiter]:
    """Requests: 10 at once; tokens: 3 (one per request), never refilled."""
    return TokenBucketLimiter(10, 0, clock), TokenBucketLimiter(3, 0, clock)


async def get_many(app: Any, count: int, path: str = "/") -> list[int]:
    transport = httpx.ASGITransport(app=app, client=(PEER, 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return [(await client.get(path)).status_code for _ in range(count)]


@pytest.mark.parametrize("middleware", [True, False], ids=["middleware", "dependencies"])
async def test_fastapi_counts_one_outcome_per_request_and_limit(
    manual_clock: ManualClock, middleware: bool
) -> None:
    requests_limiter, tokens_limiter = two_limits(manual_clock)
    requests = bl_fastapi.Limit(requests_limiter, name="requests")
    tokens = bl_fastapi.Limit(tokens_limiter, name="tokens")
    app = FastAPI()
    if middleware:
        app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=requests)
    route_limits = [tokens] if middleware else [requests, tokens]

    @app.get("/", dependencies=[Depends(limit) for limit in route_limits])
    async def root() -> str:
        return "hi"

    statuses = await get_many(app, 5)
    assert statuses == [200, 200, 200, 403, 403]
    # The requests limiter admitted all five: two of those charges were given back.
    assert requests_limiter.stats()["allowed"] == 5
    assert outcomes(requests) == {"allowed": 3, "refused": 0, "given_back": 2, "abandoned": 0}
    assert outcomes(tokens) == {"allowed": 3, "refused": 2, "given_back": 0, "abandoned": 0}
    for limit in (requests, tokens):
        counted = sum(outcomes(limit).values())
        assert counted == len(statuses), f"{limit.name}: every answered request counted once"


def test_flask_counts_one_outcome_per_request_and_limit(manual_clock: ManualClock) -> None:
    requests_limiter, tokens_limiter = two_limits(manual_clock)
    requests = bl_flask.Limit(requests_limiter, name="requests")
    tokens = bl_flask.Limit(tokens_limiter, name="tokens")
    app = flask.Flask(__name__)
    bl_flask.RateLimit(requests, app)
    app.add_url_rule("/", "index", tokens(lambda: "hi"))
    client = app.test_client()
    statuses = [client.get("/").status_code for _ in range(5)]
    assert statuses == [200, 200, 200, 403, 403]
    assert outcomes(requests) == {"allowed": 3, "refused": 0, "given_back": 2, "abandoned": 0}
    assert outcomes(tokens) == {"allowed": 3, "refused": 2, "given_back": 0, "abandoned": 0}


async def test_an_admission_is_counted_once_the_request_runs() -> None:
    """Not when the limit admits: a later limit may still refuse the request."""
    gate = asyncio.Event()
    requests = bl_fastapi.Limit(TokenBucketLimiter(10, 0), name="requests")
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=requests)
    reached: list[dict[str, int]] = []

    @app.get("/")
    async def root() -> StreamingResponse:
        reached.append(outcomes(requests))  # the handler runs: not counted yet

        async def body() -> Any:
            yield b"a"
            await gate.wait()
            yield b"b"

        return StreamingResponse(body())

    exchange = Exchange(app, "/", peer=PEER)
    assert await exchange.start() == 200
    assert reached == [{"allowed": 0, "refused": 0, "given_back": 0, "abandoned": 0}]
    assert outcomes(requests)["allowed"] == 1  # counted when its response started
    gate.set()
    await exchange.rest()
    assert outcomes(requests)["allowed"] == 1  # and once


async def test_a_client_that_leaves_while_it_waits_is_abandoned_by_every_limit() -> None:
    per_minute = TokenBucketLimiter(1, 1, per=60)  # the real clock: the waiter really waits
    requests = bl_fastapi.Limit(TokenBucketLimiter(10, 0), name="requests")
    tokens = bl_fastapi.Limit(per_minute, name="tokens", max_wait=90)
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=requests)

    @app.get("/", dependencies=[Depends(tokens)])
    async def root() -> str:
        return "hi"

    assert await get_many(app, 1) == [200]
    waiter = Exchange(app, "/", peer=PEER)  # waits about a minute for the next token

    def holds_the_next_token() -> bool:
        return per_minute.peek(PEER).retry_after > 60

    await until(holds_the_next_token, True, "the second request waiting for its token")
    waiter.hang_up()
    await waiter.done()
    assert outcomes(requests) == {"allowed": 1, "refused": 0, "given_back": 0, "abandoned": 1}
    assert outcomes(tokens) == {"allowed": 1, "refused": 0, "given_back": 0, "abandoned": 1}


def test_a_shadow_limit_counts_its_would_be_refusals_and_the_request_as_allowed() -> None:
    shadow = bl_flask.Limit(TokenBucketLimiter(1, 0), name="shadow", shadow=True)
    app = flask.Flask(__name__)
    app.add_url_rule("/", "index", shadow(lambda: "hi"))
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(3)] == [200, 200, 200]
    assert outcomes(shadow)["allowed"] == 3
    assert shadow.stats()["shadow_refusals"] == 2


# -- permits ------------------------------------------------------------------------------------


def permit_app(limit: bl_fastapi.Limit, gate: asyncio.Event) -> FastAPI:
    """GET / streams "a", waits for ``gate``, then "b"."""
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware)

    @app.get("/", dependencies=[Depends(limit)])
    async def root() -> StreamingResponse:
        async def body() -> Any:
            yield b"a"
            await gate.wait()
            yield b"b"

        return StreamingResponse(body())

    return app


async def test_permits_granted_in_flight_and_waiting() -> None:
    gate = asyncio.Event()
    limit = bl_fastapi.Limit(concurrency=1, name="generations", max_wait=30)
    app = permit_app(limit, gate)
    holder = Exchange(app, "/", peer=PEER)
    assert await holder.start() == 200
    await holder.chunk()
    assert limit.stats()["in_flight"] == 1
    waiter = Exchange(app, "/", peer=PEER)
    await until(lambda: limit.stats()["waiting"], 1, "the second request waiting")
    gate.set()
    await holder.rest()
    assert await waiter.start() == 200
    await waiter.rest()
    stats = limit.stats()
    assert (stats["granted"], stats["in_flight"], stats["waiting"]) == (2, 0, 0)
    assert (stats["expired"], stats["requests_allowed"]) == (0, 2)
    waits = dict(((name, labels["resource"]), h) for name, labels, h in limit.histograms())
    # Each admitted request's wait for its permit, once: the holder's 0 (it did not
    # wait), the waiter's as measured (a permit frees when another request ends).
    snapshot = waits["wait_seconds", "permit"].snapshot()
    assert (snapshot.count, snapshot.counts[0]) == (2, 1), "one request did not wait"


async def test_a_response_that_outlives_its_permit_counts_it_expired() -> None:
    gate = asyncio.Event()
    generations = ConcurrencyLimiter(1, ttl=0.05)
    limit = bl_fastapi.Limit(concurrency=generations, name="generations")
    app = permit_app(limit, gate)
    exchange = Exchange(app, "/", peer=PEER)
    assert await exchange.start() == 200
    await exchange.chunk()
    # The stream sends nothing for longer than the ttl: the slot is freed meanwhile.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while generations.in_flight(PEER):
        assert loop.time() < deadline, "the permit never expired"
        await asyncio.sleep(0.01)
    gate.set()
    await exchange.rest()
    assert limit.stats()["expired"] == 1
    assert limit.stats()["in_flight"] == 0


def test_tokens_waited_for_are_timed_by_the_limiters_delay(manual_clock: ManualClock) -> None:
    tokens = bl_flask.Limit(
        TokenBucketLimiter(1, 1, manual_clock, per=4), name="tokens", max_wait=10
    )
    app = flask.Flask(__name__)
    app.add_url_rule("/", "index", tokens(lambda: "hi"))
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 200]
    [(name, labels, waits)] = tokens.histograms()
    assert (name, labels) == ("wait_seconds", {"resource": "tokens"})
    snapshot = waits.snapshot()
    assert (snapshot.count, snapshot.sum) == (2, 4.0), "waited 0 s, then 4 s for a token"
