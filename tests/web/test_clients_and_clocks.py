"""What real clients read, and the time-patching libraries tests use:

- the openai SDK reads the ``openai`` profile: ``code="rate_limit_exceeded"`` on its
  ``RateLimitError``, and it waits as ``retry-after-ms`` says before retrying;
- freezegun and time-machine move an app's limits put on
  ``bucketlimit.testing.PatchedTimeClock`` (and do not move the built-in clock).
"""

from __future__ import annotations

import time
import types
from typing import Any

import freezegun
import httpx2
import openai
import pytest
import time_machine
from flask import Flask

from bucketlimit import TokenBucketLimiter
from bucketlimit import flask as bl_flask
from bucketlimit.testing import ManualClock, PatchedTimeClock, limits_on_clock


def models_app(limiter: TokenBucketLimiter) -> Flask:
    app = Flask(__name__)
    bl_flask.RateLimit(bl_flask.Limit(limiter, name="requests", headers="openai"), app)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": []}

    return app


def sdk_client(app: Flask, max_retries: int) -> openai.OpenAI:
    transport = httpx2.WSGITransport(app=app)
    return openai.OpenAI(
        api_key="test",
        base_url="http://api.test/v1",
        max_retries=max_retries,
        http_client=httpx2.Client(transport=transport, base_url="http://api.test/v1"),
    )


def test_the_openai_sdk_reads_the_code_of_a_refusal() -> None:
    app = models_app(TokenBucketLimiter(1, 2, ManualClock(), per=60))
    client = sdk_client(app, max_retries=0)
    assert client.models.list().data == []
    with pytest.raises(openai.RateLimitError) as refused:
        client.models.list()
    assert refused.value.status_code == 429
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.type == "requests"
    assert "Rate limit reached for requests" in refused.value.message


def test_the_openai_sdk_waits_as_retry_after_ms_says(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = ManualClock()
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # the SDK's wait, on the limiter's clock
        slept.append(seconds)
        clock.advance(seconds)

    # Only the SDK's own module sees this time.sleep.
    fake_time = types.SimpleNamespace(**{**vars(time), "sleep": sleep})
    monkeypatch.setattr("openai._base_client.time", fake_time)
    app = models_app(TokenBucketLimiter(1, 2, clock, per=60))  # one every 30 s
    client = sdk_client(app, max_retries=2)
    assert client.models.list().data == []
    clock.advance(12.5)
    assert client.models.list().data == []  # refused, waited, retried: passed
    assert slept == [17.5]  # retry-after-ms: 17500, not the SDK's own backoff (< 8 s)


def flask_app() -> Flask:
    app = Flask(__name__)
    bl_flask.RateLimit(bl_flask.Limit(TokenBucketLimiter(2, 1), name="requests"), app)
    app.add_url_rule("/", "index", lambda: "hi")
    return app


def statuses(app: Flask, count: int) -> list[int]:
    client = app.test_client()
    return [client.get("/").status_code for _ in range(count)]


def test_freezegun_moves_limits_on_the_patched_time_clock() -> None:
    app = flask_app()
    with freezegun.freeze_time("2026-01-01 12:00:00") as frozen:
        with limits_on_clock(PatchedTimeClock()):
            assert statuses(app, 3) == [200, 200, 429]
            frozen.tick(1)
            assert statuses(app, 2) == [200, 429]
            frozen.tick(5)
            assert statuses(app, 3) == [200, 200, 429]
        # The built-in clock (the CPU's counter, read in Rust) does not follow:
        builtin = TokenBucketLimiter(1, 1, per=1000)  # one every 1,000 s of real time
        assert builtin.allow("k")
        assert not builtin.allow("k")
        frozen.tick(5000)
        assert not builtin.allow("k")


def test_time_machine_moves_limits_on_the_patched_time_clock() -> None:
    app = flask_app()
    with time_machine.travel(1_800_000_000, tick=False) as traveller:
        with limits_on_clock(PatchedTimeClock()):
            assert statuses(app, 3) == [200, 200, 429]
            traveller.shift(1)
            assert statuses(app, 2) == [200, 429]
        # time-machine never patches time.monotonic: a clock bound to it stays put.
        monotonic = TokenBucketLimiter(1, 1, clock=time.monotonic, per=1000)
        assert monotonic.allow("k")
        assert not monotonic.allow("k")
        traveller.shift(5000)
        assert not monotonic.allow("k")
        patched = TokenBucketLimiter(1, 1, clock=PatchedTimeClock())
        assert patched.allow("k")
        assert not patched.allow("k")
        traveller.shift(1)
        assert patched.allow("k")
