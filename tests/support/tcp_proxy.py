"""A small loopback TCP proxy for the fault tests: it forwards, delays, drops replies
and counts the commands that went through.

    with TcpProxy(server.port) as proxy:
        client = redis.Redis(port=proxy.port)
        proxy.latency = 0.1        # every command reaches the server 100 ms late
        proxy.drop_next_reply()    # the next command is forwarded, its reply dropped
        proxy.black_hole("SUBSCRIBE")  # connections that sent it stay open, silent
        proxy.commands()           # commands seen so far (RESP arrays, by name too)

It sits between a client and a real redis-server, so the server does run what
was sent: a test can tell "the command ran and the reply was lost" from "the
command never arrived". Commands are counted as they arrive from the client,
before any delay, so a count is what the client sent.

Threads: one accepts, two per connection (one each way). Bounded: at most
``max_connections`` at a time (more are closed at once) and the last
``MAX_EVENTS`` commands remembered; :meth:`stop` closes every socket and joins
every thread. Loopback only.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["TcpProxy"]

MAX_EVENTS = 200_000
CHUNK = 65536


class _CommandParser:
    """Splits a client's byte stream into commands (RESP arrays, or inline lines)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[str]:
        """The names (upper case) of the commands ``data`` completes."""
        self._buffer += data
        names = []
        while (name := self._next()) is not None:
            names.append(name)
        return names

    def _next(self) -> str | None:
        buf = self._buffer
        end = buf.find(b"\r\n")
        if end < 0:
            return None
        if buf[:1] != b"*":  # an inline command: one line
            line = bytes(buf[:end])
            del buf[: end + 2]
            return line.split(b" ", 1)[0].decode("utf-8", "replace").upper()
        count = int(buf[1:end])
        position = end + 2
        name = ""
        for i in range(count):
            end = buf.find(b"\r\n", position)
            if end < 0:
                return None
            start = end + 2
            stop = start + int(buf[position + 1 : end])  # "$<length>"
            if len(buf) < stop + 2:
                return None
            if i == 0:
                name = bytes(buf[start:stop]).decode("utf-8", "replace").upper()
            position = stop + 2
        del buf[:position]
        return name


class _Link:
    """One client connection and its connection to the server."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.muted = False  # replies are dropped from now on
        self.sent: set[str] = set()  # the names of the commands it carried

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``."""

    def __init__(self, upstream_port: int, *, max_connections: int = 256) -> None:
        self.upstream_port = upstream_port
        self.max_connections = max_connections
        #: Seconds each chunk from the client waits before it is forwarded.
        self.latency = 0.0
        #: Drop every reply (the server runs the commands; nobody hears back).
        self.drop_replies = False
        self.connections = 0  # accepted so far
        self._accepted: list[float] = []  # time.monotonic() of each accepted connection
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[float, str]] = collections.deque(maxlen=MAX_EVENTS)
        self._total = 0
        self._drop_next = False
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.05)  # accept() wakes up to notice stop()
        self.port: int = self._listener.getsockname()[1]

    # -- control -------------------------------------------------------------------

    def start(self) -> TcpProxy:
        self._spawn(self._accept_loop)
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._threads:
            self._threads[0].join(10)  # the accepting thread: no new links after this
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()
        for thread in self._threads:
            thread.join(10)
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"proxy threads did not stop: {alive}"

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def drop_next_reply(self) -> None:
        """The next command is forwarded to the server; its reply (and anything
        after it on that connection) is dropped."""
        with self._lock:
            self._drop_next = True

    def black_hole(self, command: str) -> int:
        """Every open connection that has carried ``command`` goes silent: it stays
        open, forwarding what the client sends, and no reply reaches the client
        again (a black-holed path). Answers how many went silent."""
        name = command.upper()
        with self._lock:
            silenced = [link for link in self._links if name in link.sent]
            for link in silenced:
                link.muted = True
        return len(silenced)

    # -- counts ----------------------------------------------------------------------

    def commands(self, *names: str, since: float = 0.0) -> int:
        """Commands that arrived from clients (only those ``names`` if given) at or
        after ``since`` (a ``time.monotonic()`` reading)."""
        wanted = {name.upper() for name in names}
        with self._lock:
            if not wanted and since == 0.0:
                return self._total
            return sum(
                1 for at, name in self._events if at >= since and (not wanted or name in wanted)
            )

    def connections_since(self, since: float) -> int:
        """Connections accepted at or after ``since`` (a ``time.monotonic()`` reading)."""
        with self._lock:
            return sum(1 for at in self._accepted if at >= since)

    # -- the threads -----------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        # Finished threads are dropped (the accepting thread, first, runs until stop()).
        self._threads = [t for t in self._threads if t.is_alive() or t is self._threads[0]]
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                self.connections += 1
                self._accepted.append(time.monotonic())
                full = len(self._links) >= self.max_connections
            try:
                if full:
                    raise OSError("too many connections")
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()  # as a dead server would: the client sees the connection drop
                continue
            link = _Link(client, upstream)
            with self._lock:
                self._links.add(link)
            self._spawn(self._to_server, link)
            self._spawn(self._to_client, link)

    def _to_server(self, link: _Link) -> None:
        parser = _CommandParser()
        try:
            while data := link.client.recv(CHUNK):
                names = parser.feed(data)
                now = time.monotonic()
                with self._lock:
                    for name in names:
                        self._events.append((now, name))
                    link.sent.update(names)
                    self._total += len(names)
                    if names and self._drop_next:
                        self._drop_next = False
                        link.muted = True
                if self.latency > 0 and self._stopped.wait(self.latency):
                    break
                link.upstream.sendall(data)
        except OSError:
            pass
        finally:
            self._forget(link)

    def _to_client(self, link: _Link) -> None:
        try:
            while data := link.upstream.recv(CHUNK):
                if not (link.muted or self.drop_replies):
                    link.client.sendall(data)
        except OSError:
            pass
        finally:
            self._forget(link)

    def _forget(self, link: _Link) -> None:
        link.close()
        with self._lock:
            self._links.discard(link)
