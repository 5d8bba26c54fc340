"""``flask_limiter_before.py`` moved to bucketlimit by docs/migrating.md, "From
flask-limiter": the same routes, limits, settings and breach log.

    gunicorn --chdir examples/migrations flask_limiter_after:app --workers 4
    REDIS_URL=redis://127.0.0.1:6379/0 gunicorn --chdir examples/migrations \\
        flask_limiter_after:app --workers 4

With REDIS_URL each route's limit holds across the workers (one atomic script per
decision), and the store is asked at start-up (before each worker's first request
for the views' limits).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flask import Flask, Request

from bucketlimit.flask import RateLimit, limit
from bucketlimit.web import Refusal

STORAGE = os.environ.get("REDIS_URL") or "memory://"
log = logging.getLogger("breaches")


def log_breach(request: Request, refusal: Refusal) -> None:
    """Logs the breach; returning None keeps the default 429 (as on_breach's does)."""
    log.warning("breach: %s", refusal)


app = Flask(__name__)
app.config["RATELIMIT_HEADERS_ENABLED"] = True  # flask-limiter's X-RateLimit-* fields
limiter = RateLimit(
    app=app,
    default_limits=["50/minute"],
    storage=STORAGE,
    on_refusal=log_breach,
)


@app.get("/health")
@limiter.exempt
def health() -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@app.get("/login")
@limit("5/minute")
def login() -> str:
    return "welcome"


@app.get("/signup")
@limit("5/minute")
def signup() -> str:
    return "signed up"


@app.get("/reset")
@limit("2/minute;10/hour")
def reset() -> str:
    return "sent"


@app.get("/items")
def items() -> dict[str, Any]:
    return {"items": []}
