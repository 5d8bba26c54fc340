"""Reservations on Redis: what ``reserve`` and ``acquire`` cost.

    python -m benches.redis_reserve [--calls 20000] [--rounds 7]

Starts its own redis-server on a free loopback port (stopped by PID at the end)
and talks to it over ONE connection (``single_connection_client=True``). In the
same run, interleaved round by round, it times per call:

- ``EVALSHA`` of the limiter's own script, raw, as ``allow`` sends it (no
  argument) and as ``reserve`` sends it (cost, mode, now, max_wait);
- ``RedisTokenBucketLimiter.allow``, ``.reserve`` and ``.acquire`` (granted at
  once: no wait, so the figure is the call, not a sleep);

then the script's own server time per call, ``usec_per_call`` of
``cmdstat_evalsha`` in ``INFO commandstats``, for allow and for reserve (the
statistics reset before each). With ``--before OLD_BUCKET_LUA`` (e.g. from
``git show b57fe8a:python/bucketlimit/_redis/bucket.lua``, the script before
reservations) the raw allow of that script is timed too, in the same rounds,
and its server time: whether the common call got dearer. Keys: 1,000, round robin, capacity 1,000 at
1,000 tokens a second, so every call is granted at once. Prints one JSON
object. A measurement, never a test: nothing here runs in the test suite; do
not run it while a test suite runs on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import redis

from benches.server_stats import own_form
from bucketlimit import _core
from bucketlimit.redis import RedisTokenBucketLimiter

KEYS = [f"user-{i:04d}" for i in range(1000)]
CAPACITY, RATE = 1000, 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(directory: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--dir", directory]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return server, port
        except redis.ConnectionError:
            time.sleep(0.025)
    server.kill()
    sys.exit(f"redis-server did not answer on port {port}")


def timed(run: Callable[[str], object], calls: int) -> float:
    """Microseconds per call over ``calls`` calls, round robin over the keys."""
    keys = (KEYS * (calls // len(KEYS) + 1))[:calls]
    start = time.perf_counter_ns()
    for key in keys:
        run(key)
    return (time.perf_counter_ns() - start) / calls / 1000


def server_usec_per_call(
    client: redis.Redis, argv: Callable[[str], tuple[Any, ...]], calls: int
) -> float:
    """``usec_per_call`` of EVALSHA in INFO commandstats over ``calls`` calls of
    ``argv(key)``, pipelined 500 at a time: the server's own time, without the
    client's pauses between calls (which leave its caches cold)."""
    client.config_resetstat()
    keys = (KEYS * (calls // len(KEYS) + 1))[:calls]
    for start in range(0, calls, 500):
        pipe = client.pipeline(transaction=False)
        for key in keys[start : start + 500]:
            pipe.execute_command(*argv(key))
        pipe.execute()
    stats: dict[str, Any] = client.info("commandstats")
    return float(stats["cmdstat_evalsha"]["usec_per_call"])


def sent_by(
    client: redis.Redis, limiter: RedisTokenBucketLimiter, call: Callable[[], object]
) -> Callable[[str], tuple[Any, ...]]:
    """The command ``call`` sends for ``KEYS[0]`` (seen through the client's own
    ``execute_command``, the script loaded first), as a function of the key: what
    the limiter sends, sent raw."""
    call()  # loads the script: the next call is the EVALSHA
    seen: list[tuple[Any, ...]] = []
    send = client.execute_command

    def spy(*args: Any, **options: Any) -> Any:
        seen.append(args)
        return send(*args, **options)

    client.execute_command = spy  # type: ignore[method-assign]
    try:
        call()
    finally:
        del client.execute_command
    (argv,) = seen
    mine = limiter.redis_key(KEYS[0])
    assert argv[0] == "EVALSHA", argv
    assert mine in argv, argv
    return lambda key: tuple(limiter.redis_key(key) if a == mine else a for a in argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per row and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", help="an older bucket.lua, for its raw allow")
    options = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        server, port = start_server(directory)
        try:
            client = redis.Redis(port=port, single_connection_client=True)
            limiter = RedisTokenBucketLimiter(client, CAPACITY, RATE, prefix="bench:")
            capacity, p, unit = _core.exact_units(CAPACITY, RATE)
            execute = client.execute_command
            allow_sent = sent_by(client, limiter, lambda: limiter.allow(KEYS[0]))
            reserve_sent = sent_by(client, limiter, lambda: limiter.reserve(KEYS[0]))

            def allow_argv(key: str) -> tuple[Any, ...]:
                return allow_sent(key)

            def reserve_argv(key: str) -> tuple[Any, ...]:
                return reserve_sent(key)

            def raw_allow(key: str) -> object:
                return execute(*allow_argv(key))

            def raw_reserve(key: str) -> object:
                return execute(*reserve_argv(key))

            def reserve(key: str) -> object:
                reservation = limiter.reserve(key)
                assert reservation.delay == 0.0
                return reservation

            def acquire(key: str) -> object:
                return limiter.acquire(key)

            rows: dict[str, Callable[[str], object]] = {}
            if options.before:
                with open(options.before, encoding="utf-8") as f:
                    old = own_form(f.read(), capacity, unit, p)
                old_sha: str = client.script_load(old)

                def before_argv(key: str) -> tuple[Any, ...]:
                    return ("EVALSHA", old_sha, 1, b"before:" + key.encode())

                def raw_before(key: str) -> object:
                    return execute(*before_argv(key))

                rows["EVALSHA raw, allow, the script before"] = raw_before
            rows |= {
                "EVALSHA raw, as allow sends it": raw_allow,
                "EVALSHA raw, as reserve sends it": raw_reserve,
                "allow()": limiter.allow,
                "reserve() (no wait)": reserve,
                "acquire() (no wait)": acquire,
            }
            for run in rows.values():  # warm up: scripts loaded, buckets made
                timed(run, len(KEYS))
            samples: dict[str, list[float]] = {name: [] for name in rows}
            for _ in range(options.rounds):
                for name, run in rows.items():
                    samples[name].append(timed(run, options.calls))
            served: dict[str, Callable[[str], tuple[Any, ...]]] = {
                "allow": allow_argv,
                "reserve": reserve_argv,
            }
            if options.before:
                served["allow, the script before"] = before_argv
            server_samples: dict[str, list[float]] = {name: [] for name in served}
            for _ in range(options.rounds):
                for name, run in served.items():
                    server_samples[name].append(server_usec_per_call(client, run, options.calls))
            server_time = {name: round(median(v), 2) for name, v in server_samples.items()}
            version = client.info("server")["redis_version"]
        finally:
            server.terminate()
            server.wait(10)

    print(
        json.dumps(
            {
                "machine": {
                    "python": platform.python_version(),
                    "redis-server": version,
                    "cpus": os.cpu_count(),
                    "load average": os.getloadavg(),
                },
                "calls per row and round": options.calls,
                "rounds": options.rounds,
                "us per call (median of rounds)": {
                    name: round(median(values), 2) for name, values in samples.items()
                },
                "us per call (each round)": {
                    name: [round(v, 2) for v in values] for name, values in samples.items()
                },
                "server usec_per_call (INFO commandstats, EVALSHA; median of rounds)": (
                    server_time
                ),
                "server usec_per_call (each round)": server_samples,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
