"""Rate limits for FastAPI and Starlette: a dependency and a pure ASGI middleware.

::

    from fastapi import Depends, FastAPI
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.fastapi import Limit, RateLimitMiddleware

    per_client = Limit(TokenBucketLimiter(10, 1), name="per-client")
    search = Limit(TokenBucketLimiter(2, 0.1), name="search")

    app = FastAPI()
    app.add_middleware(RateLimitMiddleware, limit=per_client)   # every request
                                                                # and WebSocket
    @app.get("/search", dependencies=[Depends(search)])         # one route
    async def do_search(): ...

Only Starlette is imported (FastAPI is built on it), so a bare Starlette app uses
this module too. Key, cost and exempt functions receive a Starlette ``Request``
(a ``WebSocket`` on a websocket route). The in-process and the sync Redis limiter
are called directly; the asyncio Redis limiter is awaited. A refusal is the one
every adapter sends: 429 with ``Retry-After`` and an RFC 9457 problem body (413
or 403 when it can never pass), the same from the dependency and the
middleware; every limited response carries ``RateLimit-Policy`` and
``RateLimit`` (draft-ietf-httpapi-ratelimit-headers-11), one field each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from bucketlimit._core import Decision
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.fields import Refusal
from bucketlimit._web.limits import ConfigurationError, KeyFunctionError
from bucketlimit._web.reservations import AsyncReservation, reserve_async
from bucketlimit.asgi import (
    POLICY_VIOLATION,
    AsgiLimit,
    RateLimitMiddleware,
    Receive,
    Scope,
    ratelimit_fields,
    refusal_bytes,
    request_limits,
    reservation,
    send_refusal,
)

__all__ = [
    "POLICY_VIOLATION",
    "AsyncReservation",
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "RateLimitExceeded",
    "RateLimitMiddleware",
    "client_address",
    "ratelimit_fields",
    "refusal_handler",
    "remote_address",
    "reservation",
    "reserve_async",
]


def client_address(
    trusted_proxies: Iterable[str | Network] = (), *, ipv6_prefix: int = 64
) -> Callable[[HTTPConnection], str]:
    """A key function: the client's IP address, an IPv6 client by its ``/64``.

    With no trusted proxies (the default) it is the direct peer, ``request.client``,
    and ``X-Forwarded-For`` is ignored: a client cannot pick its own key by sending
    one. Behind proxies, list their networks; the key is then the right-most
    ``X-Forwarded-For`` hop that is not one of them. (Do not also run uvicorn's
    ``--proxy-headers`` with a broad ``--forwarded-allow-ips``: it rewrites the peer
    before this function sees it.) ``ipv6_prefix`` (0-128) is how many bits of an
    IPv6 address the key keeps.
    """
    return client_address_key(
        trusted_proxies,
        lambda request: request.client.host if request.client is not None else None,
        lambda request: request.headers.getlist("x-forwarded-for"),
        "scope['client'] is None",
        ipv6_prefix,
    )


#: The default key: the direct peer address (IPv6 by /64), ``X-Forwarded-For`` ignored.
remote_address = client_address()


class RateLimitExceeded(HTTPException):
    """The refusal a :class:`Limit` dependency raises; :func:`refusal_handler` answers it.

    The dependency registers that handler with the app's exception middleware the
    first time it refuses (unless the app registered its own), so the body is the
    same problem document the middleware sends, not ``{"detail": ...}``.
    """

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(
            refusal.status, detail=str(refusal.body["detail"]), headers=refusal.headers
        )
        self.refusal = refusal

    @property
    def decision(self) -> Decision:
        return self.refusal.decision


async def refusal_handler(connection: HTTPConnection, exc: Exception) -> Response | None:
    """Answers a :class:`RateLimitExceeded`: the problem response, or for a WebSocket
    a refused handshake (429 where the server can send one, else close 1008)."""
    assert isinstance(exc, RateLimitExceeded)
    refusal = exc.refusal
    if connection.scope["type"] == "websocket":
        websocket: Any = connection
        await send_refusal(connection.scope, websocket.receive, websocket.send, refusal)
        return None
    return Response(refusal_bytes(refusal), refusal.status, headers=refusal.headers)


def _register_handler(scope: Scope) -> None:
    handlers = scope.get("starlette.exception_handlers")
    if handlers is not None:
        handlers[0].setdefault(RateLimitExceeded, refusal_handler)


class Limit(AsgiLimit[Any]):
    """One limit: a FastAPI dependency, or app-wide through :class:`RateLimitMiddleware`.

    The arguments are those of :class:`bucketlimit._web.limits.LimitSettings`
    (docs/web.md); any limiter works, ``AsyncRedisTokenBucketLimiter`` included,
    and its functions may be ``async def`` (e.g. a cost of
    ``(await request.json())["max_tokens"]``: the route can still read the body).
    A request waiting ``max_wait`` for its tokens awaits ``acquire_async``. As a
    dependency (HTTP and websocket routes) it returns the request's
    :class:`AsyncReservation`.
    """

    default_key = staticmethod(remote_address)

    def connection(self, scope: Scope, receive: Receive) -> HTTPConnection:
        return Request(scope, receive) if scope["type"] == "http" else HTTPConnection(scope)

    async def __call__(self, request: HTTPConnection, response: Response) -> AsyncReservation:
        held, refused = await self.apply(request)
        limits = request_limits(request.scope)
        if refused:
            _register_handler(request.scope)
            raise RateLimitExceeded(limits.refusal())
        for name, value in limits.fields().items():
            response.headers[name] = value  # replaces: the last limit writes every member
        return held
