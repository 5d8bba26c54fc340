"""A small Django service limited by bucketlimit: one file, no project scaffold.

Run it from the repository root:

    python examples/django_app.py runserver                    # in-process buckets
    REDIS_URL=redis://127.0.0.1:6379/0 \\
        gunicorn --chdir examples django_app:application --workers 4   # shared in Redis

    curl -i localhost:8000/hello
    curl -i localhost:8000/v1/complete -H 'content-type: application/json' \\
        -d '{"prompt": "hello there", "max_tokens": 50}'
    curl -i localhost:8000/api/search                          # Django REST framework

Without ``REDIS_URL`` every worker process has its own buckets, so N workers admit
up to N times the limit; with it they share one bucket per client.

Environment:
  BUCKETLIMIT_CAPACITY   requests a client may burst (default 10)
  BUCKETLIMIT_RATE       requests per second it gets back (default 1; 0 = a fixed quota)
  BUCKETLIMIT_TOKENS     LLM tokens per client per minute (default 10000)
  REDIS_URL              share the buckets through Redis (redis-py URL)
  REDIS_TIMEOUT          seconds to wait for Redis (default 0.25)
  TRUSTED_PROXIES        comma-separated proxy networks whose X-Forwarded-For is believed
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, ClassVar

import django
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.urls import path

from bucketlimit import TokenBucketLimiter
from bucketlimit.django import Limit, LimitThrottle, reservation

CAPACITY = int(os.environ.get("BUCKETLIMIT_CAPACITY", "10"))
RATE = float(os.environ.get("BUCKETLIMIT_RATE", "1"))
TOKENS_PER_MINUTE = int(os.environ.get("BUCKETLIMIT_TOKENS", "10000"))
REDIS_URL = os.environ.get("REDIS_URL")
TRUSTED = [n.strip() for n in os.environ.get("TRUSTED_PROXIES", "").split(",") if n.strip()]

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=["bucketlimit.django.RateLimitMiddleware"],
        INSTALLED_APPS=[],
        BUCKETLIMIT_LIMITS=[f"{__name__}.per_client"],  # every request (the middleware)
        BUCKETLIMIT_TRUSTED_PROXIES=TRUSTED,  # the default key behind these proxies
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "DEFAULT_PERMISSION_CLASSES": [],
            "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
            "UNAUTHENTICATED_USER": None,
        },
    )
    django.setup()


def make_limiter(capacity: int, rate: float, *, per: float, prefix: str) -> Any:
    """In-process by default; the sync Redis limiter when REDIS_URL is set (WSGI)."""
    if not REDIS_URL:
        return TokenBucketLimiter(capacity, rate, per=per)
    from bucketlimit.redis import RedisTokenBucketLimiter

    timeout = float(os.environ.get("REDIS_TIMEOUT", "0.25"))
    return RedisTokenBucketLimiter.from_url(
        REDIS_URL, capacity, rate, per=per, prefix=prefix, timeout=timeout
    )


# Every request but the health check, keyed by the client's address.
per_client = Limit(
    make_limiter(CAPACITY, RATE, per=1, prefix="example:requests:"),
    name="requests",
    exempt=lambda request: request.path == "/health",
)


def requested_tokens(request: HttpRequest) -> int:
    """The cost of a completion: the most tokens it may generate (read from the body)."""
    try:
        return max(1, int(json.loads(request.body)["max_tokens"]))
    except (ValueError, KeyError, TypeError):
        return 1


# LLM tokens a minute, reserved up front, unused ones given back.
tokens = Limit(
    make_limiter(TOKENS_PER_MINUTE, TOKENS_PER_MINUTE, per=60, prefix="example:tokens:"),
    cost=requested_tokens,
    name="tokens",
)


def health(request: HttpRequest) -> JsonResponse:
    """Not limited (exempt). The pid tells which worker answered."""
    return JsonResponse({"status": "ok", "pid": os.getpid()})


def hello(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"hello": "world"})


@tokens
def complete(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body)
    words = str(body.get("prompt", "")).split()[: int(body["max_tokens"])]  # the model
    refunded = reservation(request, "tokens").settle(len(words))
    return JsonResponse({"text": " ".join(words), "tokens": len(words), "refunded": refunded})


class SearchThrottle(LimitThrottle):
    limit = Limit(make_limiter(5, 1, per=1, prefix="example:search:"), name="search")


def search_view() -> Any:
    from rest_framework.response import Response
    from rest_framework.views import APIView

    class Search(APIView):
        throttle_classes: ClassVar = [SearchThrottle]

        def get(self, request: Any) -> Response:
            return Response({"results": []})

    return Search.as_view()


urlpatterns = [
    path("health", health),
    path("hello", hello),
    path("v1/complete", complete),
    path("api/search", search_view()),
]

from django.core.wsgi import get_wsgi_application  # noqa: E402 - after the settings

application = get_wsgi_application()

if __name__ == "__main__":
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
