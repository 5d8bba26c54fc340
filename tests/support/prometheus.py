"""A real Prometheus server for the tests: Debian's ``prometheus`` package, started on
a free loopback port with a configuration of the test's own (never the system
service the package may have started), its data in a temporary folder.

``prometheus_server(targets, folder)`` starts one scraping ``targets`` every second
and stops it after; :class:`Prometheus` asks its HTTP API. Without the binary a test
skips, and fails under ``CI=true`` (where ``scripts/ensure_servers.py`` installed it),
as the Redis tests do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.redis_servers import free_port

READY_DEADLINE = 60.0  # seconds for Prometheus to start and answer /-/ready


def prometheus_binary() -> str:
    """The path of ``prometheus``; skips the test without it (fails under CI=true)."""
    found = shutil.which("prometheus")
    if found is None:
        reason = "the prometheus binary is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: the dashboard tests must run)", pytrace=False)
        pytest.skip(f"{reason}; install it with `apt-get install -y prometheus`")
    return found


class Prometheus:
    """A running Prometheus: its URL and its query API."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def query(self, expression: str) -> list[dict[str, Any]]:
        """The instant query's result: one entry per series (``metric``, ``value``)."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expression}, timeout=30)
        body = answer.json()
        assert body.get("status") == "success", f"{expression!r}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scrapes(self, job: str) -> int:
        """How many times the job's targets were scraped in the last 10 minutes."""
        found = self.query(f'sum(count_over_time(up{{job="{job}"}}[10m]))')
        return int(float(found[0]["value"][1])) if found else 0

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@contextlib.contextmanager
def prometheus_server(targets: list[str], folder: Path, job: str = "app") -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (``host:port``, their ``/metrics``) every
    second, on a free loopback port, its data and log in ``folder``."""
    binary = prometheus_binary()
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    quoted = ", ".join(f'"{target}"' for target in targets)
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        f"  - job_name: {job}\n"
        "    static_configs:\n"
        f"      - targets: [{quoted}]\n"
    )
    port = free_port()
    log = folder / "prometheus.log"
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Prometheus(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + READY_DEADLINE
        while True:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited:\n{server.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready in {READY_DEADLINE} s:\n{server.log_tail()}")
            time.sleep(0.1)  # polling interval, not a timing assumption
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
