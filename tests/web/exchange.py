"""One HTTP request to an ASGI app, driven by hand as a server would drive it: the
test reads the response one message at a time and decides when the client hangs
up (``http.disconnect``), so it can look at the app while a body is streaming.

httpx's ASGI transport and the frameworks' test clients run the app to its end
before they answer, which hides exactly the moments these tests are about.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

DEADLINE = 10.0  # seconds for the app to send a message it sends at once


def http_scope(
    path: str,
    *,
    peer: str,
    kind: str = "http",
    spec_version: str = "2.3",
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The scope a server makes for ``GET path`` from ``peer`` (or a WebSocket's)."""
    return {
        "type": kind,
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http" if kind == "http" else "ws",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ],
        "client": (peer, 50000),
        "server": ("test", 80),
    }


class Exchange:
    """A request in flight: ``await start()`` for its status, ``await chunk()`` for
    each body part, ``hang_up()`` to disconnect, ``await done()`` for the app to end."""

    def __init__(
        self,
        app: ASGIApp,
        path: str = "/",
        *,
        peer: str = "192.0.2.10",
        kind: str = "http",
        spec_version: str = "2.3",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.scope = http_scope(
            path, peer=peer, kind=kind, spec_version=spec_version, headers=headers
        )
        self._sent: asyncio.Queue[Message] = asyncio.Queue()
        self._gone = asyncio.Event()  # the client hung up
        self._over = asyncio.Event()  # hung up, or the response is complete
        self._requested = False
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.task = asyncio.ensure_future(app(self.scope, self._receive, self._send))

    async def _receive(self) -> Message:
        if not self._requested:
            self._requested = True
            if self.scope["type"] == "websocket":
                return {"type": "websocket.connect"}
            return {"type": "http.request", "body": b"", "more_body": False}
        await self._over.wait()  # as servers do: nothing more comes, then disconnect
        if self.scope["type"] == "websocket":
            return {"type": "websocket.disconnect", "code": 1001}
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if self._gone.is_set() and self.scope["asgi"]["spec_version"] >= "2.4":
            raise OSError("the client disconnected")  # what ASGI 2.4 servers do
        if message["type"] == "http.response.body" and not message.get("more_body"):
            self._over.set()
        await self._sent.put(message)

    async def message(self) -> Message:
        """The app's next message (it must come: the app has nothing to wait for)."""
        return await asyncio.wait_for(self._sent.get(), DEADLINE)

    async def start(self) -> int:
        """The response's status (and :attr:`headers`)."""
        message = await self.message()
        assert message["type"] in ("http.response.start", "websocket.accept"), message
        self.status = message.get("status", 101)
        self.headers = {k.decode(): v.decode() for k, v in message.get("headers", ())}
        return self.status

    async def chunk(self) -> tuple[bytes, bool]:
        """The next body part, and whether more follow."""
        message = await self.message()
        assert message["type"] == "http.response.body", message
        return message.get("body", b""), bool(message.get("more_body", False))

    async def rest(self) -> bytes:
        """Every body part left, then the app's end."""
        body = b""
        while True:
            part, more = await self.chunk()
            body += part
            if not more:
                break
        await self.done()
        return body

    def hang_up(self) -> None:
        """The client goes away: the next ``receive`` answers ``http.disconnect``."""
        self._gone.set()
        self._over.set()

    async def done(self) -> None:
        """Waits for the app to return (its exception, if any, is raised)."""
        await asyncio.wait_for(asyncio.shield(self.task), DEADLINE)


async def until(read: Callable[[], object], wanted: object, what: str) -> None:
    """Lets the loop run until ``read()`` equals ``wanted`` (a state the app reaches
    without waiting on time), failing after :data:`DEADLINE` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while read() != wanted:
        assert loop.time() < deadline, f"never: {what} (still {read()!r})"
        await asyncio.sleep(0)
