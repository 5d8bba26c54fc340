"""What a web adapter costs per request: bucketlimit next to flask-limiter and
slowapi, in one run, each over the same app with a no-op middleware.

    python -m benches.adapters             # from the repository root, ~1 minute
    python -m benches.adapters --profile   # cProfile of bucketlimit's own paths first

Needs flask-limiter and slowapi (benches/requirements.txt), not the package's
dependencies. Every app answers a hello route; each request is one direct call
of the app (WSGI ``app(environ, start_response)``, ASGI ``await app(scope,
receive, send)``) with no network, and the figure is CPU time per request
(``time.process_time``), the median of interleaved repetitions. "own cost" is
the row minus the no-op middleware row of the same framework: what the limiter
adds to a request, the framework's own cost of a middleware aside. Every limit
admits every request (a burst far larger than the run, one client), so this is
the allowed path; the key is the default one, the peer address.
"""

import argparse
import asyncio
import cProfile
import gc
import io
import pstats
import sys
import time
import timeit
from collections.abc import Callable
from statistics import median
from typing import Any

BIG = 10**9  # capacity: nothing is refused in a run
MINIMUM = False  # --min: the least of the repetitions (steadier on a loaded machine)


# -- Flask --------------------------------------------------------------------------------


def flask_hello() -> Any:
    from flask import Flask

    app = Flask("bench")
    app.add_url_rule("/hello", "hello", lambda: "hello")
    return app


def flask_apps() -> dict[str, Any]:
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    from bucketlimit import TokenBucketLimiter
    from bucketlimit.flask import Limit, RateLimit

    apps: dict[str, Any] = {"bare": flask_hello()}
    noop = flask_hello()
    noop.before_request(lambda: None)
    apps["no-op middleware"] = noop
    ours = flask_hello()
    RateLimit(Limit(TokenBucketLimiter(BIG, 1), name="requests"), ours)
    apps["bucketlimit"] = ours
    theirs = flask_hello()
    Limiter(get_remote_address, app=theirs, default_limits=[f"{BIG} per second"])
    apps["flask-limiter"] = theirs
    return apps


def wsgi_call(app: Any) -> Callable[[], None]:
    environ_base = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/hello",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "REMOTE_ADDR": "192.0.2.1",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": sys.stderr,
        "SERVER_PROTOCOL": "HTTP/1.1",
    }

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> None:
        assert status.startswith("200"), status

    def call() -> None:
        for _ in app(dict(environ_base), start_response):
            pass

    return call


# -- FastAPI ------------------------------------------------------------------------------


def fastapi_hello() -> Any:
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.get("/hello")
    async def hello(request: Request) -> str:
        return "hello"

    return app


class NoOpMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def fastapi_apps() -> dict[str, Any]:
    from fastapi import Depends, FastAPI, Request
    from slowapi import Limiter, _rate_limit_exceeded_handler
    from slowapi.errors import RateLimitExceeded
    from slowapi.middleware import SlowAPIASGIMiddleware
    from slowapi.util import get_remote_address

    from bucketlimit import TokenBucketLimiter
    from bucketlimit.fastapi import Limit, RateLimitMiddleware

    apps: dict[str, Any] = {"bare": fastapi_hello()}
    noop = fastapi_hello()
    noop.add_middleware(NoOpMiddleware)
    apps["no-op middleware"] = noop
    ours = fastapi_hello()
    ours.add_middleware(
        RateLimitMiddleware, limit=Limit(TokenBucketLimiter(BIG, 1), name="requests")
    )
    apps["bucketlimit"] = ours
    dependency = FastAPI()
    per_route = Limit(TokenBucketLimiter(BIG, 1), name="route")

    @dependency.get("/hello", dependencies=[Depends(per_route)])
    async def hello(request: Request) -> str:
        return "hello"

    apps["bucketlimit (dependency)"] = dependency
    noop_dependency = FastAPI()

    async def nothing(request: Request) -> None:
        return None

    @noop_dependency.get("/hello", dependencies=[Depends(nothing)])
    async def hello_too(request: Request) -> str:
        return "hello"

    apps["no-op dependency"] = noop_dependency
    limiter = Limiter(key_func=get_remote_address, default_limits=[f"{BIG}/second"])
    theirs = fastapi_hello()
    theirs.state.limiter = limiter
    theirs.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]
    theirs.add_middleware(SlowAPIASGIMiddleware)
    apps["slowapi"] = theirs
    return apps


def asgi_call(app: Any, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    scope_base = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/hello",
        "raw_path": b"/hello",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"bench")],
        "client": ("192.0.2.1", 1234),
        "server": ("bench", 80),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200, message

    async def many(count: int) -> None:
        for _ in range(count):
            await app(dict(scope_base), receive, send)

    def call_batch(count: int) -> None:
        loop.run_until_complete(many(count))

    call_batch.batched = True  # type: ignore[attr-defined]
    return call_batch  # type: ignore[return-value]


# -- timing -------------------------------------------------------------------------------


def cpu_per_call(call: Callable[..., None], count: int) -> float:
    """CPU seconds per request over ``count`` requests."""
    batched = getattr(call, "batched", False)
    start = time.process_time()
    if batched:
        call(count)
    else:
        for _ in range(count):
            call()
    return (time.process_time() - start) / count


def measure(calls: dict[str, Callable[..., None]], count: int, repeats: int) -> dict[str, float]:
    for call in calls.values():  # warm up: imports, caches, the first bucket
        cpu_per_call(call, max(100, count // 10))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):  # interleaved: every row once per repetition
        for name, call in calls.items():
            samples[name].append(cpu_per_call(call, count))
    pick = min if MINIMUM else median
    return {name: pick(values) for name, values in samples.items()}


def report(framework: str, figures: dict[str, float]) -> str:
    base = figures["no-op middleware"]
    lines = [
        f"### {framework}",
        "",
        "| app | µs per request (CPU) | own cost over a no-op middleware (dependency) |",
        "| --- | ---: | ---: |",
    ]
    for name, seconds in figures.items():
        against = figures.get("no-op dependency", base) if "dependency" in name else base
        own = "" if name.startswith(("bare", "no-op")) else f"{(seconds - against) * 1e6:+.1f} µs"
        lines.append(f"| {name} | {seconds * 1e6:.1f} | {own} |")
    return "\n".join(lines)


def profile(call: Callable[..., None], count: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    cpu_per_call(call, count)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=5000, help="requests per sample")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--profile", action="store_true", help="cProfile bucketlimit's paths")
    parser.add_argument("--min", action="store_true", help="report the least repetition")
    parser.add_argument("--no-gc", action="store_true", help="collector off while timing")
    args = parser.parse_args()
    global MINIMUM
    MINIMUM = args.min
    if args.no_gc:
        gc.disable()
    loop = asyncio.new_event_loop()
    flask_calls = {name: wsgi_call(app) for name, app in flask_apps().items()}
    asgi_calls = {name: asgi_call(app, loop) for name, app in fastapi_apps().items()}
    if args.profile:
        print(profile(flask_calls["bucketlimit"], args.count))
        print(profile(asgi_calls["bucketlimit"], args.count))
    from bucketlimit import TokenBucketLimiter

    core = TokenBucketLimiter(BIG, 1)
    allow = min(timeit.repeat(lambda: core.allow("192.0.2.1"), number=100_000, repeat=5)) / 100_000
    print(f"Python {sys.version.split()[0]}, {args.count} requests x {args.repeats} repetitions")
    print(f"calibration: the core's allow() alone takes {allow * 1e6:.2f} µs in this run\n")
    print(
        report(
            "Flask (WSGI, one direct call per request)",
            measure(flask_calls, args.count, args.repeats),
        )
    )
    print()
    print(
        report(
            "FastAPI (ASGI, one direct call per request)",
            measure(asgi_calls, args.count, args.repeats),
        )
    )
    loop.close()


if __name__ == "__main__":
    main()
