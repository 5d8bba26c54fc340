"""Metrics behind a pre-fork server: examples/metrics_app.py under a real
``gunicorn --workers 4`` with one ``/metrics`` port, scraped over real HTTP.

Without ``register_prometheus_multiprocess`` each scrape would show the one worker
that answered it; with it every scrape shows the sum of the workers,
which is what the clients were answered; a worker that exits keeps its counts.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.support.redis_servers import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
CAPACITY = 3  # per key and worker; rate 0, so a spent bucket stays spent
KEYS = 10
REQUESTS = 400
DEADLINE = 30.0  # seconds for the server to come up, or a number to show up

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="gunicorn"),
    pytest.mark.timeout(180),
]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    folder: Path  # PROMETHEUS_MULTIPROC_DIR
    log: Path

    def get(self, path: str) -> tuple[int, int, str]:
        """(status, the answering worker's pid, body), on a new connection."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", path, headers={"Connection": "close"})
            response = connection.getresponse()
            return (
                response.status,
                int(response.getheader("X-Worker", "0")),
                response.read().decode(),
            )
        finally:
            connection.close()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def gunicorn(tmp_path: Path, interval: float) -> Iterator[Server]:
    folder = tmp_path / "multiproc"
    folder.mkdir()
    port = free_port()
    log = tmp_path / "gunicorn.log"
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(folder),
        "BUCKETLIMIT_CAPACITY": str(CAPACITY),
        "BUCKETLIMIT_RATE": "0",
        "BUCKETLIMIT_METRICS_INTERVAL": str(interval),
    }
    command = [
        sys.executable, "-m", "gunicorn", "-c", str(ROOT / "examples" / "gunicorn_metrics.py"),
        "--chdir", str(ROOT / "examples"), "metrics_app:app",
        "--bind", f"127.0.0.1:{port}", "--workers", str(WORKERS), "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    server = Server(process, port, folder, log)
    try:
        wait_for_workers(server)
        yield server
    finally:
        stop(process)


def wait_for_workers(server: Server) -> None:
    """Until every worker has answered /health (which decides nothing) once."""
    pids: set[int] = set()
    deadline = time.monotonic() + DEADLINE
    while len(pids) < WORKERS and time.monotonic() < deadline:
        assert server.process.poll() is None, server.tail()
        with contextlib.suppress(OSError):
            pids.add(server.get("/health")[1])
    assert len(pids) == WORKERS, (pids, server.tail())


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM: gunicorn stops its workers gracefully (each publishes at exit)."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # any worker left behind
    process.wait()


@dataclass(frozen=True)
class Answer:
    status: int
    worker: int  # the pid that decided
    key: str


def hammer(server: Server) -> list[Answer]:
    """REQUESTS decisions, 8 in flight, each on its own connection, over KEYS keys."""

    def one(n: int) -> Answer:
        key = f"user-{n % KEYS}"
        status, pid, _ = server.get(f"/hello?key={key}")
        return Answer(status, pid, key)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(REQUESTS)))
    assert {a.status for a in answers} <= {200, 429}
    return answers


def totals(answers: Iterable[Answer]) -> dict[str, float]:
    """What the clients were answered, as the metrics should count it: one bucket
    per worker and key (each worker's own limiter)."""
    answers = list(answers)
    return {
        "allowed": sum(a.status == 200 for a in answers),
        "refused": sum(a.status == 429 for a in answers),
        "bucketlimit_keys": len({(a.worker, a.key) for a in answers}),
    }


def values(families: Iterable[Metric]) -> dict[str, float]:
    """The hello policy's samples, by name (by outcome for the decisions)."""
    found: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.labels.get("policy") == "hello":
                found[sample.labels.get("outcome", sample.name)] = sample.value
    return found


def scraped(server: Server) -> dict[str, float]:
    status, _, text = server.get("/metrics")
    assert status == 200, server.tail()
    return values(text_string_to_metric_families(text))


def files(folder: Path) -> dict[str, float]:
    """What a scrape would show, read from the files themselves."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(folder))  # type: ignore[no-untyped-call]
    return values(registry.collect())


def test_every_scrape_of_one_port_shows_the_sum_of_the_workers(tmp_path: Path) -> None:
    with gunicorn(tmp_path, interval=0.05) as server:
        answers = hammer(server)
        expected = totals(answers)
        by_worker = Counter(a.worker for a in answers if a.status == 200)
        # Several workers decided, so no single worker's numbers are the total.
        assert len(by_worker) >= 2, by_worker
        assert max(by_worker.values()) < expected["allowed"]
        # Each worker publishes every 0.05 s: wait for the last round, then every
        # scrape, whichever worker answers it, shows the totals.
        deadline = time.monotonic() + DEADLINE
        seen = scraped(server)
        while seen != {**seen, **expected} and time.monotonic() < deadline:
            seen = scraped(server)
        scrapes = [scraped(server) for _ in range(8)]
    for found in scrapes:
        assert {name: found.get(name) for name in expected} == expected
    assert expected["refused"] > 0  # capacity 3 per bucket at rate 0: many spent


def test_a_worker_that_exits_keeps_its_counts_and_leaves_the_gauges(tmp_path: Path) -> None:
    # An hour between publications: only a worker's exit publishes, so this is
    # what the exit of one worker, then of all, leaves in the files.
    with gunicorn(tmp_path, interval=3600) as server:
        answers = hammer(server)
        assert files(server.folder).get("allowed", 0) == 0  # nothing published yet
        leaving = min(a.worker for a in answers)
        os.kill(leaving, signal.SIGTERM)  # gunicorn starts another worker in its place
        # It published its decisions when it exited; then gunicorn's child_exit
        # hook took its buckets out of the live sum. The others have published
        # nothing since they started (no bucket then).
        left = {**totals(a for a in answers if a.worker == leaving), "bucketlimit_keys": 0}
        deadline = time.monotonic() + DEADLINE
        while (now := files(server.folder)) != {**now, **left}:
            assert time.monotonic() < deadline, (now, left, server.tail())
            time.sleep(0.05)  # a real process exiting, and its parent reaping it
    # Stopped: every worker published when it exited, and none is alive (no
    # gauge file left, so no keys sample at all).
    final = files(server.folder)
    expected = totals(answers)
    assert (final["allowed"], final["refused"]) == (expected["allowed"], expected["refused"])
    assert final["allowed"] + final["refused"] == REQUESTS
    assert "bucketlimit_keys" not in final
