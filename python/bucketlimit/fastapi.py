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

import inspect
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bucketlimit._core import Decision
from bucketlimit._web.addresses import Network, TrustedProxies, forwarded_client
from bucketlimit._web.fields import refusal_body, refusal_headers
from bucketlimit._web.limiters import AnyLimiter, AsyncLimiter, SyncLimiter
from bucketlimit._web.limits import (
    ConfigurationError,
    KeyFunctionError,
    LimitSettings,
    RequestLimits,
)
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve_async

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


async def _resolve(value: Any) -> Any:
    """A user function's answer; key, cost and exempt functions may be ``async def``."""
    return await value if inspect.isawaitable(value) else value


def client_address(trusted_proxies: Iterable[str | Network] = ()) -> Callable[[Request], str]:
    """A key function: the client's IP address.

    With no trusted proxies (the default) it is the direct peer, ``request.client``,
    and ``X-Forwarded-For`` is ignored: a client cannot pick its own key by sending
    one. Behind proxies, list their networks; the key is then the right-most
    ``X-Forwarded-For`` hop that is not one of them. (Do not also run uvicorn's
    ``--proxy-headers`` with a broad ``--forwarded-allow-ips``: it rewrites the peer
    before this function sees it.)
    """
    trusted = TrustedProxies(trusted_proxies)

    def key(request: Request) -> str:
        peer = request.client.host if request.client is not None else None
        address = forwarded_client(peer, request.headers.getlist("x-forwarded-for"), trusted)
        if address is None:
            raise KeyFunctionError(
                "the request has no peer address (scope['client'] is None), so "
                "client_address() cannot key it; give the limit another key="
            )
        return address

    key.__qualname__ = f"client_address({list(map(str, trusted.networks))!r})"
    return key


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

    As a dependency it returns the request's :class:`AsyncReservation`. When
    several limits apply to a request and one refuses, the others' charges are
    refunded: the request did not run.
    """

    def __init__(
        self,
        limiter: SyncLimiter | AsyncLimiter,
        *,
        key: Callable[[Request], Any] = remote_address,
        cost: int | Callable[[Request], Any] = 1,
        name: str = "default",
        shadow: bool = False,
        exempt: Callable[[Request], Any] | None = None,
    ) -> None:
        super().__init__(limiter, key=key, cost=cost, name=name, shadow=shadow, exempt=exempt)
        self._limiter: AnyLimiter = limiter

    async def __call__(self, request: Request, response: Response) -> AsyncReservation:
        held, refused = await self.apply(request)
        fields = ratelimit_fields(request)
        if refused:
            assert held.decision is not None
            raise RateLimitExceeded(held.decision, {**fields, **refusal_headers(held.decision)})
        for name, value in fields.items():
            response.headers[name] = value  # replaces: the last limit writes every member
        return held

    async def _answer(self, method: str, key: str, cost: int) -> Decision:
        result = getattr(self._limiter, method)(key, cost)
        decision: Decision = await result if self._is_async else result
        return decision

    async def apply(self, request: Request) -> tuple[AsyncReservation, bool]:
        """Applies the limit: the request's reservation, and whether to answer 429."""
        if self.exempt is not None and await _resolve(self.exempt(request)):
            return AsyncReservation(None, "", 0, None), False
        limits = _request_limits(request.scope)
        found = limits.find(self)
        if found is not None:  # already applied (middleware and dependency)
            assert isinstance(found, AsyncReservation)
            return found, False
        where = f"{request.method} {request.url.path}"
        key = self.checked_key(await _resolve(self.key(request)), where)
        cost = await _resolve(self.cost(request)) if callable(self.cost) else self.cost
        if self.can_never_pass(cost):
            decision = self.never(await self._answer("peek", key, self._limiter.capacity))
        else:
            decision = await self._answer("allow", key, cost)
        held = AsyncReservation(self._limiter, key, cost if decision.allowed else 0, decision)
        limits.add(self, self.applied(decision), held)
        if not self.refuses(decision, key, cost, where):
            return held, False
        for other in limits.others(self):
            if isinstance(other, Reservation):  # pragma: no cover - only Flask makes these
                other.cancel()
            else:
                await other.cancel()
        return held, True


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
