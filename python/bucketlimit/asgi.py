"""Rate limits for any ASGI app: a pure ASGI middleware, HTTP and WebSockets.

Nothing here imports a web framework: Starlette, Litestar, Quart, Django's ASGI
handler or a bare ASGI callable all take it. ::

    from bucketlimit import TokenBucketLimiter
    from bucketlimit.asgi import Limit, RateLimitMiddleware

    app = RateLimitMiddleware(app, limit=Limit(TokenBucketLimiter(10, 1), name="per-client"))

Key, cost and exempt functions receive a :class:`Connection` (the scope, its
headers, the peer, the body) and may be ``async def``. A refused HTTP request
gets the one refusal every adapter sends (docs/design.md §7): 429 with
``Retry-After`` and an RFC 9457 problem body, 413 or 403 when it can never pass.
A WebSocket is limited at the handshake: a refused one gets that same answer
through the ``websocket.http.response`` extension where the server offers it,
otherwise it is closed before ``accept`` with code 1008 (policy violation). An
accepted one carries the RateLimit fields on its ``accept``.

Starlette and FastAPI users: :mod:`bucketlimit.fastapi` gives key functions a
Starlette ``Request`` instead; :mod:`bucketlimit.litestar` a Litestar one.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Generic, TypeVar, cast

from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.fields import Refusal
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
    "Connection",
    "KeyFunctionError",
    "Limit",
    "RateLimitMiddleware",
    "client_address",
    "ratelimit_fields",
    "remote_address",
    "reservation",
    "reserve_async",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

R = TypeVar("R")  # the request type a framework's key functions receive

_STATE = "bucketlimit"
_FIELD_NAMES = (b"ratelimit", b"ratelimit-policy")
_DENIAL = "websocket.http.response"
#: The close code of a refused WebSocket when the server cannot send a 429.
POLICY_VIOLATION = 1008


class Connection:
    """An HTTP request or a WebSocket handshake, as bare ASGI gives it.

    ``scope``, ``method`` (``"GET"`` for a WebSocket), ``path``, ``client`` (the
    peer's host, or ``None``), ``header(name)`` / ``header_list(name)`` (names
    are case-insensitive) and, for HTTP, ``await body()`` / ``await json()``:
    the app can still read the body after a cost function did.
    """

    __slots__ = ("_body", "_receive", "scope")

    def __init__(self, scope: Scope, receive: Receive | None = None) -> None:
        self.scope = scope
        self._receive = receive
        self._body: bytes | None = None

    @property
    def method(self) -> str:
        return cast(str, self.scope.get("method", "GET"))

    @property
    def path(self) -> str:
        return cast(str, self.scope.get("path", ""))

    @property
    def client(self) -> str | None:
        peer = self.scope.get("client")
        return None if peer is None else cast(str, peer[0])

    def header_list(self, name: str) -> list[str]:
        wanted = name.lower().encode("latin-1")
        return [
            v.decode("latin-1") for k, v in self.scope.get("headers", ()) if k.lower() == wanted
        ]

    def header(self, name: str, default: str | None = None) -> str | None:
        values = self.header_list(name)
        return ", ".join(values) if values else default

    async def body(self) -> bytes:
        if self._body is None:
            if self._receive is None:
                raise RuntimeError("a WebSocket handshake has no body")
            chunks = []
            while True:
                message = await self._receive()
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        return json.loads(await self.body())

    def __repr__(self) -> str:
        return f"Connection({self.scope.get('type')!r}, {self.method} {self.path})"


def client_address(
    trusted_proxies: Iterable[str | Network] = (), *, ipv6_prefix: int = 64
) -> Callable[[Connection], str]:
    """A key function: the client's IP address, an IPv6 client by its ``/64``.

    With no trusted proxies (the default) it is the direct peer, ``scope["client"]``,
    and ``X-Forwarded-For`` is ignored. Behind proxies, list their networks; the key
    is then the right-most ``X-Forwarded-For`` hop that is not one of them.
    ``ipv6_prefix`` (0-128) is how many bits of an IPv6 address the key keeps.
    """
    return client_address_key(
        trusted_proxies,
        lambda request: request.client,
        lambda request: request.header_list("x-forwarded-for"),
        "scope['client'] is None",
        ipv6_prefix,
    )


#: The default key: the direct peer address (IPv6 by /64), ``X-Forwarded-For`` ignored.
remote_address = client_address()


def request_limits(scope: Scope) -> RequestLimits:
    """The request's limits, kept in ``scope["state"]`` (``request.state`` in
    Starlette and Litestar): shared by the middleware, the dependencies and the
    route of one request, fresh for each request."""
    state: dict[str, Any] = scope.setdefault("state", {})
    limits = state.get(_STATE)
    if limits is None:
        limits = state[_STATE] = RequestLimits()
    return cast(RequestLimits, limits)


def ratelimit_fields(request: Any) -> dict[str, str]:
    """The ``RateLimit-Policy`` and ``RateLimit`` fields of the limits applied so far
    to ``request`` (anything with a ``scope``)."""
    limits = request.scope.get("state", {}).get(_STATE)
    return {} if limits is None else cast(RequestLimits, limits).fields()


def reservation(request: Any, name: str | None = None) -> AsyncReservation:
    """The reservation a limit made for ``request`` (``name`` when several apply).

    ``await held.settle(used)`` refunds the unused part, also after the response.
    """
    limits = request.scope.get("state", {}).get(_STATE)
    if limits is None:
        raise LookupError("no limit applied to this request")
    found = cast(RequestLimits, limits).reservation(name)
    if not isinstance(found, AsyncReservation):  # pragma: no cover - only sync adapters make these
        raise TypeError("a sync reservation in an ASGI request")
    return found


def _describe(request: Any) -> str:
    scope = request.scope
    if scope["type"] == "websocket":
        return f"WebSocket {scope.get('path', '')}"
    return f"{scope.get('method', '')} {scope.get('path', '')}"


def encode_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def refusal_bytes(refusal: Refusal) -> bytes:
    return json.dumps(refusal.body, separators=(",", ":")).encode()


async def send_refusal(scope: Scope, receive: Receive, send: Send, refusal: Refusal) -> None:
    """Writes a refusal as raw ASGI: an HTTP response, or a refused WebSocket handshake."""
    body = refusal_bytes(refusal)
    headers = [*encode_headers(refusal.headers), (b"content-length", str(len(body)).encode())]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await receive()  # the handshake's websocket.connect
    if _DENIAL in (scope.get("extensions") or {}):
        start = {"type": "websocket.http.response.start", "status": refusal.status}
        await send({**start, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": "rate limited"})


def _with_fields(message: Message, fields: dict[str, str]) -> Message:
    """A response start (or WebSocket accept) with exactly one RateLimit and one
    RateLimit-Policy field."""
    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in _FIELD_NAMES]
    headers += encode_headers(fields)
    return {**message, "headers": headers}


class AsgiLimit(LimitSettings[R], Generic[R]):
    """What every ASGI adapter's ``Limit`` shares: applying it to a scope.

    A framework's subclass says how to build its request object from the scope
    (:meth:`connection`).
    """

    def connection(self, scope: Scope, receive: Receive) -> R:  # pragma: no cover - abstract
        raise NotImplementedError

    async def apply(self, request: R) -> tuple[AsyncReservation, bool]:
        """Applies the limit: the request's reservation, and whether to refuse."""
        scope: Scope = request.scope  # type: ignore[attr-defined]
        held, refused = await run_async(
            self.procedure(request, lambda: request_limits(scope), _describe, AsyncReservation)
        )
        if held is None:  # exempt: no limit, no charge
            held = AsyncReservation(None, "", 0, None)
        return held, refused


class Limit(AsgiLimit[Connection]):
    """One limit for a bare ASGI app, applied by :class:`RateLimitMiddleware`.

    - ``limiter``: ``TokenBucketLimiter``, ``RedisTokenBucketLimiter`` or
      ``AsyncRedisTokenBucketLimiter`` (awaited), or a function of the request
      returning one (a plan's), or ``(policy_name, limiter)``.
    - ``key``: a function (or ``async def``) of the :class:`Connection` returning a
      non-empty ``str``; default :data:`remote_address`.
    - ``cost``: an ``int`` or a function (or ``async def``) of the connection.
    - ``name``, ``shadow``, ``exempt``, ``pk``: as in every adapter (docs/web.md).
    """

    default_key = staticmethod(remote_address)

    def connection(self, scope: Scope, receive: Receive) -> Connection:
        return Connection(scope, receive if scope["type"] == "http" else None)


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


class RateLimitMiddleware:
    """Pure ASGI middleware applying a limit to every HTTP request and WebSocket.

    ``RateLimitMiddleware(app, limit=per_client)`` (Starlette:
    ``app.add_middleware(RateLimitMiddleware, limit=per_client)``). It writes the
    final RateLimit fields of every limit of the request (its own and the
    route's) on the response start, replacing any the app wrote, so they appear
    once. It does not buffer responses: streaming and background tasks behave as
    without it. Lifespan and other scopes pass through.
    """

    def __init__(self, app: ASGIApp, limit: AsgiLimit[Any]) -> None:
        if not isinstance(limit, AsgiLimit):
            raise TypeError(
                "RateLimitMiddleware takes a Limit of bucketlimit.asgi, bucketlimit.fastapi "
                f"or bucketlimit.litestar, got {limit!r}"
            )
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http" and kind != "websocket":
            await self.app(scope, receive, send)
            return
        body = _Replay(receive) if kind == "http" else None
        request = self.limit.connection(scope, body.record if body is not None else receive)
        _, refused = await self.limit.apply(request)
        limits = request_limits(scope)
        if refused:
            await send_refusal(scope, receive, send, limits.refusal())
            return

        async def send_with_fields(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start" or kind == "websocket.accept":
                fields = limits.fields()
                if fields:
                    message = _with_fields(message, fields)
            await send(message)

        await self.app(scope, body.replay if body is not None else receive, send_with_fields)
