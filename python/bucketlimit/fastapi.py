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

A ``concurrency=`` limit holds its permit until the response ends (a streamed body
included). :class:`RateLimitMiddleware` releases it as soon as the last chunk is
sent or the client goes away (``app.add_middleware(RateLimitMiddleware)`` takes no
limit of its own then). Without it, ``Depends(limit)`` hands the release to
FastAPI's exit stack of the request's dependencies, which FastAPI 0.118 and later
closes once the response has been sent (its background tasks included) or the
route failed; on an older FastAPI the dependency raises ``ConfigurationError``
instead: add the middleware.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.routing import Match

from bucketlimit._core import Decision
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError
from bucketlimit._web.fields import RETRY_AFTER, Refusal, RefusalHook
from bucketlimit._web.profiles import RETRY_AFTER_MS
from bucketlimit._web.reservations import AsyncReservation, reserve_async
from bucketlimit._web.startup import StoreCheckError
from bucketlimit._web.waiting import ClientDisconnected
from bucketlimit.asgi import (
    POLICY_VIOLATION,
    AsgiLimit,
    Receive,
    Scope,
    disconnect_watch,
    ratelimit_fields,
    refusal_bytes,
    release_permits_later,
    releases_permits,
    request_limits,
    reservation,
    send_refusal,
    startup_check,
)
from bucketlimit.asgi import RateLimitMiddleware as _AsgiMiddleware

__all__ = [
    "POLICY_VIOLATION",
    "AsyncReservation",
    "ClientDisconnected",
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "RateLimitExceeded",
    "RateLimitMiddleware",
    "StoreCheckError",
    "client_address",
    "exempt",
    "ratelimit_fields",
    "refusal_handler",
    "remote_address",
    "reservation",
    "reserve_async",
    "shared_limit",
    "startup_check",
]

F = TypeVar("F", bound=Callable[..., Any])

#: FastAPI's exit stack of a request's dependencies (``request.scope`` key): since
#: FastAPI 0.118 it closes after the response is sent, when dependencies with
#: ``yield`` finish. No such key: an older FastAPI, which closed it sooner.
_REQUEST_STACK = "fastapi_inner_astack"

_EXEMPT = "__bucketlimit_exempt__"  # an endpoint's mark: the middleware skips its route
#: Whether any endpoint was marked: until then no request looks for its route.
_any_exempt = False


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


def exempt(endpoint: F) -> F:
    """Marks a route's endpoint that :class:`RateLimitMiddleware` skips (no limit, no
    charge, no fields): ``@app.get("/health")`` above ``@exempt``. A
    ``Depends(limit)`` of the route still applies."""
    global _any_exempt
    setattr(endpoint, _EXEMPT, True)
    _any_exempt = True
    return endpoint


def _matched(scope: Scope) -> tuple[Any, Any]:
    """The route ``scope`` goes to and its endpoint (Starlette's own matching, over
    the app's routes), or ``(None, None)``."""
    for route in _routes(scope.get("app")):
        match, child = route.matches(scope)
        if match is Match.FULL:
            return route, child.get("endpoint", getattr(route, "endpoint", None))
    return None, None


class RateLimitExceeded(HTTPException):
    """The refusal a :class:`Limit` dependency raises; :func:`refusal_handler` answers it.

    The dependency registers that handler with the app's exception middleware the
    first time it refuses (unless the app registered its own), so the body is the
    same problem document the middleware sends, not ``{"detail": ...}``. ``hook``
    is the ``on_refusal`` that makes the response instead (or ``None``).
    """

    def __init__(self, refusal: Refusal, hook: RefusalHook | None = None) -> None:
        error = refusal.body.get("error")
        detail = error.get("message") if isinstance(error, dict) else refusal.body.get("detail")
        super().__init__(refusal.status, detail=str(detail), headers=refusal.headers)
        self.refusal = refusal
        self.hook = hook

    @property
    def decision(self) -> Decision:
        return self.refusal.decision


async def refusal_handler(connection: HTTPConnection, exc: Exception) -> Response | None:
    """Answers a :class:`RateLimitExceeded`: the problem response (or what its
    ``on_refusal`` returned, with the fields and ``Retry-After`` added where it set
    none; a hook's ``None`` is the problem response), or for a WebSocket a refused
    handshake (429 where the server can send one, else close 1008)."""
    assert isinstance(exc, RateLimitExceeded)
    refusal = exc.refusal
    response = None
    if exc.hook is not None and connection.scope["type"] == "http":
        response = exc.hook(connection, refusal)
        if inspect.isawaitable(response):
            response = await response
    if response is not None:  # the hook's answer (None: the default refusal)
        if isinstance(response, Response):
            for name, value in request_limits(connection.scope).fields(refused=True).items():
                response.headers[name] = value
            if response.status_code == refusal.status:
                for name in (RETRY_AFTER, RETRY_AFTER_MS):
                    if name in refusal.headers and name not in response.headers:
                        response.headers[name] = refusal.headers[name]
        return response  # type: ignore[no-any-return]
    if connection.scope["type"] == "websocket":
        websocket: Any = connection
        await send_refusal(connection.scope, websocket.receive, websocket.send, refusal)
        return None
    return Response(refusal_bytes(refusal), refusal.status, headers=refusal.headers)


def _watch(request: Request) -> Callable[[], Any] | None:
    """What a waiting dependency races: the middleware's watch of the receive stream
    when it runs, else the request's own (its body read first, so the route still
    has it: Starlette keeps it on the request)."""
    found = disconnect_watch(request.scope)
    if found is not None:
        return found

    async def disconnected() -> None:
        await request.body()
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return disconnected


def _register_handler(scope: Scope) -> None:
    handlers = scope.get("starlette.exception_handlers")
    if handlers is not None:
        handlers[0].setdefault(RateLimitExceeded, refusal_handler)


def _routes(app: object) -> Iterable[Any]:
    return getattr(getattr(app, "router", None), "routes", ())


def _route_limits(routes: Iterable[Any]) -> list[tuple[AsgiLimit[Any], Any]]:
    """``(limit, route)`` for each ``Depends(limit)`` of each of ``routes``, in their
    order (a route's own dependencies, its router's and the app's: FastAPI's
    dependency tree of the route)."""
    found: list[tuple[AsgiLimit[Any], Any]] = []
    for route in routes:
        stack = [getattr(route, "dependant", None)]
        while stack:
            dependant = stack.pop()
            if dependant is None:
                continue
            call = getattr(dependant, "call", None)
            if isinstance(call, AsgiLimit):
                found.append((call, route))
            stack.extend(reversed(getattr(dependant, "dependencies", ())))
    return found


def _route_id(route: Any) -> str:
    """A route's methods and path (``GET /login``): what names its buckets."""
    methods = sorted(getattr(route, "methods", None) or ())
    return " ".join([*methods, str(getattr(route, "path", "?"))])


def _attach_routes(app: object) -> list[AsgiLimit[Any]]:
    """Attaches every route limit of ``app`` to the first route that depends on it,
    and returns them."""
    limits = []
    for limit, route in _route_limits(_routes(app)):
        limit.attach(_route_id(route))
        limits.append(limit)
    return limits


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

    def locate(self, scope: Scope) -> None:
        """A route's dependency keeps the buckets of the first route (in the app's
        order) that depends on it; the middleware's, its name."""
        _attach_routes(scope.get("app"))
        self.attach(None)

    async def __call__(self, request: HTTPConnection, response: Response) -> AsyncReservation:
        counted_later = releases_permits(request.scope) or self._finish_after_the_response(
            request.scope
        )
        watch = None
        if self.max_wait and isinstance(request, Request):
            watch = _watch(request)
        try:
            held, refused = await self.apply(request, watch)
        except ClientDisconnected:
            # Nobody to answer (nginx's 499, "client closed request"); tokens given back.
            raise HTTPException(499, detail="client closed request") from None
        limits = request_limits(request.scope)
        if refused:
            _register_handler(request.scope)
            raise RateLimitExceeded(limits.refusal(), limits.refusal_hook())
        for name, value in limits.fields().items():
            response.headers[name] = value  # replaces: the last limit writes every member
        if not counted_later:
            limits.answered()
        return held

    def _finish_after_the_response(self, scope: Scope) -> bool:
        """Without the middleware: the request's permits are released, and its
        admissions counted, when FastAPI closes its dependencies' exit stack, after
        the response (0.118 and later). An older FastAPI has no such stack: a
        concurrency limit is then a ``ConfigurationError``, and an admission is
        counted at once (False)."""
        stack = scope.get(_REQUEST_STACK)
        if isinstance(stack, AsyncExitStack):
            stack.push_async_callback(release_permits_later(scope))
            return True
        if self.concurrency is not None:
            raise ConfigurationError(
                f"Depends(limit) of limit {self.name!r} has concurrency=, whose permit is "
                "held until the response ends, and this FastAPI (before 0.118) closes its "
                "dependencies before the response is sent: add "
                "bucketlimit.fastapi.RateLimitMiddleware to the app "
                "(app.add_middleware(RateLimitMiddleware), with or without a limit of its "
                "own), which releases it"
            )
        return False


def shared_limit(limit: str, scope: str, **options: Any) -> Limit:
    """slowapi's ``shared_limit``: a limit string whose buckets are the ``scope``'s,
    shared by every route that depends on a limit of that scope
    (``Limit(limit, scope=scope, ...)``), in process and in Redis alike."""
    return Limit(limit, scope=scope, **options)


class RateLimitMiddleware(_AsgiMiddleware):
    """:class:`bucketlimit.asgi.RateLimitMiddleware` for Starlette and FastAPI: a
    limit string becomes a :class:`Limit` of this module, routes whose endpoint is
    marked :func:`exempt` are skipped, the default limits (slowapi's
    ``default_limits``) are a bucket per client per route (its methods and path) on
    the routes with no ``Depends(Limit(...))`` of their own, and the lifespan
    start-up asks the store of every limit of the app, the routes' included."""

    limit_class = Limit

    def exempt_scope(self, scope: Scope) -> bool:
        if not _any_exempt:
            return False
        return bool(getattr(_matched(scope)[1], _EXEMPT, False))

    def route_of(self, scope: Scope) -> str | None:
        route, _ = _matched(scope)
        if route is None:
            return None
        if id(route) not in self.routes:  # a route with a limit of its own: none
            self.routes[id(route)] = None if _route_limits([route]) else _route_id(route)
        return self.routes[id(route)]

    def app_limits(self, scope: Scope) -> list[AsgiLimit[Any]]:
        return [*super().app_limits(scope), *_attach_routes(scope.get("app"))]
