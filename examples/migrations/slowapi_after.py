"""``slowapi_before.py`` moved to bucketlimit by docs/migrating.md, "From slowapi":
the same routes and limits; the defaults per route, the storage the app's.

    uvicorn --app-dir examples/migrations slowapi_after:app --workers 4
    REDIS_URL=redis://127.0.0.1:6379/0 uvicorn --app-dir examples/migrations \\
        slowapi_after:app --workers 4

The middleware asks the store of every limit of the app at the lifespan start-up
(a dead REDIS_URL stops uvicorn), and a refusal logged by the hook keeps its 429.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import Depends, FastAPI, Request

from bucketlimit.fastapi import Limit, RateLimitMiddleware, exempt
from bucketlimit.web import Refusal

STORAGE = os.environ.get("REDIS_URL") or "memory://"
log = logging.getLogger("breaches")


def log_refusal(request: Request, refusal: Refusal) -> None:
    """Logs the refusal; returning None keeps the default 429."""
    log.warning("breach: %s", refusal)


app = FastAPI()
app.add_middleware(
    RateLimitMiddleware, default_limits=["50/minute"], storage=STORAGE, on_refusal=log_refusal
)


@app.get("/health")
@exempt
async def health() -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@app.get("/login", dependencies=[Depends(Limit("5/minute"))])
async def login() -> str:
    return "welcome"


@app.get("/signup", dependencies=[Depends(Limit("5/minute"))])  # its own 5, not /login's
async def signup() -> str:
    return "signed up"


@app.get("/items")  # the default limit, a bucket of its own
async def items() -> dict[str, Any]:
    return {"items": []}
