"""Rate limits for FastAPI and Starlette: a dependency and a pure ASGI middleware.

::

    from fastapi import Depends, FastAPI
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.fastapi import Limit, RateLimitMiddleware

    per_client = Limit(TokenBucketLimiter(10, 1), name="per-client")
    search = Limit(TokenBucketLimiter(2, 0.1), name="search")

    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limit=per_client)   # every request

    @app.get("/search", dependencies=[Depends(search)])         # one route
    async def do_search(): ...

The in-process and the sync Redis limiter are called directly; the asyncio Redis
limiter (``AsyncRedisTokenBucketLimiter``) is awaited. A refused request gets
``429`` with ``Retry-After``; every limited response carries ``RateLimit-Policy``
and ``RateLimit`` (draft-ietf-httpapi-ratelimit-headers-11), one field each.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bucketlimit._core import Decision
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.fields import refusal_body, refusal_headers
from bucketlimit._web.limits import (
    ConfigurationError,
    KeyFunctionError,
    LimitSettings,
    RequestLimits,
    run_async,
)
from bucketlimit._web.reservations import AsyncReservation, reserve_async

__all__ = [
    "AsyncReservation",
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "RateLimitExceeded",
    "RateLimitMiddleware",
    "client_address",
    "ratelimit_fields",
    "remote_address",
    "reservation",
    "reserve_async",
]

_STATE = "bucketlimit"
_FIELD_NAMES = (b"ratelimit", b"ratelimit-policy")


def client_address(trusted_proxies: Iterable[str | Network] = ()) -> Callable[[Request], str]:
    """A key function: the client's IP address.

    With no trusted proxies (the default) it is the direct peer, ``request.client``,
    and ``X-Forwarded-For`` is ignored: a client cannot pick its own key by sending
    one. Behind proxies, list their networks; the key is then the right-most
    ``X-Forwarded-For`` hop that is not one of them. (Do not also run uvicorn's
    ``--proxy-headers`` with a broad ``--forwarded-allow-ips``: it rewrites the peer
    before this function sees it.)
    """
    return client_address_key(
        trusted_proxies,
        lambda request: request.client.host if request.client is not None else None,
        lambda request: request.headers.getlist("x-forwarded-for"),
        "scope['client'] is None",
    )


def _describe(request: Request) -> str:
    return f"{request.method} {request.url.path}"


#: The default key: the direct peer address, ``X-Forwarded-For`` ignored.
remote_address = client_address()


def _request_limits(scope: Scope) -> RequestLimits:
    # scope["state"] is the dict behind request.state: shared by the middleware,
    # the dependencies and the route of one request, and fresh for each request.
    state: dict[str, Any] = scope.setdefault("state", {})
    limits = state.get(_STATE)
    if limits is None:
        limits = state[_STATE] = RequestLimits()
    return limits


def ratelimit_fields(request: Request) -> dict[str, str]:
    """The ``RateLimit-Policy`` and ``RateLimit`` fields of the limits applied so far.

    For a route that returns its own ``Response`` under a dependency (FastAPI then
    drops the dependency's headers): ``response.headers.update(ratelimit_fields(request))``.
    The middleware does this by itself.
    """
    limits = request.scope.get("state", {}).get(_STATE)
    return {} if limits is None else limits.fields()


def reservation(request: Request, name: str | None = None) -> AsyncReservation:
    """The reservation a limit made for this request (``name`` when several apply).

    The dependency also returns it: ``held: AsyncReservation = Depends(tokens)``.
    ``await held.settle(used)`` refunds the unused part, also after the response
    (a ``BackgroundTasks`` task, the end of a streamed body).
    """
    limits = request.scope.get("state", {}).get(_STATE)
    if limits is None:
        raise LookupError("no limit applied to this request")
    found = limits.reservation(name)
    if not isinstance(found, AsyncReservation):  # pragma: no cover - only Flask makes these
        raise TypeError("a sync reservation in an ASGI request")
    return found


class RateLimitExceeded(HTTPException):
    """The 429 a :class:`Limit` dependency raises.

    FastAPI's handler answers ``{"detail": {"error": "rate limited", "retry_after": 2}}``
    with ``Retry-After`` and the RateLimit fields.
    """

    def __init__(self, decision: Decision, headers: dict[str, str]) -> None:
        super().__init__(status_code=429, detail=refusal_body(decision), headers=headers)
        self.decision = decision


class Limit(LimitSettings[Request]):
    """One limit: a FastAPI dependency, or app-wide through :class:`RateLimitMiddleware`.

    - ``limiter``: ``TokenBucketLimiter``, ``RedisTokenBucketLimiter`` or
      ``AsyncRedisTokenBucketLimiter``.
    - ``key``: a function (or ``async def``) of the request returning a non-empty
      ``str``; default :data:`remote_address`. ``None`` or ``""`` raises
      :class:`KeyFunctionError` rather than sharing one bucket.
    - ``cost``: an ``int`` or a function (or ``async def``) of the request, e.g.
      ``(await request.json())["max_tokens"]``; the route can still read the body.
      A cost above the capacity is a 429 that will never pass (no ``Retry-After``).
    - ``name``: the policy name in the RateLimit fields; distinct per route.
    - ``shadow``: decide, charge, report (fields, log, :attr:`shadow_refusals`),
      never refuse.
    - ``exempt``: a predicate of the request; true means no limit, no charge, no
      fields.
    - ``max_wait``: seconds a request that would be refused may wait for its tokens
      instead (awaited: ``acquire_async`` on the limiter's clock); 0, the default,
      refuses at once. A wait longer than that is refused at once, spending nothing.

    As a dependency it returns the request's :class:`AsyncReservation`. When
    several limits apply to a request and one refuses, the others' charges are
    refunded: the request did not run.
    """

    default_key = staticmethod(remote_address)

    async def __call__(self, request: Request, response: Response) -> AsyncReservation:
        held, refused = await self.apply(request)
        fields = ratelimit_fields(request)
        if refused:
            assert held.decision is not None
            raise RateLimitExceeded(held.decision, {**fields, **refusal_headers(held.decision)})
        for name, value in fields.items():
            response.headers[name] = value  # replaces: the last limit writes every member
        return held

    async def apply(self, request: Request) -> tuple[AsyncReservation, bool]:
        """Applies the limit: the request's reservation, and whether to answer 429."""
        held, refused = await run_async(
            self.procedure(
                request, lambda: _request_limits(request.scope), _describe, AsyncReservation
            )
        )
        if held is None:  # exempt: no limit, no charge
            held = AsyncReservation(None, "", 0, None)
        return held, refused


class _Replay:
    """Keeps the body a limit read (a cost from the JSON body) for the app to read again."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._kept: deque[Message] = deque()

    async def record(self) -> Message:
        message = await self._receive()
        self._kept.append(message)
        return message

    async def replay(self) -> Message:
        if self._kept:
            return self._kept.popleft()
        return await self._receive()


def _with_fields(message: Message, fields: dict[str, str]) -> Message:
    """The response start with exactly one RateLimit and one RateLimit-Policy field."""
    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in _FIELD_NAMES]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in fields.items()]
    return {**message, "headers": headers}


class RateLimitMiddleware:
    """Pure ASGI middleware applying a :class:`Limit` to every HTTP request.

    ``app.add_middleware(RateLimitMiddleware, limit=per_client)``. It also writes
    the final RateLimit fields of every limit of the request (its own and the
    route's dependencies'), so they appear once even on a ``Response`` the route
    built itself. Unlike ``BaseHTTPMiddleware`` it does not buffer responses, so
    streaming and background tasks behave as without it.
    """

    def __init__(self, app: ASGIApp, limit: Limit) -> None:
        if not isinstance(limit, Limit):
            raise TypeError(f"RateLimitMiddleware takes a bucketlimit.fastapi.Limit, got {limit!r}")
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})
        body = _Replay(receive)
        held, refused = await self.limit.apply(Request(scope, body.record))

        async def send_with_fields(message: Message) -> None:
            limits = state.get(_STATE)
            if message["type"] == "http.response.start" and limits is not None:
                fields = limits.fields()
                if fields:
                    message = _with_fields(message, fields)
            await send(message)

        if refused:
            assert held.decision is not None
            response = JSONResponse(
                refusal_body(held.decision),
                status_code=429,
                headers=refusal_headers(held.decision),
            )
            await response(scope, body.replay, send_with_fields)
            return
        await self.app(scope, body.replay, send_with_fields)
