"""A real run: examples/fastapi_app.py under ``uvicorn --workers 4``, 2,000 requests at once.

Capacity 100, rate 0 (a fixed quota), one key. Every request comes from 127.0.0.1
and the example keys by the peer address, so all 2,000 share one bucket: the
key is the peer, not a header a client could vary.

- With the asyncio Redis limiter the four workers share the bucket: exactly 100
  answers are 200 and 1,900 are 403 (a spent quota that never refills).
- With the in-process limiter each worker has its own bucket: more than 100 pass
  and at most 4 x 100. The README quotes the number this run prints.

The server is a subprocess on a free loopback port; readiness is polled with a
deadline (no fixed sleeps) until all four workers have answered; the workers
are always terminated.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.redis_servers import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKERS = 4
CAPACITY = 100
REQUESTS = 2000
CONCURRENCY = 100
READY_DEADLINE = 90.0  # seconds for four workers to import FastAPI on a busy machine
# Each test takes about 5 s idle, but may wait READY_DEADLINE for the workers,
# then up to 30 s for uvicorn to stop: more than the suite's default timeout.
pytestmark = pytest.mark.timeout(180)


class Server:
    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


StartServer = Callable[[dict[str, str]], Server]


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[StartServer]:
    """Starts the example under uvicorn with the given environment; stops it after."""
    started: list[Server] = []

    def start(env: dict[str, str]) -> Server:
        port = free_port()
        log = tmp_path / f"uvicorn-{port}.log"
        command = [
            sys.executable, "-m", "uvicorn",
            "--app-dir", str(EXAMPLES), "fastapi_app:app",
            "--host", "127.0.0.1", "--port", str(port),
            "--workers", str(WORKERS),
            "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the workers go with it
            )
        server = Server(process, port, log)
        started.append(server)
        wait_for_all_workers(server)
        return server

    yield start
    for server in started:
        stop(server.process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to uvicorn (it stops its workers), then SIGKILL to its group if need be."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # any worker left behind
    process.wait()


def wait_for_all_workers(server: Server) -> None:
    """Polls /health (exempt from the limit) until every worker has answered once.

    A request reaches whichever worker accepts the connection first; waiting for
    four distinct pids means the run below spreads over all of them.
    """

    async def poll() -> set[int]:
        pids: set[int] = set()
        deadline = time.monotonic() + READY_DEADLINE
        limits = httpx.Limits(max_keepalive_connections=0)  # a new connection each time
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=5) as client:
            while len(pids) < WORKERS and time.monotonic() < deadline:
                if server.process.poll() is not None:
                    break
                answers = await asyncio.gather(
                    *(client.get("/health") for _ in range(8)), return_exceptions=True
                )
                for answer in answers:
                    if isinstance(answer, httpx.Response) and answer.status_code == 200:
                        pids.add(answer.json()["pid"])
                if len(pids) < WORKERS:
                    await asyncio.sleep(0.05)  # polling interval, not a timing assumption
        return pids

    pids = asyncio.run(poll())
    if len(pids) < WORKERS:
        stop(server.process)
        pytest.fail(
            f"only {len(pids)} of {WORKERS} uvicorn workers answered within "
            f"{READY_DEADLINE} s:\n{server.log_tail()}"
        )


def hammer(server: Server) -> Counter[int]:
    """2,000 GET /hello, 100 in flight at a time, each on its own connection."""

    async def run() -> Counter[int]:
        gate = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:

            async def one() -> int:
                async with gate:
                    return (await client.get("/hello")).status_code

            return Counter(await asyncio.gather(*(one() for _ in range(REQUESTS))))

    return asyncio.run(run())


QUOTA = {"BUCKETLIMIT_CAPACITY": str(CAPACITY), "BUCKETLIMIT_RATE": "0"}


@pytest.mark.redis
def test_four_workers_sharing_redis_admit_exactly_the_capacity(
    start_server: StartServer, redis_url: str
) -> None:
    # A generous store timeout: this test is about exactness, not the failure policy.
    env = {**QUOTA, "REDIS_URL": redis_url, "REDIS_TIMEOUT": "10"}
    server = start_server(env)
    statuses = hammer(server)
    # Rate 0: a spent quota never refills, so the refusals are 403 (docs/web.md).
    assert statuses == Counter({200: CAPACITY, 403: REQUESTS - CAPACITY}), server.log_tail()


def test_four_workers_in_process_admit_more_than_the_capacity(
    start_server: StartServer, record_property: Callable[[str, object], None]
) -> None:
    server = start_server({**QUOTA, "REDIS_URL": ""})  # the example's in-process limiter
    statuses = hammer(server)
    admitted = statuses[200]
    record_property("in_process_admitted", admitted)
    print(f"\nin-process, {WORKERS} workers, capacity {CAPACITY}: {admitted}/{REQUESTS} admitted")
    assert statuses[200] + statuses[403] == REQUESTS, (statuses, server.log_tail())
    # Each worker has its own bucket of 100: more than one bucket was used, and no
    # worker admitted more than its own capacity.
    assert CAPACITY < admitted <= WORKERS * CAPACITY
