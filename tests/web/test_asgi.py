"""Any ASGI app: a raw ASGI callable, bare Starlette and Litestar, HTTP and WebSockets
(refused at the handshake: a 429 through websocket.http.response, else close 1008)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest
from litestar import Litestar, get, websocket
from litestar.connection import WebSocket as LitestarSocket
from litestar.exceptions import WebSocketDisconnect as LitestarDisconnect
from litestar.testing import TestClient as LitestarClient
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocket

from bucketlimit import TokenBucketLimiter
from bucketlimit import asgi as bl_asgi
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import litestar as bl_litestar
from bucketlimit.testing import ManualClock
from tests.web import sf
from tests.web.problem import assert_problem

pytestmark = pytest.mark.anyio


# -- a raw ASGI app ---------------------------------------------------------------------------


async def raw_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["type"] == "websocket":
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "hello"})
        await send({"type": "websocket.close", "code": 1000})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body or b"ok"})


async def cost_of(request: bl_asgi.Connection) -> int:
    return int((await request.json())["n"])


async def test_a_raw_asgi_app_is_limited_and_keeps_its_body() -> None:
    clock = ManualClock()
    limit = bl_asgi.Limit(TokenBucketLimiter(10, 1, clock), name="raw", cost=cost_of)
    app = bl_asgi.RateLimitMiddleware(raw_app, limit=limit)
    transport = httpx.ASGITransport(app=app, client=("198.51.100.3", 1))
    async with httpx.AsyncClient(transport=transport, base_url="http://raw") as client:
        first = await client.post("/", json={"n": 7})
        assert first.status_code == 200
        assert json.loads(first.content) == {"n": 7}  # the app read the body again
        assert sf.ratelimit(first.headers["RateLimit"])["raw"].params == {"r": 3, "t": 1}
        refused = await client.post("/", json={"n": 4})
        assert refused.status_code == 429
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.headers["retry-after"] == "1"
        assert_problem(refused.json(), 429, "raw", 1)
        too_big = await client.post("/", json={"n": 11})
        assert too_big.status_code == 413
        assert_problem(too_big.json(), 413, "raw", None)


async def test_the_connection_reads_the_scope() -> None:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/x",
        "client": ("2001:db8::1", 5),
        "headers": [(b"X-Forwarded-For", b"a"), (b"x-forwarded-for", b"b")],
    }
    request = bl_asgi.Connection(scope)
    assert (request.method, request.path, request.client) == ("POST", "/x", "2001:db8::1")
    assert request.header_list("X-FORWARDED-FOR") == ["a", "b"]
    assert request.header("x-forwarded-for") == "a, b"
    assert request.header("missing", "-") == "-"
    assert bl_asgi.remote_address(request) == "2001:db8::/64"
    assert repr(request) == "Connection('http', POST /x)"


def test_a_raw_asgi_websocket_is_refused_at_the_handshake() -> None:
    limit = bl_asgi.Limit(TokenBucketLimiter(2, 0), name="ws")
    app = bl_asgi.RateLimitMiddleware(raw_app, limit=limit)
    with TestClient(app) as client:
        for _ in range(2):
            with client.websocket_connect("/ws") as ws:
                assert ws.receive_text() == "hello"
        with pytest.raises(WebSocketDenialResponse) as denied, client.websocket_connect("/ws"):
            pass
    response = denied.value
    assert response.status_code == 403  # rate 0: the quota is spent for good
    assert_problem(response.json(), 403, "ws", None)
    assert sf.ratelimit(response.headers["ratelimit"])["ws"].params == {"r": 0}


async def test_a_websocket_without_the_denial_extension_is_closed_with_1008() -> None:
    limit = bl_asgi.Limit(TokenBucketLimiter(1, 1, ManualClock()), name="ws")
    app = bl_asgi.RateLimitMiddleware(raw_app, limit=limit)
    scope = {"type": "websocket", "path": "/ws", "client": ("192.0.2.5", 1), "headers": []}
    accepted = await handshake(app, scope)  # a server without websocket.http.response
    assert accepted[0]["type"] == "websocket.accept"
    refused = await handshake(app, scope)
    assert refused == [{"type": "websocket.close", "code": 1008, "reason": "rate limited"}]


async def handshake(app: Any, scope: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages ``app`` sends for one WebSocket connection."""
    sent: list[dict[str, Any]] = []
    incoming = [{"type": "websocket.connect"}]

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "websocket.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await app(dict(scope), receive, send)  # each connection has its own scope
    return sent


# -- bare Starlette (no FastAPI) --------------------------------------------------------------


async def hello(request: Any) -> PlainTextResponse:
    return PlainTextResponse("hi")


async def echo_socket(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


def starlette_app(limit: bl_fastapi.Limit) -> Starlette:
    return Starlette(
        routes=[Route("/", hello), WebSocketRoute("/ws", echo_socket)],
        middleware=[Middleware(bl_fastapi.RateLimitMiddleware, limit=limit)],
    )


def test_bare_starlette_http_and_websocket() -> None:
    clock = ManualClock()
    limit = bl_fastapi.Limit(TokenBucketLimiter(3, 1, clock), name="app")
    with TestClient(starlette_app(limit)) as client:
        answer = client.get("/")
        assert answer.text == "hi"
        assert sf.ratelimit_policy(answer.headers["ratelimit-policy"])["app"].params == {
            "q": 3,
            "w": 3,
        }
        with client.websocket_connect("/ws") as ws:
            assert ws.receive_text() == "hello"
        assert client.get("/").status_code == 200
        with pytest.raises(WebSocketDenialResponse) as denied, client.websocket_connect("/ws"):
            pass
        assert denied.value.status_code == 429
        assert denied.value.headers["retry-after"] == "1"
        assert_problem(denied.value.json(), 429, "app", 1)
        clock.advance(1)
        with client.websocket_connect("/ws") as ws:
            assert ws.receive_text() == "hello"


# -- FastAPI: Depends(Limit) on a websocket route ------------------------------------------------


def test_depends_limit_on_a_fastapi_websocket_route() -> None:
    from fastapi import Depends, FastAPI

    limit = bl_fastapi.Limit(TokenBucketLimiter(2, 0), name="ws")
    app = FastAPI()

    @app.websocket("/ws")
    async def socket(
        websocket: WebSocket,
        held: bl_fastapi.AsyncReservation = Depends(limit),  # noqa: B008 - a local limit
    ) -> None:
        await websocket.accept()
        await websocket.send_text(f"charged {held.charged}")
        await websocket.close()

    with TestClient(app) as client:
        for _ in range(2):
            with client.websocket_connect("/ws") as ws:
                assert ws.receive_text() == "charged 1"
        with pytest.raises(WebSocketDenialResponse) as denied, client.websocket_connect("/ws"):
            pass
    assert denied.value.status_code == 403
    assert_problem(denied.value.json(), 403, "ws", None)


def test_one_body_shape_from_the_dependency_and_the_middleware() -> None:
    from fastapi import Depends, FastAPI

    clock = ManualClock()
    app_wide = bl_fastapi.Limit(TokenBucketLimiter(2, 1, clock), name="app")
    route = bl_fastapi.Limit(TokenBucketLimiter(1, 1, clock), name="route")
    app = FastAPI()
    app.add_middleware(bl_fastapi.RateLimitMiddleware, limit=app_wide)

    @app.get("/limited", dependencies=[Depends(route)])
    async def limited() -> str:
        return "hi"

    @app.get("/plain")
    async def plain() -> str:
        return "hi"

    with TestClient(app, client=("192.0.2.8", 1)) as client:
        assert client.get("/limited").status_code == 200
        by_dependency = client.get("/limited")  # "app" is refunded: the route did not run
        assert client.get("/plain").status_code == 200
        by_middleware = client.get("/plain")
    for answer, policy in ((by_dependency, "route"), (by_middleware, "app")):
        assert answer.status_code == 429
        assert answer.headers["content-type"] == "application/problem+json"
        assert_problem(answer.json(), 429, policy, 1)


# -- Litestar -----------------------------------------------------------------------------------


def test_litestar_app_wide_and_per_route_limits() -> None:
    clock = ManualClock()
    per_client = bl_litestar.Limit(TokenBucketLimiter(3, 1, clock), name="app")
    search = bl_litestar.Limit(
        TokenBucketLimiter(10, 1, clock), name="search", cost=lambda r: int(r.query_params["n"])
    )

    @get("/search", middleware=[search.middleware])
    async def do_search() -> str:
        return "found"

    @get("/")
    async def root() -> str:
        return "hi"

    @websocket("/ws")
    async def socket(socket: LitestarSocket[Any, Any, Any]) -> None:
        await socket.accept()
        await socket.send_text("hello")
        await socket.close()

    app = Litestar([do_search, root, socket], middleware=[per_client.middleware])
    with LitestarClient(app) as client:
        answer = client.get("/search?n=6")
        assert answer.text == "found"
        limits = sf.ratelimit(answer.headers["ratelimit"])
        assert list(limits) == ["app", "search"]  # one field, one member per limit
        assert limits["search"].params == {"r": 4, "t": 1}
        refused = client.get("/search?n=5")
        assert refused.status_code == 429
        assert_problem(refused.json(), 429, "search", 1)
        assert client.get("/").status_code == 200
        with client.websocket_connect("/ws") as ws:
            assert ws.receive_text() == "hello"
        # Litestar's test client has no websocket.http.response: closed before accept.
        with pytest.raises(LitestarDisconnect) as denied, client.websocket_connect("/ws") as ws:
            ws.receive_text()
    assert denied.value.code == 1008
    assert denied.value.detail == "rate limited"


# -- the ASGI parts without FastAPI or Starlette ------------------------------------------------


def test_the_asgi_adapter_imports_without_any_framework() -> None:
    code = (
        "import sys\n"
        "for name in ('fastapi', 'starlette', 'litestar'):\n"
        "    sys.modules[name] = None  # an import of it fails\n"
        "import bucketlimit.asgi\n"
        "print('asgi ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.stdout == "asgi ok\n", done.stderr


def test_the_fastapi_adapter_imports_without_fastapi() -> None:
    code = (
        "import sys\n"
        "sys.modules['fastapi'] = None\n"
        "import bucketlimit.fastapi\n"
        "print('fastapi module ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.stdout == "fastapi module ok\n", done.stderr
