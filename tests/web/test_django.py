"""bucketlimit.django: the decorator on sync and async views, the middleware (sync
and async), a DRF APIView with LimitThrottle, settings overrides; the test client
and the async client."""

from __future__ import annotations

from collections.abc import Iterator

import django
import pytest
from django.conf import settings

if not settings.configured:
    settings.configure(SECRET_KEY="tests", ALLOWED_HOSTS=["*"], INSTALLED_APPS=[])
    django.setup()

from django.test import AsyncClient, Client, override_settings

from bucketlimit import TokenBucketLimiter
from bucketlimit.django import Limit, LimitThrottle, remote_address
from bucketlimit.testing import reset_limits
from tests.web import django_views as views
from tests.web import sf
from tests.web.problem import assert_problem

MIDDLEWARE = ["bucketlimit.django.RateLimitMiddleware"]
BASE = {
    "DEBUG": False,
    "ROOT_URLCONF": "tests.web.django_views",
    "MIDDLEWARE": MIDDLEWARE,
    "BUCKETLIMIT_LIMITS": [],
    "REST_FRAMEWORK": {
        "DEFAULT_AUTHENTICATION_CLASSES": [],
        "DEFAULT_PERMISSION_CLASSES": [],
        "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
        "UNAUTHENTICATED_USER": None,
    },
}


@pytest.fixture(autouse=True)
def django_settings() -> Iterator[None]:
    reset_limits()
    with override_settings(**BASE):
        yield
    reset_limits()


def fields(answer: object) -> dict[str, dict[str, object]]:
    limits = sf.ratelimit(answer["RateLimit"])  # type: ignore[index]
    policies = sf.ratelimit_policy(answer["RateLimit-Policy"])  # type: ignore[index]
    assert list(limits) == list(policies)
    return {name: {**policies[name].params, **item.params} for name, item in limits.items()}


def test_a_sync_view_with_the_test_client() -> None:
    client = Client()
    answers = [client.get("/sync") for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert fields(answers[0]) == {"sync": {"q": 3, "w": 3, "r": 2, "t": 1}}
    refused = answers[-1]
    assert refused["Retry-After"] == "1"
    assert refused["Content-Type"] == "application/problem+json"
    assert fields(refused) == {"sync": {"q": 3, "w": 3, "r": 0, "t": 1}}
    assert_problem(refused.json(), 429, "sync", 1)
    views.CLOCK.advance(1)
    assert client.get("/sync").status_code == 200


async def async_statuses(path: str, count: int, **extra: str) -> list[int]:
    client = AsyncClient()
    return [(await client.get(path, **extra)).status_code for _ in range(count)]


@pytest.mark.anyio
async def test_an_async_view_with_the_async_client() -> None:
    client = AsyncClient()
    answers = [await client.get("/async") for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert fields(answers[0])["async"]["r"] == 2
    assert_problem(answers[-1].json(), 429, "async", 1)


def test_a_class_based_view_and_a_spent_quota() -> None:
    client = Client()
    assert client.get("/class").status_code == 200
    spent = client.get("/class")
    assert spent.status_code == 403  # rate 0: spent for good
    assert "Retry-After" not in spent
    assert_problem(spent.json(), 403, "class", None)


def test_several_limits_on_one_view_are_one_field_each() -> None:
    with override_settings(BUCKETLIMIT_LIMITS=["tests.web.django_views.app_wide"]):
        answer = Client().get("/stacked")
    assert answer.status_code == 200
    assert answer.headers.get("RateLimit-Policy") == (
        '"app";q=4;w=4, "burst";q=5;w=5, "daily";q=50;w=86400'
    )
    assert list(fields(answer)) == ["app", "burst", "daily"]
    assert fields(answer)["daily"]["t"] == 1728  # a token every 1728 s


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_middleware_applies_the_configured_limits(asynchronous: bool) -> None:
    path = "/async-plain" if asynchronous else "/plain"
    with override_settings(BUCKETLIMIT_LIMITS=[views.app_wide]):
        client = Client()
        answers = [client.get(path) for _ in range(5)]
        assert [a.status_code for a in answers] == [200, 200, 200, 200, 429]
        assert fields(answers[0]) == {"app": {"q": 4, "w": 4, "r": 3, "t": 1}}
        assert_problem(answers[-1].json(), 429, "app", 1)
        health = client.get("/health")
        assert health.status_code == 200
        assert "RateLimit" not in health


@pytest.mark.anyio
async def test_the_async_middleware_with_the_async_client() -> None:
    with override_settings(BUCKETLIMIT_LIMITS=["tests.web.django_views.app_wide"]):
        assert await async_statuses("/async-plain", 5) == [200, 200, 200, 200, 429]
        assert await async_statuses("/plain", 1) == [429]  # a sync view, the same bucket


def test_a_refusal_by_the_view_refunds_the_middlewares_limit() -> None:
    with override_settings(BUCKETLIMIT_LIMITS=[views.app_wide]):
        client = Client()
        statuses = [client.get("/class").status_code for _ in range(3)]
    assert statuses == [200, 403, 403]
    assert views.app_wide.limiter.peek("127.0.0.1", 3).allowed  # type: ignore[union-attr]


def test_each_limit_counts_one_outcome_per_request() -> None:
    """The middleware's limit admitted all three requests; the view's refused two, and
    the middleware's charges for those were given back: not admissions."""
    keys = ("requests_allowed", "requests_refused", "requests_given_back")
    before = {limit.name: limit.stats() for limit in (views.app_wide, views.class_limit)}
    with override_settings(BUCKETLIMIT_LIMITS=[views.app_wide]):
        client = Client()
        assert [client.get("/class").status_code for _ in range(3)] == [200, 403, 403]
    counted = {
        limit.name: tuple(limit.stats()[k] - before[limit.name][k] for k in keys)  # type: ignore[literal-required]
        for limit in (views.app_wide, views.class_limit)
    }
    assert counted == {"app": (1, 0, 2), "class": (1, 2, 0)}


def test_reserve_then_settle_in_a_view() -> None:
    answer = Client().post("/complete", {"max_tokens": 400}, content_type="application/json")
    assert answer.json() == {"refunded": 300}
    assert fields(answer)["tokens"]["r"] == 600  # the reservation, before the refund
    assert views.tokens.limiter.peek("127.0.0.1", 900).allowed  # type: ignore[union-attr]
    too_big = Client().post("/complete", {"max_tokens": 1001}, content_type="application/json")
    assert too_big.status_code == 413
    assert_problem(too_big.json(), 413, "tokens", None)


def test_a_drf_apiview_with_the_throttle() -> None:
    client = Client()
    answers = [client.get("/api/search") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[0].json() == {"results": []}
    assert fields(answers[0]) == {"api": {"q": 2, "w": 4, "r": 1, "t": 2}}
    refused = answers[-1]
    assert refused["Retry-After"] == "2"  # wait(): one token at 0.5 a second
    assert_problem(refused.json(), 429, "api", 2)  # the middleware's body, not DRF's


def test_a_drf_throttle_without_the_middleware_is_drfs_429_with_retry_after() -> None:
    with override_settings(MIDDLEWARE=[]):
        client = Client()
        answers = [client.get("/api/search") for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[-1]["Retry-After"] == "2"
    assert "detail" in answers[-1].json()
    assert "RateLimit" not in answers[0]  # the fields need the middleware


def test_throttle_wait_is_the_retry_after() -> None:
    class One(LimitThrottle):
        limit = Limit(TokenBucketLimiter(1, 0.25, views.CLOCK), name="one")

    from django.test import RequestFactory

    request = RequestFactory().get("/")
    throttle = One()
    assert throttle.allow_request(request, None)
    assert throttle.wait() is None
    again = RequestFactory().get("/")
    assert not One().allow_request(again, None)
    refused = One()
    assert not refused.allow_request(RequestFactory().get("/"), None)
    assert refused.wait() == 4.0
    assert refused.get_ident(again) == "127.0.0.1"

    class Empty(LimitThrottle):
        pass

    with pytest.raises(Exception, match="needs a class attribute limit"):
        Empty()


def test_settings_choose_the_trusted_proxies_and_the_ipv6_prefix() -> None:
    from django.test import RequestFactory

    request = RequestFactory().get("/", REMOTE_ADDR="10.0.0.1", HTTP_X_FORWARDED_FOR="2001:db8::1")
    assert remote_address(request) == "10.0.0.1"  # no trusted proxies: the header is ignored
    with override_settings(BUCKETLIMIT_TRUSTED_PROXIES=["10.0.0.0/8"]):
        assert remote_address(request) == "2001:db8::/64"
        with override_settings(BUCKETLIMIT_IPV6_PREFIX=48):
            assert remote_address(request) == "2001:db8::/48"
    with override_settings(BUCKETLIMIT_TRUSTED_PROXIES="10.0.0.0/8"), pytest.raises(TypeError):
        remote_address(request)


def test_a_bad_limits_setting_is_a_configuration_error() -> None:
    from bucketlimit import ConfigurationError

    bad = override_settings(BUCKETLIMIT_LIMITS=["tests.web.django_views.CLOCK"])
    with bad, pytest.raises(ConfigurationError, match="not a Limit"):
        Client(raise_request_exception=True).get("/plain")
