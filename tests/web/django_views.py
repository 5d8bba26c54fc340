"""The views and URLs of tests/web/test_django.py (ROOT_URLCONF)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.response import Response
from rest_framework.views import APIView

from bucketlimit import TokenBucketLimiter
from bucketlimit.django import Limit, LimitThrottle, reservation
from bucketlimit.testing import ManualClock

CLOCK = ManualClock()

sync_limit = Limit(TokenBucketLimiter(3, 1, CLOCK), name="sync")
async_limit = Limit(TokenBucketLimiter(3, 1, CLOCK), name="async")
burst = Limit(TokenBucketLimiter(5, 1, CLOCK), name="burst")
daily = Limit(TokenBucketLimiter(50, 50, CLOCK, per=86400), name="daily")
app_wide = Limit(
    TokenBucketLimiter(4, 1, CLOCK), name="app", exempt=lambda request: request.path == "/health"
)
tokens = Limit(
    TokenBucketLimiter(1000, 0, CLOCK),
    name="tokens",
    cost=lambda request: int(json.loads(request.body)["max_tokens"]),
)
class_limit = Limit(TokenBucketLimiter(1, 0, CLOCK), name="class")
api_limit = Limit(TokenBucketLimiter(2, 0.5, CLOCK), name="api")
ALL = [sync_limit, async_limit, burst, daily, app_wide, tokens, class_limit, api_limit]


@sync_limit
def sync_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("sync")


@async_limit
async def async_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async")


@burst
@daily
def stacked(request: HttpRequest) -> HttpResponse:
    return HttpResponse("stacked")


def plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("plain")


async def async_plain(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async plain")


@tokens
def complete(request: HttpRequest) -> JsonResponse:
    used = 100
    return JsonResponse({"refunded": reservation(request, "tokens").settle(used)})


@method_decorator(class_limit, name="dispatch")
class ClassBased(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("class")


class ApiThrottle(LimitThrottle):
    limit = api_limit


class Search(APIView):
    throttle_classes: ClassVar = [ApiThrottle]

    def get(self, request: Any) -> Response:
        return Response({"results": []})


urlpatterns = [
    path("sync", sync_view),
    path("async", async_view),
    path("stacked", stacked),
    path("plain", plain),
    path("async-plain", async_plain),
    path("health", plain),
    path("complete", complete),
    path("class", ClassBased.as_view()),
    path("api/search", Search.as_view()),
]
