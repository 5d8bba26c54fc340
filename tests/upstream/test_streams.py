"""bucketlimit.httpx's transports over a real HTTP server (http.server, in a thread):
a streamed body reaches the caller as it comes, and the usage a JSON body reports
settles the request once the body has all come (read whole, or a stream read to
its end); a stream closed before its end keeps its estimate."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import httpx2
import pytest

from bucketlimit import TokenBucketLimiter
from bucketlimit.httpx import (
    AsyncRateLimitTransport,
    RateLimitTransport,
    default_key,
    estimate_tokens,
)
from bucketlimit.testing import ManualClock

CHAT = {"model": "m", "max_tokens": 300, "messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": 20, "completion_tokens": 80}
# A body in two parts: the server sends the second only once the test has read the
# first (or, as a hang guard, after RELEASE_WAIT seconds), and says which.
PARTS = {
    "application/json": (b'{"id": "x", "choices": [], ', b'"released": %s, "usage": %s}'),
    "application/x-ndjson": (b'{"n": 1}\n', b'{"released": %s, "usage": %s}\n'),
}
RELEASE_WAIT = 10.0


class Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.release = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    """``POST /stream/<type>``: a body of that content type in two parts, the end of
    the body marked by the connection's close (HTTP/1.0); ``POST /json``: a
    gzip-encoded JSON body with its usage, whole."""

    server: Upstream

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        usage = json.dumps(USAGE).encode()
        if self.path == "/json":
            body = gzip.compress(b'{"id": "x", "choices": [], "usage": %s}' % usage)
            self.send_header("content-type", "application/json")
            self.send_header("content-encoding", "gzip")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        content_type = self.path.removeprefix("/stream/").replace("_", "/")
        first, rest = PARTS[content_type]
        self.send_header("content-type", content_type)
        self.end_headers()
        self.wfile.write(first)
        self.wfile.flush()
        released = self.server.release.wait(RELEASE_WAIT)
        self.wfile.write(rest % (b"true" if released else b"false", usage))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.release.set()  # a handler still waiting ends now
    server.shutdown()
    server.server_close()
    thread.join(10)


def stream_url(upstream: Upstream, content_type: str) -> str:
    return f"{upstream.url}/stream/{content_type.replace('/', '_')}"


def budget() -> tuple[TokenBucketLimiter, dict[str, Any]]:
    """A tokens limiter on a ManualClock, and the transport's words for it."""
    clock = ManualClock(100)
    tpm = TokenBucketLimiter(10_000, 10_000, per=60, clock=clock)
    return tpm, {"tokens": tpm, "clock": clock}


KEY = default_key(httpx.Request("POST", "http://127.0.0.1/"))
ESTIMATE = sum(estimate_tokens(httpx.Request("POST", "http://h/", json=CHAT)) or (0, 0))
# What a second request leaves after the first, whose usage did or did not settle.
SETTLED = 10_000 - sum(USAGE.values()) - ESTIMATE - 1
UNSETTLED = 10_000 - 2 * ESTIMATE - 1


@pytest.mark.parametrize("library", [httpx, httpx2], ids=["httpx", "httpx2"])
@pytest.mark.parametrize("content_type", sorted(PARTS))
def test_a_streamed_body_reaches_the_caller_as_it_comes(
    upstream: Upstream, content_type: str, library: Any
) -> None:
    _tpm, words = budget()
    transport = RateLimitTransport(library.HTTPTransport(), **words)
    with (
        library.Client(transport=transport, timeout=30) as client,
        client.stream("POST", stream_url(upstream, content_type), json=CHAT) as response,
    ):
        chunks = response.iter_bytes()
        assert next(chunks) == PARTS[content_type][0], "the body was read whole first"
        upstream.release.set()
        assert b'"released": true' in b"".join(chunks)


@pytest.mark.parametrize(
    ("to_its_end", "left"), [(True, SETTLED), (False, UNSETTLED)], ids=["read", "closed early"]
)
def test_a_streamed_json_body_settles_its_usage_once_it_has_all_come(
    upstream: Upstream, to_its_end: bool, left: int
) -> None:
    tpm, words = budget()
    transport = RateLimitTransport(httpx.HTTPTransport(), **words)
    with httpx.Client(transport=transport, timeout=30) as client:
        url = stream_url(upstream, "application/json")
        with client.stream("POST", url, json=CHAT) as response:
            if to_its_end:
                upstream.release.set()
                assert json.loads(response.read())["usage"] == USAGE
            else:
                next(response.iter_bytes())  # then closed
        upstream.release.set()
        client.post(f"{upstream.url}/json", json=CHAT)  # gzip-encoded: read decoded
    wrong = "its usage did not settle" if to_its_end else "it settled a usage it never had"
    assert tpm.peek(KEY).remaining == left, f"a stream {wrong}"


def test_the_asyncio_transport_streams_and_settles_alike(upstream: Upstream) -> None:
    tpm, words = budget()

    async def main() -> None:
        transport = AsyncRateLimitTransport(httpx.AsyncHTTPTransport(), **words)
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            url = stream_url(upstream, "application/json")
            async with client.stream("POST", url, json=CHAT) as response:
                chunks = response.aiter_bytes()
                first = await anext(chunks)
                assert first == PARTS["application/json"][0], "the body was read whole first"
                upstream.release.set()
                async for _ in chunks:
                    pass
            await client.post(f"{upstream.url}/json", json=CHAT)

    asyncio.run(main())
    assert tpm.peek(KEY).remaining == SETTLED, "the stream's usage did not settle its estimate"
