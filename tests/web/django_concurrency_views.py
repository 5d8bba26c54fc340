"""The views and URLs of tests/web/test_concurrency_sync.py's Django tests
(ROOT_URLCONF): ``concurrency=`` on a plain view, a streaming one (sync and async),
one that raises, and a DRF view with a LimitThrottle."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, ClassVar

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView

from bucketlimit import ConcurrencyLimiter
from bucketlimit.django import Limit, LimitThrottle

INFLIGHT = ConcurrencyLimiter(1)
inflight = Limit(concurrency=INFLIGHT, name="inflight")
api_inflight = Limit(concurrency=INFLIGHT, name="api")
#: What each streamed body saw: the permits held at its chunks.
SEEN: list[int] = []
#: Set by a test to let the slow stream finish.
GATE = threading.Event()


@inflight
def plain(request: HttpRequest) -> HttpResponse:
    SEEN.append(INFLIGHT.in_flight("127.0.0.1"))
    return HttpResponse("plain")


@inflight
def stream(request: HttpRequest) -> StreamingHttpResponse:
    def body() -> Iterator[bytes]:
        SEEN.append(INFLIGHT.in_flight("127.0.0.1"))
        yield b"a"
        SEEN.append(INFLIGHT.in_flight("127.0.0.1"))
        yield b"b"

    return StreamingHttpResponse(body())


@inflight
async def async_stream(request: HttpRequest) -> StreamingHttpResponse:
    async def body() -> AsyncIterator[bytes]:
        SEEN.append(INFLIGHT.in_flight("127.0.0.1"))
        yield b"a"
        yield b"b"

    return StreamingHttpResponse(body())


@inflight
def fails(request: HttpRequest) -> HttpResponse:
    raise RuntimeError("the view failed")


def undecorated(request: HttpRequest) -> HttpResponse:
    return HttpResponse("undecorated")


class InflightThrottle(LimitThrottle):
    limit = api_inflight


class Api(APIView):
    throttle_classes: ClassVar = [InflightThrottle]

    def get(self, request: Any) -> Response:
        SEEN.append(INFLIGHT.in_flight("127.0.0.1"))
        return Response({"ok": True})


urlpatterns = [
    path("plain", plain),
    path("stream", stream),
    path("async-stream", async_stream),
    path("fails", fails),
    path("undecorated", undecorated),
    path("api", Api.as_view()),
]
