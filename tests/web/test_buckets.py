"""One set of buckets per (route or limit name, limit), the same in memory and in
Redis: two routes with the same limit string each admit the limit (slowapi's
``/login`` 5 and ``/signup`` 5, never one Redis bucket for both), one
limit on several routes and one shared ``scope`` share, and the names are the
same in every process (a second app built from the same code shares the first's
Redis buckets, as a second worker does)."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import django
import httpx
import pytest
from django.conf import settings

if not settings.configured:
    settings.configure(SECRET_KEY="tests", ALLOWED_HOSTS=["*"], INSTALLED_APPS=[])
    django.setup()

from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import path
from fastapi import Depends, FastAPI
from flask import Flask
from litestar import Litestar, get
from litestar.testing import TestClient as LitestarClient
from rest_framework.response import Response as DrfResponse
from rest_framework.views import APIView

from bucketlimit import django as bl_django
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit import litestar as bl_litestar

PEER = "192.0.2.60"
ROUTES = ("/login", "/signup")
STORES = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=STORES)
def storage(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    return str(request.getfixturevalue("redis_url"))


def admitted(statuses: list[int]) -> int:
    return statuses.count(200)


# -- FastAPI ----------------------------------------------------------------------------------


def slowapi_like(storage: str, **limit: Any) -> tuple[FastAPI, list[bl_fastapi.Limit]]:
    """Two routes, each with its own ``Depends(Limit("5/minute"))``."""
    app = FastAPI()
    made = []
    for route in ROUTES:
        each = bl_fastapi.Limit("5/minute", storage=storage, **limit)
        made.append(each)
        app.get(route, dependencies=[Depends(each)])(lambda: "hi")
    return app, made


def fastapi_counts(app: Any, limits: list[bl_fastapi.Limit], sends: int = 8) -> dict[str, int]:
    """Admitted of ``sends`` requests to each route, one route after the other."""

    async def run() -> dict[str, int]:
        transport = httpx.ASGITransport(app=app, client=(PEER, 1))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return {
                    route: admitted([(await client.get(route)).status_code for _ in range(sends)])
                    for route in ROUTES
                }
        finally:
            for limit in limits:
                await _close(limit)

    return asyncio.run(run())


async def _close(limit: Any) -> None:
    for each in limit.parts or (limit,):
        aclose = getattr(getattr(each.limiter, "client", None), "aclose", None)
        if aclose is not None:
            await aclose()  # the asyncio client shared per URI, in this event loop


def test_fastapi_two_routes_keep_their_own_buckets(storage: str) -> None:
    counts = fastapi_counts(*slowapi_like(storage))
    assert counts == {"/login": 5, "/signup": 5}, "each route admits its own 5 a minute"


def test_fastapi_a_shared_scope_shares_one_set_of_buckets(storage: str) -> None:
    app = FastAPI()
    made = [bl_fastapi.shared_limit("5/minute", "fastapi-auth", storage=storage) for _ in ROUTES]
    for route, limit in zip(ROUTES, made, strict=True):
        app.get(route, dependencies=[Depends(limit)])(lambda: "hi")
    counts = fastapi_counts(app, made)
    assert counts == {"/login": 5, "/signup": 0}, "one scope: 5 a minute for both routes"


def test_fastapi_one_limit_on_two_routes_is_one_set_of_buckets(storage: str) -> None:
    limit = bl_fastapi.Limit("5/minute", storage=storage)
    app = FastAPI(dependencies=[Depends(limit)])  # the app's own dependency: every route
    for route in ROUTES:
        app.get(route)(lambda: "hi")
    assert fastapi_counts(app, [limit]) == {"/login": 5, "/signup": 0}


@pytest.mark.redis
def test_fastapi_names_are_the_same_in_every_process(redis_url: str) -> None:
    """A second app from the same code (a second worker) shares the first's buckets
    on Redis, whichever route each first served and whether the limiter was read
    before the limit knew its route (a start-up check reads it)."""
    first, first_limits = slowapi_like(redis_url)
    second, second_limits = slowapi_like(redis_url)
    assert second_limits[1].limiter is not None  # read early: built under its name
    assert fastapi_counts(first, first_limits, sends=3) == {"/login": 3, "/signup": 3}
    assert fastapi_counts(second, second_limits) == {"/login": 2, "/signup": 2}, (
        "the second app's routes continue the first app's buckets"
    )


def test_fastapi_default_limits_are_per_route_on_the_apps_storage(storage: str) -> None:
    """slowapi's ``default_limits``: a bucket per client per route, on the routes with
    no limit of their own, on the app's storage (``storage=`` of the middleware)."""
    app = FastAPI()
    own = bl_fastapi.Limit("2/minute", name="own")
    app.add_middleware(bl_fastapi.RateLimitMiddleware, default_limits=["3/minute"], storage=storage)
    for route in (*ROUTES, "/own"):
        app.get(route, dependencies=[Depends(own)] if route == "/own" else [])(lambda: "hi")

    async def run() -> dict[str, int]:
        transport = httpx.ASGITransport(app=app, client=(PEER, 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            counts = {
                route: admitted([(await client.get(route)).status_code for _ in range(8)])
                for route in (*ROUTES, "/own")
            }
        if storage != "memory://":
            assert "redis" in type(own.limiter).__module__, "the route's limit: the app's storage"
        await _close(own)  # the asyncio client of the URI, the default limits' too
        return counts

    counts = asyncio.run(run())
    assert counts == {"/login": 3, "/signup": 3, "/own": 2}, (
        "each route pays its own default bucket; a route with a limit of its own only that"
    )


# -- Flask ------------------------------------------------------------------------------------


def flask_counts(app: Flask, sends: int = 8) -> dict[str, int]:
    client = app.test_client()
    env = {"REMOTE_ADDR": PEER}
    return {
        route: admitted([client.get(route, environ_base=env).status_code for _ in range(sends)])
        for route in ROUTES
    }


def test_flask_two_views_keep_their_own_buckets(storage: str) -> None:
    app = Flask(__name__)
    bl_flask.RateLimit(app=app, storage=storage)

    @app.get("/login")
    @bl_flask.limit("5/minute")
    def login() -> str:
        return "hi"

    @app.get("/signup")
    @bl_flask.limit("5/minute")
    def signup() -> str:
        return "hi"

    assert flask_counts(app) == {"/login": 5, "/signup": 5}


def test_flask_shared_limit_shares_across_views(storage: str) -> None:
    app = Flask(__name__)
    ext = bl_flask.RateLimit(app=app, storage=storage)
    auth = ext.shared_limit("5/minute", scope="flask-auth")
    app.add_url_rule("/login", "login", auth(lambda: "hi"))
    app.add_url_rule("/signup", "signup", auth(lambda: "hi"))
    assert flask_counts(app) == {"/login": 5, "/signup": 0}


def test_flask_several_limits_in_one_string(storage: str) -> None:
    """flask-limiter's ``@limit("2/minute;3/hour")``: each a limit of its own."""
    app = Flask(__name__)
    bl_flask.RateLimit(app=app, storage=storage)
    limit = bl_flask.limit("2/minute;3/hour")
    app.add_url_rule("/login", "login", limit(lambda: "hi"))
    client = app.test_client()
    env = {"REMOTE_ADDR": PEER}
    first = client.get("/login", environ_base=env)
    assert first.headers["RateLimit-Policy"] == '"2/minute";q=2;w=60, "3/hour";q=3;w=3600'
    assert first.headers["RateLimit"] == '"2/minute";r=1;t=30, "3/hour";r=2;t=1200'
    statuses = [client.get("/login", environ_base=env).status_code for _ in range(2)]
    assert statuses == [200, 429], "the minute's limit refuses the third"


# -- Django and DRF ---------------------------------------------------------------------------

COUNTS: dict[str, Callable[[], None]] = {}


@pytest.fixture
def django_urls(storage: str) -> Iterator[None]:
    @bl_django.limit("5/minute")
    def login(request: HttpRequest) -> HttpResponse:
        return HttpResponse("hi")

    @bl_django.limit("5/minute")
    def signup(request: HttpRequest) -> HttpResponse:
        return HttpResponse("hi")

    class LoginThrottle(bl_django.LimitThrottle):
        limit = bl_django.Limit("5/minute")

    class SignupThrottle(bl_django.LimitThrottle):
        limit = bl_django.Limit("5/minute")

    class Login(APIView):  # type: ignore[misc]  # DRF has no type information
        throttle_classes: ClassVar = [LoginThrottle]

        def get(self, request: Any) -> DrfResponse:
            return DrfResponse({})

    class Signup(APIView):  # type: ignore[misc]
        throttle_classes: ClassVar = [SignupThrottle]

        def get(self, request: Any) -> DrfResponse:
            return DrfResponse({})

    urls = types.ModuleType("bucket_urls")
    urls.urlpatterns = [  # type: ignore[attr-defined]
        path("login", login),
        path("signup", signup),
        path("drf/login", Login.as_view()),
        path("drf/signup", Signup.as_view()),
    ]
    drf: dict[str, Any] = {"DEFAULT_AUTHENTICATION_CLASSES": [], "UNAUTHENTICATED_USER": None}
    with override_settings(
        ROOT_URLCONF=urls, MIDDLEWARE=[], REST_FRAMEWORK=drf, BUCKETLIMIT_STORAGE=storage
    ):
        yield


@pytest.mark.usefixtures("django_urls")
@pytest.mark.parametrize("prefix", ["", "/drf"])
def test_django_views_and_drf_throttles_keep_their_own_buckets(prefix: str) -> None:
    client = Client(REMOTE_ADDR=PEER)
    counts = {
        route: admitted([client.get(prefix + route).status_code for _ in range(8)])
        for route in ROUTES
    }
    assert counts == {"/login": 5, "/signup": 5}, "each view (each throttle) admits its own 5"


# -- Litestar ---------------------------------------------------------------------------------


def test_litestar_two_handlers_keep_their_own_buckets(storage: str) -> None:
    handlers = []
    made = []
    for route in ROUTES:
        each = bl_litestar.Limit("5/minute", storage=storage)
        made.append(each)

        async def handler() -> str:
            return "hi"

        handlers.append(get(route, middleware=[each.middleware])(handler))

    async def close() -> None:
        for limit in made:
            await _close(limit)

    with LitestarClient(Litestar(handlers, on_shutdown=[close])) as client:
        counts = {
            route: admitted([client.get(route).status_code for _ in range(8)]) for route in ROUTES
        }
    assert counts == {"/login": 5, "/signup": 5}


def test_a_limit_of_several_on_a_fake_clock() -> None:
    """limits_on_clock twins each part of a string of several, and gives them back."""
    from bucketlimit.testing import ManualClock, limits_on_clock

    several = bl_flask.Limit("2/minute;3/hour")
    originals = [part.limiter for part in several.parts]
    clock = ManualClock()
    with limits_on_clock(clock):
        app = Flask(__name__)
        app.add_url_rule("/", "index", several(lambda: "hi"))
        client = app.test_client()
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
        clock.advance(60)  # the minute's refill; the hour's one left
        assert [client.get("/").status_code for _ in range(2)] == [200, 429]
    assert [part.limiter for part in several.parts] == originals, "each part's own limiter back"
    assert several.limiter is None, "a limit of several has no limiter of its own"
