"""Django with the peers' conventions, for tests/web/test_conventions_servers.py
(gunicorn): BUCKETLIMIT_* settings, limit strings, header profiles, on_refusal,
exempt. ``application`` is the WSGI app."""

from __future__ import annotations

import django
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

PROFILES = ["draft-11", "legacy", "openai"]

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="tests-only",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=["bucketlimit.django.RateLimitMiddleware"],
        INSTALLED_APPS=[],
        BUCKETLIMIT_STORAGE="memory://",
        BUCKETLIMIT_HEADERS=PROFILES,
        BUCKETLIMIT_DEFAULT_LIMITS="1000/minute",  # views without a limit of their own
    )
    django.setup()

from django.core.wsgi import get_wsgi_application  # noqa: E402

from bucketlimit.django import exempt, limit  # noqa: E402
from bucketlimit.web import Refusal  # noqa: E402


def custom_refusal(request: HttpRequest, refusal: Refusal) -> JsonResponse:
    return JsonResponse({"custom": True, "path": request.path}, status=refusal.status)


@exempt
def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@limit("2/minute", name="requests")
def models(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"object": "list", "data": []})


@limit("1/minute", name="custom", on_refusal=custom_refusal)
def custom(request: HttpRequest) -> HttpResponse:
    return HttpResponse("once")


urlpatterns = [path("health", health), path("v1/models", models), path("custom", custom)]
application = get_wsgi_application()
