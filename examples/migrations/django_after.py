"""``django_before.py`` moved to bucketlimit by docs/migrating.md, "From
django-ratelimit" and "From DRF throttles": the same routes and limits.
``application`` is the WSGI app.

    gunicorn --chdir examples/migrations django_after:application --workers 4
    REDIS_URL=redis://127.0.0.1:6379/0 gunicorn --chdir examples/migrations \\
        django_after:application --workers 4

With REDIS_URL the limits hold across the workers (one atomic script per decision,
where DRF's throttle reads, then writes, a timestamp list), each view's store is
asked before its first decision, and a refusal is a 429 with Retry-After.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import django
from django.conf import settings

STORAGE = os.environ.get("REDIS_URL") or "memory://"

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=["bucketlimit.django.RateLimitMiddleware"],
        INSTALLED_APPS=[],
        BUCKETLIMIT_STORAGE=STORAGE,
        BUCKETLIMIT_ON_REFUSAL=f"{__name__}.log_refusal",
        REST_FRAMEWORK={"DEFAULT_AUTHENTICATION_CLASSES": [], "UNAUTHENTICATED_USER": None},
    )
    django.setup()

from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.http import HttpRequest, HttpResponse, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from rest_framework.response import Response  # noqa: E402
from rest_framework.views import APIView  # noqa: E402

from bucketlimit.django import Limit, LimitThrottle, exempt, limit  # noqa: E402
from bucketlimit.web import Refusal  # noqa: E402

log = logging.getLogger("breaches")


def log_refusal(request: HttpRequest, refusal: Refusal) -> None:
    """Logs the refusal; returning None keeps the default 429."""
    log.warning("breach: %s", refusal)


@exempt
def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok", "pid": os.getpid()})


@limit("10/minute")  # was @ratelimit(key="ip", rate="10/m", block=True)
def login(request: HttpRequest) -> HttpResponse:
    return HttpResponse("welcome")


@limit("10/minute")  # its own 10, not /login's
def signup(request: HttpRequest) -> HttpResponse:
    return HttpResponse("signed up")


class AnonThrottle(LimitThrottle):  # was AnonRateThrottle with {"anon": "50/minute"}
    limit = Limit("50/minute", name="anon")


class Items(APIView):
    throttle_classes = (AnonThrottle,)

    def get(self, request: Any) -> Response:
        return Response({"items": []})


urlpatterns = [
    path("health", health),
    path("login", login),
    path("signup", signup),
    path("items", Items.as_view()),
]
application = get_wsgi_application()
