"""A limit's limiter is one attribute; an app's limits on a fake clock and reset
between tests (bucketlimit.testing); the limiter chosen per request (plans)."""

from __future__ import annotations

import asyncio
from typing import cast

import httpx
import pytest
from fastapi import Depends, FastAPI, Request
from flask import Flask

from bucketlimit import TokenBucketLimiter
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit.testing import ManualClock, limits_on_clock, reset_limits
from tests.web import sf

# A module-level app, as users write them: its limiters use the real clock.
per_client = bl_fastapi.Limit(TokenBucketLimiter(2, 1), name="app")
route = bl_fastapi.Limit(TokenBucketLimiter(5, 0.5), name="route")
original_app_limiter, original_route_limiter = per_client.limiter, route.limiter
asgi_app = FastAPI()
asgi_app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=per_client)


@asgi_app.get("/", dependencies=[Depends(route)])
async def hello() -> str:
    return "hi"


def statuses(app: FastAPI, count: int, path: str = "/", **headers: str) -> list[int]:
    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app, client=("192.0.2.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get(path, headers=headers)).status_code for _ in range(count)]

    return asyncio.run(run())


def test_assigning_a_limiter_takes_effect_at_once() -> None:
    original = per_client.limiter
    try:
        per_client.limiter = TokenBucketLimiter(1, 0, clock=ManualClock())
        assert statuses(asgi_app, 2) == [200, 403]  # capacity 1 now, not 2
    finally:
        per_client.limiter = original
    with pytest.raises(TypeError, match="no allow"):
        per_client.limiter = object()  # type: ignore[assignment]


def test_limits_on_clock_puts_every_limit_of_the_app_on_one_clock() -> None:
    with limits_on_clock() as clock:
        assert statuses(asgi_app, 3) == [200, 200, 429]  # the middleware's limit too
        assert isinstance(clock, ManualClock)
        clock.advance(1)
        assert statuses(asgi_app, 2) == [200, 429]
        made_inside = bl_flask.Limit(TokenBucketLimiter(1, 1), name="late")
        late = cast(TokenBucketLimiter, made_inside.limiter)
        assert late.allow("k")
        assert not late.allow("k")
        clock.advance(1)
        assert late.allow("k")
    assert per_client.limiter is original_app_limiter
    assert route.limiter is original_route_limiter


def test_the_limits_clock_fixture_starts_every_test_fresh(limits_clock: ManualClock) -> None:
    assert statuses(asgi_app, 3) == [200, 200, 429]
    limits_clock.advance(1)
    assert statuses(asgi_app, 1) == [200]


def test_the_fixture_again_sees_full_buckets(limits_clock: ManualClock) -> None:
    assert statuses(asgi_app, 3) == [200, 200, 429]


def test_reset_limits_empties_every_bucket() -> None:
    limiter = TokenBucketLimiter(1, 0)
    limit = bl_flask.Limit(limiter)
    app = Flask(__name__)
    bl_flask.RateLimit(limit, app)
    app.add_url_rule("/", "hello", lambda: "hi")
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(2)] == [200, 403]
    reset_limits()
    assert client.get("/").status_code == 200


# -- plans: the limiter chosen per request --------------------------------------------------

PLANS = {"free": TokenBucketLimiter(2, 0), "pro": TokenBucketLimiter(5, 0)}


def plan_of(request: Request) -> tuple[str, TokenBucketLimiter]:
    plan = request.headers.get("x-plan", "free")  # in real life: the JWT's claim
    return plan, PLANS[plan]


def test_a_limit_chooses_its_limiter_per_request() -> None:
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=bl_fastapi.Limit(plan_of))

    @app.get("/")
    async def root() -> str:
        return "hi"

    async def run() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            free = await client.get("/")
            pro = await client.get("/", headers={"x-plan": "pro"})
            return free, pro

    with limits_on_clock():  # plan limiters are twinned as well
        free, pro = asyncio.run(run())
        assert sf.ratelimit_policy(free.headers["RateLimit-Policy"])["free"].params["q"] == 2
        assert sf.ratelimit(free.headers["RateLimit"])["free"].params["r"] == 1
        assert sf.ratelimit_policy(pro.headers["RateLimit-Policy"])["pro"].params["q"] == 5
        assert statuses(app, 3, **{"x-plan": "free"}) == [200, 200, 403]
        assert statuses(app, 4, **{"x-plan": "pro"}) == [200, 200, 200, 200]
    assert PLANS["free"].peek("192.0.2.7").remaining == 1  # the real ones were not touched


def test_a_plan_function_must_return_a_limiter() -> None:
    app = Flask(__name__)
    app.testing = True
    bl_flask.RateLimit(bl_flask.Limit(lambda request: "gold"), app)  # type: ignore[arg-type,return-value]
    app.add_url_rule("/", "hello", lambda: "hi")
    with pytest.raises(bl_flask.ConfigurationError, match="plan function"):
        app.test_client().get("/")
