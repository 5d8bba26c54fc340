"""A FastAPI app whose requests wait for their tokens (``max_wait``), for
tests/web/test_disconnect.py under uvicorn: ``/mw`` is limited by the middleware,
``/dep`` by a dependency, each one token a minute, waits up to two minutes.
``/state/{which}`` (not limited) reports how long the next token is away for the
caller. ``REDIS_URL`` set: the asyncio Redis limiter instead of the in-process one.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from fastapi import Depends, FastAPI, Request

from bucketlimit import TokenBucketLimiter
from bucketlimit.fastapi import Limit, RateLimitMiddleware

REDIS_URL = os.environ.get("REDIS_URL")


def one_a_minute(prefix: str) -> Any:
    if not REDIS_URL:
        return TokenBucketLimiter(1, 1, per=60)
    from bucketlimit.redis import AsyncRedisTokenBucketLimiter

    return AsyncRedisTokenBucketLimiter.from_url(REDIS_URL, 1, 1, per=60, prefix=prefix, timeout=5)


LIMITERS = {
    "mw": one_a_minute(f"wait-mw-{os.getpid()}:"),
    "dep": one_a_minute(f"wait-dep-{os.getpid()}:"),
}

app = FastAPI()
app.add_middleware(
    RateLimitMiddleware,
    limit=Limit(
        LIMITERS["mw"], name="mw", max_wait=120, exempt=lambda request: request.url.path != "/mw"
    ),
)


@app.get("/health")
async def health() -> str:
    return "ok"


@app.get("/mw")
async def mw() -> str:
    return "mw"


@app.get("/dep", dependencies=[Depends(Limit(LIMITERS["dep"], name="dep", max_wait=120))])
async def dep() -> str:
    return "dep"


@app.get("/state/{which}")
async def state(which: str, request: Request) -> dict[str, float]:
    answer = LIMITERS[which].peek(request.client.host if request.client else "")
    decision = await answer if inspect.isawaitable(answer) else answer
    return {"next_token": decision.retry_after}
