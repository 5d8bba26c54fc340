"""A small Flask service limited by bucketlimit.

Run it from the repository root:

    python examples/flask_app.py                                  # in-process buckets
    REDIS_URL=redis://127.0.0.1:6379/0 python examples/flask_app.py  # buckets in Redis

    curl -i localhost:5000/hello
    curl -i localhost:5000/v1/complete -H 'content-type: application/json' \\
        -d '{"prompt": "hello there", "max_tokens": 50}'

Under a multi-process server (``gunicorn -w 4 --chdir examples flask_app:app``) set
``REDIS_URL``: in-process buckets are per process, so 4 workers admit up to 4 times
the limit.

Environment:
  BUCKETLIMIT_CAPACITY   requests a client may burst (default 10)
  BUCKETLIMIT_RATE       requests per second it gets back (default 1; 0 = a fixed quota)
  BUCKETLIMIT_TOKENS     LLM tokens per client per minute (default 10000)
  REDIS_URL              share the buckets through Redis (redis-py URL)
  REDIS_TIMEOUT          seconds to wait for Redis (default 0.25)
  TRUSTED_PROXIES        comma-separated proxy networks whose X-Forwarded-For is believed
  PORT                   port for ``python examples/flask_app.py`` (default 5000)
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, Request, request

from bucketlimit import TokenBucketLimiter
from bucketlimit.flask import Limit, RateLimit, client_address, limit, reservation

CAPACITY = int(os.environ.get("BUCKETLIMIT_CAPACITY", "10"))
RATE = float(os.environ.get("BUCKETLIMIT_RATE", "1"))
TOKENS_PER_MINUTE = int(os.environ.get("BUCKETLIMIT_TOKENS", "10000"))
REDIS_URL = os.environ.get("REDIS_URL")
TRUSTED = [n.strip() for n in os.environ.get("TRUSTED_PROXIES", "").split(",") if n.strip()]


def make_limiter(capacity: int, rate: float, *, per: float, prefix: str) -> Any:
    """In-process by default; the Redis limiter when REDIS_URL is set."""
    if not REDIS_URL:
        return TokenBucketLimiter(capacity, rate, per=per)
    from bucketlimit.redis import RedisTokenBucketLimiter

    timeout = float(os.environ.get("REDIS_TIMEOUT", "0.25"))
    return RedisTokenBucketLimiter.from_url(
        REDIS_URL, capacity, rate, per=per, prefix=prefix, timeout=timeout
    )


def requested_tokens(req: Request) -> int:
    """The cost of a completion: the most tokens it may generate (from the JSON body)."""
    body = req.get_json(silent=True) or {}
    try:
        return max(1, int(body.get("max_tokens", 1)))
    except (TypeError, ValueError):
        return 1


app = Flask(__name__)

# Every request but the health check, keyed by the client's address.
RateLimit(
    Limit(
        make_limiter(CAPACITY, RATE, per=1, prefix="example:requests:"),
        key=client_address(TRUSTED),
        name="requests",
        exempt=lambda req: req.path == "/health",
    ),
    app,
)


@app.get("/health")
def health() -> dict[str, Any]:
    return {"status": "ok", "pid": os.getpid()}


@app.get("/hello")
def hello() -> dict[str, str]:
    return {"hello": "world"}


@app.post("/v1/complete")
@limit(
    make_limiter(TOKENS_PER_MINUTE, TOKENS_PER_MINUTE, per=60, prefix="example:tokens:"),
    key=client_address(TRUSTED),
    cost=requested_tokens,  # reserve the most it may generate...
    name="tokens",
)
def complete() -> tuple[dict[str, Any], int] | dict[str, Any]:
    body = request.get_json(silent=True) or {}
    if not isinstance(body.get("prompt"), str):
        reservation("tokens").cancel()  # nothing was generated: give it all back
        return {"error": "prompt must be a string"}, 400
    words = body["prompt"].split()[: requested_tokens(request)]  # a stand-in for the model
    refunded = reservation("tokens").settle(len(words))  # ...and give back what it did not use
    return {"text": " ".join(words), "tokens": len(words), "refunded": refunded}


if __name__ == "__main__":
    app.run(host="127.0.0.1", port=int(os.environ.get("PORT", "5000")))
