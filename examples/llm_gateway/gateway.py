"""An LLM gateway: one model quota shared by many users, without one user's batch job
eating it (docs/recipes/llm-gateway.md walks through it).

A FastAPI proxy of OpenAI's ``POST /v1/chat/completions`` to a provider, its limits
on Redis, shared by every worker:

- per user: 40 requests and 9,000 tokens a minute, at most 2 generations in flight
  (held until a streamed answer ends);
- for the whole organisation: 48,000 tokens a minute, below the provider's quota;
- a request's tokens are estimated before it runs (a quarter of its prompt's
  characters, plus its ``max_tokens``), then settled with the usage the provider
  reports, a streamed answer's included;
- a request over a user's limits waits its turn (``max_wait``) instead of being
  refused, so batch jobs queue rather than fail; the org cap waits only briefly;
- OpenAI's rate-limit headers and error body (the ``openai`` header profile), so
  the openai SDK reads them as OpenAI's own;
- ``GET /metrics``: the limits' series for Prometheus (one port for every worker:
  prometheus_client's multiprocess mode), which dashboard.json charts.

Run it from the repository root (``pip install 'bucketlimit[redis,fastapi,metrics]'
httpx 'uvicorn[standard]'``)::

    rm -rf /tmp/gateway-metrics && mkdir /tmp/gateway-metrics
    PROMETHEUS_MULTIPROC_DIR=/tmp/gateway-metrics REDIS_URL=redis://127.0.0.1:6379/0 \\
    PROVIDER_URL=https://api.openai.com/v1 PROVIDER_API_KEY=sk-... \\
        uvicorn --app-dir examples/llm_gateway gateway:app --workers 4

Environment (the limits are per ``GATEWAY_WINDOW`` seconds, 60 by default):
  REDIS_URL               the store every worker shares (required)
  PROVIDER_URL            the provider's API base, up to /v1 (required)
  PROVIDER_API_KEY        the organisation's key at the provider
  GATEWAY_KEYS            JSON: each user's API key -> the user's name
  GATEWAY_RPM, GATEWAY_TPM, GATEWAY_ORG_TPM, GATEWAY_GENERATIONS
                          40, 9000, 48000, 2
  GATEWAY_MAX_WAIT        seconds a request may wait for a user's limits (60; 0 refuses)
  GATEWAY_ORG_WAIT        seconds it may wait for the org cap (5)
  GATEWAY_PREFIX          the limits' Redis key prefix ("llm-gateway:")
  REDIS_TIMEOUT           seconds to wait for Redis before a limit answers without it (1)
  PROMETHEUS_MULTIPROC_DIR  an empty folder for the metrics of every worker
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from bucketlimit.fastapi import AsyncReservation, Limit, RateLimitMiddleware, reservation
from bucketlimit.metrics import LimiterMetrics
from bucketlimit.redis import (
    AsyncRedisConcurrencyLimiter,
    AsyncRedisTokenBucketLimiter,
    client_from_url,
)

WINDOW = float(os.environ.get("GATEWAY_WINDOW", "60"))
MAX_WAIT = float(os.environ.get("GATEWAY_MAX_WAIT", "60"))
ORG_WAIT = float(os.environ.get("GATEWAY_ORG_WAIT", "5"))
PREFIX = os.environ.get("GATEWAY_PREFIX", "llm-gateway:")
USERS: dict[str, str] = json.loads(os.environ.get("GATEWAY_KEYS", '{"sk-alice": "alice"}'))
#: The output a request may make when it does not say (its max_tokens).
DEFAULT_MAX_TOKENS = 1024


def setting(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


# -- who asks, and what it may cost ------------------------------------------------------


def user(request: Request) -> str:
    """The user an API key belongs to (``Authorization: Bearer <key>``): every limit's
    key. An unknown key is a 401 before any limit charges anything."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    found = USERS.get(key) if scheme.lower() == "bearer" else None
    if found is None:
        raise HTTPException(401, detail="unknown API key")
    return found


async def estimate(request: Request) -> int:
    """The most tokens the request may use: a quarter of its prompt's characters (an
    overestimate for English text) and all of its ``max_tokens``. Settled with the
    provider's usage once the answer is known. Read once per request (two limits
    charge it), from the body the route reads again."""
    cached: int | None = getattr(request.state, "estimate", None)
    if cached is None:
        body = await request.json()
        characters = sum(len(m.get("content") or "") for m in body.get("messages", ()))
        most = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        cached = request.state.estimate = math.ceil(characters / 4) + int(most)
    return cached


# -- the limits, shared by every worker through Redis ------------------------------------

# A request waits seconds for its answer anyway: a store slow to answer under load
# (1 s) is better waited for than answered without it (each worker's own share).
store = client_from_url(
    os.environ["REDIS_URL"], asyncio=True, timeout=float(os.environ.get("REDIS_TIMEOUT", "1"))
)


def per_window(limit: int, name: str) -> AsyncRedisTokenBucketLimiter:
    return AsyncRedisTokenBucketLimiter(store, limit, limit, per=WINDOW, prefix=PREFIX + name + ":")


# Taken in this order: a request waiting for a generation slot holds no tokens.
generations = Limit(
    concurrency=AsyncRedisConcurrencyLimiter(
        store, setting("GATEWAY_GENERATIONS", 2), ttl=120, prefix=PREFIX + "generations:"
    ),
    key=user,
    name="generations",
    max_wait=MAX_WAIT,
    headers="openai",
)
requests = Limit(
    per_window(setting("GATEWAY_RPM", 40), "requests"),
    key=user,
    name="requests",
    max_wait=MAX_WAIT,
    headers="openai",
)
tokens = Limit(
    per_window(setting("GATEWAY_TPM", 9_000), "tokens"),
    key=user,
    cost=estimate,
    name="tokens",
    max_wait=MAX_WAIT,
    headers="openai",
)
org_tokens = Limit(
    per_window(setting("GATEWAY_ORG_TPM", 48_000), "org-tokens"),
    key=lambda request: "org",
    cost=estimate,
    name="org-tokens",
    max_wait=ORG_WAIT,
    headers="openai",
)
LIMITS = (generations, requests, tokens, org_tokens)

# -- metrics: one series set per limit, labelled by its name -----------------------------

metrics = LimiterMetrics()
for limit in LIMITS:
    metrics.add_limit(limit)
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from prometheus_client.multiprocess import MultiProcessCollector

    metrics.register_prometheus_multiprocess()  # in every worker

    def registry() -> CollectorRegistry:
        collected = CollectorRegistry()  # a fresh one per scrape: every worker's files
        MultiProcessCollector(collected)
        return collected

else:
    single = CollectorRegistry()
    metrics.register_prometheus(single)

    def registry() -> CollectorRegistry:
        return single


# -- the app -------------------------------------------------------------------------------

provider = httpx.AsyncClient(
    base_url=os.environ["PROVIDER_URL"].rstrip("/"),
    headers={"authorization": f"Bearer {os.environ.get('PROVIDER_API_KEY', '')}"},
    timeout=httpx.Timeout(600, connect=10),
)
app = FastAPI()
# Releases each request's generation slot when its answer ends, a stream's included
# (or when the client hangs up), and counts what each limit decided.
app.add_middleware(RateLimitMiddleware)


@app.post("/v1/chat/completions", dependencies=[Depends(limit) for limit in LIMITS])
async def chat(request: Request) -> Response:
    body = await request.json()
    body["user"] = user(request)  # OpenAI's end-user id, for the provider's abuse checks
    held = [reservation(request, "tokens"), reservation(request, "org-tokens")]
    if body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        upstream = await provider.send(
            provider.build_request("POST", "/chat/completions", json=body), stream=True
        )
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            return await answer_failed(upstream, held)
        return StreamingResponse(
            relay(upstream, held),
            media_type=upstream.headers.get("content-type", "text/event-stream"),
        )
    upstream = await provider.post("/chat/completions", json=body)
    if upstream.status_code != 200:
        return await answer_failed(upstream, held)
    await settle(held, upstream.json().get("usage"))
    return Response(upstream.content, media_type="application/json")


async def relay(upstream: httpx.Response, held: list[AsyncReservation]) -> AsyncIterator[bytes]:
    """The provider's event stream as it comes; its last event carries the usage,
    which settles the tokens before it is passed on (so a client that read it finds
    them settled). A client that hangs up ends it here (Starlette stops the body):
    the estimate is kept, the provider's stream closed, and the middleware frees
    the generation slot at once."""
    events = SSEUsage()
    try:
        async for chunk in upstream.aiter_raw():
            if events.feed(chunk):
                await settle(held, events.usage)
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):  # a hang-up cancels the body: close it all the same
            await upstream.aclose()


async def settle(held: list[AsyncReservation], usage: dict[str, Any] | None) -> None:
    """Keeps what the answer used in both token limits, gives back the rest; without
    a usage the estimate stands."""
    if usage is not None:
        for reserved in held:
            await reserved.settle(int(usage["total_tokens"]))


async def answer_failed(upstream: httpx.Response, held: list[AsyncReservation]) -> Response:
    """The provider's own error, passed on; it generated nothing, so the tokens come
    back (a 429 there means the org cap is set above the provider's quota)."""
    for reserved in held:
        await reserved.settle(0)
    return Response(
        upstream.content,
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type"),
        headers={k: v for k, v in upstream.headers.items() if k.startswith("retry-after")},
    )


class SSEUsage:
    """Reads an OpenAI event stream as it passes, for the ``usage`` of its last event."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self._rest = b""

    def feed(self, chunk: bytes) -> bool:
        """Reads ``chunk``; True when it completed the event carrying the usage."""
        lines = (self._rest + chunk).split(b"\n")
        self._rest = lines.pop()
        found = False
        for line in lines:
            data = line.strip().removeprefix(b"data:").strip()
            if line.startswith(b"data:") and data and data != b"[DONE]":
                event = json.loads(data)
                if event.get("usage"):
                    self.usage, found = event["usage"], True
        return found


@app.get("/metrics")
async def metrics_endpoint() -> Response:
    return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)


@app.get("/health")
async def health() -> JSONResponse:
    return JSONResponse({"status": "ok"})
