"""Workers against the mock provider (tests/upstream/provider.py): what
tests/upstream/test_mock_provider.py checks and benches/upstream.py measures.

The provider runs under uvicorn on a free loopback port and enforces its own token
bucket, its true limits 10 % below what the workers are configured with; a consumer
outside bucketlimit spends 20 % of its tokens; ``processes`` processes of
``threads`` threads (tests/upstream/workers.py) send chat-completion-shaped
requests with random token counts through ``bucketlimit.httpx.RateLimitTransport``
and one Redis budget, all from one start. The provider's log of every request is
the measure. A :class:`Scale` sets the sizes: the test's runs are short, the
bench's long; the same behaviour shows in both.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.redis_servers import free_port
from tests.upstream.workers import Plan, work
from tests.web.test_servers import serve

SPAWN = multiprocessing.get_context("spawn")
#: The workers' configuration is this much above the provider's true limits.
ABOVE = 10 / 9
#: The share of the provider's tokens the consumer outside bucketlimit spends.
OTHER_SHARE = 0.2
#: One row of the provider's log: arrival (time.monotonic()), consumer, status,
#: tokens used, retry-after.
Log = list[list[Any]]


@dataclass(frozen=True)
class Scale:
    """The sizes of one run: the provider's window (seconds) and its true limits per
    window, the workers' processes and threads, and how long they send."""

    window: float = 2.0
    tokens: int = 36_000
    requests: int = 1_800
    processes: int = 4
    threads: int = 4
    windows: float = 10

    @property
    def duration(self) -> float:
        return self.windows * self.window


@dataclass(frozen=True)
class Run:
    """What one run left: the provider's log and the workers' start (both on
    ``time.monotonic()``, system-wide)."""

    scale: Scale
    log: Log
    start: float

    def ours(self, since: float = 0.0) -> Log:
        """The workers' requests that arrived from ``since`` seconds into the run
        until its end, in order of arrival."""
        end = self.start + self.scale.duration
        return sorted(
            r for r in self.log if r[1] == "bucketlimit" and self.start + since <= r[0] < end
        )

    def others(self, since: float = 0.0) -> Log:
        end = self.start + self.scale.duration
        return [r for r in self.log if r[1] == "other" and self.start + since <= r[0] < end]

    def allowed(self, since: float = 0.0) -> float:
        """The tokens the provider let the workers have from ``since`` seconds into
        the run until its end: its true rate, less what the other consumer used."""
        rate = self.scale.tokens / self.scale.window
        others: int = sum(r[3] for r in self.others(since))
        return rate * (self.scale.duration - since) - others


@contextlib.contextmanager
def provider(scale: Scale, log_file: Path) -> Iterator[str]:
    """The mock provider with ``scale``'s true limits, under uvicorn; its URL."""
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", "tests.upstream.provider:app", "--host", "127.0.0.1",
        "--port", str(port), "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip
    env = {
        "PROVIDER_TOKENS": str(scale.tokens),
        "PROVIDER_REQUESTS": str(scale.requests),
        "PROVIDER_WINDOW": str(scale.window),
        "PROVIDER_LATENCY": "0.01",
    }
    with serve(command, port, log_file, env) as url:
        yield url


def other_consumer(url: str, scale: Scale, start: float) -> None:
    """Spends ``OTHER_SHARE`` of the true token rate in requests every 0.1 s, outside
    bucketlimit (and waits out its own 429s, as a well-behaved service would); a
    request sent late (a loaded machine) moves the next ones later rather than
    bursting to catch up."""
    each = round(scale.tokens / scale.window * OTHER_SHARE * 0.1)
    body = {
        "model": "m",
        "max_tokens": each - 5,
        "messages": [{"role": "user", "content": "x" * 20}],
    }
    with httpx.Client(base_url=url, headers={"x-consumer": "other"}, timeout=30) as client:
        due = start
        while due < start + scale.duration:
            time.sleep(max(0.0, due - time.monotonic()))
            answer = client.post("/v1/chat/completions", json=body)
            if answer.status_code == 429:
                time.sleep(float(answer.headers["retry-after-ms"]) / 1000)
                continue
            due = max(due + 0.1, time.monotonic())


def run(
    scale: Scale,
    url: str,
    redis_url: str,
    client: str,
    during: Callable[[float], None] = lambda start: None,
) -> Run:
    """The workers (raw ``"httpx"`` or the ``"openai"`` SDK) and the other consumer,
    all started at one moment once every process is ready; ``during(start)`` runs
    meanwhile. Then the provider's log."""
    ready, go, start = SPAWN.Queue(), SPAWN.Event(), SPAWN.Value("d", 0.0)
    tokens, requests = round(scale.tokens * ABOVE), round(scale.requests * ABOVE)
    plans = [
        Plan(url, redis_url, f"{client}:", scale.window, tokens, requests, scale.threads,
             scale.duration, client, seed)
        for seed in range(scale.processes)
    ]  # fmt: skip
    processes = [SPAWN.Process(target=work, args=(plan, ready, go, start)) for plan in plans]
    for process in processes:
        process.start()
    try:
        for _ in processes:
            ready.get(timeout=60)
        start.value = time.monotonic() + 0.2
        go.set()
        other = threading.Thread(target=other_consumer, args=(url, scale, start.value))
        other.start()
        during(start.value)
        other.join(scale.duration + 60)
        for process in processes:
            process.join(scale.duration + 60)
            assert process.exitcode == 0, "a worker process failed"
    finally:
        for process in processes:
            with contextlib.suppress(Exception):
                process.kill()
    log: Log = httpx.get(f"{url}/log", timeout=10).json()
    return Run(scale, log, float(start.value))


def drain(url: str, scale: Scale, at: float) -> None:
    """A burst elsewhere at ``at`` (``time.monotonic()``): three windows of the
    provider's tokens at once, so that it refuses everything for two windows and the
    workers' next requests get 429, however late a loaded machine sends them."""
    time.sleep(max(0.0, at - time.monotonic()))
    headers = {"x-tokens": str(scale.tokens * 3)}
    httpx.post(f"{url}/drain", headers=headers, timeout=10).raise_for_status()
