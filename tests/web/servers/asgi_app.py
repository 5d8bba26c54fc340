"""A bare ASGI app behind bucketlimit.asgi, for tests/web/test_servers.py (uvicorn).

Capacity ``BUCKETLIMIT_CAPACITY`` (default 2), rate 0, keyed by the peer address.
"""

from __future__ import annotations

import os
from typing import Any

from bucketlimit import TokenBucketLimiter
from bucketlimit.asgi import Limit, RateLimitMiddleware

CAPACITY = int(os.environ.get("BUCKETLIMIT_CAPACITY", "2"))


async def inner(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "hello"})
        await send({"type": "websocket.close", "code": 1000})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


app = RateLimitMiddleware(
    inner,
    limit=Limit(TokenBucketLimiter(CAPACITY, 0), name="conn", exempt=lambda r: r.path == "/health"),
)
