"""The worker processes of tests/upstream/scenario.py: each runs threads sending
chat-completion-shaped requests through bucketlimit's transport, sharing one Redis
budget with every other process. A module of its own: spawned processes import it."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bucketlimit.httpx import RateLimitTransport
from bucketlimit.redis import RedisTokenBucketLimiter


@dataclass(frozen=True)
class Plan:
    url: str  # the mock provider
    redis_url: str
    prefix: str
    window: float
    tokens: int  # the limits the client is configured with, per window
    requests: int
    threads: int
    duration: float  # seconds every thread sends for, from the start
    client: str  # "httpx" or "openai"
    seed: int


def work(plan: Plan, ready: Any, go: Any, start: Any) -> None:
    """One process: says it is ready (everything imported and built), waits for the
    common start (``time.monotonic()``, system-wide), and its threads send until the
    deadline."""
    store = redis.Redis.from_url(
        plan.redis_url, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
    )
    tokens = RedisTokenBucketLimiter(
        store, plan.tokens, plan.tokens, per=plan.window, prefix=f"{plan.prefix}tokens:"
    )
    requests = RedisTokenBucketLimiter(
        store, plan.requests, plan.requests, per=plan.window, prefix=f"{plan.prefix}requests:"
    )
    transport = RateLimitTransport(httpx.HTTPTransport(), requests=requests, tokens=tokens)
    http = httpx.Client(
        transport=transport, base_url=plan.url, headers={"x-consumer": "bucketlimit"}, timeout=30
    )
    send = _sender(plan, http)
    ready.put(plan.seed)
    go.wait()
    deadline = start.value + plan.duration
    threads = [
        threading.Thread(
            target=_loop, args=(start.value, deadline, send, random.Random(plan.seed * 100 + i))
        )
        for i in range(plan.threads)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    http.close()
    store.close()


def _sender(plan: Plan, http: httpx.Client) -> Any:
    if plan.client == "httpx":

        def post(body: dict[str, Any]) -> None:
            http.post("/v1/chat/completions", json=body)

        return post
    import openai

    # The SDK takes an httpx.Client as well as its own httpx2.Client (its types say
    # only the latter): http_client=httpx.Client(transport=...), as docs/upstream.md says.
    sdk = openai.OpenAI(api_key="sk-test", base_url=f"{plan.url}/v1", http_client=http)  # type: ignore[arg-type]

    def create(body: dict[str, Any]) -> None:
        # A 429 the SDK gave up on is counted by the provider: the test reads its log.
        with contextlib.suppress(openai.RateLimitError):
            sdk.chat.completions.create(**body)

    return create


def _loop(start: float, deadline: float, send: Any, rng: random.Random) -> None:
    time.sleep(max(0.0, start - time.monotonic()))
    while time.monotonic() < deadline:
        send(
            {
                "model": "mock",
                "max_tokens": rng.randint(100, 600),
                "messages": [{"role": "user", "content": "x" * rng.randint(20, 200)}],
            }
        )
