"""Typed key and cost functions and the public Limiter protocol, checked by
``mypy --strict`` over this file (``make lint``): each deliberate mistake below
carries a ``type: ignore`` that strict mode would report as unused if mypy did
not catch the mistake. At run time the same calls work or raise as documented."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit.web import Limiter, SyncLimiter


class CountingLimiter:
    """A limiter of one's own: it satisfies the public protocol structurally."""

    def __init__(self) -> None:
        self.inner = TokenBucketLimiter(5, 1)

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def rate(self) -> float:
        return self.inner.rate

    def allow(self, key: str, cost: int = 1) -> Decision:
        return self.inner.allow(key, cost)

    def peek(self, key: str, cost: int = 1) -> Decision:
        return self.inner.peek(key, cost)

    def refund(self, key: str, cost: int) -> None:
        self.inner.refund(key, cost)


def api_key(request: Request) -> str:
    return request.headers.get("x-api-key", "anonymous")


def tokens(request: Request) -> int:
    return 1


def test_typed_functions_and_the_protocol() -> None:
    own: Limiter = CountingLimiter()
    sync: SyncLimiter = TokenBucketLimiter(1, 1)
    assert isinstance(own, Limiter)
    assert isinstance(sync, SyncLimiter)
    bl_fastapi.Limit(own, key=api_key, cost=tokens)
    bl_flask.Limit(CountingLimiter())
    with pytest.raises(TypeError):
        bl_fastapi.Limit(own, cost="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # a str is a limit string now (typed), but not this one
        bl_fastapi.Limit("not a limiter")


def test_a_key_function_must_return_a_str() -> None:
    def numeric(request: Request) -> int:
        return 42

    limit = bl_fastapi.Limit(TokenBucketLimiter(1, 1), key=numeric)  # type: ignore[arg-type]
    assert limit.key is numeric  # accepted at run time; refused per request (KeyFunctionError)


def test_the_limiter_factory_says_which_class_it_builds() -> None:
    """``bucketlimit.limiter`` is typed by its arguments (overloads), so the decision's
    fields need no cast: the default storage is the in-process limiter."""
    import bucketlimit
    from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter

    in_process: TokenBucketLimiter = bucketlimit.limiter("10/second")
    assert in_process.allow("k").retry_after == 0.0  # a Decision, not an awaitable
    url = "redis://127.0.0.1:1/0"  # nothing is sent at construction
    asyncio_one: AsyncRedisTokenBucketLimiter = bucketlimit.limiter(
        "10/second", storage=url, async_=True
    )
    blocking: TokenBucketLimiter | RedisTokenBucketLimiter = bucketlimit.limiter(
        "10/second", storage=url, async_=False
    )
    assert isinstance(asyncio_one, AsyncRedisTokenBucketLimiter)
    assert isinstance(blocking, RedisTokenBucketLimiter)
    with pytest.raises(ValueError, match="async_=False with an async"):
        bucketlimit.limiter("10/second", storage=f"async+{url}", async_=False)
