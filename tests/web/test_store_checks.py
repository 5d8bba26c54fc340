"""Every limit with a store asks it (``check()``) once per process before its limiter
first decides, where no start-up asked it already: route decorators, FastAPI
dependencies, Django views and DRF throttles, which no start-up hook sees. A
store that does not answer fails the request (StoreCheckError, a 500) rather than
letting each worker admit its own copy of the limit; the next request asks again.
``check_store=False``, on the limit or the app, never asks."""

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
from rest_framework.response import Response as DrfResponse
from rest_framework.views import APIView

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit import django as bl_django
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit.web import StoreCheckError
from tests.support.redis_servers import free_port

PEER = "192.0.2.50"


class StoreLimiter:
    """An in-process limiter with a store to ask: ``check()`` answers while
    ``up``, and every call is recorded in order."""

    def __init__(self, *, up: bool = True) -> None:
        self.inner = TokenBucketLimiter(5, 1)
        self.up = up
        self.calls: list[str] = []

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def rate(self) -> float:
        return self.inner.rate

    def check(self) -> None:
        self.calls.append("check")
        if not self.up:
            raise ConnectionError("the store is down")

    def allow(self, key: str, cost: int = 1) -> Decision:
        self.calls.append("allow")
        return self.inner.allow(key, cost)

    def peek(self, key: str, cost: int = 1) -> Decision:
        return self.inner.peek(key, cost)

    def refund(self, key: str, cost: int) -> None:
        self.inner.refund(key, cost)


def fastapi_statuses(app: FastAPI, count: int, *closing: bl_fastapi.Limit) -> list[int]:
    """The statuses of ``count`` requests; then the asyncio Redis clients of
    ``closing`` are closed in the same event loop (they are shared per URI)."""

    async def calls() -> list[int]:
        transport = httpx.ASGITransport(app=app, client=(PEER, 1), raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return [(await client.get("/")).status_code for _ in range(count)]
        finally:
            for limit in closing:
                await limit.limiter.client.aclose()  # type: ignore[union-attr]

    return asyncio.run(calls())


def fastapi_route(limit: bl_fastapi.Limit, **middleware: Any) -> FastAPI:
    app = FastAPI()
    if middleware:
        app.add_middleware(bl_fastapi.RateLimitMiddleware, **middleware)
    app.get("/", dependencies=[Depends(limit)])(lambda: "hi")
    return app


def test_a_route_limit_asks_its_store_once_before_it_first_decides() -> None:
    limiter = StoreLimiter()
    app = fastapi_route(bl_fastapi.Limit(limiter, name="route"))
    assert fastapi_statuses(app, 3) == [200, 200, 200]
    assert limiter.calls == ["check", "allow", "allow", "allow"], "asked once, before deciding"


def test_a_store_that_does_not_answer_fails_each_request_until_it_does() -> None:
    limiter = StoreLimiter(up=False)
    app = fastapi_route(bl_fastapi.Limit(limiter, name="route"))
    assert fastapi_statuses(app, 2) == [500, 500], "no answer from the store: no admission"
    assert limiter.calls == ["check", "check"], "nothing decided without the store"
    limiter.up = True
    assert fastapi_statuses(app, 2) == [200, 200]
    assert limiter.calls[2:] == ["check", "allow", "allow"], "asked again, then once only"


def test_check_store_false_on_the_limit_or_the_app_never_asks() -> None:
    own = StoreLimiter(up=False)
    assert fastapi_statuses(fastapi_route(bl_fastapi.Limit(own, check_store=False)), 1) == [200]
    apps = StoreLimiter(up=False)
    app = fastapi_route(bl_fastapi.Limit(apps, name="route"), check_store=False)
    assert fastapi_statuses(app, 1) == [200]
    assert own.calls == apps.calls == ["allow"], "the opted-out limits never asked"


def test_flask_views_ask_before_their_first_decision() -> None:
    limiter = StoreLimiter(up=False)
    app = Flask(__name__)
    app.add_url_rule("/", "index", bl_flask.Limit(limiter, name="view")(lambda: "hi"))
    client = app.test_client()
    assert client.get("/", environ_base={"REMOTE_ADDR": PEER}).status_code == 500
    limiter.up = True
    assert client.get("/", environ_base={"REMOTE_ADDR": PEER}).status_code == 200
    assert limiter.calls == ["check", "check", "allow"]


STORES: dict[str, StoreLimiter] = {}


def hello(request: HttpRequest) -> HttpResponse:
    return HttpResponse("hi")


@pytest.fixture
def django_urls() -> Iterator[None]:
    STORES.clear()
    STORES["view"] = StoreLimiter(up=False)
    STORES["items"] = StoreLimiter(up=False)

    class Throttle(bl_django.LimitThrottle):
        limit = bl_django.Limit(STORES["items"], name="items")

    class Items(APIView):  # type: ignore[misc]  # DRF has no type information
        throttle_classes: ClassVar = [Throttle]

        def get(self, request: Any) -> DrfResponse:
            return DrfResponse({"items": []})

    urls = types.ModuleType("store_urls")
    urls.urlpatterns = [  # type: ignore[attr-defined]
        path("view", bl_django.Limit(STORES["view"], name="view")(hello)),
        path("items", Items.as_view()),
    ]
    drf: dict[str, Any] = {"DEFAULT_AUTHENTICATION_CLASSES": [], "UNAUTHENTICATED_USER": None}
    with override_settings(ROOT_URLCONF=urls, MIDDLEWARE=[], REST_FRAMEWORK=drf):
        yield


@pytest.mark.usefixtures("django_urls")
@pytest.mark.parametrize("route", ["view", "items"])
def test_django_views_and_drf_throttles_ask_without_the_middleware(route: str) -> None:
    client = Client(REMOTE_ADDR=PEER)
    with pytest.raises(StoreCheckError, match=f"'{route}'"):
        client.get(f"/{route}")
    STORES[route].up = True
    assert client.get(f"/{route}").status_code == 200
    assert STORES[route].calls == ["check", "check", "allow"]


@pytest.mark.usefixtures("django_urls")
@pytest.mark.parametrize("route", ["view", "items"])
def test_django_check_store_setting_false_never_asks(route: str) -> None:
    with override_settings(BUCKETLIMIT_CHECK_STORE=False):
        assert Client(REMOTE_ADDR=PEER).get(f"/{route}").status_code == 200
    assert STORES[route].calls == ["allow"], "BUCKETLIMIT_CHECK_STORE = False: never asked"


# -- real redis-servers ------------------------------------------------------------------------


@pytest.fixture
def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


@pytest.mark.redis
def test_a_route_limit_string_on_a_dead_store_fails_instead_of_admitting(dead_url: str) -> None:
    """``Depends(Limit("5/minute", storage=dead))`` must not let each of 4 workers admit
    on its own: every request fails, as the peers' do, until the store answers."""
    limit = bl_fastapi.Limit("5/minute", storage=dead_url)
    assert fastapi_statuses(fastapi_route(limit), 8, limit) == [500] * 8, "nobody admitted"
    lenient = bl_fastapi.Limit("5/minute", storage=dead_url, check_store=False)
    answered = fastapi_statuses(fastapi_route(lenient), 8, lenient)
    assert 500 not in answered, f"check_store=False: the policy answers, got {answered}"


@pytest.mark.redis
def test_a_route_limit_string_on_a_live_store(redis_url: str) -> None:
    limit = bl_fastapi.Limit("5/minute", storage=redis_url)
    assert fastapi_statuses(fastapi_route(limit), 6, limit) == [200] * 5 + [429]
