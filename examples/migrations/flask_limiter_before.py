"""A Flask app limited by flask-limiter: the "before" of docs/migrating.md, "From
flask-limiter" (``flask_limiter_after.py`` is the same app on bucketlimit).

    gunicorn --chdir examples/migrations flask_limiter_before:app --workers 4
    REDIS_URL=redis://127.0.0.1:6379/0 gunicorn --chdir examples/migrations \\
        flask_limiter_before:app --workers 4

Each route's own limit, 50 a minute per route by default, a breach logged.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flask import Flask
from flask_limiter import Limiter, RequestLimit
from flask_limiter.util import get_remote_address

STORAGE = os.environ.get("REDIS_URL") or "memory://"
log = logging.getLogger("breaches")


def log_breach(limit: RequestLimit) -> None:
    """Logs the breach; returning None keeps flask-limiter's 429."""
    log.warning("breach: %s", limit.limit)


app = Flask(__name__)
app.config["RATELIMIT_HEADERS_ENABLED"] = True
limiter = Limiter(
    get_remote_address,
    app=app,
    default_limits=["50/minute"],
    storage_uri=STORAGE,
    on_breach=log_breach,
)


@app.get("/health")
@limiter.exempt
def health() -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@app.get("/login")
@limiter.limit("5/minute")
def login() -> str:
    return "welcome"


@app.get("/signup")
@limiter.limit("5/minute")
def signup() -> str:
    return "signed up"


@app.get("/reset")
@limiter.limit("2/minute;10/hour")
def reset() -> str:
    return "sent"


@app.get("/items")
def items() -> dict[str, Any]:
    return {"items": []}
