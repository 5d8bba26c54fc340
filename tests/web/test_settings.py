"""Limits configured the peers' way: Flask's RATELIMIT_* keys and the extension's
application and default limits, Django's BUCKETLIMIT_* settings, ``exempt`` in
Flask, FastAPI and Django, and the DRF throttle used alone; each in the
framework's own test client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import django
import httpx
import pytest
from django.conf import settings

if not settings.configured:
    settings.configure(SECRET_KEY="tests", ALLOWED_HOSTS=["*"], INSTALLED_APPS=[])
    django.setup()

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from fastapi import FastAPI
from flask import Flask
from rest_framework.response import Response as DrfResponse
from rest_framework.views import APIView

from bucketlimit import TokenBucketLimiter
from bucketlimit import django as bl_django
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit.web import Refusal
from tests.web import sf
from tests.web.problem import assert_problem

# -- Flask ----------------------------------------------------------------------------------


def flask_app(config: dict[str, Any], **extension: Any) -> tuple[Flask, bl_flask.RateLimit]:
    app = Flask(__name__)
    app.config.update(config)
    ext = bl_flask.RateLimit(app=app, **extension)

    @app.get("/a")
    def a() -> str:
        return "a"

    @app.get("/b")
    def b() -> str:
        return "b"

    @app.get("/own")
    @bl_flask.limit("1/minute", name="own")
    def own() -> str:
        return "own"

    @app.get("/ping")
    @ext.exempt
    def ping() -> str:
        return "pong"

    return app, ext


def statuses(app: Flask, *paths: str) -> list[int]:
    client = app.test_client()
    return [client.get(p).status_code for p in paths]


def test_ratelimit_default_is_per_route_and_a_routes_own_limit_replaces_it() -> None:
    app, _ = flask_app({"RATELIMIT_DEFAULT": "2 per minute;100/day"})
    first = app.test_client().get("/a")
    assert set(sf.ratelimit(first.headers["RateLimit"])) == {"2 per minute", "100/day"}
    # Each route has its own 2 a minute (flask-limiter's default limits).
    assert statuses(app, "/a", "/a", "/b", "/b", "/b") == [200, 429, 200, 200, 429]
    # /own has a limit of its own: the defaults do not apply there.
    own = app.test_client().get("/own")
    assert set(sf.ratelimit(own.headers["RateLimit"])) == {"own"}
    assert statuses(app, "/own") == [429]
    assert statuses(app, "/ping", "/ping", "/ping") == [200, 200, 200]  # exempt
    assert "RateLimit" not in app.test_client().get("/ping").headers


def test_ratelimit_application_is_one_bucket_for_the_whole_app() -> None:
    app, _ = flask_app({"RATELIMIT_APPLICATION": "3/minute"})
    assert statuses(app, "/a", "/b", "/a", "/b") == [200, 200, 200, 429]
    assert statuses(app, "/ping") == [200]  # exempt from the application limits too
    assert statuses(app, "/missing") == [429]  # a 404 is a request too


def test_ratelimit_enabled_false_turns_every_limit_off() -> None:
    app, _ = flask_app({"RATELIMIT_DEFAULT": "1/minute", "RATELIMIT_ENABLED": False})
    assert statuses(app, "/a", "/a", "/own", "/own") == [200] * 4
    assert "RateLimit" not in app.test_client().get("/a").headers


def test_ratelimit_enabled_false_without_the_extension() -> None:
    app = Flask(__name__)
    app.config["RATELIMIT_ENABLED"] = False
    app.add_url_rule("/", "index", bl_flask.limit("1/minute")(lambda: "hi"))
    assert statuses(app, "/", "/") == [200, 200]


def test_arguments_win_over_the_config() -> None:
    app, _ = flask_app(
        {"RATELIMIT_DEFAULT": "1/minute", "RATELIMIT_STORAGE_URI": "memory://"},
        default_limits=["2/minute"],
        headers="legacy",
    )
    answer = app.test_client().get("/a")
    assert sf.integer(answer.headers["X-RateLimit-Limit"]) == 2
    assert "RateLimit" not in answer.headers
    assert statuses(app, "/a", "/a") == [200, 429]


@pytest.mark.parametrize("extension", [True, False])
def test_ratelimit_headers_enabled_reads_as_flask_limiters(extension: bool) -> None:
    """``RATELIMIT_HEADERS_ENABLED = True`` is flask-limiter's ``X-RateLimit-*``
    fields, the same names it sends; ``False`` none; unset, draft-11's."""
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    def app_with(config: dict[str, Any], ours: bool) -> Flask:
        app = Flask(__name__)
        app.config.update(config)
        if ours and extension:
            bl_flask.RateLimit(app=app)

        def view() -> str:
            return "hi"

        if ours:
            app.add_url_rule("/", "index", bl_flask.limit("2/minute")(view))
        else:
            limiter = Limiter(get_remote_address, app=app, storage_uri="memory://")
            app.add_url_rule("/", "index", limiter.limit("2/minute")(view))
        return app

    on = {"RATELIMIT_HEADERS_ENABLED": True}
    theirs = app_with(on, ours=False).test_client().get("/")
    answer = app_with(on, ours=True).test_client().get("/")
    legacy = {name for name, _ in answer.headers if name.lower().startswith("x-ratelimit")}
    peers = {name for name, _ in theirs.headers if name.lower().startswith("x-ratelimit")}
    assert legacy == peers, "the same names flask-limiter sends"
    assert sf.integer(answer.headers["X-RateLimit-Remaining"]) == 1
    assert "RateLimit" not in answer.headers, "the peer's fields, not draft-11's"
    off = app_with({"RATELIMIT_HEADERS_ENABLED": False}, ours=True).test_client().get("/")
    assert not [name for name, _ in off.headers if "ratelimit" in name.lower()]
    unset = app_with({}, ours=True).test_client().get("/")
    assert "RateLimit" in unset.headers


def test_a_limit_string_on_a_view_takes_the_apps_storage() -> None:
    decorated = bl_flask.limit("5/minute", name="late")  # before the app exists
    assert not decorated.bound
    app = Flask(__name__)
    app.config["RATELIMIT_STORAGE_URI"] = "memory://"
    bl_flask.RateLimit(app=app)
    assert decorated.bound  # init_app bound it to the app's storage
    assert isinstance(decorated.limiter, TokenBucketLimiter)


def test_a_bad_config_is_loud_at_init_app() -> None:
    app = Flask(__name__)
    app.config["RATELIMIT_DEFAULT"] = "100 per fortnight"
    with pytest.raises(ValueError, match="fortnight"):
        bl_flask.RateLimit(app=app)
    app = Flask(__name__)
    app.config["RATELIMIT_STORAGE_URI"] = "memcached://localhost"
    with pytest.raises(ValueError, match="storage must be a URI"):
        bl_flask.RateLimit(app=app)
    with pytest.raises(TypeError, match="Limit or a limit string"):
        bl_flask.RateLimit(TokenBucketLimiter(1, 1))  # type: ignore[arg-type]


# -- FastAPI --------------------------------------------------------------------------------


def test_fastapi_exempt_skips_the_middleware() -> None:
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit="1/minute")

    @app.get("/health")
    @bl_fastapi.exempt
    async def health() -> str:
        return "ok"

    @app.get("/items/{item}")
    async def item(item: int) -> int:
        return item

    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=("192.0.2.3", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            paths = ["/health", "/health", "/items/1", "/items/2", "/health"]
            return [await client.get(p) for p in paths]

    answers = asyncio.run(calls())
    assert [a.status_code for a in answers] == [200, 200, 200, 429, 200]
    assert "RateLimit" not in answers[0].headers
    assert sf.ratelimit(answers[2].headers["RateLimit"])["1/minute"].params["r"] == 0


# -- Django ---------------------------------------------------------------------------------


@bl_django.limit("1/minute", name="own")
def own_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("own")


def plain_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("plain")


@bl_django.exempt
def health_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


def refused_as_json(request: HttpRequest, refusal: Refusal) -> JsonResponse:
    return JsonResponse({"refused": refusal.status}, status=refusal.status)


spent_quota = bl_django.Limit(TokenBucketLimiter(1, 0), name="quota")


class QuotaThrottle(bl_django.LimitThrottle):
    limit = spent_quota


class Quota(APIView):  # type: ignore[misc]
    throttle_classes = [QuotaThrottle]  # noqa: RUF012 - DRF's own convention

    def get(self, request: Any) -> DrfResponse:
        return DrfResponse({"ok": True})


urlpatterns = [
    path("own", own_view),
    path("plain", plain_view),
    path("other", plain_view, name="other"),
    path("health", health_view),
    path("quota", Quota.as_view()),
]

DJANGO = {
    "ROOT_URLCONF": __name__,
    "MIDDLEWARE": ["bucketlimit.django.RateLimitMiddleware"],
    "REST_FRAMEWORK": {
        "DEFAULT_AUTHENTICATION_CLASSES": [],
        "DEFAULT_PERMISSION_CLASSES": [],
        "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
        "UNAUTHENTICATED_USER": None,
    },
}


@pytest.fixture
def django_site() -> Iterator[None]:
    with override_settings(**DJANGO):
        yield


def django_statuses(*paths: str) -> list[int]:
    client = Client()
    return [client.get(p).status_code for p in paths]


@pytest.mark.usefixtures("django_site")
def test_django_default_limits_per_route_storage_headers_and_exempt() -> None:
    with override_settings(
        BUCKETLIMIT_DEFAULT_LIMITS="2/minute",
        BUCKETLIMIT_STORAGE="memory://",
        BUCKETLIMIT_HEADERS=["draft-11", "legacy"],
    ):
        assert django_statuses("/plain", "/plain", "/plain") == [200, 200, 429]
        assert django_statuses("/other", "/other") == [200, 200]  # a route of its own
        own = Client().get("/own")
        assert set(sf.ratelimit(own["RateLimit"])) == {"own"}  # its limit, not the default
        assert sf.integer(own["X-RateLimit-Limit"]) == 1
        assert django_statuses("/own") == [429]
        assert django_statuses("/health", "/health", "/health") == [200] * 3


@pytest.mark.usefixtures("django_site")
def test_django_limits_from_strings_enabled_and_on_refusal() -> None:
    with override_settings(
        BUCKETLIMIT_LIMITS=["3/minute"],
        BUCKETLIMIT_ON_REFUSAL=f"{__name__}.refused_as_json",
    ):
        client = Client()
        answers = [client.get(p) for p in ("/plain", "/other", "/health", "/plain", "/plain")]
        assert [a.status_code for a in answers] == [200, 200, 200, 200, 429]
        assert answers[-1].json() == {"refused": 429}
        assert answers[-1]["Retry-After"] == "20"  # added where on_refusal set none
        with override_settings(BUCKETLIMIT_ENABLED=False):
            assert django_statuses("/plain", "/own", "/own") == [200, 200, 200]


@pytest.mark.usefixtures("django_site")
def test_a_drf_throttle_alone_answers_a_spent_quota_with_403_not_a_bare_429() -> None:
    spent_quota.limiter = TokenBucketLimiter(1, 0)
    with override_settings(MIDDLEWARE=[]):  # the throttle alone, as DRF users do
        client = Client()
        answers = [client.get("/quota") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 403, 403]
    assert "Retry-After" not in answers[1]  # nothing to wait for: a client stops
    assert_problem(answers[1].json(), 403, "quota", None)
    spent_quota.limiter = TokenBucketLimiter(1, 0)
    client = Client()  # with the middleware: the same status, problem+json and the fields
    answers = [client.get("/quota") for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 403]
    assert answers[1]["Content-Type"] == "application/problem+json"
    assert sf.ratelimit(answers[1]["RateLimit"])["quota"].params["r"] == 0
