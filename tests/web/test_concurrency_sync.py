"""``concurrency=`` in the synchronous adapters, Flask and Django (and DRF), in their
own test clients: a plain response releases its permit when the view returns, a
streamed one when the server closes it (Flask's ``call_on_close``, Django's
``close()``), a view that raises releases it too; ``max_wait`` queues threads in
arrival order. Also the header profiles of a concurrency limit, the test helpers
and bad input."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import django
import pytest
from django.conf import settings
from flask import Flask, Response
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st

if not settings.configured:
    settings.configure(SECRET_KEY="tests", ALLOWED_HOSTS=["*"], INSTALLED_APPS=[])
    django.setup()

from django.test import AsyncClient, Client, override_settings

from bucketlimit import ConcurrencyLimiter, TokenBucketLimiter
from bucketlimit import flask as bl_flask
from bucketlimit.django import ConfigurationError as DjangoConfigurationError
from bucketlimit.django import Limit as DjangoLimit
from bucketlimit.testing import ManualClock, limits_on_clock
from tests.web import django_concurrency_views as views
from tests.web import sf
from tests.web.problem import assert_problem
from tests.web.test_concurrency_asgi import AsyncConcurrency

PEER = "127.0.0.1"  # the Flask and Django test clients' peer
DEADLINE = 10.0  # seconds for a thread to reach a state it reaches at once


def wait_until(read: Callable[[], object], wanted: object, what: str) -> None:
    """Waits for another thread to bring ``read()`` to ``wanted``."""
    deadline = time.monotonic() + DEADLINE
    while read() != wanted:
        assert time.monotonic() < deadline, f"never: {what} (still {read()!r})"
        time.sleep(0.001)  # polling interval, not a timing assumption


def flask_app(*limits: bl_flask.Limit, app_wide: bl_flask.Limit | None = None) -> Flask:
    """/plain and /stream (two chunks), each behind ``limits``; /fail raises."""
    app = Flask(__name__)
    if app_wide is not None:
        bl_flask.RateLimit(app_wide, app)

    def limited(view: Callable[..., Any]) -> Callable[..., Any]:
        for one in reversed(limits):
            view = one(view)
        return view

    @app.get("/plain")
    @limited
    def plain() -> str:
        return "plain"

    @app.get("/stream")
    @limited
    def stream() -> Response:
        return Response(iter([b"a", b"b"]))

    @app.get("/fail")
    @limited
    def fail() -> str:
        raise RuntimeError("the view failed")

    return app


# -- Flask ------------------------------------------------------------------------------------


def test_flask_releases_a_plain_responses_permit_when_the_view_returns() -> None:
    inflight = ConcurrencyLimiter(1)
    client = flask_app(bl_flask.Limit(concurrency=inflight, name="inflight")).test_client()
    for _ in range(3):
        answer = client.get("/plain")
        assert answer.status_code == 200
        assert answer.headers["RateLimit-Policy"] == '"inflight";q=1;qu="concurrent-requests"'
        assert answer.headers["RateLimit"] == '"inflight";r=0'
        assert inflight.in_flight(PEER) == 0  # before the test client closed anything


def test_flask_holds_a_streamed_responses_permit_until_the_server_closes_it() -> None:
    inflight = ConcurrencyLimiter(1)
    client = flask_app(bl_flask.Limit(concurrency=inflight, name="inflight")).test_client()
    streaming = client.get("/stream")  # not buffered: the body is still to be sent
    assert streaming.status_code == 200
    assert next(iter(streaming.response)) == b"a"
    refused = client.get("/plain")
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.mimetype == "application/problem+json"
    assert_problem(refused.get_json(), 429, "inflight", 1)
    assert sf.ratelimit(refused.headers["RateLimit"])["inflight"].params == {"r": 0}
    assert inflight.in_flight(PEER) == 1
    streaming.close()  # what a WSGI server does after the last chunk, or when a write fails
    assert inflight.in_flight(PEER) == 0
    assert client.get("/plain").status_code == 200


@pytest.mark.parametrize("testing", [True, False])
@pytest.mark.parametrize("where", ["view", "app"])
def test_flask_releases_the_permit_of_a_view_that_raises(testing: bool, where: str) -> None:
    inflight = ConcurrencyLimiter(1)
    limit = bl_flask.Limit(concurrency=inflight, name="inflight")
    app = flask_app(limit) if where == "view" else flask_app(app_wide=limit)
    app.testing = testing  # True: the error propagates (PROPAGATE_EXCEPTIONS), no response
    client = app.test_client()
    if testing:
        with pytest.raises(RuntimeError, match="the view failed"):
            client.get("/fail")
    else:
        with client.get("/fail") as answer:  # werkzeug's error page is a streamed body,
            assert answer.status_code == 500  # released when the server closes it
    assert inflight.in_flight(PEER) == 0
    assert inflight.stats()["released"] == 1


def test_flask_a_concurrency_refusal_refunds_the_app_wide_rate_limit() -> None:
    rate = TokenBucketLimiter(10, 0)
    inflight = ConcurrencyLimiter(1)
    app = flask_app(
        bl_flask.Limit(concurrency=inflight, name="inflight"),
        app_wide=bl_flask.Limit(rate, name="requests"),
    )
    client = app.test_client()
    streaming = client.get("/stream")
    refused = client.get("/plain")
    assert refused.status_code == 429
    assert refused.get_json()["violated-policies"] == ["inflight"]
    assert rate.peek(PEER, 9).allowed  # 10 - the streaming request: the refused one refunded
    assert not rate.peek(PEER, 10).allowed
    streaming.close()


def test_flask_max_wait_queues_threads_in_arrival_order() -> None:
    inflight = ConcurrencyLimiter(1)
    app = flask_app(bl_flask.Limit(concurrency=inflight, name="inflight", max_wait=30))
    holder = app.test_client().get("/stream")
    assert inflight.in_flight(PEER) == 1
    granted: list[tuple[int, Any]] = []  # (thread, its streaming response), in order

    def wait_for_a_slot(n: int) -> None:
        answer = app.test_client().get("/stream")  # waits in the view's limit
        assert answer.status_code == 200
        granted.append((n, answer))

    def waiting() -> int:
        return inflight.stats()["waiting"]

    def served() -> int:
        return len(granted)

    threads = []
    for n in range(3):  # each queued before the next arrives
        threads.append(threading.Thread(target=wait_for_a_slot, args=(n,)))
        threads[-1].start()
        wait_until(waiting, n + 1, f"{n + 1} waiting")
    holder.close()  # its slot goes to the first waiter
    for n, thread in enumerate(threads):
        wait_until(served, n + 1, f"thread {n} granted")
        assert granted[n][0] == n
        assert inflight.in_flight(PEER) == 1
        granted[n][1].close()  # the next one's turn
        thread.join(DEADLINE)
    assert inflight.in_flight(PEER) == 0


def test_flask_a_wait_longer_than_max_wait_is_refused() -> None:
    clock = ManualClock()
    inflight = ConcurrencyLimiter(1, ttl=60, clock=clock)
    client = flask_app(bl_flask.Limit(concurrency=inflight, max_wait=2)).test_client()
    holder = client.get("/stream")
    refused = client.get("/plain")  # waits 2 s on the manual clock
    assert refused.status_code == 429
    assert clock.now == 2.0
    assert inflight.stats()["waiting"] == 0
    holder.close()


def test_flask_takes_no_asyncio_concurrency_limiter() -> None:
    with pytest.raises(TypeError, match="synchronous"):
        bl_flask.Limit(concurrency=AsyncConcurrency(ConcurrencyLimiter(1)))


def test_the_reservation_holds_the_permit_and_its_fencing_token() -> None:
    inflight = ConcurrencyLimiter(2)
    limit = bl_flask.Limit(concurrency=inflight, name="inflight")
    app = Flask(__name__)
    tokens: list[int] = []

    @app.get("/")
    @limit
    def index() -> str:
        held = bl_flask.reservation("inflight")
        tokens.append(held.permit.token)
        held.release()  # the expensive part is done: free the slot now
        assert inflight.in_flight(PEER) == 0
        return "ok"

    client = app.test_client()
    assert client.get("/").status_code == client.get("/").status_code == 200
    assert tokens[1] > tokens[0] > 0
    assert inflight.stats()["released"] == 2  # once each: the end frees nothing more


# -- header profiles --------------------------------------------------------------------------


def test_the_legacy_profile_shows_a_concurrency_limit_only_when_it_refuses() -> None:
    inflight = ConcurrencyLimiter(1)
    alone = flask_app(bl_flask.Limit(concurrency=inflight, name="inflight", headers="legacy"))
    client = alone.test_client()
    streaming = client.get("/stream")
    assert not [k for k, _ in streaming.headers.items() if k.startswith("X-RateLimit")]
    refused = client.get("/plain")
    assert refused.headers["X-RateLimit-Limit"] == "1"
    assert refused.headers["X-RateLimit-Remaining"] == "0"
    assert "X-RateLimit-Reset" not in refused.headers  # permits have no reset time
    assert refused.headers["Retry-After"] == "1"
    streaming.close()
    both = flask_app(
        bl_flask.Limit(TokenBucketLimiter(10, 1), concurrency=5, name="api", headers="legacy")
    )
    answer = both.test_client().get("/plain")
    assert answer.headers["X-RateLimit-Limit"] == "10"  # the rate's, not the permits'
    assert answer.headers["X-RateLimit-Remaining"] == "9"


def test_the_openai_profile_names_the_concurrency_limit() -> None:
    inflight = ConcurrencyLimiter(1)
    client = flask_app(
        bl_flask.Limit(concurrency=inflight, name="inflight", headers="openai")
    ).test_client()
    streaming = client.get("/stream")
    assert streaming.headers["x-ratelimit-limit-inflight"] == "1"
    assert streaming.headers["x-ratelimit-remaining-inflight"] == "0"
    assert "x-ratelimit-reset-inflight" not in streaming.headers
    refused = client.get("/plain")
    assert refused.status_code == 429
    assert refused.headers["retry-after-ms"] == "1000"
    error = refused.get_json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "inflight"
    assert "at most 1 at once" in error["message"]
    streaming.close()


# -- the test helpers -------------------------------------------------------------------------


def test_limits_on_clock_puts_a_twin_of_the_concurrency_limiter_on_the_clock() -> None:
    inflight = ConcurrencyLimiter(1, ttl=30)
    limit = bl_flask.Limit(concurrency=inflight, name="inflight")
    app = flask_app(limit)
    clock = ManualClock()
    with limits_on_clock(clock):
        assert limit.concurrency is not inflight
        client = app.test_client()
        leaked = client.get("/stream")  # never closed: its permit stays held
        assert client.get("/plain").status_code == 429
        clock.advance(30)  # the twin's permit expires on the clock
        assert client.get("/plain").status_code == 200
        del leaked
    assert limit.concurrency is inflight
    assert inflight.stats()["granted"] == 0  # the real one was never asked


# -- bad input --------------------------------------------------------------------------------


def test_bad_concurrency_arguments() -> None:
    with pytest.raises(ValueError, match="limit"):
        bl_flask.Limit(concurrency=0)
    with pytest.raises(ValueError, match="limit"):
        bl_flask.Limit(concurrency=2**32)
    for wrong in (True, "3", 1.5, object()):
        with pytest.raises(TypeError, match="concurrency"):
            bl_flask.Limit(concurrency=wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a limiter"):
        bl_flask.Limit()
    with pytest.raises(TypeError, match="give one"):
        bl_flask.Limit(ConcurrencyLimiter(2), concurrency=3)
    with pytest.raises(TypeError, match="storage="):
        bl_flask.Limit(concurrency=2, storage="memory://")
    limit = bl_flask.Limit(concurrency=2)
    before = limit.concurrency
    with pytest.raises(TypeError, match="concurrency"):
        limit.concurrency = "2"  # type: ignore[assignment]
    assert limit.concurrency is before
    assert limit.concurrency is not None
    assert limit.concurrency.limit == 2


def test_a_concurrency_limiter_given_as_the_limiter_is_concurrency_alone() -> None:
    inflight = ConcurrencyLimiter(1)
    limit = bl_flask.Limit(inflight, name="inflight")
    assert limit.concurrency is inflight
    assert limit.limiter is None
    assert limit.concurrency_name == "inflight"
    answer = flask_app(limit).test_client().get("/plain")
    assert answer.headers["RateLimit-Policy"] == '"inflight";q=1;qu="concurrent-requests"'


# -- Django -----------------------------------------------------------------------------------

DJANGO = {
    "DEBUG": False,
    "ROOT_URLCONF": "tests.web.django_concurrency_views",
    "MIDDLEWARE": ["bucketlimit.django.RateLimitMiddleware"],
    "BUCKETLIMIT_LIMITS": [],
    "REST_FRAMEWORK": {
        "DEFAULT_AUTHENTICATION_CLASSES": [],
        "DEFAULT_PERMISSION_CLASSES": [],
        "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
        "UNAUTHENTICATED_USER": None,
    },
}


@pytest.fixture
def django_app() -> Iterator[None]:
    views.SEEN.clear()
    with override_settings(**DJANGO):
        yield
    assert views.INFLIGHT.in_flight(PEER) == 0, "a test left a permit held"


@pytest.mark.usefixtures("django_app")
@pytest.mark.parametrize("middleware", [True, False])
def test_django_releases_a_plain_responses_permit_when_the_view_returns(middleware: bool) -> None:
    with override_settings(MIDDLEWARE=DJANGO["MIDDLEWARE"] if middleware else []):
        client = Client()
        for _ in range(2):
            answer = client.get("/plain")
            assert answer.status_code == 200
            assert answer["RateLimit-Policy"] == '"inflight";q=1;qu="concurrent-requests"'
    assert views.SEEN == [1, 1]


@pytest.mark.usefixtures("django_app")
def test_django_holds_a_streaming_responses_permit_until_it_is_closed() -> None:
    client = Client()
    streaming = client.get("/stream")
    chunks = iter(streaming.streaming_content)
    assert next(chunks) == b"a"
    refused = client.get("/plain")
    assert refused.status_code == 429
    assert refused["Retry-After"] == "1"
    assert_problem(refused.json(), 429, "inflight", 1)
    assert list(chunks) == [b"b"]  # the test client closes the response at its end
    assert views.SEEN == [1, 1]
    assert client.get("/plain").status_code == 200


@pytest.mark.usefixtures("django_app")
def test_django_a_streaming_response_closed_early_frees_its_permit() -> None:
    client = Client()
    streaming = client.get("/stream")
    assert views.INFLIGHT.in_flight(PEER) == 1
    streaming.close()  # the server gave up: the client went away
    assert views.INFLIGHT.in_flight(PEER) == 0


@pytest.mark.anyio
@pytest.mark.usefixtures("django_app")
async def test_django_an_async_streaming_view() -> None:
    client = AsyncClient()
    answer = await client.get("/async-stream")
    assert answer.status_code == 200
    assert [chunk async for chunk in answer.streaming_content] == [b"a", b"b"]
    assert views.SEEN == [1]
    assert views.INFLIGHT.in_flight(PEER) == 0


@pytest.mark.usefixtures("django_app")
def test_django_releases_the_permit_of_a_view_that_raises() -> None:
    with pytest.raises(RuntimeError, match="the view failed"):
        Client(raise_request_exception=True).get("/fails")
    assert Client(raise_request_exception=False).get("/fails").status_code == 500


@pytest.mark.usefixtures("django_app")
def test_django_app_wide_concurrency_through_the_middleware() -> None:
    with override_settings(BUCKETLIMIT_LIMITS=[views.inflight]):
        client = Client()
        streaming = client.get("/undecorated")  # a plain response: released at once
        assert streaming["RateLimit"] == '"inflight";r=0'
        assert client.get("/undecorated").status_code == 200


@pytest.mark.usefixtures("django_app")
def test_a_drf_throttle_with_concurrency_needs_the_middleware() -> None:
    answer = Client().get("/api")
    assert answer.status_code == 200
    assert answer["RateLimit"] == '"api";r=0'
    assert views.SEEN == [1]  # held while the view ran, released after
    no_middleware = override_settings(MIDDLEWARE=[])
    with no_middleware, pytest.raises(DjangoConfigurationError, match="MIDDLEWARE"):
        Client(raise_request_exception=True).get("/api")


@pytest.mark.usefixtures("django_app")
def test_a_drf_throttle_refuses_with_the_problem_body() -> None:
    held = views.INFLIGHT.try_acquire(PEER)  # another request of the key in flight
    refused = Client().get("/api")
    held.release()
    assert refused.status_code == 429
    assert refused["Retry-After"] == "1"
    assert_problem(refused.json(), 429, "api", 1)


def test_django_takes_no_asyncio_concurrency_limiter() -> None:
    with pytest.raises(TypeError, match="synchronous"):
        DjangoLimit(concurrency=AsyncConcurrency(ConcurrencyLimiter(1)))


class UnreachableStore:
    """A concurrency limiter whose store does not answer (``check()`` fails), as a
    Redis one with a wrong URL."""

    limit = 2
    ttl = 60.0

    def try_acquire(self, key: str) -> object:
        raise ConnectionError("no store")

    def acquire(self, key: str, *, timeout: float | None = None) -> object:
        raise ConnectionError("no store")

    def check(self) -> None:
        raise ConnectionError("Connection refused")


def test_the_start_up_check_asks_a_concurrency_limiters_store() -> None:
    limit = bl_flask.Limit(concurrency=UnreachableStore(), name="inflight")
    with pytest.raises(bl_flask.StoreCheckError, match="inflight"):
        bl_flask.RateLimit(limit, Flask(__name__))
    bl_flask.RateLimit(limit, Flask(__name__), check_store=False)  # the opt-out


@examples(max_examples=40, deadline=None)
@given(
    limit=st.integers(1, 4),
    steps=st.lists(st.sampled_from(["open", "close", "plain"]), min_size=1, max_size=40),
)
def test_every_answer_against_a_count_of_the_open_responses(limit: int, steps: list[str]) -> None:
    """Random requests (streamed ones left open, closed later, plain ones): each is
    admitted exactly when fewer than ``limit`` responses are open, its fields parse
    as draft-11's and say how many permits are free, and a refusal says 429."""
    inflight = ConcurrencyLimiter(limit)
    client = flask_app(bl_flask.Limit(concurrency=inflight, name="inflight")).test_client()
    open_responses: list[Any] = []
    for step in steps:
        if step == "close":
            if open_responses:
                open_responses.pop(0).close()
            continue
        answer = client.get("/stream" if step == "open" else "/plain")
        policy = sf.ratelimit_policy(answer.headers["RateLimit-Policy"])["inflight"]
        assert policy.params == {"q": limit, "qu": "concurrent-requests"}
        free = sf.ratelimit(answer.headers["RateLimit"])["inflight"].params
        if len(open_responses) < limit:
            assert answer.status_code == 200
            assert free == {"r": limit - len(open_responses) - 1}
            if step == "open":
                open_responses.append(answer)
        else:
            assert answer.status_code == 429
            assert answer.headers["Retry-After"] == "1"
            assert free == {"r": 0}
            assert_problem(answer.get_json(), 429, "inflight", 1)
        assert inflight.in_flight(PEER) == len(open_responses)
    for answer in open_responses:
        answer.close()
    assert inflight.in_flight(PEER) == 0
