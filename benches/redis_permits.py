"""Concurrency permits on Redis: what a permit costs the client and the
server, and a combined rate + tokens + concurrency call next to the three done
separately.

    python -m benches.redis_permits [--requests 5000] [--rounds 5]

Starts its own redis-server on a free loopback port (stopped by PID at the end)
and talks to it over ONE connection (``single_connection_client=True``), so that
what is timed is one client's round trips. Every case runs ``--requests`` times a
round, round robin over 100 keys, in interleaved rounds (each case once per
round, in turn); the medians are printed, with the load average before and after.
Cases, per request:

- ``permit``: ``RedisConcurrencyLimiter.try_acquire`` + ``RedisPermit.release``
  (two script calls);
- ``combined``: ``acquire_all([(rpm, key, 1), (tpm, key, 350), (inflight, key)])``
  + ``settle([1, 120, 1])`` (one script to take all three, one to give back the
  unused tokens and release the permit);
- ``separate``: ``rpm.allow(key)``, ``tpm.allow(key, 350)``,
  ``inflight.try_acquire(key)``, ``tpm.refund(key, 230)`` and ``release()``
  (five script calls: the same work without the combined call).

For each: client µs per request (wall time over the requests) and server µs per
request (``usec`` of EVALSHA in ``INFO commandstats``, reset before the case,
divided by the requests), and the script calls per request. The buckets are
large enough that nothing is refused. A measurement, never a test: nothing here
runs in the test suite; do not run it while a test suite runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import redis

import bucketlimit
from benches.redis_reserve import start_server
from bucketlimit.redis import RedisConcurrencyLimiter, RedisTokenBucketLimiter

KEYS = [f"org-{i:03d}" for i in range(100)]


def measured(client: redis.Redis, run: Callable[[str], object], requests: int) -> dict[str, float]:
    """Client µs, server µs and script calls per request over ``requests`` runs."""
    keys = (KEYS * (requests // len(KEYS) + 1))[:requests]
    client.config_resetstat()
    start = time.perf_counter_ns()
    for key in keys:
        run(key)
    elapsed = time.perf_counter_ns() - start
    stats: dict[str, Any] = client.info("commandstats")
    scripts = stats.get("cmdstat_evalsha", {"usec": 0, "calls": 0})
    return {
        "client_us": elapsed / requests / 1000,
        "server_us": float(scripts["usec"]) / requests,
        "scripts": float(scripts["calls"]) / requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5_000, help="requests per case and round")
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory() as directory:
        server, port = start_server(directory)
        try:
            client = redis.Redis(port=port, single_connection_client=True)
            rpm = RedisTokenBucketLimiter(client, 10**6, 10**6, prefix="rpm:", processes=1)
            tpm = RedisTokenBucketLimiter(client, 10**8, 10**8, prefix="tpm:", processes=1)
            inflight = RedisConcurrencyLimiter(client, 1_000, ttl=60, prefix="c:", processes=1)

            def permit(key: str) -> None:
                held = inflight.try_acquire(key)
                assert held
                held.release()

            def combined(key: str) -> None:
                reservation = bucketlimit.acquire_all(
                    [(rpm, key, 1), (tpm, key, 350), (inflight, key)]
                )
                assert reservation
                reservation.settle([1, 120, 1])

            def separate(key: str) -> None:
                assert rpm.allow(key).allowed
                assert tpm.allow(key, 350).allowed
                held = inflight.try_acquire(key)
                assert held
                tpm.refund(key, 230)
                held.release()

            cases = {"permit": permit, "combined": combined, "separate": separate}
            for run in cases.values():  # scripts loaded, connection warm
                measured(client, run, 200)
            rows: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
            for _ in range(options.rounds):
                for name, run in cases.items():
                    rows[name].append(measured(client, run, options.requests))
            assert inflight.in_flight(KEYS[0]) == 0
        finally:
            server.terminate()
            server.wait(10)

    result = {
        "python": platform.python_version(),
        "redis_server": subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.split()[2],
        "requests_per_round": options.requests,
        "rounds": options.rounds,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "per_request_median": {
            name: {
                field: round(median(row[field] for row in runs), 2)
                for field in ("client_us", "server_us", "scripts")
            }
            for name, runs in rows.items()
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
