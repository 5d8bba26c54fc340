"""The quick starts of flask-limiter and slowapi, from their own docs, moved to
bucketlimit by following docs/migrating.md alone: the same routes, the same
limits, the same status codes, request for request.

The peers count in fixed windows that start at a key's first hit; bucketlimit's
buckets of "N per period" hold N and refill N per period. The sequences below
send each limit's requests within its period (a second for "1/second": where two
requests are a second or more apart, both libraries admit the second), so the
two agree request for request on a real clock. (Both peers' counts break under
freezegun: flask-limiter's memory storage admitted a 51st request of "50 per
hour" with time frozen, so no fake clock is used here.)
"""

from __future__ import annotations

import asyncio

import httpx
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from flask import Flask
from flask_limiter import Limiter as FlaskLimiter
from flask_limiter.util import get_remote_address as flask_remote_address
from slowapi import Limiter as SlowapiLimiter
from slowapi import _rate_limit_exceeded_handler
from slowapi.errors import RateLimitExceeded
from slowapi.util import get_remote_address


def flask_limiter_quickstart() -> Flask:
    """flask-limiter's quick start, as its docs give it."""
    app = Flask(__name__)
    limiter = FlaskLimiter(
        flask_remote_address,
        app=app,
        default_limits=["200 per day", "50 per hour"],
        storage_uri="memory://",
    )

    @app.route("/slow")
    @limiter.limit("1 per day")
    def slow() -> str:
        return ":("

    @app.route("/medium")
    @limiter.limit("1/second", override_defaults=False)
    def medium() -> str:
        return ":|"

    @app.route("/fast")
    def fast() -> str:
        return ":)"

    @app.route("/ping")
    @limiter.exempt
    def ping() -> str:
        return "PONG"

    return app


def moved_to_bucketlimit() -> Flask:
    """The same app after docs/migrating.md, "From flask-limiter"."""
    from bucketlimit.flask import RateLimit, limit

    app = Flask(__name__)
    limiter = RateLimit(
        app=app,
        default_limits=["200 per day", "50 per hour"],
        storage="memory://",
    )

    @app.route("/slow")
    @limit("1 per day")
    def slow() -> str:
        return ":("

    @app.route("/medium")
    @limit("1/second", override_defaults=False)
    def medium() -> str:
        return ":|"

    @app.route("/fast")
    def fast() -> str:
        return ":)"

    @app.route("/ping")
    @limiter.exempt
    def ping() -> str:
        return "PONG"

    return app


def play_flask(app: Flask) -> list[tuple[str, int]]:
    client = app.test_client()
    seen: list[tuple[str, int]] = []

    def get(path: str, times: int = 1) -> None:
        seen.extend((path, client.get(path).status_code) for _ in range(times))

    get("/slow", 2)
    get("/medium", 2)
    get("/fast", 51)  # the defaults: 50 an hour on this route
    get("/ping", 3)
    get("/slow")
    return seen


def test_the_flask_limiter_quick_start_moves_as_the_guide_says() -> None:
    theirs = play_flask(flask_limiter_quickstart())
    ours = play_flask(moved_to_bucketlimit())
    assert ours == theirs
    assert ours[:2] == [("/slow", 200), ("/slow", 429)]
    assert ours[4:54] == [("/fast", 200)] * 50
    assert ours[54:] == [("/fast", 429), *[("/ping", 200)] * 3, ("/slow", 429)]


def slowapi_quickstart() -> FastAPI:
    """slowapi's quick start, as its docs give it."""
    limiter = SlowapiLimiter(key_func=get_remote_address)
    app = FastAPI()
    app.state.limiter = limiter
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]

    @app.get("/home")
    @limiter.limit("5/minute")
    async def homepage(request: Request) -> PlainTextResponse:
        return PlainTextResponse("test")

    @app.get("/mars")
    @limiter.limit("5/minute")
    async def mars(request: Request, response: Response) -> dict[str, str]:
        return {"key": "value"}

    return app


def slowapi_moved_to_bucketlimit() -> FastAPI:
    """The same app after docs/migrating.md, "From slowapi"."""
    from bucketlimit.fastapi import Limit

    app = FastAPI()

    @app.get("/home", dependencies=[Depends(Limit("5/minute"))])
    async def homepage(request: Request) -> PlainTextResponse:
        return PlainTextResponse("test")

    @app.get("/mars", dependencies=[Depends(Limit("5/minute"))])
    async def mars(request: Request, response: Response) -> dict[str, str]:
        return {"key": "value"}

    return app


def play_fastapi(app: FastAPI) -> list[tuple[str, int]]:
    async def play() -> list[tuple[str, int]]:
        transport = httpx.ASGITransport(app=app, client=("203.0.113.5", 1234))
        seen: list[tuple[str, int]] = []
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:

            async def get(path: str, times: int = 1) -> None:
                for _ in range(times):
                    seen.append((path, (await client.get(path)).status_code))

            await get("/home", 6)
            await get("/mars", 6)  # a bucket of its own
        return seen

    return asyncio.run(play())


def test_the_slowapi_quick_start_moves_as_the_guide_says() -> None:
    theirs = play_fastapi(slowapi_quickstart())
    ours = play_fastapi(slowapi_moved_to_bucketlimit())
    assert ours == theirs
    assert [s for _, s in ours] == ([200] * 5 + [429]) * 2
