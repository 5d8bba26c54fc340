"""bucketlimit.limiter on Redis and Valkey storage URIs against real servers: the
right class for each URI (sync, asyncio), one shared client per URI, different
limits never reading each other's buckets, and adapters' limit strings on Redis."""

from __future__ import annotations

import asyncio

import pytest

import bucketlimit
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter
from tests.support.redis_servers import RedisServer

pytestmark = pytest.mark.redis


def test_a_redis_uri_builds_the_redis_limiter_on_one_shared_client(redis_url: str) -> None:
    minute = bucketlimit.limiter("3/minute", storage=redis_url)
    day = bucketlimit.limiter("1000/day", storage=redis_url)
    assert isinstance(minute, RedisTokenBucketLimiter)
    assert isinstance(day, RedisTokenBucketLimiter)
    assert minute.client is day.client  # one pool for every limiter of the URI
    assert (minute.capacity, minute.rate, minute.per) == (3, 3 / 60, 60.0)
    assert [minute.allow("k").allowed for _ in range(4)] == [True, True, True, False]
    assert day.allow("k").remaining == 999  # a limit of its own: not the minute's bucket
    again = bucketlimit.limiter("3/minute", storage=redis_url)
    assert isinstance(again, RedisTokenBucketLimiter)
    assert not again.allow("k")  # the same limit on the same store: the same buckets
    other = bucketlimit.limiter("3/minute", storage=redis_url, prefix="other:")
    assert isinstance(other, RedisTokenBucketLimiter)
    assert other.allow("k")  # a prefix of its own keeps them apart
    slower = bucketlimit.limiter("3/minute", storage=redis_url, timeout=2)
    assert isinstance(slower, RedisTokenBucketLimiter)
    assert slower.client is not day.client  # one client per (URI, kind, timeout)


def test_asyncio_by_argument_or_by_uri(redis_url: str) -> None:
    by_argument = bucketlimit.limiter("2/second", storage=redis_url, async_=True)
    by_uri = bucketlimit.limiter("2/second", storage=f"async+{redis_url}")
    assert isinstance(by_argument, AsyncRedisTokenBucketLimiter)
    assert isinstance(by_uri, AsyncRedisTokenBucketLimiter)
    assert by_argument.client is by_uri.client

    async def main() -> list[bool]:
        try:
            return [(await by_uri.allow("k")).allowed for _ in range(3)]
        finally:
            await by_uri.client.aclose()

    assert asyncio.run(main()) == [True, True, False]


def test_a_valkey_uri(valkey_server: RedisServer) -> None:
    url = valkey_server.url.replace("redis://", "valkey://")
    limiter = bucketlimit.limiter("1/minute", storage=url, prefix="valkey-test:")
    assert isinstance(limiter, RedisTokenBucketLimiter)
    assert limiter.allow("k")
    assert not limiter.allow("k")
    limiter.reset("k")


def test_adapters_build_the_right_kind_of_redis_limiter(redis_url: str) -> None:
    flask_limit = bl_flask.Limit("5/minute", storage=redis_url)
    asgi_limit = bl_fastapi.Limit("5/minute", storage=redis_url)
    assert isinstance(flask_limit.limiter, RedisTokenBucketLimiter)  # Flask is sync
    assert isinstance(asgi_limit.limiter, AsyncRedisTokenBucketLimiter)
