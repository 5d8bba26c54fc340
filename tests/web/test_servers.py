"""Real servers over real sockets: the ASGI middleware under uvicorn (HTTP and a
WebSocket refused at the handshake with a real 403 response), and
examples/django_app.py under gunicorn with 4 workers: with the Redis limiter they
admit exactly the capacity, 2,000 requests at once (as tests/web/test_web_workers.py
does for FastAPI)."""

from __future__ import annotations

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
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.support.redis_servers import free_port
from tests.web import sf
from tests.web.test_web_workers import (
    CAPACITY,
    QUOTA,
    REQUESTS,
    WORKERS,
    Server,
    hammer,
    stop,
    wait_for_all_workers,
)

ROOT = Path(__file__).resolve().parents[2]
READY_DEADLINE = 60.0
pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def serve(command: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[str]:
    """Runs ``command`` (a server on ``port``) until ``/health`` answers; stops it after."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_DEADLINE
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no answer in {READY_DEADLINE} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)  # polling interval, not a timing assumption
        yield url
    finally:
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_uvicorn_limits_http_and_refuses_a_websocket_at_the_handshake(tmp_path: Path) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", "tests.web.servers.asgi_app:app",
        "--host", "127.0.0.1", "--port", str(port), "--ws", "websockets",
        "--no-access-log", "--log-level", "warning",
    ]  # fmt: skip
    with serve(command, port, tmp_path / "uvicorn.log", {"BUCKETLIMIT_CAPACITY": "2"}) as url:
        answer = httpx.get(url)
        assert answer.text == "hi"
        assert sf.ratelimit(answer.headers["ratelimit"])["conn"].params == {"r": 1}
        with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            assert ws.recv() == "hello"
            assert ws.response is not None
            accepted = ws.response.headers["RateLimit"]  # the fields ride on the accept
        assert sf.ratelimit(accepted)["conn"].params == {"r": 0}
        with pytest.raises(InvalidStatus) as refused:
            connect(f"ws://127.0.0.1:{port}/ws")
        response = refused.value.response
        assert response.status_code == 403  # rate 0: spent for good, over real HTTP
        assert response.headers["Content-Type"] == "application/problem+json"
        assert b'"violated-policies":["conn"]' in response.body


# -- Django under gunicorn, 4 workers ----------------------------------------------------------


@contextlib.contextmanager
def gunicorn_django(tmp_path: Path, env: dict[str, str]) -> Iterator[Server]:
    """examples/django_app.py under ``gunicorn --workers 4``, every worker answering."""
    port = free_port()
    log = tmp_path / "gunicorn.log"
    command = [
        sys.executable, "-m", "gunicorn", "--chdir", str(ROOT / "examples"),
        "django_app:application", "--bind", f"127.0.0.1:{port}",
        "--workers", str(WORKERS), "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(process, port, log)
    try:
        wait_for_all_workers(server)
        yield server
    finally:
        stop(process)


@pytest.mark.redis
def test_django_with_four_workers_sharing_redis_admits_exactly_the_capacity(
    tmp_path: Path, redis_url: str
) -> None:
    env = {**QUOTA, "REDIS_URL": redis_url, "REDIS_TIMEOUT": "10"}
    with gunicorn_django(tmp_path, env) as server:
        statuses = hammer(server)
    # Rate 0: a spent quota never refills, so the refusals are 403.
    assert statuses == Counter({200: CAPACITY, 403: REQUESTS - CAPACITY}), server.log_tail()


def test_django_with_four_in_process_workers_admits_more(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with gunicorn_django(tmp_path, {**QUOTA, "REDIS_URL": ""}) as server:
        statuses = hammer(server)
    record_property("in_process_admitted", statuses[200])
    print(f"\nDjango in-process, {WORKERS} workers, capacity {CAPACITY}: {statuses[200]} admitted")
    assert statuses[200] + statuses[403] == REQUESTS, (statuses, server.log_tail())
    assert CAPACITY < statuses[200] <= WORKERS * CAPACITY  # one bucket per worker
