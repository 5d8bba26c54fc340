"""A FastAPI app limited by slowapi: the "before" of docs/migrating.md, "From
slowapi" (``slowapi_after.py`` is the same app on bucketlimit).

    uvicorn --app-dir examples/migrations slowapi_before:app --workers 4
    REDIS_URL=redis://127.0.0.1:6379/0 uvicorn --app-dir examples/migrations \\
        slowapi_before:app --workers 4
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, Request, Response
from slowapi import Limiter, _rate_limit_exceeded_handler
from slowapi.errors import RateLimitExceeded
from slowapi.middleware import SlowAPIMiddleware
from slowapi.util import get_remote_address

STORAGE = os.environ.get("REDIS_URL") or "memory://"

limiter = Limiter(key_func=get_remote_address, default_limits=["50/minute"], storage_uri=STORAGE)
app = FastAPI()
app.state.limiter = limiter
app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]
app.add_middleware(SlowAPIMiddleware)


@app.get("/health")
@limiter.exempt
async def health(request: Request) -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@app.get("/login")
@limiter.limit("5/minute")
async def login(request: Request, response: Response) -> str:
    return "welcome"


@app.get("/signup")
@limiter.limit("5/minute")
async def signup(request: Request, response: Response) -> str:
    return "signed up"


@app.get("/items")
async def items(request: Request) -> dict[str, Any]:
    return {"items": []}
