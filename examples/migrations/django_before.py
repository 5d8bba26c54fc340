"""A Django app limited by DRF's throttles and django-ratelimit: the "before" of
docs/migrating.md, "From django-ratelimit" and "From DRF throttles"
(``django_after.py`` is the same app on bucketlimit). ``application`` is the WSGI app.

    gunicorn --chdir examples/migrations django_before:application --workers 4
    REDIS_URL=redis://127.0.0.1:6379/0 gunicorn --chdir examples/migrations \\
        django_before:application --workers 4
"""

from __future__ import annotations

import os
from typing import Any

import django
from django.conf import settings

REDIS_URL = os.environ.get("REDIS_URL")
CACHE = (
    {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}
    if REDIS_URL
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
)

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=[],
        INSTALLED_APPS=[],
        CACHES={"default": CACHE},
        REST_FRAMEWORK={
            "DEFAULT_AUTHENTICATION_CLASSES": [],
            "UNAUTHENTICATED_USER": None,
            "DEFAULT_THROTTLE_RATES": {"anon": "50/minute"},
        },
    )
    django.setup()

from django.core.wsgi import get_wsgi_application  # noqa: E402
from django.http import HttpRequest, HttpResponse, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django_ratelimit.decorators import ratelimit  # noqa: E402
from rest_framework.response import Response  # noqa: E402
from rest_framework.throttling import AnonRateThrottle  # noqa: E402
from rest_framework.views import APIView  # noqa: E402


def health(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok", "pid": os.getpid()})


@ratelimit(key="ip", rate="10/m", block=True)
def login(request: HttpRequest) -> HttpResponse:
    return HttpResponse("welcome")


@ratelimit(key="ip", rate="10/m", block=True)
def signup(request: HttpRequest) -> HttpResponse:
    return HttpResponse("signed up")


class Items(APIView):
    throttle_classes = (AnonRateThrottle,)

    def get(self, request: Any) -> Response:
        return Response({"items": []})


urlpatterns = [
    path("health", health),
    path("login", login),
    path("signup", signup),
    path("items", Items.as_view()),
]
application = get_wsgi_application()
