"""The LLM gateway of docs/recipes/llm-gateway.md (examples/llm_gateway/gateway.py) in
front of the mock provider (tests/upstream/provider.py), driven by openai SDK callers:
what tests/recipes/test_llm_gateway.py checks and benches/gateway.py measures.

A :class:`Shape` sets the sizes: the provider's quota and compute slots, the
gateway's limits (per ``window`` seconds), the callers (interactive users, one
thread each, streaming their answers; batch users, several threads each) and how
long they send. :func:`gateway_stack` starts the provider and the gateway under
uvicorn on free loopback ports; :func:`run_callers` runs the callers from one
start; :class:`Run` measures what the provider saw (its log) and what the callers
got.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai

from tests.support.redis_servers import free_port
from tests.web.test_servers import serve

ROOT = Path(__file__).resolve().parents[2]
#: One row of the provider's log: arrival (time.monotonic()), user, status, tokens
#: used, retry-after, end of the answer.
Row = list[Any]


@dataclass(frozen=True)
class Shape:
    """The sizes of one run. The defaults are the recipe's: a provider of 60,000
    tokens a minute and 6 compute slots; per user 40 requests and 9,000 tokens a
    minute and 2 generations at once, 48,000 tokens a minute for the organisation;
    6 interactive users and 2 batch jobs of 6 threads for 40 s."""

    window: float = 60.0  # the limits are per this many seconds
    rpm: int = 40
    tpm: int = 9_000
    org_tpm: int = 48_000
    generations: int = 2
    provider_tokens: int = 60_000
    provider_requests: int = 10_000
    provider_slots: int = 6
    provider_speed: float = 400.0  # tokens generated per second and slot
    interactive: int = 6
    batch: int = 2
    batch_threads: int = 6
    duration: float = 40.0
    think: float = 1.0  # seconds an interactive user reads between two questions
    # A question's max_tokens and prompt characters (each drawn between the two).
    interactive_tokens: tuple[int, int] = (80, 300)
    interactive_chars: tuple[int, int] = (100, 400)
    batch_tokens: tuple[int, int] = (300, 900)
    batch_chars: tuple[int, int] = (100, 2000)
    max_wait: float = 60.0  # the recipe's waiting; 0: refuse at once
    org_wait: float = 5.0
    max_retries: int = 6  # the SDK's
    workers: int = 2
    prefix: str = "llm-gateway:"
    store_timeout: float = 1.0  # seconds the gateway waits for Redis (the example's)

    def users(self) -> dict[str, str]:
        """Each user's API key -> name."""
        names = [f"interactive-{n}" for n in range(1, self.interactive + 1)]
        names += [f"batch-{n}" for n in range(1, self.batch + 1)]
        names += ["dropper", "settler"]  # the tests' own callers
        return {f"sk-{name}": name for name in names}


@dataclass
class Stack:
    """The running provider and gateway; ``answers``, the status of every HTTP answer
    the gateway gave the clients of :func:`sdk` (and any a test adds)."""

    shape: Shape
    provider: str
    gateway: str
    redis_url: str
    multiproc: Path
    answers: list[int] = field(default_factory=list)

    def provider_log(self) -> list[Row]:
        rows: list[Row] = httpx.get(f"{self.provider}/log", timeout=30).json()
        return rows

    def scrape(self) -> str:
        return httpx.get(f"{self.gateway}/metrics", timeout=30).text


@contextlib.contextmanager
def gateway_stack(shape: Shape, redis_url: str, folder: Path) -> Iterator[Stack]:
    """The mock provider and the gateway (``--workers shape.workers``, metrics in
    prometheus_client's multiprocess mode) on free loopback ports."""
    folder.mkdir(parents=True, exist_ok=True)
    provider_port, gateway_port = free_port(), free_port()
    provider = [
        sys.executable, "-m", "uvicorn", "tests.upstream.provider:app",
        "--host", "127.0.0.1", "--port", str(provider_port),
        "--log-level", "warning", "--no-access-log",
        # A generation a dropped client left running holds a graceful shutdown open.
        "--timeout-graceful-shutdown", "1",
    ]  # fmt: skip
    provider_env = {
        "PROVIDER_TOKENS": str(shape.provider_tokens),
        "PROVIDER_REQUESTS": str(shape.provider_requests),
        "PROVIDER_WINDOW": str(shape.window),
        "PROVIDER_LATENCY": "0.05",
        "PROVIDER_SPEED": str(shape.provider_speed),
        "PROVIDER_SLOTS": str(shape.provider_slots),
    }
    multiproc = folder / "metrics"
    multiproc.mkdir()
    gateway = [
        sys.executable, "-m", "uvicorn",
        "--app-dir", str(ROOT / "examples" / "llm_gateway"), "gateway:app",
        "--host", "127.0.0.1", "--port", str(gateway_port),
        "--workers", str(shape.workers), "--log-level", "warning", "--no-access-log",
        # A stream the provider still generates holds a graceful shutdown open.
        "--timeout-graceful-shutdown", "5",
    ]  # fmt: skip
    with serve(provider, provider_port, folder / "provider.log", provider_env) as provider_url:
        gateway_env = {
            "REDIS_URL": redis_url,
            "PROVIDER_URL": f"{provider_url}/v1",
            "PROVIDER_API_KEY": "sk-org",
            "GATEWAY_KEYS": json.dumps(shape.users()),
            "GATEWAY_WINDOW": str(shape.window),
            "GATEWAY_RPM": str(shape.rpm),
            "GATEWAY_TPM": str(shape.tpm),
            "GATEWAY_ORG_TPM": str(shape.org_tpm),
            "GATEWAY_GENERATIONS": str(shape.generations),
            "GATEWAY_MAX_WAIT": str(shape.max_wait),
            "GATEWAY_ORG_WAIT": str(shape.org_wait),
            "GATEWAY_PREFIX": shape.prefix,
            "REDIS_TIMEOUT": str(shape.store_timeout),
            "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        }
        with serve(gateway, gateway_port, folder / "gateway.log", gateway_env) as gateway_url:
            yield Stack(shape, provider_url, gateway_url, redis_url, multiproc)


def sdk(stack: Stack, user: str, responses: list[tuple[str, int]] | None = None) -> openai.OpenAI:
    """An openai SDK client of ``user`` on the gateway; each HTTP response's status
    goes to ``stack.answers`` and, with the user, to ``responses`` (the SDK's retries
    each have one)."""

    def answered(answer: httpx2.Response) -> None:
        stack.answers.append(answer.status_code)
        if responses is not None:
            responses.append((user, answer.status_code))

    hooks = {"response": [answered]}
    return openai.OpenAI(
        api_key=f"sk-{user}",
        base_url=f"{stack.gateway}/v1",
        max_retries=stack.shape.max_retries,
        timeout=600,
        http_client=httpx2.Client(event_hooks=hooks, timeout=600),
    )


def question(shape: Shape, rng: random.Random, *, batch: bool) -> dict[str, Any]:
    """A chat completion's arguments: a batch job's are larger than a user's."""
    most = rng.randint(*(shape.batch_tokens if batch else shape.interactive_tokens))
    text = "x" * rng.randint(*(shape.batch_chars if batch else shape.interactive_chars))
    return {"model": "mock", "max_tokens": most, "messages": [{"role": "user", "content": text}]}


def estimate(arguments: dict[str, Any]) -> int:
    """The gateway's estimate of a request (examples/llm_gateway/gateway.py)."""
    characters = sum(len(m["content"]) for m in arguments["messages"])
    return math.ceil(characters / 4) + int(arguments["max_tokens"])


@dataclass
class Call:
    user: str
    batch: bool
    start: float  # time.monotonic()
    end: float
    error: str | None  # the SDK's exception, or None when it succeeded


@dataclass
class Run:
    """What one run left: every call, every HTTP response the callers got, the
    provider's log, and the start (all on time.monotonic(), system-wide)."""

    shape: Shape
    start: float
    calls: list[Call]
    responses: list[tuple[str, int]]  # (user, status) of every HTTP answer
    log: list[Row] = field(default_factory=list)

    def users(self) -> set[str]:
        return {call.user for call in self.calls}

    def admitted(self, user: str | None = None) -> list[Row]:
        """The provider's answered requests (of ``user``), in order of arrival."""
        return sorted(r for r in self.log if r[2] == 200 and (user is None or r[1] == user))

    def failed(self, batch: bool) -> int:
        return sum(1 for c in self.calls if c.batch == batch and c.error is not None)

    def total(self, batch: bool) -> int:
        return sum(1 for c in self.calls if c.batch == batch)

    def answers(self, batch: bool) -> int:
        """HTTP answers the callers got, their SDK's retries included."""
        return sum(1 for user, _ in self.responses if user.startswith("batch-") == batch)

    def latencies(self, batch: bool) -> list[float]:
        return sorted(c.end - c.start for c in self.calls if c.batch == batch and c.error is None)

    def provider_429s(self) -> int:
        return sum(1 for r in self.log if r[2] == 429)

    def margin(self, rows: list[Row], capacity: int, per: float, cost: int | None = None) -> float:
        """The least, over every arrival at the provider, of the token bucket's bound
        since the start (``capacity + rate * elapsed``) less what had arrived by then:
        negative means over the bound. ``cost=None`` counts tokens used, else
        ``cost`` per request. Exact: an arrival was admitted before it arrived, and a
        request's usage is at most what it was charged."""
        rate = capacity / per
        total, least = 0.0, math.inf
        for row in sorted(rows):
            total += row[3] if cost is None else cost
            least = min(least, capacity + rate * (row[0] - self.start) - total)
        return least

    def busiest_window(self, rows: list[Row], per: float) -> float:
        """The most tokens used by requests arriving within any ``per`` seconds."""
        rows = sorted(rows)
        most, low, inside = 0.0, 0, 0.0
        for row in rows:
            inside += row[3]
            while rows[low][0] <= row[0] - per:
                inside -= rows[low][3]
                low += 1
            most = max(most, inside)
        return most

    def most_in_flight(self, user: str) -> int:
        """The most generations of ``user`` the provider ran at once."""
        edges = sorted(
            [(r[0], 1) for r in self.admitted(user)] + [(r[5], -1) for r in self.admitted(user)]
        )
        now = most = 0
        for _, step in edges:  # an end before a start at the same instant
            now += step
            most = max(most, now)
        return most


def run_callers(stack: Stack, seed: int = 0) -> Run:
    """Every interactive user (one thread, streaming, reading ``think`` seconds between
    questions) and batch user (``batch_threads`` threads, back to back) of the shape,
    started together, asking until ``duration`` has passed; each call counted once,
    however many retries it took. Then the provider's log."""
    shape = stack.shape
    start = time.monotonic() + 0.5
    deadline = start + shape.duration
    calls: list[Call] = []
    responses: list[tuple[str, int]] = []
    lock = threading.Lock()

    def caller(user: str, batch: bool, rng: random.Random) -> None:
        client = sdk(stack, user, responses)
        time.sleep(max(0.0, start - time.monotonic()))
        while time.monotonic() < deadline:
            arguments = question(shape, rng, batch=batch)
            began = time.monotonic()
            error = None
            try:
                if batch:
                    client.chat.completions.create(**arguments)
                else:
                    for _ in client.chat.completions.create(**arguments, stream=True):
                        pass
            except openai.OpenAIError as failure:
                error = type(failure).__name__
            with lock:
                calls.append(Call(user, batch, began, time.monotonic(), error))
            if not batch:
                time.sleep(rng.uniform(0.5, 1.5) * shape.think)
        client.close()

    threads = [
        threading.Thread(target=caller, args=(f"interactive-{n}", False, random.Random(seed + n)))
        for n in range(1, shape.interactive + 1)
    ]
    threads += [
        threading.Thread(
            target=caller, args=(f"batch-{n}", True, random.Random(seed + 100 * n + t))
        )
        for n in range(1, shape.batch + 1)
        for t in range(shape.batch_threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(shape.duration + shape.max_wait * (shape.max_retries + 1) + 120)
        assert not thread.is_alive(), "a caller never finished"
    return Run(shape, start, calls, responses, stack.provider_log())


def requests_total(scrape: str) -> dict[tuple[str, str], float]:
    """``bucketlimit_requests_total`` of a scrape: {(policy, outcome): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name == "bucketlimit_requests_total":
                found[sample.labels["policy"], sample.labels["outcome"]] = sample.value
    return found
