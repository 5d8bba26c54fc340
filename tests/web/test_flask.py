"""bucketlimit.flask on real Flask apps, through Flask's test client."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, Response, abort, request, stream_with_context
from werkzeug.test import TestResponse

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit.flask import (
    ConfigurationError,
    KeyFunctionError,
    Limit,
    RateLimit,
    client_address,
    limit,
    reservation,
)
from bucketlimit.testing import ManualClock
from tests.web.problem import assert_problem

PEER = "198.51.100.7"


def tokens(limiter: TokenBucketLimiter, key: str) -> int:
    """Whole tokens in the bucket (peek answers for a cost of 1, spent or not)."""
    decision = limiter.peek(key)
    return decision.remaining + decision.allowed


def make_app(*limits: Limit) -> Flask:
    """An app whose /hello view carries ``limits`` (outermost first)."""
    app = Flask(__name__)
    app.testing = True

    def hello() -> dict[str, str]:
        return {"hello": "world"}

    view: Any = hello
    for one in reversed(limits):
        view = one(view)
    app.add_url_rule("/hello", "hello", view)
    return app


def get(app: Flask, path: str = "/hello", peer: str = PEER, **kwargs: Any) -> TestResponse:
    return app.test_client().get(path, environ_base={"REMOTE_ADDR": peer}, **kwargs)


def test_429_after_the_capacity(manual_clock: ManualClock) -> None:
    app = make_app(Limit(TokenBucketLimiter(3, 1, clock=manual_clock)))
    assert [get(app).status_code for _ in range(4)] == [200, 200, 200, 429]
    manual_clock.advance(1)
    assert get(app).status_code == 200


def test_exact_fields_for_a_known_state(manual_clock: ManualClock) -> None:
    # 10 tokens, 2 a second: w = 5 s to refill an empty bucket.
    limiter = TokenBucketLimiter(10, 2, clock=manual_clock)
    app = make_app(Limit(limiter, name="per-client"))
    first = get(app)
    assert first.status_code == 200
    assert first.headers["RateLimit-Policy"] == '"per-client";q=10;w=5'
    assert first.headers["RateLimit"] == '"per-client";r=9;t=1'  # a 10th token in 0.5 s
    assert "Retry-After" not in first.headers
    for _ in range(8):
        get(app)
    last = get(app)  # the 10th: nothing left, the next token in 0.5 s
    assert last.headers["RateLimit"] == '"per-client";r=0;t=1'
    manual_clock.advance(0.2)  # 0.4 tokens back: still refused, 0.3 s to wait
    refused = get(app)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert refused.headers["RateLimit-Policy"] == '"per-client";q=10;w=5'
    assert refused.headers["RateLimit"] == '"per-client";r=0;t=1'
    assert_problem(refused.get_json(), 429, "per-client", 1)
    assert refused.mimetype == "application/problem+json"


@pytest.mark.parametrize("elapsed", [0.0, 0.1, 2.0, 3.3, 3.333333, 4.9])
def test_retry_after_is_the_ceiling_of_the_limiters_wait(
    manual_clock: ManualClock, elapsed: float
) -> None:
    limiter = TokenBucketLimiter(1, 0.2, clock=manual_clock)  # one token every 5 s
    app = make_app(Limit(limiter))
    assert get(app).status_code == 200
    manual_clock.advance(elapsed)
    expected = limiter.peek(PEER)  # the state the next request will see
    refused = get(app)
    assert refused.status_code == 429
    seconds = int(refused.headers["Retry-After"])
    assert seconds == max(1, math.ceil(expected.retry_after))
    assert seconds >= 1
    assert refused.get_json()["retry_after"] == seconds
    assert refused.headers["RateLimit"].endswith(f";t={seconds}")


def test_a_quota_that_never_refills_refuses_without_retry_after() -> None:
    app = make_app(Limit(TokenBucketLimiter(1, 0), name="trial"))
    ok = get(app)
    assert ok.headers["RateLimit-Policy"] == '"trial";q=1'
    assert ok.headers["RateLimit"] == '"trial";r=0'
    refused = get(app)
    assert refused.status_code == 403  # spent for good: a client must not retry
    assert "Retry-After" not in refused.headers
    assert_problem(refused.get_json(), 403, "trial", None)
    assert refused.headers["RateLimit"] == '"trial";r=0'


def test_the_default_key_is_the_peer_and_a_forged_header_cannot_change_it() -> None:
    limiter = TokenBucketLimiter(2, 0)
    app = make_app(Limit(limiter))
    for forged in ("1.1.1.1", "2.2.2.2", "3.3.3.3, 4.4.4.4"):
        get(app, headers={"X-Forwarded-For": forged})
    assert tokens(limiter, PEER) == 0  # one bucket, spent by the first two
    for forged in ("1.1.1.1", "2.2.2.2", "3.3.3.3", "4.4.4.4"):
        assert tokens(limiter, forged) == 2
    assert get(app, peer="198.51.100.8").status_code == 200  # another peer, another bucket


def test_behind_a_trusted_proxy_the_right_most_untrusted_hop_is_the_key() -> None:
    limiter = TokenBucketLimiter(5, 0)
    key = client_address(trusted_proxies=["10.0.0.0/8"])
    app = make_app(Limit(limiter, key=key))
    # The client forged 6.6.6.6; the edge proxy appended 1.2.3.4, the inner one 10.0.0.2.
    forwarded = {"X-Forwarded-For": "6.6.6.6, 1.2.3.4, 10.0.0.2"}
    assert get(app, peer="10.0.0.1", headers=forwarded).status_code == 200
    assert tokens(limiter, "1.2.3.4") == 4
    assert tokens(limiter, "6.6.6.6") == 5
    assert tokens(limiter, "10.0.0.1") == 5
    # A peer that is not a trusted proxy gets its own address, whatever it claims.
    get(app, peer="203.0.113.5", headers={"X-Forwarded-For": "1.2.3.4"})
    assert tokens(limiter, "203.0.113.5") == 4
    assert tokens(limiter, "1.2.3.4") == 4


@pytest.mark.parametrize("missing", [None, ""])
def test_a_key_function_returning_nothing_is_a_configuration_error(missing: str | None) -> None:
    limiter = TokenBucketLimiter(5, 0)

    def user_id(request: Any) -> str | None:
        return missing

    app = make_app(Limit(limiter, key=user_id))  # type: ignore[arg-type] # on purpose
    with pytest.raises(KeyFunctionError, match=r"user_id.*returned.*GET /hello"):
        get(app)
    assert len(limiter) == 0


def test_shadow_mode_never_refuses_but_reports(
    manual_clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=manual_clock)
    shadow = Limit(limiter, name="trial-run", shadow=True)
    app = make_app(shadow)
    with caplog.at_level(logging.INFO, logger="bucketlimit"):
        answers = [get(app) for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 5
    assert shadow.shadow_refusals == 3
    assert answers[-1].headers["RateLimit"] == '"trial-run";r=0;t=1'
    assert "Retry-After" not in answers[-1].headers
    refusals = [r for r in caplog.records if r.name == "bucketlimit"]
    assert len(refusals) == 3
    assert "'trial-run' would refuse GET /hello" in refusals[0].getMessage()
    # It decides as the real limit would: what it admitted was charged.
    assert tokens(limiter, PEER) == 0


def test_a_cost_function_reads_the_json_body_and_the_view_reads_it_again(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(1000, 10, clock=manual_clock)

    def max_tokens(request: Any) -> int:
        return int(request.get_json()["max_tokens"])

    app = Flask(__name__)

    @app.post("/v1/complete")
    @limit(limiter, cost=max_tokens, name="tokens")
    def complete() -> dict[str, Any]:
        return {"echo": request.get_json()}

    client = app.test_client()
    answer = client.post("/v1/complete", json={"max_tokens": 300, "prompt": "hi"})
    assert answer.status_code == 200
    assert answer.get_json() == {"echo": {"max_tokens": 300, "prompt": "hi"}}
    assert answer.headers["RateLimit"] == '"tokens";r=700;t=1'
    assert tokens(limiter, "127.0.0.1") == 700
    refused = client.post("/v1/complete", json={"max_tokens": 701})
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"  # 0.1 s for the missing token
    assert tokens(limiter, "127.0.0.1") == 700


def test_a_cost_above_the_capacity_never_passes_and_charges_nothing(
    manual_clock: ManualClock,
) -> None:
    limiter = TokenBucketLimiter(100, 10, clock=manual_clock)
    app = make_app(Limit(limiter, cost=lambda request: int(request.args["n"])))
    assert get(app, "/hello?n=100").status_code == 200
    manual_clock.advance(7)  # 70 tokens back, 3 s from full
    refused = get(app, "/hello?n=101")
    assert refused.status_code == 413  # more than the bucket holds: it can never pass
    assert "Retry-After" not in refused.headers
    assert_problem(refused.get_json(), 413, "default", None)
    assert refused.headers["RateLimit"] == '"default";r=70;t=1'
    assert tokens(limiter, PEER) == 70
    manual_clock.advance(3)
    assert get(app, "/hello?n=101").headers["RateLimit"] == '"default";r=100;t=1'  # full


def test_reserve_then_refund_inside_the_view(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(1000, 0, clock=manual_clock)
    app = Flask(__name__)

    @app.post("/v1/complete")
    @limit(limiter, cost=lambda r: int(r.get_json()["max_tokens"]), name="tokens")
    def complete() -> dict[str, int]:
        generated = 42  # what the model actually produced
        return {"refunded": reservation("tokens").settle(generated)}

    answer = app.test_client().post("/v1/complete", json={"max_tokens": 500})
    assert answer.get_json() == {"refunded": 458}
    assert tokens(limiter, "127.0.0.1") == 958


def test_refund_after_the_response_from_a_streamed_body(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(1000, 0, clock=manual_clock)
    app = Flask(__name__)

    @app.post("/v1/stream")
    @limit(limiter, cost=lambda r: int(r.get_json()["max_tokens"]), name="tokens")
    def stream() -> Response:
        held = reservation()  # taken in the view: the generator outlives the request

        def generate() -> Iterator[str]:
            produced = 0
            try:
                for word in ("one ", "two ", "three"):
                    produced += 1
                    yield word
            finally:
                held.settle(produced)

        return Response(stream_with_context(generate()), mimetype="text/plain")

    client = app.test_client()
    answer = client.post("/v1/stream", json={"max_tokens": 100}, buffered=False)
    assert answer.headers["RateLimit"] == '"tokens";r=900'  # the reservation, before the body
    assert tokens(limiter, "127.0.0.1") == 900  # still reserved while streaming
    assert answer.get_data() == b"one two three"
    answer.close()
    assert tokens(limiter, "127.0.0.1") == 997  # 3 used, 97 refunded after the response


def test_refund_after_the_response_with_call_on_close(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(1000, 0, clock=manual_clock)
    app = Flask(__name__)

    @app.post("/v1/complete")
    @limit(limiter, cost=lambda r: int(r.get_json()["max_tokens"]), name="tokens")
    def complete() -> Response:
        held = reservation("tokens")
        response = Response("done")
        response.call_on_close(lambda: held.settle(10))
        return response

    answer = app.test_client().post("/v1/complete", json={"max_tokens": 200})
    assert answer.text == "done"
    assert tokens(limiter, "127.0.0.1") == 800  # sent, not yet closed
    answer.close()
    assert tokens(limiter, "127.0.0.1") == 990


def test_an_unsettled_reservation_keeps_its_full_charge() -> None:
    limiter = TokenBucketLimiter(1000, 0)
    app = make_app(Limit(limiter, cost=300))
    get(app)
    assert tokens(limiter, PEER) == 700


def test_an_exempt_request_is_not_limited_charged_or_reported() -> None:
    limiter = TokenBucketLimiter(1, 0)
    health = Limit(limiter, exempt=lambda request: request.path == "/health")
    app = Flask(__name__)
    RateLimit(health, app)
    app.add_url_rule("/health", "health", lambda: "ok")
    app.add_url_rule("/hello", "hello", lambda: "hi")
    for _ in range(3):
        answer = get(app, "/health")
        assert answer.status_code == 200
        assert "RateLimit" not in answer.headers
        assert "RateLimit-Policy" not in answer.headers
    assert tokens(limiter, PEER) == 1
    assert get(app, "/hello").status_code == 200
    assert get(app, "/hello").status_code == 403  # the one token is spent for good


def test_several_limits_on_one_route_are_one_field_each(manual_clock: ManualClock) -> None:
    app_wide = Limit(TokenBucketLimiter(100, 10, clock=manual_clock), name="app")
    burst = Limit(TokenBucketLimiter(5, 1, clock=manual_clock), name="burst")
    daily = Limit(TokenBucketLimiter(50, 50, per=86400, clock=manual_clock), name="daily")
    app = make_app(burst, daily)
    RateLimit(app_wide, app)
    answer = get(app)
    assert answer.headers.getlist("RateLimit-Policy") == [
        '"app";q=100;w=10, "burst";q=5;w=5, "daily";q=50;w=86400'
    ]
    assert answer.headers.getlist("RateLimit") == [
        '"app";r=99;t=1, "burst";r=4;t=1, "daily";r=49;t=1728'
    ]
    assert "Retry-After" not in answer.headers


def test_a_refusal_by_one_limit_refunds_the_others(manual_clock: ManualClock) -> None:
    outer = TokenBucketLimiter(100, 0, clock=manual_clock)
    inner = TokenBucketLimiter(1, 0, clock=manual_clock)
    app = make_app(Limit(outer, name="outer"), Limit(inner, name="inner"))
    assert get(app).status_code == 200
    refused = get(app)
    assert refused.status_code == 403
    assert refused.headers.getlist("RateLimit") == ['"outer";r=98, "inner";r=0']
    assert tokens(outer, PEER) == 99  # the refused request was given back


def test_two_limits_with_one_name_are_a_configuration_error() -> None:
    app = make_app(Limit(TokenBucketLimiter(5, 1)), Limit(TokenBucketLimiter(9, 1)))
    with pytest.raises(ConfigurationError, match="two limits named 'default'"):
        get(app)


def test_one_limit_app_wide_and_on_a_view_charges_once() -> None:
    limiter = TokenBucketLimiter(10, 0)
    per_client = Limit(limiter, name="per-client")
    app = make_app(per_client)
    RateLimit(per_client, app)
    answer = get(app)
    assert answer.headers["RateLimit"] == '"per-client";r=9'
    assert tokens(limiter, PEER) == 9


def test_the_extension_with_init_app_limits_every_route_and_error_responses() -> None:
    limiter = TokenBucketLimiter(3, 0)
    extension = RateLimit(Limit(limiter, name="app"))
    app = Flask(__name__)
    extension.init_app(app)

    @app.get("/broken")
    def broken() -> str:
        abort(400)

    bad = get(app, "/broken")
    assert bad.status_code == 400
    assert bad.headers["RateLimit"] == '"app";r=2'
    assert get(app, "/missing").headers["RateLimit"] == '"app";r=1'  # a 404 is a request too
    assert get(app, "/broken").status_code == 400
    refused = get(app, "/broken")
    assert refused.status_code == 403  # refused before the view runs (a spent quota)
    assert refused.headers["RateLimit"] == '"app";r=0'
    assert extension.shadow_refusals == 0


def test_the_extension_in_shadow_mode_counts(manual_clock: ManualClock) -> None:
    extension = RateLimit(Limit(TokenBucketLimiter(1, 1, clock=manual_clock), shadow=True))
    app = make_app()
    extension.init_app(app)
    assert [get(app).status_code for _ in range(3)] == [200, 200, 200]
    assert extension.shadow_refusals == 2


def test_flask_refuses_an_asyncio_limiter() -> None:
    class AsyncOnly:
        capacity = 5
        rate = 1.0

        async def allow(self, key: str, cost: int = 1) -> Decision:
            raise AssertionError("never called")

        async def peek(self, key: str, cost: int = 1) -> Decision:
            raise AssertionError("never called")

        async def refund(self, key: str, cost: int) -> None:
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="Flask views are synchronous"):
        Limit(AsyncOnly())  # type: ignore[arg-type]


def test_the_extension_takes_a_limit() -> None:
    with pytest.raises(TypeError, match=r"takes a bucketlimit\.flask\.Limit"):
        RateLimit(TokenBucketLimiter(1, 1))  # type: ignore[arg-type]


def test_reservation_outside_a_limited_request_is_a_lookup_error() -> None:
    app = Flask(__name__)

    @app.get("/free")
    def free() -> str:
        reservation()
        return "unreachable"

    app.testing = True
    with pytest.raises(LookupError, match="no limit applied"):
        app.test_client().get("/free")


@pytest.mark.redis
def test_the_redis_limiter_inside_flask(redis_url: str, manual_clock: ManualClock) -> None:
    from bucketlimit.redis import RedisTokenBucketLimiter

    limiter = RedisTokenBucketLimiter.from_url(
        redis_url, 1000, 10, clock=manual_clock, timeout=10, prefix="web-test:"
    )
    app = Flask(__name__)

    @app.post("/v1/complete")
    @limit(limiter, cost=lambda r: int(r.get_json()["max_tokens"]), name="tokens")
    def complete() -> dict[str, int]:
        return {"refunded": reservation().settle(100)}

    try:
        client = app.test_client()
        answer = client.post("/v1/complete", json={"max_tokens": 400})
        assert answer.get_json() == {"refunded": 300}
        assert answer.headers["RateLimit-Policy"] == '"tokens";q=1000;w=100'
        assert answer.headers["RateLimit"] == '"tokens";r=600;t=1'
        refused = client.post("/v1/complete", json={"max_tokens": 901})
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert refused.headers["RateLimit"] == '"tokens";r=900;t=1'
    finally:
        limiter.client.close()


def test_the_example_app(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "flask_app.py"
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("BUCKETLIMIT_CAPACITY", "3")
    monkeypatch.setenv("BUCKETLIMIT_RATE", "0")
    spec = importlib.util.spec_from_file_location("flask_example", path)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    client = example.app.test_client()

    health = client.get("/health")
    assert health.get_json()["status"] == "ok"
    assert "RateLimit" not in health.headers
    assert client.get("/hello").headers["RateLimit"] == '"requests";r=2'
    done = client.post("/v1/complete", json={"prompt": "one two three", "max_tokens": 50})
    assert done.get_json() == {"text": "one two three", "tokens": 3, "refunded": 47}
    assert done.headers.getlist("RateLimit") == ['"requests";r=1, "tokens";r=9950;t=1']
    bad = client.post("/v1/complete", json={"max_tokens": 50})
    assert bad.status_code == 400
    refused = client.get("/hello")
    assert refused.status_code == 403
    assert_problem(refused.get_json(), 403, "requests", None)


# -- waiting for tokens -----------------------------------------------------------


def test_max_wait_makes_a_request_wait_for_its_tokens(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(2, 1, clock=manual_clock)
    app = make_app(Limit(limiter, max_wait=1.5))
    assert [get(app).status_code for _ in range(2)] == [200, 200]
    assert manual_clock.now == 0.0
    # The third would be refused: it waits 1 s on the limiter's clock instead.
    assert get(app).status_code == 200
    assert manual_clock.now == 1.0
    # Two waiting would be 2.5 s: refused at once, nothing spent, no sleep.
    limiter.reserve(PEER, 1)
    refused = get(app)
    assert refused.status_code == 429
    assert manual_clock.now == 1.0
    assert refused.headers["Retry-After"] == "1"  # until a wait of 1.5 s would do


def test_max_wait_zero_refuses_as_before_and_bad_values_are_rejected(
    manual_clock: ManualClock,
) -> None:
    app = make_app(Limit(TokenBucketLimiter(1, 1, clock=manual_clock)))
    assert [get(app).status_code for _ in range(2)] == [200, 429]
    with pytest.raises(ValueError, match="max_wait"):
        Limit(TokenBucketLimiter(1, 1), max_wait=-1)
    with pytest.raises(TypeError, match="max_wait"):
        Limit(TokenBucketLimiter(1, 1), max_wait="1")  # type: ignore[arg-type]


def test_settle_in_the_view_charges_the_overage(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(100, 10, clock=manual_clock)
    app = Flask(__name__)

    @app.get("/complete")
    @Limit(limiter, cost=20, name="tokens")
    def complete() -> dict[str, int]:
        reservation("tokens").settle(50)  # the answer was longer than the estimate
        return {"used": 50}

    assert get(app, "/complete").status_code == 200
    assert tokens(limiter, PEER) == 50


def test_a_request_that_waited_gives_back_what_it_did_not_use(manual_clock: ManualClock) -> None:
    """Settled through its reservation, a request that waited for its tokens gives
    back the unused part exactly when nobody queued behind it (docs/design.md §4,
    "Giving back"): as if it had reserved only what it used."""
    limiter = TokenBucketLimiter(100, 10, clock=manual_clock)
    app = Flask(__name__)

    @app.get("/complete")
    @Limit(limiter, cost=60, name="tokens", max_wait=5)
    def complete() -> dict[str, int]:
        return {"refunded": reservation("tokens").settle(20)}

    assert get(app, "/complete").get_json() == {"refunded": 40}  # no wait: 60 taken, 40 back
    limiter.charge(PEER, 30)  # 100 - 20 - 30 = 50 left
    waited = get(app, "/complete")
    assert waited.get_json() == {"refunded": 40}
    assert manual_clock.now == 1.0  # 10 tokens short, at 10 a second
    # It used 20 of the 60 it waited for: the 40 are there again (a refund
    # without its place in the queue would have given back nothing).
    assert limiter.peek(PEER, 40)
    assert not limiter.peek(PEER, 41)
