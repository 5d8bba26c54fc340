"""bucketlimit.fastapi on real FastAPI apps, through httpx's ASGI transport.

(httpx.ASGITransport rather than starlette's TestClient: the latter warns that
httpx is deprecated for it, and warnings are errors in this suite. The transport
takes the peer address as ``client=``.)
"""

# No `from __future__ import annotations`: FastAPI must see the Annotated[...,
# Depends(limit)] of routes defined inside tests, whose limits are local variables.
import asyncio
import json
import logging
import math
from typing import Annotated, Any, cast

import httpx
import pytest
from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit.fastapi import (
    AsyncReservation,
    ConfigurationError,
    KeyFunctionError,
    Limit,
    RateLimitMiddleware,
    client_address,
    ratelimit_fields,
    reservation,
)
from bucketlimit.testing import ManualClock
from tests.web.problem import assert_problem

pytestmark = pytest.mark.anyio

PEER = "198.51.100.7"


def tokens(limiter: TokenBucketLimiter, key: str) -> int:
    """Whole tokens in the bucket (peek answers for a cost of 1, spent or not)."""
    decision = limiter.peek(key)
    return decision.remaining + decision.allowed


class AsyncWrapper:
    """An in-process limiter behind coroutine methods: the awaited path, without Redis."""

    def __init__(self, inner: TokenBucketLimiter) -> None:
        self.inner = inner
        self.calls = 0

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def rate(self) -> float:
        return self.inner.rate

    async def allow(self, key: str, cost: int = 1) -> Decision:
        self.calls += 1
        return self.inner.allow(key, cost)

    async def peek(self, key: str, cost: int = 1) -> Decision:
        return self.inner.peek(key, cost)

    async def refund(self, key: str, cost: int) -> None:
        self.inner.refund(key, cost)


async def call(
    app: Any, method: str = "GET", path: str = "/hello", peer: str = PEER, **kwargs: Any
) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=(peer, 50000))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def make_app(*limits: Limit) -> FastAPI:
    """An app whose GET /hello depends on ``limits``, in order."""
    app = FastAPI()

    @app.get("/hello", dependencies=[Depends(one) for one in limits])
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    return app


async def max_tokens(request: Request) -> int:
    body = await request.json()
    return int(body["max_tokens"])


class Completion(BaseModel):
    prompt: str
    max_tokens: int


# -- the dependency ---------------------------------------------------------------------------


async def test_429_after_the_capacity(manual_clock: ManualClock) -> None:
    app = make_app(Limit(TokenBucketLimiter(3, 1, clock=manual_clock)))
    assert [(await call(app)).status_code for _ in range(4)] == [200, 200, 200, 429]
    manual_clock.advance(1)
    assert (await call(app)).status_code == 200


async def test_exact_fields_for_a_known_state(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(10, 2, clock=manual_clock)  # w = 5 s
    app = make_app(Limit(limiter, name="per-client"))
    first = await call(app)
    assert first.status_code == 200
    assert first.headers["RateLimit-Policy"] == '"per-client";q=10;w=5'
    assert first.headers["RateLimit"] == '"per-client";r=9;t=1'
    assert "retry-after" not in first.headers
    for _ in range(9):
        await call(app)
    manual_clock.advance(0.2)
    refused = await call(app)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["RateLimit-Policy"] == '"per-client";q=10;w=5'
    assert refused.headers["RateLimit"] == '"per-client";r=0;t=1'
    # The dependency's refusal is the same problem document the middleware sends.
    assert_problem(refused.json(), 429, "per-client", 1)
    assert refused.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize("elapsed", [0.0, 0.1, 2.0, 3.3, 3.333333, 4.9])
async def test_retry_after_is_the_ceiling_of_the_limiters_wait(
    manual_clock: ManualClock, elapsed: float
) -> None:
    limiter = TokenBucketLimiter(1, 0.2, clock=manual_clock)
    app = make_app(Limit(limiter))
    assert (await call(app)).status_code == 200
    manual_clock.advance(elapsed)
    expected = limiter.peek(PEER)
    refused = await call(app)
    assert refused.status_code == 429
    seconds = int(refused.headers["Retry-After"])
    assert seconds == max(1, math.ceil(expected.retry_after))
    assert refused.json()["retry_after"] == seconds
    assert refused.headers["RateLimit"].endswith(f";t={seconds}")


async def test_the_dependency_works_on_a_router(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=manual_clock)
    router = APIRouter(prefix="/api", dependencies=[Depends(Limit(limiter, name="api"))])

    @router.get("/a")
    async def a() -> str:
        return "a"

    @router.get("/b")
    def b() -> str:  # a sync route, run in the thread pool
        return "b"

    app = FastAPI()
    app.include_router(router)
    assert (await call(app, path="/api/a")).headers["RateLimit"] == '"api";r=1;t=1'
    assert (await call(app, path="/api/b")).headers["RateLimit"] == '"api";r=0;t=1'
    assert (await call(app, path="/api/a")).status_code == 429


async def test_the_default_key_is_the_peer_and_a_forged_header_cannot_change_it() -> None:
    limiter = TokenBucketLimiter(2, 0)
    app = make_app(Limit(limiter))
    for forged in ("1.1.1.1", "2.2.2.2", "3.3.3.3, 4.4.4.4"):
        await call(app, headers={"X-Forwarded-For": forged})
    assert tokens(limiter, PEER) == 0
    for forged in ("1.1.1.1", "2.2.2.2", "3.3.3.3", "4.4.4.4"):
        assert tokens(limiter, forged) == 2
    assert (await call(app, peer="198.51.100.8")).status_code == 200


async def test_behind_a_trusted_proxy_the_right_most_untrusted_hop_is_the_key() -> None:
    limiter = TokenBucketLimiter(5, 0)
    app = make_app(Limit(limiter, key=client_address(trusted_proxies=["10.0.0.0/8"])))
    forwarded = {"X-Forwarded-For": "6.6.6.6, 1.2.3.4, 10.0.0.2"}
    assert (await call(app, peer="10.0.0.1", headers=forwarded)).status_code == 200
    assert tokens(limiter, "1.2.3.4") == 4
    assert tokens(limiter, "6.6.6.6") == 5
    await call(app, peer="203.0.113.5", headers={"X-Forwarded-For": "1.2.3.4"})
    assert tokens(limiter, "203.0.113.5") == 4
    assert tokens(limiter, "1.2.3.4") == 4


@pytest.mark.parametrize("missing", [None, ""])
async def test_a_key_function_returning_nothing_is_a_configuration_error(
    missing: str | None,
) -> None:
    limiter = TokenBucketLimiter(5, 0)

    def api_key(request: Request) -> str | None:
        return missing

    app = make_app(Limit(limiter, key=api_key))  # type: ignore[arg-type] # on purpose
    with pytest.raises(KeyFunctionError, match=r"api_key.*returned.*GET /hello"):
        await call(app)
    assert len(limiter) == 0


async def test_no_peer_address_is_a_configuration_error() -> None:
    limit = Limit(TokenBucketLimiter(5, 0))
    scope: Scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "client": None}
    with pytest.raises(KeyFunctionError, match="no peer address"):
        await limit.apply(Request(scope))


async def test_an_async_key_function(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(5, 0, clock=manual_clock)

    async def tenant(request: Request) -> str:
        return request.headers["x-tenant"]

    app = make_app(Limit(limiter, key=tenant))
    await call(app, headers={"x-tenant": "acme"})
    assert tokens(limiter, "acme") == 4


async def test_shadow_mode_never_refuses_but_reports(
    manual_clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=manual_clock)
    shadow = Limit(limiter, name="trial-run", shadow=True)
    app = make_app(shadow)
    with caplog.at_level(logging.INFO, logger="bucketlimit"):
        answers = [await call(app) for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 5
    assert shadow.shadow_refusals == 3
    assert answers[-1].headers["RateLimit"] == '"trial-run";r=0;t=1'
    assert "retry-after" not in answers[-1].headers
    logged = [r for r in caplog.records if r.name == "bucketlimit"]
    assert len(logged) == 3
    assert "'trial-run' would refuse GET /hello" in logged[0].getMessage()


async def test_a_cost_function_reads_the_json_body_and_the_route_reads_it_again(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(1000, 10, clock=manual_clock)
    app = FastAPI()

    @app.post("/v1/complete", dependencies=[Depends(Limit(limiter, cost=max_tokens))])
    async def complete(body: Completion, request: Request) -> dict[str, Any]:
        return {"model": body.model_dump(), "raw": await request.json()}

    sent = {"prompt": "hi", "max_tokens": 300}
    answer = await call(app, "POST", "/v1/complete", json=sent)
    assert answer.status_code == 200
    assert answer.json() == {"model": sent, "raw": sent}
    assert answer.headers["RateLimit"] == '"default";r=700;t=1'
    refused = await call(app, "POST", "/v1/complete", json={"prompt": "", "max_tokens": 701})
    assert refused.status_code == 429
    assert tokens(limiter, PEER) == 700


async def test_a_cost_above_the_capacity_never_passes(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(100, 10, clock=manual_clock)
    app = make_app(Limit(limiter, cost=lambda request: int(request.query_params["n"])))
    await call(app, path="/hello?n=30")
    refused = await call(app, path="/hello?n=101")
    assert refused.status_code == 413
    assert "retry-after" not in refused.headers
    assert_problem(refused.json(), 413, "default", None)
    assert refused.headers["RateLimit"] == '"default";r=70;t=1'
    assert tokens(limiter, PEER) == 70


async def test_the_dependency_returns_the_reservation_to_settle(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(1000, 0, clock=manual_clock)
    tokens_limit = Limit(limiter, cost=max_tokens, name="tokens")
    app = FastAPI()

    @app.post("/v1/complete")
    async def complete(
        body: Completion, held: Annotated[AsyncReservation, Depends(tokens_limit)]
    ) -> dict[str, int]:
        generated = 42
        return {"refunded": await held.settle(generated)}

    answer = await call(app, "POST", "/v1/complete", json={"prompt": "x", "max_tokens": 500})
    assert answer.json() == {"refunded": 458}
    assert tokens(limiter, PEER) == 958


async def test_refund_after_the_response_in_a_background_task(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(1000, 0, clock=manual_clock)
    tokens_limit = Limit(limiter, cost=max_tokens, name="tokens")
    seen_during_response: list[int] = []
    app = FastAPI()

    async def settle_later(held: AsyncReservation) -> None:
        seen_during_response.append(tokens(limiter, PEER))
        await held.settle(7)

    @app.post("/v1/complete")
    async def complete(
        body: Completion,
        tasks: BackgroundTasks,
        held: Annotated[AsyncReservation, Depends(tokens_limit)],
    ) -> dict[str, str]:
        tasks.add_task(settle_later, held)
        return {"text": "..."}

    answer = await call(app, "POST", "/v1/complete", json={"prompt": "x", "max_tokens": 100})
    assert answer.headers["RateLimit"] == '"tokens";r=900'
    assert seen_during_response == [900]  # the task ran after the response was sent
    assert tokens(limiter, PEER) == 993


async def test_an_exempt_request_is_not_limited_charged_or_reported() -> None:
    limiter = TokenBucketLimiter(1, 0)
    app = make_app(Limit(limiter, exempt=lambda request: "x-internal" in request.headers))
    for _ in range(3):
        answer = await call(app, headers={"x-internal": "1"})
        assert answer.status_code == 200
        assert "ratelimit" not in answer.headers
        assert "ratelimit-policy" not in answer.headers
    assert tokens(limiter, PEER) == 1
    assert (await call(app)).status_code == 200
    assert (await call(app)).status_code == 403  # spent for good


async def test_several_dependencies_are_one_field_each(manual_clock: ManualClock) -> None:
    burst = Limit(TokenBucketLimiter(5, 1, clock=manual_clock), name="burst")
    daily = Limit(TokenBucketLimiter(50, 50, per=86400, clock=manual_clock), name="daily")
    app = make_app(burst, daily)
    answer = await call(app)
    assert answer.headers.get_list("RateLimit-Policy") == ['"burst";q=5;w=5, "daily";q=50;w=86400']
    assert answer.headers.get_list("RateLimit") == ['"burst";r=4;t=1, "daily";r=49;t=1728']


async def test_a_refusal_by_one_dependency_refunds_the_others() -> None:
    outer = TokenBucketLimiter(100, 0)
    inner = TokenBucketLimiter(1, 0)
    app = make_app(Limit(outer, name="outer"), Limit(inner, name="inner"))
    await call(app)
    refused = await call(app)
    assert refused.status_code == 403
    assert refused.headers.get_list("RateLimit") == ['"outer";r=98, "inner";r=0']
    assert tokens(outer, PEER) == 99


async def test_two_limits_with_one_name_are_a_configuration_error() -> None:
    app = make_app(Limit(TokenBucketLimiter(5, 1)), Limit(TokenBucketLimiter(9, 1)))
    with pytest.raises(ConfigurationError, match="two limits named 'default'"):
        await call(app)


async def test_a_route_returning_its_own_response_copies_the_fields() -> None:
    limit = Limit(TokenBucketLimiter(5, 0), name="own")
    app = FastAPI()

    @app.get("/own", dependencies=[Depends(limit)])
    async def own(request: Request) -> PlainTextResponse:
        # FastAPI drops a dependency's headers when the route returns a Response.
        return PlainTextResponse("hi", headers=ratelimit_fields(request))

    answer = await call(app, path="/own")
    assert answer.headers["RateLimit"] == '"own";r=4'


# -- the async limiter -------------------------------------------------------------------------


async def test_an_async_limiter_is_awaited(manual_clock: ManualClock) -> None:
    inner = TokenBucketLimiter(2, 1, clock=manual_clock)
    limiter = AsyncWrapper(inner)
    app = FastAPI()
    limit = Limit(limiter, cost=max_tokens, name="async")

    @app.post("/v1/complete")
    async def complete(body: Completion, held: Annotated[AsyncReservation, Depends(limit)]) -> int:
        return await held.settle(1)

    answer = await call(app, "POST", "/v1/complete", json={"prompt": "", "max_tokens": 2})
    assert answer.json() == 1
    assert answer.headers["RateLimit"] == '"async";r=0;t=1'
    assert limiter.calls == 1
    assert tokens(inner, PEER) == 1
    refused = await call(app, "POST", "/v1/complete", json={"prompt": "", "max_tokens": 2})
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    too_big = await call(app, "POST", "/v1/complete", json={"prompt": "", "max_tokens": 3})
    assert too_big.status_code == 413
    assert too_big.json()["retry_after"] is None


# -- the middleware ---------------------------------------------------------------------------


def middleware_app(limit: Limit, *route_limits: Limit) -> FastAPI:
    app = make_app(*route_limits)
    app.add_middleware(RateLimitMiddleware, limit=limit)

    @app.get("/plain")
    async def plain() -> PlainTextResponse:
        return PlainTextResponse("plain")

    @app.post("/echo")
    async def echo(body: Completion) -> Completion:
        return body

    return app


async def test_the_middleware_limits_every_request(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(3, 1, clock=manual_clock)
    app = middleware_app(Limit(limiter, name="app"))
    first = await call(app)
    assert first.headers["RateLimit-Policy"] == '"app";q=3;w=3'
    assert first.headers["RateLimit"] == '"app";r=2;t=1'
    plain = await call(app, path="/plain")  # a Response built by the route
    assert plain.headers["RateLimit"] == '"app";r=1;t=1'
    await call(app, path="/missing")  # a 404 is a request too
    refused = await call(app, path="/plain")
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["RateLimit"] == '"app";r=0;t=1'
    assert refused.headers["content-type"] == "application/problem+json"
    assert_problem(refused.json(), 429, "app", 1)


async def test_the_middleware_and_dependencies_share_one_field(
    manual_clock: ManualClock,
) -> None:
    app_limit = Limit(TokenBucketLimiter(100, 10, clock=manual_clock), name="app")
    burst = Limit(TokenBucketLimiter(5, 1, clock=manual_clock), name="burst")
    app = middleware_app(app_limit, burst)
    answer = await call(app)
    assert answer.headers.get_list("RateLimit-Policy") == ['"app";q=100;w=10, "burst";q=5;w=5']
    assert answer.headers.get_list("RateLimit") == ['"app";r=99;t=1, "burst";r=4;t=1']
    for _ in range(4):
        await call(app)
    refused = await call(app)  # refused by the dependency, under the middleware
    assert refused.status_code == 429
    assert refused.headers.get_list("RateLimit") == ['"app";r=94;t=1, "burst";r=0;t=1']
    assert refused.headers.get_list("Retry-After") == ["1"]


async def test_one_limit_in_the_middleware_and_a_dependency_charges_once() -> None:
    limiter = TokenBucketLimiter(10, 0)
    per_client = Limit(limiter, name="per-client")
    app = middleware_app(per_client, per_client)
    answer = await call(app)
    assert answer.headers.get_list("RateLimit") == ['"per-client";r=9']
    assert tokens(limiter, PEER) == 9


async def test_the_middleware_replays_a_body_its_cost_function_read(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(1000, 10, clock=manual_clock)
    app = middleware_app(Limit(limiter, cost=max_tokens, name="tokens"))
    sent = {"prompt": "a" * 70_000, "max_tokens": 250}
    answer = await call(app, "POST", "/echo", json=sent)
    assert answer.status_code == 200
    assert answer.json() == sent
    assert answer.headers["RateLimit"] == '"tokens";r=750;t=1'


async def test_the_middleware_replays_a_body_sent_in_several_messages(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(1000, 10, clock=manual_clock)
    app = middleware_app(Limit(limiter, cost=max_tokens, name="tokens"))
    body = json.dumps({"prompt": "abc" * 1000, "max_tokens": 40}).encode()
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)]
    incoming: list[Message] = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/echo",
        "raw_path": b"/echo",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": (PEER, 1),
        "server": ("test", 80),
    }
    await app(scope, receive, send)
    assert len(chunks) > 3
    start, *rest = sent
    assert start["status"] == 200
    assert (b"ratelimit", b'"tokens";r=960;t=1') in start["headers"]
    assert json.loads(b"".join(m.get("body", b"") for m in rest)) == json.loads(body)


async def test_the_middleware_in_shadow_mode(manual_clock: ManualClock) -> None:
    shadow = Limit(TokenBucketLimiter(1, 1, clock=manual_clock), shadow=True)
    app = middleware_app(shadow)
    assert [(await call(app)).status_code for _ in range(3)] == [200, 200, 200]
    assert shadow.shadow_refusals == 2


async def test_the_middleware_exempts_health_checks() -> None:
    limiter = TokenBucketLimiter(1, 0)
    app = middleware_app(Limit(limiter, exempt=lambda request: request.url.path == "/plain"))
    for _ in range(3):
        answer = await call(app, path="/plain")
        assert answer.status_code == 200
        assert "ratelimit" not in answer.headers
    assert tokens(limiter, PEER) == 1


async def test_the_middleware_passes_other_scopes_through() -> None:
    seen: list[str] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    middleware = RateLimitMiddleware(inner, limit=Limit(TokenBucketLimiter(1, 0)))

    async def receive() -> Message:
        raise AssertionError("not read")

    async def send(message: Message) -> None:
        raise AssertionError("not sent")

    await middleware({"type": "lifespan"}, receive, send)
    assert seen == ["lifespan"]  # WebSockets are limited: tests/web/test_asgi.py


async def test_reservation_of_the_middlewares_limit(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(1000, 0, clock=manual_clock)
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limit=Limit(limiter, cost=max_tokens, name="t"))

    @app.post("/v1/complete")
    async def complete(body: Completion, request: Request) -> int:
        return await reservation(request, "t").settle(100)

    answer = await call(app, "POST", "/v1/complete", json={"prompt": "", "max_tokens": 400})
    assert answer.json() == 300
    assert tokens(limiter, PEER) == 900


async def test_the_middleware_takes_a_limit() -> None:
    with pytest.raises(
        TypeError, match=r"takes a Limit of bucketlimit\.asgi, bucketlimit\.fastapi"
    ):
        RateLimitMiddleware(make_app(), limit=TokenBucketLimiter(1, 1))  # type: ignore[arg-type]


# -- the asyncio Redis limiter ------------------------------------------------------------------


@pytest.mark.redis
async def test_the_async_redis_limiter_inside_fastapi(
    redis_url: str, manual_clock: ManualClock
) -> None:
    from bucketlimit.redis import AsyncRedisTokenBucketLimiter

    # The ManualClock is sent to the script, so the fields are exact.
    limiter = AsyncRedisTokenBucketLimiter.from_url(
        redis_url, 1000, 10, clock=manual_clock, timeout=10, prefix="web-test:"
    )
    tokens_limit = Limit(limiter, cost=max_tokens, name="tokens")
    per_client = Limit(
        AsyncRedisTokenBucketLimiter.from_url(
            redis_url, 3, 1, clock=manual_clock, timeout=10, prefix="web-test-app:"
        ),
        name="app",
    )
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limit=per_client)

    @app.post("/v1/complete")
    async def complete(
        body: Completion,
        tasks: BackgroundTasks,
        held: Annotated[AsyncReservation, Depends(tokens_limit)],
    ) -> dict[str, int]:
        tasks.add_task(held.settle, 50)  # refunded in Redis after the response
        return {"reserved": held.charged}

    try:
        first = await call(app, "POST", "/v1/complete", json={"prompt": "", "max_tokens": 400})
        assert first.status_code == 200
        assert first.json() == {"reserved": 400}
        assert first.headers.get_list("RateLimit-Policy") == [
            '"app";q=3;w=3, "tokens";q=1000;w=100'
        ]
        assert first.headers.get_list("RateLimit") == ['"app";r=2;t=1, "tokens";r=600;t=1']
        # 350 of the 400 came back: 950 in the bucket.
        assert (await limiter.peek(PEER, 950)).allowed
        assert not (await limiter.peek(PEER, 951)).allowed
        too_many = await call(app, "POST", "/v1/complete", json={"prompt": "", "max_tokens": 951})
        assert too_many.status_code == 429
        assert too_many.headers["Retry-After"] == "1"  # 0.1 s for the missing token
        assert too_many.headers.get_list("RateLimit") == ['"app";r=1;t=1, "tokens";r=950;t=1']
        # "tokens" refused it, so its "app" charge was given back: 2 requests left.
        one_token = {"prompt": "", "max_tokens": 1}
        for _ in range(2):
            assert (await call(app, "POST", "/v1/complete", json=one_token)).status_code == 200
        refused = await call(app, "POST", "/v1/complete", json=one_token)
        assert refused.status_code == 429  # by the middleware, before the route
        assert_problem(refused.json(), 429, "app", 1)
        assert refused.headers["RateLimit"] == '"app";r=0;t=1'
    finally:
        await limiter.client.aclose()
        await cast(Any, per_client.limiter).client.aclose()


# -- the example ----------------------------------------------------------------------------------


async def test_the_example_app(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "fastapi_app.py"
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("BUCKETLIMIT_CAPACITY", "3")
    monkeypatch.setenv("BUCKETLIMIT_RATE", "0")
    spec = importlib.util.spec_from_file_location("fastapi_example", path)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    app = example.app

    health = await call(app, path="/health")
    assert health.json()["status"] == "ok"
    assert "ratelimit" not in health.headers
    hello = await call(app, path="/hello")
    assert hello.headers["RateLimit"] == '"requests";r=2'
    done = await call(
        app, "POST", "/v1/complete", json={"prompt": "one two three", "max_tokens": 50}
    )
    assert done.json() == {"text": "one two three", "tokens": 3, "refunded": 47}
    assert done.headers.get_list("RateLimit") == ['"requests";r=1, "tokens";r=9950;t=1']
    assert (await call(app, path="/hello")).status_code == 200
    refused = await call(app, path="/hello")
    assert refused.status_code == 403
    assert_problem(refused.json(), 403, "requests", None)


# -- waiting for tokens ------------------------------------------------------------------------


async def test_max_wait_makes_a_request_wait_for_its_tokens(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=manual_clock)
    app = make_app(Limit(limiter, max_wait=1.5))
    assert [(await call(app)).status_code for _ in range(2)] == [200, 200]
    # The third waits 1 s, awaited on the limiter's clock (ManualClock.sleep_async).
    assert (await call(app)).status_code == 200
    assert manual_clock.now == 1.0
    limiter.reserve(PEER, 1)
    refused = await call(app)
    assert refused.status_code == 429
    assert manual_clock.now == 1.0
    assert refused.headers["Retry-After"] == "1"


async def test_max_wait_in_the_middleware_with_real_sleeps() -> None:
    """The real clock: waiting requests sleep with asyncio.sleep, none refused."""
    limiter = TokenBucketLimiter(1, 200)
    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limit=Limit(limiter, max_wait=1))

    @app.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    answers = await asyncio.gather(*(call(app) for _ in range(10)))
    assert [a.status_code for a in answers] == [200] * 10


async def test_a_cancelled_waiting_request_gives_its_tokens_back(
    manual_clock: ManualClock,
) -> None:
    frozen = TokenBucketLimiter(1, 1, clock=lambda: manual_clock())  # waits with asyncio.sleep
    limit = Limit(frozen, max_wait=30)
    app = make_app(limit)
    assert (await call(app)).status_code == 200
    waiting = asyncio.create_task(call(app))
    await asyncio.sleep(0.05)
    assert frozen.peek(PEER).retry_after == 2.0  # the waiter holds its token
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert frozen.peek(PEER).retry_after == 1.0


async def test_a_request_that_waited_gives_back_what_it_did_not_use(
    manual_clock: ManualClock,
) -> None:
    """The awaited twin of the Flask test: settled through its reservation, the
    unused part of a wait comes back exactly (docs/design.md §4, "Giving back")."""
    limiter = TokenBucketLimiter(100, 10, clock=manual_clock)
    tokens_limit = Limit(limiter, cost=60, name="tokens", max_wait=5)
    app = FastAPI()

    @app.get("/complete")
    async def complete(held: Annotated[AsyncReservation, Depends(tokens_limit)]) -> int:
        return await held.settle(20)

    limiter.charge(PEER, 50)  # 50 left: the request waits 1 s for 60
    assert (await call(app, path="/complete")).json() == 40
    assert manual_clock.now == 1.0  # awaited on the limiter's clock
    assert limiter.peek(PEER, 40)
    assert not limiter.peek(PEER, 41)
