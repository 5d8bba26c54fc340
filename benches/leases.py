"""Leases for hot keys: what a leased ``allow()`` costs, and one key from 8 processes.

    python -m benches.leases            # from the repository root; about a minute
    python -m benches.leases --quick    # a smoke run

Not part of the test suite: the figures are printed side by side, never asserted.
It starts its own redis-server (the tests' runner: loopback, a free port, no
persistence; benches/server_stats.py) and measures, in one run:

1. ``calls``: nanoseconds per ``allow()`` from one Python loop, interleaved rounds
   (median and best of the rounds): the in-process ``TokenBucketLimiter``, the
   leased ``RedisTokenBucketLimiter`` (every call answered by its lease; a
   billion-token bucket), the asyncio one awaited in a loop, and the unleased one
   (a round trip) for scale. Goal: the leased call within 2x the in-process one.
2. ``processes``: one key (capacity 10,000, 100,000 a second, as the issue's tests),
   8 processes calling ``allow`` as fast as they can for a few seconds, each of:
   leased, unleased, and limits' fixed window (100,000 a second) on the same
   server. Per mode: decisions a second (all answers), admitted a second, Redis
   commands per 1,000 admitted decisions (``INFO commandstats``: the commands the
   clients sent, all scripts, and every command the server ran, those the scripts
   ran too) and the server's CPU per 1,000 admitted decisions (``INFO cpu``).

It runs in the development environment (``make install``; it uses the tests' server
runner); limits' row needs ``limits`` (benches/requirements.txt) and is left out,
saying so, without it. Run it lightly: it uses both cores for a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

from benches import peers
from benches.server_stats import SCRIPT_COMMANDS, load, server_cpu, start_server
from bucketlimit import TokenBucketLimiter, __version__
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter

SPAWN = multiprocessing.get_context("spawn")
KEY = "hot"
CAPACITY, RATE = 10_000, 100_000
#: Every call allowed for the per-call section: a bucket no loop drains.
HUGE = 10**9


def _loop(allow: Callable[[str], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        allow(KEY)
    return (time.perf_counter() - start) / calls * 1e9


def _loop_async(loop: asyncio.AbstractEventLoop, allow: Callable[[str], Any], calls: int) -> float:
    async def main() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            await allow(KEY)
        return (time.perf_counter() - start) / calls * 1e9

    return loop.run_until_complete(main())


def calls_section(port: int, rounds: int, calls: int) -> dict[str, tuple[float, float]]:
    """ns per allow(): (median, best) over interleaved rounds."""
    client = redis.Redis(host="127.0.0.1", port=port)
    in_process = TokenBucketLimiter(HUGE, HUGE)
    leased = RedisTokenBucketLimiter(client, HUGE, HUGE, prefix="calls-l:", lease=True)
    unleased = RedisTokenBucketLimiter(client, HUGE, HUGE, prefix="calls-u:")
    async_client = redis.asyncio.Redis(host="127.0.0.1", port=port)
    leased_async = AsyncRedisTokenBucketLimiter(
        async_client, HUGE, HUGE, prefix="calls-a:", lease=True
    )
    loop = asyncio.new_event_loop()  # one loop: the asyncio client's connections live in it
    for _ in range(3):  # the first lease, then one of the share
        leased.allow(KEY)
    _loop_async(loop, leased_async.allow, 3)
    subjects: dict[str, Callable[[], float]] = {
        "in-process TokenBucketLimiter": lambda: _loop(in_process.allow, calls),
        "leased RedisTokenBucketLimiter": lambda: _loop(leased.allow, calls),
        "leased AsyncRedisTokenBucketLimiter (awaited)": lambda: _loop_async(
            loop, leased_async.allow, calls
        ),
        "unleased RedisTokenBucketLimiter (a round trip)": lambda: _loop(
            unleased.allow, max(1, calls // 100)
        ),
    }
    seen: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(rounds):
        for name, run in subjects.items():
            seen[name].append(run())
    hits = leased.stats()["lease_hits"]
    leased.close()
    client.close()
    loop.run_until_complete(leased_async.aclose())
    loop.run_until_complete(async_client.aclose())
    loop.close()
    print(f"  (the leased limiter answered {hits:,} calls from its leases)")
    return {name: (statistics.median(v), min(v)) for name, v in seen.items()}


# -- one key, 8 processes ----------------------------------------------------------------


def _worker(mode: str, port: int, seconds: float, barrier: Any, results: Any) -> None:
    if mode == "limits fixed window":
        subject = peers.limits_fixed_redis(peers.Quota(RATE, RATE, 1), port)
        allow: Callable[[str], object] = subject.allow
    else:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
        limiter = RedisTokenBucketLimiter(
            client, CAPACITY, RATE, prefix="procs:", lease=mode == "leased"
        )
        allow = limiter.allow
    allow("warm-up")
    barrier.wait()
    decisions = admitted = 0
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for _ in range(100):
            decisions += 1
            if allow(KEY):
                admitted += 1
    if mode != "limits fixed window":
        limiter.close()
    results.put((decisions, admitted))


def _commands(admin: redis.Redis) -> tuple[int, int]:
    """Commands the clients sent (each mode's are scripts: EVALSHA, EVAL; limits' fixed
    window too), and every command the server ran, those inside the scripts too."""
    stats = admin.info("commandstats")
    ran = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    for ours in ("info", "config|resetstat", "flushall"):
        ran.pop(ours, None)
    return sum(ran.get(name, 0) for name in SCRIPT_COMMANDS), sum(ran.values())


def processes_run(mode: str, port: int, processes: int, seconds: float) -> dict[str, float]:
    admin = redis.Redis(host="127.0.0.1", port=port)
    admin.flushall()
    barrier = SPAWN.Barrier(processes + 1)
    results = SPAWN.Queue()
    workers = [
        SPAWN.Process(target=_worker, args=(mode, port, seconds, barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    while barrier.n_waiting < processes:
        time.sleep(0.01)
    admin.config_resetstat()
    cpu = server_cpu(admin)
    barrier.wait()
    counts = [results.get(timeout=seconds + 120) for _ in workers]
    for worker in workers:
        worker.join(60)
    cpu = server_cpu(admin) - cpu
    sent, ran = _commands(admin)
    admin.close()
    decisions = sum(d for d, _ in counts)
    admitted = sum(a for _, a in counts)
    return {
        "decisions/s": decisions / seconds,
        "admitted/s": admitted / seconds,
        "commands per 1,000 admitted": sent / admitted * 1000,
        "server-run commands per 1,000": ran / admitted * 1000,
        "server CPU ms per 1,000 admitted": cpu * 1e6 / admitted,
    }


def processes_section(port: int, processes: int, seconds: float) -> dict[str, dict[str, float]]:
    modes = ["leased", "unleased"]
    try:
        import limits  # noqa: F401
    except ImportError:
        print("  note: limits is not installed: its row is left out")
    else:
        modes.append("limits fixed window")
    return {mode: processes_run(mode, port, processes, seconds) for mode in modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, a few seconds")
    args = parser.parse_args()
    rounds, calls, seconds = (3, 20_000, 1.0) if args.quick else (15, 200_000, 4.0)
    print(
        f"bucketlimit {__version__}, Python {platform.python_version()}, "
        f"redis-py {redis.__version__}; load average {load()} at the start"
    )
    with tempfile.TemporaryDirectory(prefix="bench-leases-") as directory:
        server = start_server(Path(directory))
        try:
            print(f"\n1. ns per allow(), one process ({rounds} interleaved rounds of {calls:,})")
            figures = calls_section(server.port, rounds, calls)
            inproc = figures["in-process TokenBucketLimiter"][0]
            print(f"  {'':48} {'median':>9} {'best':>9} {'x in-process':>13}")
            for name, (median, best) in figures.items():
                print(f"  {name:48} {median:9.0f} {best:9.0f} {median / inproc:13.2f}")
            quota = f"capacity {CAPACITY:,}, {RATE:,}/s"
            print(f"\n2. one key ({quota}), 8 processes, {seconds:g} s each")
            table = processes_section(server.port, 8, seconds)
            print("  | | " + " | ".join(table) + " |")
            print("  | --- |" + " ---: |" * len(table))
            for column in next(iter(table.values())):
                cells = " | ".join(f"{row[column]:,.1f}" for row in table.values())
                print(f"  | {column} | {cells} |")
        finally:
            server.stop()
    print(f"\nload average {load()} at the end")


if __name__ == "__main__":
    main()
