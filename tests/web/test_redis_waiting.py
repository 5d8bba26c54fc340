"""The adapters' ``max_wait`` and ``settle`` overage with the Redis limiters, as with
the in-process one (docs/web.md, "Waiting instead of refusing"): a real Flask app
over ``RedisTokenBucketLimiter`` and a real FastAPI app over
``AsyncRedisTokenBucketLimiter``, a real redis-server, time on a ManualClock."""

# No `from __future__ import annotations`: FastAPI must see the route's annotations.
import asyncio
import itertools
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio
from fastapi import Depends, FastAPI
from flask import Flask

from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter
from bucketlimit.testing import ManualClock

PEER = "198.51.100.7"
_prefixes = itertools.count()


def fresh() -> str:
    return f"web-wait-{next(_prefixes)}:"


def flask_app(limit: bl_flask.Limit) -> Flask:
    app = Flask(__name__)
    app.testing = True

    @app.get("/hello")
    @limit
    def hello() -> dict[str, str]:
        return {"hello": "world"}

    return app


def test_flask_max_wait_and_settle_over_redis(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 2, 1, clock, prefix=fresh())
    app = flask_app(bl_flask.Limit(limiter, max_wait=1.5))
    client = app.test_client()

    def get() -> Any:
        return client.get("/hello", environ_base={"REMOTE_ADDR": PEER})

    assert [get().status_code for _ in range(2)] == [200, 200]
    # The third waits 1 s for its token, sleeping on the limiter's clock.
    assert get().status_code == 200
    assert clock.now == 1.0
    limiter.reserve(PEER, 1)  # another process's waiter: the next would wait 2 s
    refused = get()
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "1"
    assert clock.now == 1.0, "refused at once, nothing spent"
    assert limiter.peek(PEER).retry_after == 2.0

    # settle() above the estimate charges the overage in Redis.
    tokens = RedisTokenBucketLimiter(redis_client, 100, 10, clock, prefix=fresh())
    overage = Flask(__name__)

    @overage.get("/complete")
    @bl_flask.Limit(tokens, cost=20, name="tokens")
    def complete() -> dict[str, int]:
        bl_flask.reservation("tokens").settle(50)  # longer than the estimate
        return {"used": 50}

    answer = overage.test_client().get("/complete", environ_base={"REMOTE_ADDR": PEER})
    assert answer.status_code == 200
    assert tokens.peek(PEER, 50).allowed
    assert not tokens.peek(PEER, 51).allowed


class Parked(ManualClock):
    """A ManualClock whose async sleep lasts until the waiter is cancelled;
    ``parked`` counts the waiters that reached it."""

    parked = 0

    async def sleep_async(self, seconds: float) -> None:
        self.parked += 1
        await asyncio.Event().wait()


async def call(app: Any, path: str = "/hello") -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=(PEER, 50000))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path)


def test_fastapi_max_wait_settle_and_cancellation_over_redis(redis_url: str) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            clock = ManualClock()
            limiter = AsyncRedisTokenBucketLimiter(client, 2, 1, clock, prefix=fresh())
            app = FastAPI()
            limit = bl_fastapi.Limit(limiter, max_wait=1.5)

            @app.get("/hello", dependencies=[Depends(limit)])
            async def hello() -> dict[str, str]:
                return {"hello": "world"}

            assert [(await call(app)).status_code for _ in range(2)] == [200, 200]
            assert (await call(app)).status_code == 200
            assert clock.now == 1.0, "awaited on the limiter's clock"
            await limiter.reserve(PEER, 1)
            refused = await call(app)
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "1"
            assert clock.now == 1.0

            tokens = AsyncRedisTokenBucketLimiter(client, 100, 10, clock, prefix=fresh())
            held_limit = bl_fastapi.Limit(tokens, cost=20, name="tokens")
            overage = FastAPI()

            @overage.get("/complete")
            async def complete(
                held: bl_fastapi.AsyncReservation = Depends(held_limit),  # noqa: B008
            ) -> dict[str, int]:
                await held.settle(50)
                return {"used": 50}

            assert (await call(overage, "/complete")).status_code == 200
            assert (await tokens.peek(PEER, 50)).allowed
            assert not (await tokens.peek(PEER, 51)).allowed

            # A request cancelled while it waits gives its token back.
            parking = Parked()
            parked = AsyncRedisTokenBucketLimiter(client, 1, 1, parking, prefix=fresh())
            waits = FastAPI()

            @waits.get("/hello", dependencies=[Depends(bl_fastapi.Limit(parked, max_wait=30))])
            async def hello_again() -> dict[str, str]:
                return {"hello": "world"}

            assert (await call(waits)).status_code == 200
            waiting = asyncio.ensure_future(call(waits))
            while parking.parked == 0:  # until the request waits for its token
                await asyncio.sleep(0)
            assert (await parked.peek(PEER)).retry_after == 2.0  # the waiter holds its token
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert (await parked.peek(PEER)).retry_after == 1.0
        finally:
            await client.aclose()

    asyncio.run(main())


def test_fastapi_max_wait_with_the_sync_redis_limiter(redis_client: redis.Redis) -> None:
    """An async app given the sync Redis limiter awaits the wait (acquire_async)."""

    async def main() -> None:
        clock = ManualClock()
        limiter = RedisTokenBucketLimiter(redis_client, 1, 1, clock, prefix=fresh())
        app = FastAPI()

        @app.get("/hello", dependencies=[Depends(bl_fastapi.Limit(limiter, max_wait=2))])
        async def hello() -> dict[str, str]:
            return {"hello": "world"}

        assert [(await call(app)).status_code for _ in range(3)] == [200, 200, 200]
        assert clock.now == 2.0

    asyncio.run(main())


def test_a_request_that_waited_gives_back_what_it_did_not_use_in_redis(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """Settled through its Redis reservation, a request that waited for its tokens
    gives back the unused part exactly when nobody queued behind it (a refund
    without its place in the queue would have given back nothing)."""
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 100, 10, clock, prefix=fresh())
    app = Flask(__name__)

    @app.get("/complete")
    @bl_flask.Limit(limiter, cost=60, name="tokens", max_wait=5)
    def complete() -> dict[str, int]:
        return {"refunded": bl_flask.reservation("tokens").settle(20)}

    def get() -> Any:
        return app.test_client().get("/complete", environ_base={"REMOTE_ADDR": PEER})

    assert limiter.charge(PEER, 50)  # 50 left: the request waits 1 s for 60
    assert get().get_json() == {"refunded": 40}
    assert clock.now == 1.0
    assert limiter.peek(PEER, 40).allowed
    assert not limiter.peek(PEER, 41).allowed

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            tokens = AsyncRedisTokenBucketLimiter(client, 100, 10, clock, prefix=fresh())
            tokens_limit = bl_fastapi.Limit(tokens, cost=60, name="tokens", max_wait=5)
            fast = FastAPI()

            @fast.get("/complete")
            async def complete_async(
                held: bl_fastapi.AsyncReservation = Depends(tokens_limit),  # noqa: B008
            ) -> int:
                return await held.settle(20)

            await tokens.charge(PEER, 50)
            assert (await call(fast, "/complete")).json() == 40
            assert clock.now == 2.0
            assert (await tokens.peek(PEER, 40)).allowed
            assert not (await tokens.peek(PEER, 41)).allowed
        finally:
            await client.aclose()

    asyncio.run(main())
