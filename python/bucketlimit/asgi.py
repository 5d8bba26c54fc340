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

A limit with ``concurrency=`` holds its permit until the response ends: its last
body chunk sent (a streamed body included), the client gone (``http.disconnect``),
or the app done or failed; a WebSocket's until it closes. The middleware releases
the permits of every limit of the request, a route's own included.

Starlette and FastAPI users: :mod:`bucketlimit.fastapi` gives key functions a
Starlette ``Request`` instead; :mod:`bucketlimit.litestar` a Litestar one.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Generic, TypeVar, cast

from bucketlimit import _config
from bucketlimit._web import profiles
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError
from bucketlimit._web.fields import RETRY_AFTER, Refusal, RefusalHook
from bucketlimit._web.limits import Headers, LimitSettings, live_limits
from bucketlimit._web.procedure import run_async
from bucketlimit._web.request_limits import RequestLimits
from bucketlimit._web.reservations import AsyncReservation, reserve_async
from bucketlimit._web.startup import StoreCheckError, check_stores_async
from bucketlimit._web.waiting import ClientDisconnected

__all__ = [
    "AsyncReservation",
    "ClientDisconnected",
    "ConfigurationError",
    "Connection",
    "KeyFunctionError",
    "Limit",
    "RateLimitMiddleware",
    "StoreCheckError",
    "client_address",
    "ratelimit_fields",
    "release_permits_later",
    "releases_permits",
    "remote_address",
    "reservation",
    "reserve_async",
    "startup_check",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

R = TypeVar("R")  # the request type a framework's key functions receive

_STATE = "bucketlimit"
_REPLAY = "bucketlimit.receive"  # scope["state"]: the middleware's receive stream
_CLOSES = "bucketlimit.closes"  # scope["state"]: a middleware releases the request's permits
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


def request_limits(
    scope: Scope,
    headers: tuple[str, ...] | None = None,
    on_refusal: RefusalHook | None = None,
    check_store: bool = True,
    storage: str | None = None,
) -> RequestLimits:
    """The request's limits, kept in ``scope["state"]`` (``request.state`` in
    Starlette and Litestar): shared by the middleware, the dependencies and the
    route of one request, fresh for each request. The first to make them (the
    outermost middleware) gives the app's header profile, refusal hook,
    ``check_store`` and storage."""
    state: dict[str, Any] = scope.setdefault("state", {})
    limits = state.get(_STATE)
    if limits is None:
        limits = state[_STATE] = RequestLimits(headers, on_refusal, check_store, storage)
    return cast(RequestLimits, limits)


def releases_permits(scope: Scope) -> bool:
    """Whether something releases this request's permits when its response ends (what
    a route's ``concurrency=`` limit needs): a :class:`RateLimitMiddleware` around
    it, or what :func:`release_permits_later` arranged."""
    state: dict[str, object] = scope.get("state", {})
    return state.get(_CLOSES) is True


def release_permits_later(scope: Scope) -> Callable[[], Awaitable[None]]:
    """Marks the request's permits as released by someone other than a middleware,
    and returns the coroutine function that releases them and counts the request
    ``allowed`` by the limits that admitted it (``RequestLimits.answered``), to be
    called once the response has ended (FastAPI's dependency hands it to the
    request's exit stack)."""
    state: dict[str, Any] = scope.setdefault("state", {})
    state[_CLOSES] = True

    async def release() -> None:
        limits: RequestLimits | None = state.get(_STATE)
        if limits is not None:
            limits.answered()
            await _awaited(limits.close())

    return release


async def _awaited(answer: Awaitable[None] | None) -> None:
    if answer is not None:
        await answer


def _ends(message: Message) -> bool:
    """Whether ``message``, sent, ends the response (or the WebSocket)."""
    kind: str = message["type"]
    if kind == "http.response.body" or kind == "websocket.http.response.body":
        return not message.get("more_body", False)
    return kind == "websocket.close"


_GONE = ("http.disconnect", "websocket.disconnect")
#: What starts a response: by then every limit of the request has decided.
_STARTS = ("http.response.start", "websocket.accept", _DENIAL + ".start")


async def _serve(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, limits: RequestLimits | None
) -> None:
    """Runs ``app``: writes the fields of ``limits`` (when given) on the response start
    or WebSocket accept, and releases the request's permits (those its route's
    limits take too) once the response has ended: its last body chunk sent, the
    client gone, or the app returned or failed. A streamed body renews them as it
    goes (``RequestLimits.keep_alive``). Once a response starts (or the app ends
    without one) every limit of the request has decided: those that admitted it
    count it ``allowed`` (``RequestLimits.answered``)."""
    state: dict[str, Any] = scope["state"]

    async def sending(message: Message) -> None:
        kind = message["type"]
        if kind in _STARTS:
            answered: RequestLimits | None = state.get(_STATE)
            if answered is not None:
                answered.answered()
            if limits is not None and kind != _DENIAL + ".start":
                fields = limits.fields()
                if fields:
                    message = _with_fields(message, fields)
        await send(message)
        held: RequestLimits | None = state.get(_STATE)
        if held is not None and held.permits:
            await _awaited(held.close() if _ends(message) else held.keep_alive())

    async def receiving() -> Message:
        message = await receive()
        if message["type"] in _GONE:
            held: RequestLimits | None = state.get(_STATE)
            if held is not None:
                await _awaited(held.close())
        return message

    try:
        await app(scope, receiving, sending)
    finally:
        held: RequestLimits | None = state.get(_STATE)
        if held is not None:
            held.answered()
            await _awaited(held.close())


def disconnect_watch(scope: Scope) -> Callable[[], Awaitable[object]] | None:
    """What a waiting request races when the middleware runs: a function whose
    awaitable ends when the client disconnects (``None`` without the middleware)."""
    replay = scope.get("state", {}).get(_REPLAY)
    return None if replay is None else cast(_Replay, replay).disconnected


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
    """A response start (or WebSocket accept) with exactly one of each rate-limit
    field (the app's own are replaced)."""
    if not fields:
        return message
    names = _FIELD_NAMES + _names(fields)
    headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in names]
    headers += encode_headers(fields)
    return {**message, "headers": headers}


def _names(fields: dict[str, str]) -> tuple[bytes, ...]:
    return tuple(name.lower().encode("latin-1") for name in fields)


class AsgiLimit(LimitSettings[R], Generic[R]):
    """What every ASGI adapter's ``Limit`` shares: applying it to a scope.

    A framework's subclass says how to build its request object from the scope
    (:meth:`connection`) and how to send a response its ``on_refusal`` returned
    (:meth:`send_response`). A limit string on a Redis storage gets the asyncio
    limiter.
    """

    storage_asyncio = True

    def connection(self, scope: Scope, receive: Receive) -> R:  # pragma: no cover - abstract
        raise NotImplementedError

    async def apply(
        self, request: R, disconnected: Callable[[], Awaitable[object]] | None = None
    ) -> tuple[AsyncReservation, bool]:
        """Applies the limit: the request's reservation, and whether to refuse. While
        it waits (``max_wait``), ``disconnected`` (default: the middleware's watch of
        the receive stream) ending first cancels the wait and raises
        :class:`ClientDisconnected`, every token of the request given back."""
        scope: Scope = request.scope  # type: ignore[attr-defined]
        if not self.attached:
            self.locate(scope)
        if disconnected is None and self.max_wait:
            disconnected = disconnect_watch(scope)
        held, refused = await run_async(
            self.procedure(request, lambda: request_limits(scope), _describe, AsyncReservation),
            disconnected,
        )
        if held is None:  # exempt: no limit, no charge
            held = AsyncReservation(None, "", 0, None)
        return held, refused

    def locate(self, scope: Scope) -> None:
        """Attaches the limit to the route of the app (``scope["app"]``) it is applied
        to, the same in every process (:meth:`LimitSettings.attach`): a framework's
        subclass reads its routes. A bare ASGI app has none: the limit's name."""
        self.attach(None)

    async def send_response(
        self, response: Any, request: R, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Sends what ``on_refusal`` returned: here an ASGI app (a Starlette
        ``Response`` is one)."""
        await response(scope, receive, send)

    async def check_store(self) -> None:
        """Asks this limit's Redis store now (``check()``, awaited for the asyncio
        limiter); raises :class:`StoreCheckError` when it does not answer. Nothing
        for an in-process limiter. A start-up hook: Litestar's
        ``on_startup=[limit.check_store]``, or a FastAPI lifespan."""
        await check_stores_async([self])


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
    """Keeps what a limit read from the receive stream (a cost from the JSON body, or
    messages read while watching for a disconnect) for the app to read again."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._kept: deque[Message] = deque()
        self._pending: asyncio.Future[Message] | None = None

    async def _next(self) -> Message:
        """The next message; one a cancelled watch left in flight comes first."""
        pending = self._pending
        if pending is None:
            return await self._receive()
        message = await asyncio.shield(pending)
        self._pending = None
        return message

    async def record(self) -> Message:
        message = await self._next()
        self._kept.append(message)
        return message

    async def disconnected(self) -> None:
        """Ends when the client disconnects: reads (and keeps, for the app) the rest
        of the body until ``http.disconnect`` comes. Cancelled, it leaves the receive
        it was waiting on running (shielded), so no message is lost."""
        if any(m["type"] == "http.disconnect" for m in self._kept):
            return
        while True:
            if self._pending is None:
                self._pending = asyncio.ensure_future(self._receive())
            message = await asyncio.shield(self._pending)
            self._pending = None
            self._kept.append(message)
            if message["type"] == "http.disconnect":
                return

    async def replay(self) -> Message:
        if self._kept:
            return self._kept.popleft()
        return await self._next()


class RateLimitMiddleware:
    """Pure ASGI middleware applying a limit to every HTTP request and WebSocket.

    ``RateLimitMiddleware(app, limit=per_client)`` (Starlette:
    ``app.add_middleware(RateLimitMiddleware, limit=per_client)``); ``limit`` may
    be a limit string (``"100/minute"``, in memory unless a ``Limit`` says
    ``storage=``), or ``None``: no limit of its own, for an app whose limits are on
    its routes. It writes the final rate-limit fields of every limit of the
    request (its own and the route's) on the response start, replacing any the
    app wrote, so they appear once, and releases their concurrency permits when
    the response ends (a route's ``concurrency=`` limit needs it). It does not
    buffer responses: streaming and background tasks behave as without it.

    - ``headers``: the header profile(s) of the limits of the request that name none
      (default ``"draft-11"``; ``[]`` for none);
    - ``on_refusal(request, refusal)``: the response (an ASGI app, e.g. a Starlette
      ``Response``; may be ``async def``) for a refusal by a limit that has none;
    - ``check_store``: at the lifespan start-up, ask the Redis store of its limit
      (``check()``); one that does not answer fails the start-up
      (``lifespan.startup.failed``: uvicorn exits). Limits on routes are asked
      before they first decide. ``False``: no limit of the app asks; the limiters'
      ``on_store_error`` policy answers.

    A request waiting ``max_wait`` for its tokens whose client disconnects is
    given up: the wait is cancelled and its tokens come back. Other scopes pass
    through.
    """

    #: The ``Limit`` a limit string becomes.
    limit_class: type[AsgiLimit[Any]] | None = None

    def __init__(
        self,
        app: ASGIApp,
        limit: AsgiLimit[Any] | str | None = None,
        *,
        default_limits: str | Iterable[str] | None = None,
        storage: str | None = None,
        key: Callable[[Any], Any] | None = None,
        headers: Headers | None = None,
        on_refusal: RefusalHook | None = None,
        check_store: bool = True,
    ) -> None:
        if storage is not None:
            _config.storage_scheme(storage)  # a bad URI fails here
        if key is not None and not callable(key):
            raise TypeError(f"key must be a function of the request, got {key!r}")
        self.key = key
        if isinstance(limit, str):
            limit = self.limit_from(limit)
        if limit is not None and not isinstance(limit, AsgiLimit):
            raise TypeError(
                "RateLimitMiddleware takes a Limit of bucketlimit.asgi, bucketlimit.fastapi "
                f"or bucketlimit.litestar, or a limit string, got {limit!r}"
            )
        if on_refusal is not None and not callable(on_refusal):
            raise TypeError(f"on_refusal must be a function (request, refusal), got {on_refusal!r}")
        self.app = app
        self.limit = limit
        texts = [] if default_limits is None else _config.split_limits(default_limits)
        default_key = key or cast(Callable[[Any], Any], (self.limit_class or Limit).default_key)
        #: The default limits: one ``Limit`` each, keyed by route and client.
        self.defaults = [self.limit_from(text, _per_route(default_key)) for text in texts]
        #: :meth:`route_of`'s answers by ``id(route)``, for a subclass that reads routes.
        self.routes: dict[int, str | None] = {}
        self.storage = storage
        self.headers = profiles.check_headers(headers)
        self.on_refusal = on_refusal
        self.check_store = bool(check_store)

    def limit_from(self, text: str, key: Callable[[Any], Any] | None = None) -> AsgiLimit[Any]:
        """The ``Limit`` of a limit string of this middleware (its ``key=``, or
        ``key``), on the app's storage."""
        chosen = key or self.key
        options: dict[str, Any] = {} if chosen is None else {"key": chosen}
        return (self.limit_class or Limit)(text, **options)

    def limits_for(self, scope: Scope) -> list[AsgiLimit[Any]]:
        """The limits the middleware applies to ``scope``, in order: its own, then the
        default limits where :meth:`route_of` names a route."""
        own = [] if self.limit is None else [self.limit]
        if not self.defaults:
            return own
        route = self.route_of(scope)
        if route is None:
            return own
        scope["state"][_ROUTE] = route
        return [*own, *self.defaults]

    def route_of(self, scope: Scope) -> str | None:
        """The route the default limits key ``scope`` by, or ``None`` where they do
        not apply: a bare ASGI app has no routes, so each path is one (a framework's
        subclass reads its routes, and skips those with a limit of their own)."""
        return str(scope.get("path", ""))

    def app_limits(self, scope: Scope) -> list[AsgiLimit[Any]]:
        """Every limit of the app the lifespan start-up asks the store of: the
        middleware's (a framework's subclass adds its routes')."""
        return [*([] if self.limit is None else [self.limit]), *self.defaults]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http" and kind != "websocket":
            if kind == "lifespan" and self.check_store:
                send = self._checking_at_startup(scope, send)
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[_CLOSES] = True
        if self.exempt_scope(scope):
            await _serve(self.app, scope, receive, send, None)
            return
        limits = request_limits(
            scope, self.headers, self.on_refusal, self.check_store, self.storage
        )
        applied = self.limits_for(scope)
        if not applied:
            await _serve(self.app, scope, receive, send, limits)
            return
        body = None
        if kind == "http":
            body = scope["state"][_REPLAY] = _Replay(receive)
        request = applied[0].connection(scope, body.record if body is not None else receive)
        for limit in applied:
            try:
                _, refused = await limit.apply(
                    request, body.disconnected if body is not None else None
                )
            except ClientDisconnected:
                await _awaited(limits.close())
                return  # nobody to answer; its tokens and permits were given back
            except BaseException:
                await _awaited(limits.close())
                raise
            if refused:
                try:
                    await self._refuse(limit, request, scope, receive, send, limits)
                finally:
                    await _awaited(limits.close())
                return
        await _serve(self.app, scope, body.replay if body is not None else receive, send, limits)

    async def _refuse(
        self,
        limit: AsgiLimit[Any],
        request: Any,
        scope: Scope,
        receive: Receive,
        send: Send,
        limits: RequestLimits,
    ) -> None:
        refusal = limits.refusal()
        hook = limits.refusal_hook()
        response = None
        if hook is not None:
            response = hook(request, refusal)
            if inspect.isawaitable(response):
                response = await response
        if response is None:  # no hook, or the hook's None: the default refusal
            await send_refusal(scope, receive, send, refusal)
            return

        async def send_with_fields(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.http.response.start"):
                message = _with_fields(message, limits.fields(refused=True))
                if message.get("status") == refusal.status:
                    message = _with_defaults(message, refusal.headers)
            await send(message)

        await limit.send_response(response, request, scope, receive, send_with_fields)

    def exempt_scope(self, scope: Scope) -> bool:
        """Whether the app marked the route of ``scope`` exempt: a bare ASGI app has
        no routes (``bucketlimit.fastapi``'s middleware reads Starlette's)."""
        return False

    def _checking_at_startup(self, scope: Scope, send: Send) -> Send:
        """``send`` that checks the stores of the app's limits (:meth:`app_limits`, each
        limit string bound to the app's storage first) before the app's
        ``lifespan.startup.complete`` goes out: when one fails it reports
        ``lifespan.startup.failed`` instead and raises :class:`StoreCheckError` into
        the app, as a failing start-up does."""
        failed = False

        async def checking(message: Message) -> None:
            nonlocal failed
            kind = message["type"]
            if failed and kind.startswith("lifespan.startup"):
                return  # the app reporting the error again: said once
            if kind == "lifespan.startup.complete":
                try:
                    found = self.app_limits(scope)
                    for limit in found:
                        limit.bind(self.storage)
                    await check_stores_async(found)
                except StoreCheckError as error:
                    failed = True
                    await send({"type": "lifespan.startup.failed", "message": str(error)})
                    raise
            await send(message)

        return checking


async def startup_check() -> int:
    """Asks the Redis store of every web limit alive in the process (``check()``,
    awaited for the asyncio limiter); one that does not answer raises
    :class:`StoreCheckError`. What the middleware does at the lifespan start-up, for
    an app without it: Litestar's ``on_startup=[startup_check]``, or a FastAPI
    ``lifespan``. Returns how many stores were asked."""
    return await check_stores_async(live_limits())


#: ``scope["state"]``: the route a default limit keys this request by.
_ROUTE = "bucketlimit.route"


def _per_route(key: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A default limit's key: the request's route and its key, so that each route has
    its own bucket per client (slowapi's and flask-limiter's default limits)."""

    def route_key(request: Any) -> Any:
        route = request.scope["state"][_ROUTE]
        found = key(request)
        if inspect.isawaitable(found):
            return _prefixed(route, found)
        return f"{route}|{found}"

    return route_key


async def _prefixed(route: str, key: Awaitable[Any]) -> str:
    return f"{route}|{await key}"


def _with_defaults(message: Message, defaults: dict[str, str]) -> Message:
    """A refusal's ``Retry-After`` (and ``retry-after-ms``) on a response an
    ``on_refusal`` hook made, unless it wrote its own."""
    names = {k.lower() for k, _ in message.get("headers", ())}
    extra = [
        (name.lower().encode("latin-1"), defaults[name].encode("latin-1"))
        for name in (RETRY_AFTER, profiles.RETRY_AFTER_MS)
        if name in defaults and name.lower().encode("latin-1") not in names
    ]
    return {**message, "headers": [*message.get("headers", ()), *extra]} if extra else message
