"""Real servers over real sockets, once each: the ASGI middleware under uvicorn
(HTTP and a WebSocket refused at the handshake with a real 429/403 response)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.support.redis_servers import free_port
from tests.web import sf

ROOT = Path(__file__).resolve().parents[2]
READY_DEADLINE = 60.0
pytestmark = pytest.mark.timeout(120)


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
