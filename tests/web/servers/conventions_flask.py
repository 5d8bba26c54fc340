"""Flask with the peers' conventions, for tests/web/test_conventions_servers.py
(gunicorn): config keys, limit strings, header profiles, on_refusal, exempt."""

from __future__ import annotations

from typing import Any

from flask import Flask, Request

from bucketlimit.flask import RateLimit, exempt, limit
from bucketlimit.web import Refusal

app = Flask(__name__)
app.config.update(RATELIMIT_STORAGE_URI="memory://", RATELIMIT_HEADERS_ENABLED=True)
RateLimit(app=app)
PROFILES = ["draft-11", "legacy", "openai"]


def custom(request: Request, refusal: Refusal) -> Any:
    return {"custom": True, "path": request.path}, refusal.status


@app.get("/health")
@exempt
def health() -> str:
    return "ok"


@app.get("/v1/models")
@limit("2/minute", name="requests", headers=PROFILES)
def models() -> dict[str, Any]:
    return {"object": "list", "data": []}


@app.get("/custom")
@limit("1/minute", name="custom", on_refusal=custom)
def custom_route() -> str:
    return "once"
