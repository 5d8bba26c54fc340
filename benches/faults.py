"""What a Redis outage and a flood from one key cost a RedisTokenBucketLimiter.

    python -m benches.faults            # from the repository root; about 40 s
    python -m benches.faults --quick    # a shorter run

Not part of the test suite. It starts its own redis-server (loopback, a free
port, no persistence) and the tests' TCP proxy (tests/support/tcp_proxy.py) in
front of it, and prints two tables from one run. It runs as a module from the
root so that it can import those helpers as ``tests.support.*``.

1. Latency of ``allow()`` during an outage. The proxy drops every reply (the
   server runs the commands; nobody hears back), as a hung server or a dead
   network path looks to a client. The client waits ``TIMEOUT`` for a reply;
   ``retry_interval`` is ``RETRY``. Calls are sorted by what they did, read from
   ``stats()["store_calls"]``: the call right at the failure (the breaker still
   closed: it waits out its timeout), the probes (one per interval, each waits
   out a timeout too), and the calls while the breaker is open (answered from
   the local fallback). For contrast, the same outage with the breaker off
   (``retry_interval=0``): every call waits out its own timeout.
2. Store commands per second during a flood from one key (one thread calling
   as fast as it can, after the key spent its burst), with and without the
   refusal cache, counted by the server (INFO commandstats: EVALSHA + EVAL).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script, the repository root is not on sys.path
    sys.exit("run it from the repository root as a module: python -m benches.faults")

import redis

import bucketlimit
from bucketlimit.redis import RedisTokenBucketLimiter
from tests.support.redis_servers import RedisServer  # the tests' server runner
from tests.support.tcp_proxy import TcpProxy  # and their proxy

TIMEOUT = 0.05  # the client's socket timeout, seconds
RETRY = 0.5  # the breaker's retry_interval, seconds


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def row(name: str, samples: list[float]) -> str:
    if not samples:
        return f"| {name} | 0 | - | - | - |"
    return (
        f"| {name} | {len(samples):,} | {percentile(samples, 0.5) * 1e6:,.1f} "
        f"| {percentile(samples, 0.99) * 1e6:,.1f} | {max(samples) * 1e6:,.1f} |"
    )


def wait_for_store(limiter: RedisTokenBucketLimiter) -> None:
    deadline = time.monotonic() + 30
    while limiter.allow("bench").degraded:
        if time.monotonic() > deadline:
            raise RuntimeError("the store never answered again")
        time.sleep(0.01)


def outage_latencies(
    proxy: TcpProxy, outages: int, seconds: float
) -> tuple[dict[str, list[float]], int]:
    """Latency samples by kind of call, over ``outages`` outages of ``seconds`` each."""
    kinds: dict[str, list[float]] = {"failure": [], "probe": [], "open": [], "no breaker": []}
    url = f"redis://127.0.0.1:{proxy.port}/0"
    protected = RedisTokenBucketLimiter.from_url(
        url, 10**9, 10**6, timeout=TIMEOUT, retry_interval=RETRY
    )
    unprotected = RedisTokenBucketLimiter.from_url(
        url, 10**9, 10**6, timeout=TIMEOUT, retry_interval=0, prefix="u:"
    )
    for _ in range(outages):
        proxy.drop_replies = False
        wait_for_store(protected)
        proxy.drop_replies = True
        first = True
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sent = protected.stats()["store_calls"]
            started = time.perf_counter()
            decision = protected.allow("bench")
            took = time.perf_counter() - started
            assert decision.degraded
            if protected.stats()["store_calls"] == sent:
                kinds["open"].append(took)
            elif first:
                kinds["failure"].append(took)
                first = False
            else:
                kinds["probe"].append(took)
    # The breaker off: every call asks the store (and the first of them too).
    proxy.drop_replies = False
    wait_for_store(unprotected)
    proxy.drop_replies = True
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        unprotected.allow("bench")
        kinds["no breaker"].append(time.perf_counter() - started)
    proxy.drop_replies = False
    openings = protected.stats()["breaker_openings"]
    protected.client.close()
    unprotected.client.close()
    return kinds, openings


def script_calls(admin: redis.Redis) -> int:
    stats = admin.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{n}", {}).get("calls", 0)) for n in ("evalsha", "eval"))


def flood(url: str, admin: redis.Redis, seconds: float, **limit: object) -> tuple[float, float]:
    """(decisions per second, store commands per second) for one key flooding, in the
    steady state: the key has spent its burst before the count starts."""
    cached = RedisTokenBucketLimiter.from_url(url, **limit, prefix="f:")  # type: ignore[arg-type]
    while cached.allow("abuser").allowed:
        pass
    admin.config_resetstat()
    calls = 0
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            cached.allow("abuser")
        calls += 100
    elapsed = time.perf_counter() - start
    commands = script_calls(admin)
    cached.client.close()
    admin.delete(*admin.keys("f:*"))
    return calls / elapsed, commands / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer outages, shorter floods")
    args = parser.parse_args()
    # The breaker logs a warning per outage; this run makes dozens on purpose.
    logging.getLogger("bucketlimit").setLevel(logging.ERROR)
    outages, outage_seconds, flood_seconds = (5, 1.5, 1.0) if args.quick else (20, 1.5, 3.0)

    directory = Path(tempfile.mkdtemp(prefix="bucketlimit-faults-"))
    server = RedisServer(directory).start()
    admin = server.client()
    try:
        with TcpProxy(server.port) as proxy:
            kinds, openings = outage_latencies(proxy, outages, outage_seconds)
        floods = []
        for name, limit in [
            ("10 a second (capacity 10)", {"capacity": 10, "rate": 10}),
            ("100 a minute (capacity 100)", {"capacity": 100, "rate": 100, "per": 60}),
        ]:
            for cache in (False, True):
                rates = flood(server.url, admin, flood_seconds, **limit, refusal_cache=cache)
                floods.append((name, cache, *rates))
        version = admin.info("server")["redis_version"]
    finally:
        admin.close()
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)

    print(
        f"bucketlimit {bucketlimit.__version__}, redis-py {redis.__version__}, "
        f"redis-server {version}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"\nallow() during an outage (replies dropped by a proxy): socket timeout "
        f"{TIMEOUT * 1000:.0f} ms, retry_interval {RETRY} s, on_store_error='local', "
        f"{outages} outages of {outage_seconds} s ({openings} breaker openings), one thread\n"
    )
    print("| call | calls | p50 µs | p99 µs | worst µs |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(row("at the failure (breaker closed)", kinds["failure"]))
    print(row("probe (one per retry_interval)", kinds["probe"]))
    print(row("breaker open (local fallback)", kinds["open"]))
    print(row("no breaker (retry_interval=0), every call", kinds["no breaker"]))
    print(
        f"\nOne key flooding from one thread for {flood_seconds} s "
        "(store commands counted by the server)\n"
    )
    print("| limit | refusal cache | decisions/s | store commands/s |")
    print("| --- | --- | ---: | ---: |")
    for name, cache, decisions, commands in floods:
        print(f"| {name} | {'on' if cache else 'off'} | {decisions:,.0f} | {commands:,.1f} |")


if __name__ == "__main__":
    main()
