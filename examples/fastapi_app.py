"""A small FastAPI service limited by bucketlimit.

Run it from the repository root:

    uvicorn --app-dir examples fastapi_app:app                  # in-process buckets
    REDIS_URL=redis://127.0.0.1:6379/0 \\
        uvicorn --app-dir examples fastapi_app:app --workers 4  # buckets shared in Redis

    curl -i localhost:8000/hello
    curl -i localhost:8000/v1/complete -H 'content-type: application/json' \\
        -d '{"prompt": "hello there", "max_tokens": 50}'

Without ``REDIS_URL`` every worker process has its own buckets, so N workers admit
up to N times the limit; with it they share one bucket per client.

Environment:
  BUCKETLIMIT_CAPACITY   requests a client may burst (default 10)
  BUCKETLIMIT_RATE       requests per second it gets back (default 1; 0 = a fixed quota)
  BUCKETLIMIT_TOKENS     LLM tokens per client per minute (default 10000)
  REDIS_URL              share the buckets through Redis (redis-py URL)
  REDIS_TIMEOUT          seconds to wait for Redis (default 0.25)
  TRUSTED_PROXIES        comma-separated proxy networks whose X-Forwarded-For is believed
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, Field

from bucketlimit import TokenBucketLimiter
from bucketlimit.fastapi import AsyncReservation, Limit, RateLimitMiddleware, client_address

CAPACITY = int(os.environ.get("BUCKETLIMIT_CAPACITY", "10"))
RATE = float(os.environ.get("BUCKETLIMIT_RATE", "1"))
TOKENS_PER_MINUTE = int(os.environ.get("BUCKETLIMIT_TOKENS", "10000"))
REDIS_URL = os.environ.get("REDIS_URL")
TRUSTED = [n.strip() for n in os.environ.get("TRUSTED_PROXIES", "").split(",") if n.strip()]


def make_limiter(capacity: int, rate: float, *, per: float, prefix: str) -> Any:
    """In-process by default; the asyncio Redis limiter when REDIS_URL is set."""
    if not REDIS_URL:
        return TokenBucketLimiter(capacity, rate, per=per)
    from bucketlimit.redis import AsyncRedisTokenBucketLimiter

    timeout = float(os.environ.get("REDIS_TIMEOUT", "0.25"))
    return AsyncRedisTokenBucketLimiter.from_url(
        REDIS_URL, capacity, rate, per=per, prefix=prefix, timeout=timeout
    )


# Every request but the health check, keyed by the client's address (behind the
# proxies listed in TRUSTED_PROXIES, the address they saw).
per_client = Limit(
    make_limiter(CAPACITY, RATE, per=1, prefix="example:requests:"),
    key=client_address(TRUSTED),
    name="requests",
    exempt=lambda request: request.url.path == "/health",
)


async def requested_tokens(request: Request) -> int:
    """The cost of a completion: the most tokens it may generate (read from the body)."""
    try:
        body = await request.json()
        return max(1, int(body["max_tokens"]))
    except (ValueError, KeyError, TypeError):
        return 1  # a malformed body is rejected by the route's validation anyway


# LLM tokens a minute, reserved up front, unused ones given back.
tokens = Limit(
    make_limiter(TOKENS_PER_MINUTE, TOKENS_PER_MINUTE, per=60, prefix="example:tokens:"),
    key=client_address(TRUSTED),
    cost=requested_tokens,
    name="tokens",
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    for limit in (per_client, tokens):
        aclose = getattr(limit.limiter, "aclose", None)  # a Redis limiter: its connections
        if aclose is not None:
            await aclose()


app = FastAPI(lifespan=lifespan)
app.add_middleware(RateLimitMiddleware, limit=per_client)


class Completion(BaseModel):
    prompt: str
    max_tokens: int = Field(ge=1)


@app.get("/health")
async def health() -> dict[str, Any]:
    """Not limited (exempt). The pid tells which worker answered."""
    return {"status": "ok", "pid": os.getpid()}


@app.get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "world"}


@app.post("/v1/complete")
async def complete(
    body: Completion, held: Annotated[AsyncReservation, Depends(tokens)]
) -> dict[str, Any]:
    words = body.prompt.split()[: body.max_tokens]  # a stand-in for the model
    refunded = await held.settle(len(words))  # keep what was used, give back the rest
    return {"text": " ".join(words), "tokens": len(words), "refunded": refunded}
