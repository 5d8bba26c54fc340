"""One real server per adapter with the peers' conventions: Flask and
Django under gunicorn, FastAPI and Litestar under uvicorn, real HTTP clients
(httpx, and the openai SDK). Limit strings, the three header profiles (each
structured field read with http-sf), on_refusal, exempt."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.redis_servers import free_port
from tests.web import sf
from tests.web.test_profiles import go_seconds
from tests.web.test_servers import serve

pytestmark = pytest.mark.timeout(180)

SERVERS = {
    "flask": ["gunicorn", "tests.web.servers.conventions_flask:app"],
    "django": ["gunicorn", "tests.web.servers.conventions_django:application"],
    "fastapi": ["uvicorn", "tests.web.servers.conventions_asgi:fastapi_app"],
    "litestar": ["uvicorn", "tests.web.servers.conventions_asgi:litestar_app"],
}


def command(server: str, app: str, port: int) -> list[str]:
    if server == "gunicorn":
        return [sys.executable, "-m", "gunicorn", app, "--bind", f"127.0.0.1:{port}",
                "--workers", "1", "--log-level", "warning"]  # fmt: skip
    return [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
            "--no-access-log", "--log-level", "warning"]  # fmt: skip


@pytest.mark.parametrize("framework", sorted(SERVERS))
def test_a_real_server_with_the_peers_conventions(framework: str, tmp_path: Path) -> None:
    port = free_port()
    server, app = SERVERS[framework]
    with serve(command(server, app, port), port, tmp_path / f"{framework}.log", {}) as url:
        for _ in range(3):
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 200
        assert not [h for h in health.headers if h.startswith("x-ratelimit")]  # exempt

        first = httpx.get(f"{url}/v1/models", timeout=10)
        assert first.status_code == 200
        assert sf.ratelimit(first.headers["RateLimit"])["requests"].params["r"] == 1
        assert sf.ratelimit_policy(first.headers["RateLimit-Policy"])["requests"].params["q"] == 2
        assert sf.integer(first.headers["x-ratelimit-remaining-requests"]) == 1
        assert sf.integer(first.headers["x-ratelimit-limit-requests"]) == 2
        assert 0 < go_seconds(first.headers["x-ratelimit-reset-requests"]) <= 30
        assert sf.integer(first.headers["X-RateLimit-Remaining"]) >= 0

        sdk = openai.OpenAI(api_key="test", base_url=f"{url}/v1", max_retries=0)
        assert sdk.models.list().data == []  # the second: allowed
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.models.list()
        assert refused.value.code == "rate_limit_exceeded"
        response = refused.value.response
        assert 0 < int(response.headers["retry-after-ms"]) <= 30_000
        assert int(response.headers["Retry-After"]) >= 1
        assert sf.ratelimit(response.headers["RateLimit"])["requests"].params["r"] == 0

        assert httpx.get(f"{url}/custom", timeout=10).status_code == 200
        custom = httpx.get(f"{url}/custom", timeout=10)
        assert custom.status_code == 429
        assert custom.json() == {"custom": True, "path": "/custom"}
        assert int(custom.headers["Retry-After"]) >= 1  # added to on_refusal's answer
