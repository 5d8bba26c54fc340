"""A refusal hook never admits a refused request, in any adapter: a hook that
returns ``None`` (flask-limiter's ``on_breach`` is a logging callback that does)
means "send the default refusal", and a hook that raises is the app's error.

Each app has one route limited to one request; the second request is refused,
the hook is called for it, and the route never runs a second time."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterator
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

from bucketlimit import TokenBucketLimiter
from bucketlimit import asgi as bl_asgi
from bucketlimit import django as bl_django
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit import litestar as bl_litestar
from bucketlimit.testing import ManualClock
from bucketlimit.web import Refusal
from tests.web.problem import assert_problem

PEER = "192.0.2.40"


class Breaches:
    """A hook that logs the breach and returns ``None`` (or raises), counting calls."""

    def __init__(self, *, raises: bool = False) -> None:
        self.seen: list[int] = []
        self.raises = raises

    def __call__(self, request: Any, refusal: Refusal) -> None:
        self.seen.append(refusal.status)
        if self.raises:
            raise LookupError("the app's own error")


class AsyncBreaches(Breaches):
    async def hook(self, request: Any, refusal: Refusal) -> None:
        self(request, refusal)


def one_a_minute(**options: Any) -> Any:
    return TokenBucketLimiter(1, 1, ManualClock(), per=60)


def assert_default_refusal(status: int, headers: Any, body: Any, policy: str) -> None:
    assert status == 429, "the hook's None must not admit the refused request"
    assert headers["Retry-After"] == "60", "the default refusal says when to come back"
    assert_problem(body, 429, policy, 60)


# -- Flask ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["limit", "app"])
def test_flask_hook_returning_none_sends_the_default_refusal(where: str) -> None:
    hook = Breaches()
    app = Flask(__name__)
    runs: list[str] = []
    if where == "app":
        bl_flask.RateLimit(app=app, on_refusal=hook)
        limit = bl_flask.Limit(one_a_minute(), name="one")
    else:
        limit = bl_flask.Limit(one_a_minute(), name="one", on_refusal=hook)

    @app.get("/")
    @limit
    def index() -> str:
        runs.append("ran")
        return "hi"

    client = app.test_client()
    assert client.get("/", environ_base={"REMOTE_ADDR": PEER}).status_code == 200
    refused = client.get("/", environ_base={"REMOTE_ADDR": PEER})
    assert_default_refusal(refused.status_code, refused.headers, refused.get_json(), "one")
    assert hook.seen == [429], "the hook was called once, for the refusal"
    assert runs == ["ran"], "the view ran for the admitted request only"


def test_flask_app_wide_limit_with_a_none_hook_refuses() -> None:
    hook = Breaches()
    app = Flask(__name__)
    bl_flask.RateLimit(bl_flask.Limit(one_a_minute(), name="app"), app, on_refusal=hook)
    app.add_url_rule("/", "index", lambda: "hi")
    client = app.test_client()
    statuses = [client.get("/", environ_base={"REMOTE_ADDR": PEER}).status_code for _ in range(3)]
    assert statuses == [200, 429, 429], "a None from the app's hook keeps every refusal"
    assert hook.seen == [429, 429]


def test_flask_hook_that_raises_is_the_apps_error() -> None:
    hook = Breaches(raises=True)
    app = Flask(__name__)
    limit = bl_flask.Limit(one_a_minute(), name="one", on_refusal=hook)
    app.add_url_rule("/", "index", limit(lambda: "hi"))
    client = app.test_client()
    client.get("/", environ_base={"REMOTE_ADDR": PEER})
    assert client.get("/", environ_base={"REMOTE_ADDR": PEER}).status_code == 500
    assert hook.seen == [429]


# -- FastAPI, the ASGI middleware, Litestar ---------------------------------------------------


def fastapi_calls(app: Any, count: int) -> list[httpx.Response]:
    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=(PEER, 1), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.get("/") for _ in range(count)]

    return asyncio.run(calls())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_fastapi_dependency_hook_returning_none(asynchronous: bool) -> None:
    breaches = AsyncBreaches()
    hook = breaches.hook if asynchronous else breaches
    limit = bl_fastapi.Limit(one_a_minute(), name="one", on_refusal=hook)
    runs: list[str] = []
    app = FastAPI()

    @app.get("/", dependencies=[Depends(limit)])
    async def index() -> str:
        runs.append("ran")
        return "hi"

    first, refused = fastapi_calls(app, 2)
    assert first.status_code == 200
    assert_default_refusal(refused.status_code, refused.headers, refused.json(), "one")
    assert breaches.seen == [429], "the hook was called once, for the refusal"
    assert runs == ["ran"], "the route ran for the admitted request only"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_asgi_middleware_hook_returning_none(asynchronous: bool) -> None:
    breaches = AsyncBreaches()
    hook = breaches.hook if asynchronous else breaches
    runs: list[str] = []

    async def hello(scope: Any, receive: Any, send: Any) -> None:
        runs.append("ran")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hi"})

    limit = bl_asgi.Limit(one_a_minute(), name="one")
    app = bl_asgi.RateLimitMiddleware(hello, limit=limit, on_refusal=hook)
    first, refused = fastapi_calls(app, 2)
    assert first.status_code == 200
    assert_default_refusal(refused.status_code, refused.headers, refused.json(), "one")
    assert breaches.seen == [429], "the hook was called once, for the refusal"
    assert runs == ["ran"], "the route ran for the admitted request only"


def test_asgi_hooks_that_raise_are_the_apps_error() -> None:
    dependency_hook = Breaches(raises=True)
    limit = bl_fastapi.Limit(one_a_minute(), name="one", on_refusal=dependency_hook)
    app = FastAPI()
    app.get("/", dependencies=[Depends(limit)])(lambda: "hi")
    assert [a.status_code for a in fastapi_calls(app, 2)] == [200, 500]
    middleware_hook = Breaches(raises=True)
    limited = bl_fastapi.RateLimitMiddleware(
        FastAPI(), limit=bl_fastapi.Limit(one_a_minute(), name="one"), on_refusal=middleware_hook
    )
    statuses = [a.status_code for a in fastapi_calls(limited, 2)]
    assert statuses == [404, 500], "the refusal's hook failed: a server error, not an admission"
    assert dependency_hook.seen == middleware_hook.seen == [429]


def test_litestar_hook_returning_none() -> None:
    hook = Breaches()
    limit = bl_litestar.Limit(one_a_minute(), name="one", on_refusal=hook)
    runs: list[str] = []

    @get("/", middleware=[limit.middleware])
    async def index() -> str:
        runs.append("ran")
        return "hi"

    with LitestarClient(Litestar([index])) as client:
        assert client.get("/").status_code == 200
        refused = client.get("/")
    assert_default_refusal(refused.status_code, refused.headers, refused.json(), "one")
    assert hook.seen == [429], "the hook was called once, for the refusal"
    assert runs == ["ran"], "the route ran for the admitted request only"


# -- Django and DRF ---------------------------------------------------------------------------

HOOK = Breaches()
RUNS: list[str] = []


def django_hook(request: Any, refusal: Refusal) -> None:
    HOOK(request, refusal)


@pytest.fixture
def django_urls() -> Iterator[types.ModuleType]:
    HOOK.seen.clear()
    RUNS.clear()
    own = bl_django.Limit(one_a_minute(), name="own", on_refusal=django_hook)
    setting = bl_django.Limit(one_a_minute(), name="setting")

    @own
    def view(request: HttpRequest) -> HttpResponse:
        RUNS.append("view")
        return HttpResponse("hi")

    @setting
    async def async_view(request: HttpRequest) -> HttpResponse:
        RUNS.append("async")
        return HttpResponse("hi")

    class Throttle(bl_django.LimitThrottle):
        limit = bl_django.Limit(one_a_minute(), name="drf")

    class Items(APIView):  # type: ignore[misc]  # DRF has no type information
        throttle_classes: ClassVar = [Throttle]

        def get(self, request: Any) -> DrfResponse:
            RUNS.append("drf")
            return DrfResponse({"items": []})

    urls = types.ModuleType("hook_urls")
    urls.urlpatterns = [  # type: ignore[attr-defined]
        path("view", view),
        path("async", async_view),
        path("items", Items.as_view()),
    ]
    with override_settings(
        ROOT_URLCONF=urls,
        MIDDLEWARE=["bucketlimit.django.RateLimitMiddleware"],
        BUCKETLIMIT_ON_REFUSAL=f"{__name__}.django_hook",
        REST_FRAMEWORK={"DEFAULT_AUTHENTICATION_CLASSES": [], "UNAUTHENTICATED_USER": None},
    ):
        yield urls


POLICIES = {"view": "own", "async": "setting", "items": "drf"}


@pytest.mark.usefixtures("django_urls")
@pytest.mark.parametrize("route", ["view", "async", "items"])
def test_django_hooks_returning_none_send_the_default_refusal(route: str) -> None:
    client = Client(REMOTE_ADDR=PEER)
    assert client.get(f"/{route}").status_code == 200
    refused = client.get(f"/{route}")
    assert_default_refusal(refused.status_code, refused, refused.json(), POLICIES[route])
    assert HOOK.seen == [429], "the hook (the limit's or BUCKETLIMIT_ON_REFUSAL) was called"
    assert len(RUNS) == 1, "the view ran for the admitted request only"
