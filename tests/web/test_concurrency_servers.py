"""``concurrency=`` under real servers over real sockets: 10 slow streamed
responses on limit 3 under uvicorn (FastAPI) and gunicorn (Flask, threaded workers);
the in-flight count measured on the server side, by a counter each body raises and
lowers (tests/web/servers/concurrency_app.py); the 4th request refused, or queued
with ``max_wait``; a client that disconnects mid-stream frees its permit.

With 4 workers the limit holds across them only on a shared store: the in-process
limiter keeps at most 3 per worker, so up to 12 at once; the Redis concurrency
limiter keeps 3 in all (those runs need ``bucketlimit.redis.RedisConcurrencyLimiter``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.redis_servers import free_port
from tests.web.test_web_workers import READY_DEADLINE, Server, stop

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.web.servers.concurrency_app"
LIMIT = 3
REQUESTS = 10
DEADLINE = 60.0  # seconds for a state the servers reach in well under one


def command(server: str, port: int, workers: int) -> list[str]:
    if server == "uvicorn":
        return [
            sys.executable, "-m", "uvicorn", f"{APP}:fastapi_app",
            "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers),
            "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
    return [
        sys.executable, "-m", "gunicorn", f"{APP}:flask_app",
        "--bind", f"127.0.0.1:{port}", "--workers", str(workers),
        "--worker-class", "gthread", "--threads", "16", "--log-level", "warning",
    ]  # fmt: skip


@contextlib.contextmanager
def running(
    server: str, tmp_path: Path, *, workers: int = 1, env: dict[str, str] | None = None
) -> Iterator[tuple[Server, Path]]:
    """The app under ``server`` with ``workers`` processes, every one answering."""
    state = tmp_path / "state"
    state.mkdir()
    port = free_port()
    log = tmp_path / f"{server}.log"
    environ = {**os.environ, "STATE_DIR": str(state), "REDIS_URL": "", **(env or {})}
    with log.open("wb") as out:
        process = subprocess.Popen(
            command(server, port, workers),
            cwd=ROOT,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    running_server = Server(process, port, log)
    try:
        wait_for_workers(running_server, workers)
        yield running_server, state
    finally:
        (state / "open").touch()  # lets any body still streaming finish
        stop(process)


def wait_for_workers(server: Server, workers: int) -> None:
    pids: set[int] = set()
    deadline = time.monotonic() + READY_DEADLINE
    while len(pids) < workers:
        if server.process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{len(pids)} of {workers} workers answered:\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            limits = httpx.Limits(max_keepalive_connections=0)
            with httpx.Client(base_url=server.url, limits=limits, timeout=5) as client:
                for _ in range(8):
                    answer = client.get("/health")
                    if answer.status_code == 200:
                        pids.add(answer.json()["pid"])
        time.sleep(0.05)  # polling interval, not a timing assumption


def counters(state: Path) -> dict[str, Any]:
    path = state / "counters.json"
    return json.loads(path.read_text()) if path.exists() else {}


def in_flight_now(state: Path) -> int:
    return int(counters(state).get("all", {}).get("now", 0))


class Slow:
    """One ``GET /slow``: its status once known, and its whole body at the end."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.known = asyncio.Event()
        self.body = b""


async def slow_requests(
    url: str,
    count: int,
    state: Path,
    until_known: int,
    check: Callable[[httpx.AsyncClient], Awaitable[None]] | None = None,
) -> list[Slow]:
    """``count`` concurrent ``GET /slow``; once ``until_known`` of them have a status
    (a refusal's whole body, or an admitted stream's first line) and ``check`` (given
    a client) returned, opens the gate so the admitted streams end; returns them
    all, finished."""
    limits = httpx.Limits(max_connections=count + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=DEADLINE) as client:
        requests = [Slow() for _ in range(count)]

        async def one(slow: Slow) -> None:
            async with client.stream("GET", "/slow") as answer:
                slow.status = answer.status_code
                async for chunk in answer.aiter_bytes():
                    slow.body += chunk
                    if slow.status != 200 or slow.body.startswith(b"start\n"):
                        slow.known.set()
            slow.known.set()

        tasks = [asyncio.ensure_future(one(slow)) for slow in requests]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while sum(slow.known.is_set() for slow in requests) < until_known:
            assert loop.time() < deadline, [s.status for s in requests]
            for task in tasks:
                if task.done():
                    task.result()  # a transport error, if any
            await asyncio.sleep(0.05)  # polling interval, not a timing assumption
        if check is not None:
            await check(client)
        (state / "open").touch()
        await asyncio.gather(*tasks)
        return requests


def wait_until_idle(state: Path) -> None:
    deadline = time.monotonic() + DEADLINE
    while in_flight_now(state) != 0:
        assert time.monotonic() < deadline, counters(state)
        time.sleep(0.05)  # polling interval, not a timing assumption


# -- one worker: at most 3 at every moment, the 4th refused or queued -------------------------


@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_ten_slow_streams_on_limit_three_admit_three_and_refuse_seven(
    server: str, tmp_path: Path
) -> None:
    with running(server, tmp_path) as (srv, state):
        requests = asyncio.run(slow_requests(srv.url, REQUESTS, state, until_known=REQUESTS))
        wait_until_idle(state)
        measured = counters(state)
        statuses = Counter(slow.status for slow in requests)
        assert statuses == Counter({200: LIMIT, 429: REQUESTS - LIMIT}), srv.log_tail()
        assert measured["all"]["max"] == LIMIT  # never more in flight, server side
        for slow in requests:
            if slow.status == 200:
                assert slow.body.startswith(b"start\n")
                assert slow.body.endswith(b"\nend\n")  # the whole stream was sent
            else:
                problem = json.loads(slow.body)
                assert problem["violated-policies"] == ["inflight"]
                assert problem["retry_after"] == 1
        again = httpx.get(f"{srv.url}/slow", timeout=DEADLINE)  # the gate is open now
        assert again.status_code == 200  # every permit came back
        stats = httpx.get(f"{srv.url}/state", timeout=DEADLINE).json()
        assert stats["in_flight"] == 0
        assert stats["granted"] == stats["released"] == LIMIT + 1


@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_with_max_wait_the_others_queue_and_all_ten_are_served(server: str, tmp_path: Path) -> None:
    with running(server, tmp_path, env={"MAX_WAIT": "120"}) as (srv, state):

        async def seven_queued(client: httpx.AsyncClient) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            while (await client.get("/state")).json()["waiting"] != REQUESTS - LIMIT:
                assert loop.time() < deadline, "never seven waiting"
                await asyncio.sleep(0.05)  # polling interval, not a timing assumption
            assert counters(state)["all"]["now"] == LIMIT  # three stream meanwhile

        requests = asyncio.run(slow_requests(srv.url, REQUESTS, state, LIMIT, seven_queued))
        wait_until_idle(state)
        assert Counter(slow.status for slow in requests) == Counter({200: REQUESTS})
        assert counters(state)["all"]["max"] == LIMIT  # queued, never more at once
        assert all(slow.body.endswith(b"\nend\n") for slow in requests)


@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_a_client_that_disconnects_mid_stream_frees_its_permit(server: str, tmp_path: Path) -> None:
    with running(server, tmp_path, env={"BUCKETLIMIT_CONCURRENCY": "1"}) as (srv, state):
        client = socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
        try:
            client.sendall(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            received = b""
            while b"start" not in received:  # the stream has begun
                part = client.recv(4096)
                assert part, received
                received += part
            assert b" 200 " in received.split(b"\r\n", 1)[0]
            assert httpx.get(f"{srv.url}/slow", timeout=DEADLINE).status_code == 429  # held
        finally:
            client.close()  # the client goes away mid-stream
        wait_until_idle(state)  # the body stopped: the server saw the client go
        deadline = time.monotonic() + DEADLINE
        while httpx.get(f"{srv.url}/state", timeout=DEADLINE).json()["in_flight"] != 0:
            assert time.monotonic() < deadline, "the permit was never released"
            time.sleep(0.05)  # polling interval, not a timing assumption
        (state / "open").touch()
        assert httpx.get(f"{srv.url}/slow", timeout=DEADLINE).status_code == 200


# -- four workers ------------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_four_workers_in_process_keep_three_each_not_three_in_all(
    server: str, tmp_path: Path
) -> None:
    """The in-process limiter is one per worker: 40 slow streams across 4 workers are
    held to 3 per worker at every moment, so up to 12 at once in all."""
    with running(server, tmp_path, workers=4) as (srv, state):
        requests = asyncio.run(slow_requests(srv.url, 40, state, until_known=40))
        wait_until_idle(state)
        measured = counters(state)
        admitted = sum(slow.status == 200 for slow in requests)
        workers = {name: c for name, c in measured.items() if name.startswith("pid:")}
        print(
            f"\n{server}, 4 workers in process, limit {LIMIT}: {admitted} of 40 admitted, "
            f"{measured['all']['max']} at most at once, per worker "
            f"{sorted(c['max'] for c in workers.values())}"
        )
        assert all(c["max"] <= LIMIT for c in workers.values())
        assert LIMIT <= measured["all"]["max"] <= 4 * LIMIT
        assert admitted + sum(slow.status == 429 for slow in requests) == 40


@pytest.mark.redis
@pytest.mark.parametrize("server", ["uvicorn", "gunicorn"])
def test_four_workers_on_redis_keep_three_in_all(
    server: str, tmp_path: Path, redis_url: str
) -> None:
    with running(server, tmp_path, workers=4, env={"REDIS_URL": redis_url}) as (srv, state):
        requests = asyncio.run(slow_requests(srv.url, REQUESTS, state, until_known=REQUESTS))
        wait_until_idle(state)
        statuses = Counter(slow.status for slow in requests)
        assert statuses == Counter({200: LIMIT, 429: REQUESTS - LIMIT}), srv.log_tail()
        assert counters(state)["all"]["max"] == LIMIT
