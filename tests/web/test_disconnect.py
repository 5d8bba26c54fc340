"""A client that disconnects while its request waits for tokens gives them back
under real uvicorn with a real client (a raw socket that sends a
request and hangs up), through the middleware and through FastAPI's dependency,
in process and on the asyncio Redis limiter.

One token a minute: the first request takes it, the second waits for the next
one, holding it, so the token after that is about two minutes away. When the
waiter hangs up, its wait is cancelled and the token it held comes back: the next
token is again as near as if it never came (under a minute), at once. Before the
fix it stayed about two minutes away until the waiter's minute had passed.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.redis_servers import free_port
from tests.web.test_servers import serve

pytestmark = pytest.mark.timeout(180)
DEADLINE = 30.0  # seconds to wait for a state the server reaches in milliseconds


def next_token(url: str, which: str) -> float:
    answer = httpx.get(f"{url}/state/{which}", timeout=10).json()
    return float(answer["next_token"])


def until(url: str, which: str, condition: str) -> float:
    """Polls the server until the next token's wait meets ``condition``."""
    deadline = time.monotonic() + DEADLINE
    while True:
        seconds = next_token(url, which)
        if eval(condition, {"s": seconds}):  # a literal of this file
            return seconds
        assert time.monotonic() < deadline, f"{which}: next token {seconds} s, not {condition}"
        time.sleep(0.05)  # polling interval, not a timing assumption


def hang_up_while_waiting(url: str, port: int, which: str) -> tuple[float, float]:
    """(the next token while a client waits, right after it hung up)."""
    assert httpx.get(f"{url}/{which}", timeout=10).status_code == 200  # takes the token
    alone = next_token(url, which)
    assert 0 < alone <= 60
    waiter = socket.create_connection(("127.0.0.1", port))
    try:
        waiter.sendall(f"GET /{which} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        held = until(url, which, "s > 60")  # the waiter holds the next token
    finally:
        waiter.close()  # the client goes away
    after = until(url, which, "s <= 60")
    return held, after


@pytest.mark.parametrize("store", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_waiter_that_disconnects_gives_its_token_back(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = {"REDIS_URL": request.getfixturevalue("redis_url") if store == "redis" else ""}
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", "tests.web.servers.waiting_app:app",
        "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning",
    ]  # fmt: skip
    with serve(command, port, tmp_path / "uvicorn.log", env) as url:
        for which in ("mw", "dep"):
            held, after = hang_up_while_waiting(url, port, which)
            print(f"\n{store} {which}: next token {held:.2f} s away while the client waited, "
                  f"{after:.2f} s once it hung up")  # fmt: skip
            assert held > 60
            assert after <= 60
