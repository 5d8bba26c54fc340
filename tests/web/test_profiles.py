"""Header profiles (draft-11, legacy, openai; per limit or app-wide) in each
framework's own test client, every structured field read with http-sf
(tests/web/sf.py), and refusals reshaped: Flask's errorhandler(429), on_refusal in
every adapter."""

from __future__ import annotations

import asyncio
import math
import re
import time
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from flask import Flask, jsonify
from litestar import Litestar, Response, get
from litestar.testing import TestClient
from starlette.responses import JSONResponse

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit import litestar as bl_litestar
from bucketlimit.testing import ManualClock
from bucketlimit.web import Refusal, go_duration
from tests.web import sf
from tests.web.problem import assert_problem

PEER = "192.0.2.8"
GO_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$|^(\d+)ms$")


def go_seconds(text: str) -> float:
    """A Go duration as OpenAI writes it (``6m0s``, ``1.5s``, ``12ms``), in seconds."""
    match = GO_DURATION.match(text)
    assert text, "an empty Go duration"
    assert match is not None, f"not a Go duration: {text!r}"
    hours, minutes, seconds, ms = match.groups()
    if ms is not None:
        return int(ms) / 1000
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds or 0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.012, "12ms"), (0.0004, "1ms"), (1, "1s"), (1.5, "1.5s"), (59.999, "59.999s"),
     (60, "1m0s"), (360, "6m0s"), (3723, "1h2m3s"), (3600, "1h0m0s"), (90.25, "1m30.25s")],
)  # fmt: skip
def test_openai_durations(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text
    assert go_seconds(text) >= seconds  # rounded up to the millisecond, never short


def flask_app(*limits: bl_flask.Limit, **extension: Any) -> Flask:
    app = Flask(__name__)
    if extension:
        bl_flask.RateLimit(app=app, **extension)

    @app.get("/")
    def index() -> str:
        return "hi"

    view = index
    for limit in reversed(limits):
        view = limit(view)
    app.view_functions["index"] = view
    return app


def test_legacy_and_draft11_together_in_flask() -> None:
    clock = ManualClock()
    requests = bl_flask.Limit(
        TokenBucketLimiter(10, 1, clock), name="requests", headers=["draft-11", "legacy"]
    )
    tight = bl_flask.Limit(TokenBucketLimiter(2, 0.5, clock), name="tight", headers="legacy")
    app = flask_app(requests, tight)
    client = app.test_client()
    before = time.time()
    answer = client.get("/", environ_base={"REMOTE_ADDR": PEER})
    assert set(sf.ratelimit(answer.headers["RateLimit"])) == {"requests"}  # draft-11: one
    assert sf.integer(answer.headers["X-RateLimit-Limit"]) == 2  # the tighter of the two
    assert sf.integer(answer.headers["X-RateLimit-Remaining"]) == 1
    reset = sf.integer(answer.headers["X-RateLimit-Reset"])  # UTC epoch seconds
    assert math.floor(before + 2) <= reset <= math.ceil(time.time() + 2)
    client.get("/", environ_base={"REMOTE_ADDR": PEER})
    refused = client.get("/", environ_base={"REMOTE_ADDR": PEER})
    assert refused.status_code == 429
    assert sf.integer(refused.headers["X-RateLimit-Remaining"]) == 0
    assert refused.headers["Retry-After"] == "2"


def test_no_fields_at_all_when_the_app_says_so() -> None:
    app = Flask(__name__)
    app.config["RATELIMIT_HEADERS_ENABLED"] = False
    bl_flask.RateLimit("1/minute", app)
    app.add_url_rule("/", "index", lambda: "hi")
    client = app.test_client()
    answer = client.get("/")
    assert not [h for h in answer.headers if "ratelimit" in h[0].lower()]
    refused = client.get("/")
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "60"  # part of the refusal, whatever the fields


def openai_limits(clock: ManualClock) -> tuple[bl_fastapi.Limit, bl_fastapi.Limit]:
    requests = bl_fastapi.Limit(
        TokenBucketLimiter(2, 2, clock, per=60), name="requests", headers="openai"
    )
    tokens = bl_fastapi.Limit(
        TokenBucketLimiter(1000, 1000, clock, per=60),
        name="tokens",
        cost=lambda request: int(request.headers.get("x-cost", "1")),
        headers="openai",
    )
    return requests, tokens


async def fastapi_calls(app: FastAPI, *costs: int) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app, client=(PEER, 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return [await client.post("/v1/chat", headers={"x-cost": str(c)}) for c in costs]


def test_openai_headers_and_error_body_in_fastapi() -> None:
    clock = ManualClock()
    requests, tokens = openai_limits(clock)
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=requests)

    @app.post("/v1/chat", dependencies=[Depends(tokens)])
    async def chat() -> dict[str, str]:
        return {"ok": "yes"}

    first, second, third = asyncio.run(fastapi_calls(app, 100, 50, 1))
    assert first.status_code == second.status_code == 200
    assert sf.integer(first.headers["x-ratelimit-limit-requests"]) == 2
    assert sf.integer(first.headers["x-ratelimit-remaining-requests"]) == 1
    assert sf.integer(first.headers["x-ratelimit-limit-tokens"]) == 1000
    assert sf.integer(first.headers["x-ratelimit-remaining-tokens"]) == 900
    assert first.headers["x-ratelimit-reset-requests"] == "30s"  # one of 2 a minute to refill
    assert first.headers["x-ratelimit-reset-tokens"] == "6s"  # 100 of 1000 a minute
    assert go_seconds(second.headers["x-ratelimit-reset-requests"]) == 60
    assert "RateLimit" not in first.headers  # openai only, as asked
    assert third.status_code == 429
    assert third.headers["retry-after-ms"] == "30000"
    assert third.headers["Retry-After"] == "30"
    assert third.headers["content-type"] == "application/json"
    error = third.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "requests"
    assert error["param"] is None
    assert "30s" in error["message"]


def test_an_openai_name_must_be_a_header_token() -> None:
    with pytest.raises(ValueError, match="must be a token"):
        bl_fastapi.Limit(TokenBucketLimiter(1, 1), name="per client", headers="openai")
    with pytest.raises(ValueError, match="unknown profile"):
        bl_fastapi.Limit(TokenBucketLimiter(1, 1), headers="draft-10")
    with pytest.raises(TypeError, match="headers must be"):
        bl_fastapi.Limit(TokenBucketLimiter(1, 1), headers=7)  # type: ignore[arg-type]


def test_an_app_wide_profile_in_the_middleware_and_per_limit_wins() -> None:
    clock = ManualClock()
    app = FastAPI()
    route = bl_fastapi.Limit(TokenBucketLimiter(5, 1, clock), name="route", headers="draft-11")
    app.add_middleware(
        bl_fastapi.RateLimitMiddleware,
        limit=bl_fastapi.Limit(TokenBucketLimiter(3, 1, clock), name="app"),
        headers="legacy",
    )

    @app.post("/v1/chat", dependencies=[Depends(route)])
    async def chat() -> str:
        return "ok"

    (answer,) = asyncio.run(fastapi_calls(app, 1))
    assert set(sf.ratelimit(answer.headers["RateLimit"])) == {"route"}
    assert sf.integer(answer.headers["X-RateLimit-Limit"]) == 3  # the app's limit, legacy
    assert sf.integer(answer.headers["X-RateLimit-Remaining"]) == 2


# -- refusals reshaped ---------------------------------------------------------------------


def test_flask_errorhandler_429_answers_a_refusal() -> None:
    app = Flask(__name__)
    limiter = TokenBucketLimiter(1, 0.5, ManualClock())
    bl_flask.RateLimit(bl_flask.Limit(limiter, name="api"), app)
    app.add_url_rule("/", "index", lambda: "hi")
    seen: list[bl_flask.RateLimitExceeded] = []

    @app.errorhandler(429)
    def too_many(error: bl_flask.RateLimitExceeded) -> Any:
        seen.append(error)
        return jsonify(message="slow down", retry=error.decision.retry_after), 429

    client = app.test_client()
    assert client.get("/").status_code == 200
    refused = client.get("/")
    assert refused.status_code == 429
    assert refused.get_json() == {"message": "slow down", "retry": 2.0}
    assert refused.headers["Retry-After"] == "2"  # added where the handler set none
    assert sf.ratelimit(refused.headers["RateLimit"])["api"].params["r"] == 0
    assert isinstance(seen[0], bl_flask.RateLimitExceeded)
    assert not seen[0].decision.allowed


def test_flask_errorhandler_by_class_and_the_default_body() -> None:
    app = Flask(__name__)
    limit = bl_flask.Limit(TokenBucketLimiter(1, 0), name="quota")

    @app.get("/")
    @limit
    def index() -> str:
        return "hi"

    client = app.test_client()
    client.get("/")
    spent = client.get("/")  # unhandled: the problem document, 403 for a spent quota
    assert spent.status_code == 403
    assert spent.mimetype == "application/problem+json"
    assert_problem(spent.get_json(), 403, "quota", None)

    handled = Flask(__name__)
    handled.add_url_rule("/", "index", index)

    @handled.errorhandler(bl_flask.RateLimitExceeded)
    def refused(error: bl_flask.RateLimitExceeded) -> Any:
        return {"status": error.code, "remaining": error.decision.remaining}, error.code

    again = handled.test_client().get("/")
    assert again.status_code == 403
    assert again.get_json() == {"status": 403, "remaining": 0}


def test_on_refusal_in_flask_per_limit_and_app_wide() -> None:
    def app_wide(request: Any, refusal: Refusal) -> Any:
        return {"app": refusal.status}, 429

    def own(request: Any, refusal: Refusal) -> Any:
        return {"own": request.path, "retry": refusal.headers["Retry-After"]}, 429

    app = Flask(__name__)
    bl_flask.RateLimit(app=app, on_refusal=app_wide)
    clock = ManualClock()
    limited = bl_flask.Limit(TokenBucketLimiter(1, 1, clock), name="a")
    mine = bl_flask.Limit(TokenBucketLimiter(1, 1, clock), name="b", on_refusal=own)
    app.add_url_rule("/a", "a", limited(lambda: "a"))
    app.add_url_rule("/b", "b", mine(lambda: "b"))
    client = app.test_client()
    client.get("/a"), client.get("/b")
    assert client.get("/a").get_json() == {"app": 429}
    answer = client.get("/b")
    assert answer.get_json() == {"own": "/b", "retry": "1"}
    assert answer.headers["Retry-After"] == "1"


def test_on_refusal_in_fastapi_middleware_and_dependency() -> None:
    async def middleware_hook(request: Any, refusal: Refusal) -> JSONResponse:
        return JSONResponse({"by": "middleware", "status": refusal.status}, status_code=429)

    def dependency_hook(request: Any, refusal: Refusal) -> JSONResponse:
        return JSONResponse({"by": "dependency"}, status_code=429)

    clock = ManualClock()
    app = FastAPI()
    route = bl_fastapi.Limit(
        TokenBucketLimiter(1, 1, clock), name="route", on_refusal=dependency_hook
    )
    app.add_middleware(
        bl_fastapi.RateLimitMiddleware,
        limit=bl_fastapi.Limit(TokenBucketLimiter(3, 1, clock), name="app"),
        on_refusal=middleware_hook,
    )

    @app.post("/v1/chat", dependencies=[Depends(route)])
    async def chat() -> str:
        return "ok"

    @app.post("/other")
    async def other() -> str:
        return "ok"

    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=(PEER, 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            paths = ["/v1/chat", "/v1/chat", "/other", "/other", "/other"]
            return [await client.post(path) for path in paths]

    answers = asyncio.run(calls())
    assert [a.status_code for a in answers] == [200, 429, 200, 200, 429]
    assert answers[1].json() == {"by": "dependency"}
    assert answers[1].headers["Retry-After"] == "1"
    assert sf.ratelimit(answers[1].headers["RateLimit"])["route"].params["r"] == 0
    assert answers[4].json() == {"by": "middleware", "status": 429}  # the app's limit
    assert answers[4].headers["Retry-After"] == "1"
    assert sf.ratelimit(answers[4].headers["RateLimit"])["app"].params["r"] == 0


def test_on_refusal_in_litestar_returns_a_litestar_response() -> None:
    def hook(request: Any, refusal: Refusal) -> Response[dict[str, str]]:
        return Response({"wait": refusal.headers["Retry-After"]}, status_code=429)

    limiter = TokenBucketLimiter(1, 0.25, ManualClock())
    limit = bl_litestar.Limit(limiter, name="search", on_refusal=hook)

    @get("/search", middleware=[limit.middleware])
    async def search() -> str:
        return "found"

    with TestClient(Litestar([search])) as client:
        assert client.get("/search").status_code == 200
        refused = client.get("/search")
    assert refused.status_code == 429
    assert refused.json() == {"wait": "4"}
    assert refused.headers["Retry-After"] == "4"
    assert sf.ratelimit(refused.headers["RateLimit"])["search"].params["r"] == 0


def test_on_refusal_must_be_callable() -> None:
    with pytest.raises(TypeError, match="on_refusal must be"):
        bl_flask.Limit(TokenBucketLimiter(1, 1), on_refusal="json")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_refusal must be"):
        bl_fastapi.RateLimitMiddleware(
            FastAPI(),
            limit="1/second",
            on_refusal=3,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("limit", "text"),
    [("5/minute", "5 per 1 minute"), ("100/2 hours", "100 per 2 hours"),
     ("1000/day", "1000 per 1 day"), ("2/10 seconds", "2 per 10 seconds")],
)  # fmt: skip
def test_a_refusal_reads_as_its_limit(limit: str, text: str) -> None:
    """``str(refusal)`` and Flask's ``description`` say the limit as flask-limiter does."""
    seen: list[str] = []

    def hook(request: Any, refusal: Refusal) -> None:
        seen.append(str(refusal))

    app = Flask(__name__)
    app.add_url_rule("/", "index", bl_flask.limit(limit, on_refusal=hook)(lambda: "hi"))
    client = app.test_client()
    statuses = [client.get("/").status_code for _ in range(int(limit.split("/")[0]) + 1)]
    assert statuses[-1] == 429
    assert seen == [text], "the refusal, shown to a user, names its limit"
    errors: list[str] = []

    def too_many(error: bl_flask.RateLimitExceeded) -> tuple[str, int]:
        errors.append(error.description or "")
        return "slow down", 429

    other = Flask(__name__)
    other.register_error_handler(429, too_many)
    other.add_url_rule("/", "index", bl_flask.limit(limit)(lambda: "hi"))
    client = other.test_client()
    for _ in range(int(limit.split("/")[0]) + 1):
        client.get("/")
    assert errors == [text], "RateLimitExceeded.description is the limit, as flask-limiter's"


def test_a_concurrency_and_a_quota_read_as_such() -> None:
    from bucketlimit.web import Applied, describe_limit

    permits = Applied.concurrent(Decision(False, 1.0, 0, math.inf, 3), "inflight")
    assert describe_limit(permits) == "3 at once"
    quota = Applied.of(TokenBucketLimiter(100, 0), Decision(False, math.inf, 0, math.inf, 100))
    assert describe_limit(quota) == "100 in all"
