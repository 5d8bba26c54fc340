"""Rate limits for Litestar: a middleware, app-wide or on any layer (router,
controller, route handler).

::

    from litestar import Litestar, get
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.litestar import Limit

    per_client = Limit(TokenBucketLimiter(10, 1), name="per-client")
    search = Limit(TokenBucketLimiter(2, 0.1), name="search")

    @get("/search", middleware=[search.middleware])    # one route
    async def do_search() -> str: ...

    app = Litestar([do_search], middleware=[per_client.middleware])   # every request

``limit.middleware`` is a ``DefineMiddleware`` of the pure ASGI
:class:`bucketlimit.asgi.RateLimitMiddleware`, so Litestar's own layering applies
it; key, cost and exempt functions receive a Litestar ``Request`` (an
``ASGIConnection`` for a WebSocket) and may be ``async def``. The refusal and the
fields are those of every adapter (docs/design.md §7); a WebSocket is limited at
the handshake. Unlike Litestar's own ``RateLimitConfig`` the decision is one
atomic step (in Redis too) and the fields are draft-11's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.middleware import DefineMiddleware

from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError
from bucketlimit._web.reservations import AsyncReservation, reserve_async
from bucketlimit._web.startup import StoreCheckError
from bucketlimit._web.waiting import ClientDisconnected
from bucketlimit.asgi import (
    AsgiLimit,
    RateLimitMiddleware,
    Receive,
    Scope,
    Send,
    ratelimit_fields,
    reservation,
    startup_check,
)

__all__ = [
    "AsyncReservation",
    "ClientDisconnected",
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "RateLimitMiddleware",
    "StoreCheckError",
    "client_address",
    "ratelimit_fields",
    "remote_address",
    "reservation",
    "reserve_async",
    "startup_check",
]


def client_address(
    trusted_proxies: Iterable[str | Network] = (), *, ipv6_prefix: int = 64
) -> Callable[[ASGIConnection[Any, Any, Any, Any]], str]:
    """A key function: the client's IP address, an IPv6 client by its ``/64``.

    With no trusted proxies (the default) it is the direct peer, ``request.client``,
    and ``X-Forwarded-For`` is ignored. Behind proxies, list their networks; the key
    is then the right-most ``X-Forwarded-For`` hop that is not one of them.
    """
    return client_address_key(
        trusted_proxies,
        lambda request: request.client.host if request.client is not None else None,
        lambda request: request.headers.getall("x-forwarded-for", []),
        "scope['client'] is None",
        ipv6_prefix,
    )


#: The default key: the direct peer address (IPv6 by /64), ``X-Forwarded-For`` ignored.
remote_address = client_address()


class Limit(AsgiLimit[Any]):
    """One limit for Litestar: put :attr:`middleware` on the app or any layer.

    The same settings as every adapter: ``limiter`` (or a plan function, or a limit
    string on ``storage=``), ``key`` (default :data:`remote_address`), ``cost``,
    ``name``, ``shadow``, ``exempt``, ``pk``, ``max_wait``, ``headers``,
    ``on_refusal`` (docs/web.md); ``on_refusal`` may return a Litestar ``Response``.
    Its Redis store is checked at start-up with
    ``Litestar(..., on_startup=[limit.check_store])`` (every limit's:
    ``on_startup=[startup_check]``).
    """

    default_key = staticmethod(remote_address)

    def connection(self, scope: Scope, receive: Receive) -> Any:
        if scope["type"] == "http":
            return Request(scope, receive)  # type: ignore[arg-type]
        return ASGIConnection(scope)  # type: ignore[arg-type]

    def locate(self, scope: Scope) -> None:
        """A limit in one route handler's own ``middleware=`` keeps the buckets of the
        first such handler (in the app's order); one on a layer (the app, a router,
        a controller), its name."""
        for route in getattr(scope.get("app"), "routes", ()):
            handlers = getattr(route, "route_handlers", None) or [
                getattr(route, "route_handler", None)
            ]
            for handler in handlers:
                for middleware in getattr(handler, "middleware", None) or ():
                    limit = getattr(middleware, "kwargs", {}).get("limit")
                    if isinstance(limit, Limit):
                        methods = sorted(getattr(handler, "http_methods", None) or ())
                        limit.attach(" ".join([*methods, str(route.path)]))
        self.attach(None)

    async def send_response(
        self, response: Any, request: Any, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Sends what ``on_refusal`` returned: a Litestar ``Response``, or an ASGI app."""
        if isinstance(response, Response):
            response = response.to_asgi_response(None, request)
        await response(scope, receive, send)

    @property
    def middleware(self) -> DefineMiddleware:
        """This limit as Litestar middleware: ``middleware=[limit.middleware]``."""
        # Pure ASGI: Litestar's stricter scope types describe the same messages.
        return DefineMiddleware(RateLimitMiddleware, limit=self)  # type: ignore[arg-type]
