"""The store behind an app's limits is checked when the app starts: Flask's
init_app, the ASGI middleware's lifespan start-up (FastAPI, Starlette, the routes'
limits too), Litestar's on_startup, Django's middleware; a dead store fails the
start, naming the limit; a live one starts; each check can be turned off."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import django
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
from starlette.testclient import TestClient

from bucketlimit import django as bl_django
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit import litestar as bl_litestar
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter
from bucketlimit.web import StoreCheckError
from tests.support.redis_servers import free_port

pytestmark = pytest.mark.redis


@pytest.fixture
def dead_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


def test_flask_init_app_checks_the_store(dead_url: str, redis_url: str) -> None:
    dead = bl_flask.Limit(RedisTokenBucketLimiter.from_url(dead_url, 5, 1), name="requests")
    with pytest.raises(StoreCheckError, match="'requests'") as failed:
        bl_flask.RateLimit(dead, Flask(__name__))
    assert failed.value.__cause__ is not None  # the client's own error
    bl_flask.RateLimit(dead, Flask(__name__), check_store=False)  # starts anyway
    live = bl_flask.Limit(RedisTokenBucketLimiter.from_url(redis_url, 5, 1), name="live")
    app = Flask(__name__)
    bl_flask.RateLimit(live, app)
    app.add_url_rule("/", "index", lambda: "hi")
    assert app.test_client().get("/").status_code == 200
    del dead  # the live limits list forgets it: later start-ups do not ask its store


def fastapi_app(limit: bl_fastapi.Limit, *, check_store: bool = True) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await limit.limiter.client.aclose()  # type: ignore[union-attr]

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=limit, check_store=check_store)

    @app.get("/")
    async def index() -> str:
        return "hi"

    return app


def test_the_asgi_middleware_checks_the_store_at_lifespan_startup(
    dead_url: str, redis_url: str
) -> None:
    dead = bl_fastapi.Limit(AsyncRedisTokenBucketLimiter.from_url(dead_url, 5, 1), name="dead")
    with pytest.raises(RuntimeError), TestClient(fastapi_app(dead)):  # startup failed
        pass
    with TestClient(fastapi_app(dead, check_store=False)) as client:
        # "local" without a share: the store never counted the processes sharing the
        # limit, so it fails closed (degraded), rather than each worker admitting 5.
        assert client.get("/").status_code == 429
    dead.limiter = AsyncRedisTokenBucketLimiter.from_url(redis_url, 5, 1)  # fixed
    with TestClient(fastapi_app(dead)) as client:
        assert client.get("/").status_code == 200


def test_litestar_on_startup(dead_url: str) -> None:
    dead = bl_litestar.Limit(AsyncRedisTokenBucketLimiter.from_url(dead_url, 5, 1), name="ls")

    @get("/", middleware=[dead.middleware])
    async def index() -> str:
        return "hi"

    app = Litestar([index], on_startup=[dead.check_store])
    with (
        pytest.raises(BaseException, match=r"did not answer|unhandled errors") as failed,
        LitestarClient(app),
    ):
        pass
    found: BaseException = failed.value
    while hasattr(found, "exceptions"):  # an exception group: Litestar's task group's
        found = found.exceptions[0]
    assert isinstance(found, StoreCheckError)
    assert "'ls'" in str(found)


def hello(request: HttpRequest) -> HttpResponse:
    return HttpResponse("hi")


urlpatterns = [path("", hello)]
DEAD: list[bl_django.Limit] = []


@pytest.fixture
def django_dead(dead_url: str) -> Iterator[None]:
    DEAD[:] = [bl_django.Limit(RedisTokenBucketLimiter.from_url(dead_url, 5, 1), name="dj")]
    with override_settings(
        ROOT_URLCONF=__name__,
        MIDDLEWARE=["bucketlimit.django.RateLimitMiddleware"],
        BUCKETLIMIT_LIMITS=DEAD,
    ):
        yield
    DEAD.clear()


@pytest.mark.usefixtures("django_dead")
def test_django_checks_when_it_builds_the_middleware() -> None:
    with pytest.raises(StoreCheckError, match="'dj'"):
        Client().get("/")  # the test client builds the handler (and its middleware) now
    with override_settings(BUCKETLIMIT_CHECK_STORE=False):
        assert Client().get("/").status_code == 429  # no share counted: fails closed


def test_the_fastapi_middleware_asks_the_routes_stores_at_lifespan_startup(dead_url: str) -> None:
    """Route limits (``Depends``) are the app's too: a dead store behind one fails the
    start-up, before any request; the app's ``storage=`` is theirs."""
    route = bl_fastapi.Limit("5/minute", name="route")
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, storage=dead_url)
    app.get("/", dependencies=[Depends(route)])(lambda: "hi")
    with pytest.raises(RuntimeError), TestClient(app):  # startup failed
        pass
    assert "redis" in type(route.limiter).__module__, "bound to the app's storage at start-up"
    assert "GET /" in route.limiter.prefix, "named after its route"  # type: ignore[union-attr]


def test_a_limit_of_several_is_asked_for_each_part(dead_url: str) -> None:
    several = bl_fastapi.Limit("2/minute;10/hour", storage=dead_url)
    with pytest.raises(StoreCheckError, match="'2/minute'"), TestClient(fastapi_app(several)):
        pass


VIEWS: list[Any] = []
# A URLconf module whose urlpatterns is VIEWS, importable by name.
_urls = types.ModuleType(f"{__name__}_views")
_urls.urlpatterns = VIEWS  # type: ignore[attr-defined]
sys.modules[_urls.__name__] = _urls


@pytest.fixture
def django_views_on_a_dead_store(dead_url: str) -> Iterator[None]:
    from rest_framework.views import APIView

    dead = bl_django.Limit("5/minute", storage=dead_url, name="view")

    class Throttle(bl_django.LimitThrottle):
        limit = bl_django.Limit("50/minute", storage=dead_url, name="drf")

    class Items(APIView):  # type: ignore[misc]  # DRF has no type information
        throttle_classes = (Throttle,)

    VIEWS[:] = [path("", hello), path("login", dead(hello)), path("items", Items.as_view())]
    with override_settings(
        ROOT_URLCONF=f"{__name__}_views",
        MIDDLEWARE=["bucketlimit.django.RateLimitMiddleware"],
        BUCKETLIMIT_LIMITS=[],
    ):
        yield
    VIEWS.clear()


@pytest.mark.usefixtures("django_views_on_a_dead_store")
def test_django_asks_the_stores_of_the_views_limits_when_it_builds_the_middleware() -> None:
    """The URLconf's ``@limit``s and DRF throttles are the app's too: building the
    middleware (a worker's start) asks their stores, before any request to them."""
    with pytest.raises(StoreCheckError, match=r"'view'|'drf'"):
        Client().get("/")  # a route with no limit: the start failed, not the request
    with override_settings(BUCKETLIMIT_CHECK_STORE=False):
        assert Client().get("/").status_code == 200
