"""Shared round trips on a Redis Cluster under faults: what the
healthy keys pay while one primary hangs, and what a slot migration costs.

    python -m benches.cluster_faults            # from the repository root; about a minute

Not part of the test suite. It starts its own 3-primary cluster (loopback, free
ports, no persistence; the tests' runner, tests/support/redis_servers.py) and
prints two tables from one run, for the asyncio limiter with shared round trips
(``batching=True``, the default), without them, and the sync limiter's group commit
(``batching=True``) and plain calls:

1. **A hung primary.** 32 callers (tasks, or threads for the sync class) allow keys
   spread over the three nodes for 4 s; after 1 s one primary is stopped (SIGSTOP)
   for 2 s. The latency of each allow of a key on a *healthy* node is recorded:
   p50, p99, max, and how many were degraded. The client's timeout is 0.25 s.
2. **A slot migrated.** 32 asyncio callers allow keys of one hash slot (one tag)
   while the slot moves between nodes four times, key by key (ASK, TRYAGAIN for
   several keys of a batch): the answers degraded, and the slowest call.

Only what both this package's current code and its earlier versions have is used
(an explicit prefix, ``from_url``, ``allow``), so the same run measures a checkout
of an older commit: ``PYTHONPATH=/path/to/old/python python -m benches.cluster_faults``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if not __package__:
    sys.exit("run it from the repository root as a module: python -m benches.cluster_faults")

import bucketlimit
from bucketlimit._redis.keys import key_slot
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter
from tests.support.redis_servers import RedisClusterNodes, RedisServer

TIMEOUT = 0.25
CALLERS = 32
PREFIX = "bench:"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)] if ordered else math.nan


def summary(latencies: list[float], degraded: int) -> dict[str, Any]:
    return {
        "calls": len(latencies),
        "p50_ms": round(percentile(latencies, 0.5) * 1000, 2),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
        "max_ms": round(max(latencies, default=math.nan) * 1000, 2),
        "degraded": degraded,
    }


def keys_on(cluster: RedisClusterNodes, count: int) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {server.port: [] for server in cluster.servers}
    i = 0
    while min(len(keys) for keys in found.values()) < count:
        key = f"user-{i}"
        port = cluster.owner(key_slot(f"{PREFIX}{{{key}}}:{key}".encode())).port
        if len(found[port]) < count:
            found[port].append(key)
        i += 1
    return found


def hung_primary_async(cluster: RedisClusterNodes, batching: bool) -> dict[str, Any]:
    by_node = keys_on(cluster, 8)
    hung = cluster.servers[0]
    healthy = {k for s in cluster.servers[1:] for k in by_node[s.port]}
    every = [k for keys in by_node.values() for k in keys]
    latencies: list[float] = []
    degraded = 0

    async def main() -> None:
        nonlocal degraded
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            cluster.url,
            10**6,
            10**6,
            cluster=True,
            timeout=TIMEOUT,
            prefix=PREFIX,
            batching=batching,
            retry_interval=0.5,
        )
        for key in every:
            await limiter.allow(key)
        stop = time.monotonic() + 4

        async def caller(i: int) -> None:
            nonlocal degraded
            while time.monotonic() < stop:
                key = every[i % len(every)]
                started = time.perf_counter()
                answer = await limiter.allow(key)
                if key in healthy:
                    latencies.append(time.perf_counter() - started)
                    degraded += answer.degraded
                i += 1

        async def fault() -> None:
            await asyncio.sleep(1)
            hung.pause()
            await asyncio.sleep(2)
            hung.resume()

        await asyncio.gather(fault(), *(caller(i) for i in range(CALLERS)))
        await limiter.client.aclose()

    asyncio.run(main())
    return summary(latencies, degraded)


def hung_primary_sync(cluster: RedisClusterNodes, batching: bool) -> dict[str, Any]:
    by_node = keys_on(cluster, 8)
    hung = cluster.servers[0]
    healthy = {k for s in cluster.servers[1:] for k in by_node[s.port]}
    every = [k for keys in by_node.values() for k in keys]
    limiter = RedisTokenBucketLimiter.from_url(
        cluster.url,
        10**6,
        10**6,
        cluster=True,
        timeout=TIMEOUT,
        prefix=PREFIX,
        batching=batching,
        retry_interval=0.5,
    )
    for key in every:
        limiter.allow(key)
    latencies: list[float] = []
    counts = {"degraded": 0}
    lock = threading.Lock()
    stop = time.monotonic() + 4

    def caller(i: int) -> None:
        while time.monotonic() < stop:
            key = every[i % len(every)]
            started = time.perf_counter()
            answer = limiter.allow(key)
            if key in healthy:
                with lock:
                    latencies.append(time.perf_counter() - started)
                    counts["degraded"] += answer.degraded
            i += 1

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
    for thread in threads:
        thread.start()
    time.sleep(1)
    hung.pause()
    time.sleep(2)
    hung.resume()
    for thread in threads:
        thread.join()
    limiter.client.close()
    return summary(latencies, counts["degraded"])


def migration(cluster: RedisClusterNodes, batching: bool) -> dict[str, Any]:
    tag = "tenant"
    slot = key_slot(f"{PREFIX}{{{tag}}}:x".encode())
    keys = [f"user-{i}" for i in range(64)]
    seed = cluster.owner(slot).client()
    for i in range(200):
        seed.set(f"seed{{{tag}}}{i}", "x")
    seed.close()
    latencies: list[float] = []
    degraded = 0

    async def main() -> None:
        nonlocal degraded
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            cluster.url,
            10**6,
            0,
            cluster=True,
            timeout=0.5,
            prefix=PREFIX,
            hash_tag=lambda key: tag,
            batching=batching,
        )
        for key in keys:
            await limiter.allow(key)
        finished = asyncio.Event()
        loop = asyncio.get_running_loop()

        def migrate() -> None:
            try:
                for _ in range(4):
                    source = cluster.owner(slot)
                    target = next(s for s in cluster.servers if s is not source)
                    cluster.move_slot(slot, target, batch=1)
            finally:
                loop.call_soon_threadsafe(finished.set)

        async def caller(i: int) -> None:
            nonlocal degraded
            while not finished.is_set():
                started = time.perf_counter()
                answer = await limiter.allow(keys[i % len(keys)])
                latencies.append(time.perf_counter() - started)
                degraded += answer.degraded
                i += 7

        mover = loop.run_in_executor(None, migrate)
        await asyncio.gather(*(caller(i) for i in range(CALLERS)))
        await mover
        await limiter.client.aclose()

    asyncio.run(main())
    return summary(latencies, degraded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the scenarios whose name has this")
    only = parser.parse_args().only
    results: dict[str, Any] = {"package": os.path.dirname(bucketlimit.__file__)}
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        for name, run in [
            ("hung primary, asyncio batched", lambda c: hung_primary_async(c, True)),
            ("hung primary, asyncio unbatched", lambda c: hung_primary_async(c, False)),
            ("hung primary, sync group commit", lambda c: hung_primary_sync(c, True)),
            ("hung primary, sync plain", lambda c: hung_primary_sync(c, False)),
            ("migration, asyncio batched", lambda c: migration(c, True)),
            ("migration, asyncio unbatched", lambda c: migration(c, False)),
        ]:
            if only not in name:
                continue
            servers = [RedisServer(root / f"{len(results)}-{i}", cluster=True) for i in range(3)]
            cluster = RedisClusterNodes(root, servers)
            cluster.start()
            try:
                results[name] = run(cluster)
            finally:
                cluster.stop()
            print(f"{name}: {results[name]}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
