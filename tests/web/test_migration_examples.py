"""The three migrations of docs/migrating.md as running apps (examples/migrations):
each peer's app (flask-limiter, slowapi, DRF's throttles with django-ratelimit) and
the same app moved to bucketlimit, under real servers with two workers on one
redis-server. Sequential requests get the same answers from both (so the guide
cannot drift from the code); requests at once, across the workers, are admitted
exactly as the limit says by ours. The moved apps pass ``mypy --strict``."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis

from tests.support.redis_servers import free_port
from tests.web.test_servers import serve

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "migrations"
WORKERS = "2"

#: Each migration: its server, its two apps, its route limits, what its peer
#: answers a refusal with (django-ratelimit's Ratelimited is a 403).
MIGRATIONS = {
    "flask": ("gunicorn", "flask_limiter_before:app", "flask_limiter_after:app", 5, 429),
    "fastapi": ("uvicorn", "slowapi_before:app", "slowapi_after:app", 5, 429),
    "django": ("gunicorn", "django_before:application", "django_after:application", 10, 403),
}
DEFAULT = 50  # every migration's default limit, 50 a minute per route (DRF's anon rate)


def command(server: str, app: str, port: int) -> list[str]:
    if server == "gunicorn":
        return [sys.executable, "-m", "gunicorn", "--chdir", str(EXAMPLES), app,
                "--bind", f"127.0.0.1:{port}", "--workers", WORKERS,
                "--log-level", "warning"]  # fmt: skip
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(EXAMPLES), app,
            "--host", "127.0.0.1", "--port", str(port), "--workers", WORKERS,
            "--no-access-log", "--log-level", "warning"]  # fmt: skip


def sequential(url: str, route_limit: int) -> dict[str, list[int]]:
    """Each route's statuses, one request after the other, two past its limit."""
    sends = {"/login": route_limit + 2, "/signup": route_limit + 2, "/items": DEFAULT + 2}
    with httpx.Client(base_url=url, timeout=30) as client:
        return {path: [client.get(path).status_code for _ in range(n)] for path, n in sends.items()}


def at_once(url: str, path: str, count: int) -> Counter[int]:
    """``count`` requests to ``path``, all in flight together, each on its own
    connection, from another loopback address (another client: a key of its own)."""

    async def run() -> Counter[int]:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2", limits=limits)
        async with httpx.AsyncClient(base_url=url, transport=transport, timeout=60) as client:
            answers = await asyncio.gather(*(client.get(path) for _ in range(count)))
        return Counter(a.status_code for a in answers)

    return asyncio.run(run())


@pytest.mark.parametrize("framework", sorted(MIGRATIONS))
def test_the_peers_app_and_ours_answer_alike(
    framework: str, tmp_path: Path, redis_url: str
) -> None:
    server, before, after, route_limit, peer_refusal = MIGRATIONS[framework]
    store = redis.Redis.from_url(redis_url)
    answers = {}
    for app in (before, after):
        store.flushall()
        port = free_port()
        env = {"REDIS_URL": redis_url}
        with serve(command(server, app, port), port, tmp_path / f"{port}.log", env) as url:
            answers[app] = sequential(url, route_limit)
            if app == after:
                concurrent = at_once(url, "/login", 4 * route_limit)
    for path, statuses in answers[after].items():
        theirs = answers[before][path]
        limit = DEFAULT if path == "/items" else route_limit
        assert statuses == [200] * limit + [429] * 2, f"{framework} {path}: ours"
        assert theirs == [200] * limit + [peer_refusal if path != "/items" else 429] * 2, (
            f"{framework} {path}: the peer's app answered otherwise"
        )
    assert concurrent == Counter({200: route_limit, 429: 3 * route_limit}), (
        f"{framework}: {4 * route_limit} requests at once over {WORKERS} workers on Redis "
        f"admit exactly the limit, {route_limit}"
    )


def test_the_moved_apps_pass_mypy_strict() -> None:
    """The Flask and FastAPI apps as the guide moves them type-check with no cast and
    no ignore (the Django one needs django-stubs, which this environment lacks)."""
    from mypy import api

    apps = [str(EXAMPLES / f"{name}_after.py") for name in ("flask_limiter", "slowapi")]
    out, err, status = api.run(["--strict", "--no-incremental", *apps])
    assert status == 0, out + err
