"""Tests ported from flask-limiter and slowapi that move time with freezegun or
time-machine pass unchanged: this module imports both, so the bucketlimit pytest
plugin puts every web limit on ``PatchedTimeClock`` for each test (the
``limits_patched_time`` fixture does it on request; ``bucketlimit_real_clock``
opts out)."""

from __future__ import annotations

import asyncio

import freezegun
import httpx
import pytest
import time_machine
from fastapi import Depends, FastAPI
from flask import Flask

from bucketlimit import fastapi as bl_fastapi
from bucketlimit.flask import RateLimit, limit
from bucketlimit.testing import PatchedTimeClock


def flask_app() -> Flask:
    app = Flask(__name__)
    RateLimit(app=app, default_limits=["2 per minute"], storage="memory://")
    app.add_url_rule("/", "index", lambda: "hi")
    app.add_url_rule("/own", "own", limit("1/minute")(lambda: "own"))
    return app


APP = flask_app()  # a module-level app, made before any test: its limits too


def test_a_flask_limiter_test_with_freezegun_unchanged() -> None:
    with freezegun.freeze_time("2026-01-01 12:00:00") as frozen:
        client = APP.test_client()
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
        frozen.tick(30)  # one token of "2 per minute" comes back
        assert client.get("/").status_code == 200
        assert [client.get("/own").status_code for _ in range(2)] == [200, 429]
        frozen.tick(60)
        assert client.get("/own").status_code == 200


def test_a_slowapi_test_with_time_machine_unchanged() -> None:
    route = bl_fastapi.Limit("5/minute")
    app = FastAPI()
    app.get("/home", dependencies=[Depends(route)])(lambda: "home")

    async def statuses(count: int) -> list[int]:
        transport = httpx.ASGITransport(app=app, client=("203.0.113.5", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get("/home")).status_code for _ in range(count)]

    with time_machine.travel(1_800_000_000, tick=False) as traveller:
        assert asyncio.run(statuses(6)) == [200] * 5 + [429]
        traveller.shift(12)  # one of "5/minute" back
        assert asyncio.run(statuses(2)) == [200, 429]


def test_each_test_starts_with_full_buckets() -> None:
    """The previous tests spent APP's buckets; on the patched clock each test gets
    fresh ones, as flask-limiter's tests that build their app per test do."""
    with freezegun.freeze_time("2026-01-01 12:00:00"):
        assert APP.test_client().get("/own").status_code == 200


def test_the_fixture_gives_the_clock(limits_patched_time: PatchedTimeClock) -> None:
    with freezegun.freeze_time("2026-01-01 12:00:00") as frozen:
        assert limits_patched_time() == 1_767_268_800.0
        frozen.tick(1)
        assert limits_patched_time() == 1_767_268_801.0


@pytest.mark.bucketlimit_real_clock
def test_the_marker_keeps_the_limits_on_their_own_clocks() -> None:
    with freezegun.freeze_time("2026-01-01 12:00:00") as frozen:
        client = APP.test_client()
        statuses = [client.get("/").status_code for _ in range(3)]
        frozen.tick(30)
        statuses.append(client.get("/").status_code)
    assert statuses[-1] == 429, "the real clock did not move with freezegun: still empty"
