"""Redis worker, run by ``run.py`` in a fresh interpreter per parser.

``python benches/redis_bench.py PORT {hiredis,python} REPS SECONDS CPU``

Every row talks to the one redis-server on 127.0.0.1:PORT that run.py
started, over one connection (``single_connection_client=True``) unless the
row says "pooled". With ``python`` the hiredis module is hidden before redis-py
is imported, so redis-py falls back to its pure-Python reply parser. Prints
one JSON object: per workload, per row, the median microseconds per call and
the allowed fraction. The process pins itself to CPU, the server's CPU.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and sys.argv[2] == "python":
    # A None entry makes `import hiredis` raise ImportError: redis-py then
    # uses its own parser, exactly as on a machine without hiredis.
    sys.modules["hiredis"] = None  # type: ignore[assignment]

import asyncio
import inspect
import json
import os
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import peers
import redis
import redis.asyncio
from redis.utils import HIREDIS_AVAILABLE

TRIVIAL = "return {1, 0}"

# workload -> (keys, quota)
WORKLOADS: dict[str, tuple[int, peers.Quota]] = {
    "1,000 keys, mostly allowed": (1000, peers.ALLOWED),
    "1 key, mostly refused": (1, peers.REFUSED),
}


def keys_for(n: int) -> list[str]:
    return [f"user-{i:05d}" for i in range(n)] if n > 1 else ["user-00000"]


class Row:
    """One thing timed: ``run(keys)`` makes one call per key."""

    def __init__(
        self,
        name: str,
        run: Callable[[list[str]], list[object]],
        allowed: Callable[[object], bool],
        kind: str,
    ) -> None:
        self.name = name
        self.run = run
        self.allowed = allowed
        self.kind = kind


def sync_row(name: str, subject: peers.Subject, kind: str) -> Row:
    allow = subject.allow

    def run(keys: list[str]) -> list[object]:
        return [allow(k) for k in keys]

    return Row(name, run, subject.allowed, kind)


def async_row(
    name: str, loop: asyncio.AbstractEventLoop, allow: Callable[[str], Any], kind: str
) -> Row:
    async def many(keys: list[str]) -> list[object]:
        return [await allow(k) for k in keys]

    def run(keys: list[str]) -> list[object]:
        return loop.run_until_complete(many(keys))

    return Row(name, run, bool, kind)


# Closed before the event loop is, so no connection outlives it.
ASYNC_CLIENTS: list[redis.asyncio.Redis] = []


def async_client(port: int) -> redis.asyncio.Redis:
    client = redis.asyncio.Redis(host="127.0.0.1", port=port, single_connection_client=True)
    ASYNC_CLIENTS.append(client)
    return client


def baseline_rows(port: int, loop: asyncio.AbstractEventLoop) -> list[Row]:
    one = peers.redis_client(port)
    trivial = one.script_load(TRIVIAL)
    evalsha = one.evalsha
    pooled = redis.Redis(host="127.0.0.1", port=port)
    pooled_evalsha = pooled.evalsha
    aclient = async_client(port)
    aevalsha = aclient.evalsha

    return [
        sync_row(
            "EVALSHA trivial script (return {1,0})",
            peers.Subject(lambda _k: evalsha(trivial, 0), lambda _k, _c: None),
            "floor",
        ),
        sync_row(
            "EVALSHA trivial script, pooled client",
            peers.Subject(lambda _k: pooled_evalsha(trivial, 0), lambda _k, _c: None),
            "baseline",
        ),
        async_row(
            "async EVALSHA trivial script",
            loop,
            lambda _k: aevalsha(trivial, 0),
            "async-floor",
        ),
    ]


# The commands any token bucket on the server's clock needs, and nothing else:
# read the clock, read the bucket, write it back with a TTL. What separates
# this row from the trivial one is Redis's own cost of those three commands.
COMMANDS_ONLY = """
local t = redis.call('TIME')
local value = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], '999999999999999 1780000000000000', 'PX', '60000')
return {0, 999, 1000}
"""


def bucketlimit_rows(port: int, q: peers.Quota, loop: asyncio.AbstractEventLoop) -> list[Row]:
    """bucketlimit's own script called raw, then through its limiter classes."""
    from bucketlimit import _core

    rows = []
    client = peers.redis_client(port)
    try:
        # A limiter's own script is assembled in bucketlimit._redis.script (bucketlimit.redis
        # does not re-export it).
        from bucketlimit._redis.script import FRAGMENTS, limiter_script
    except ImportError as e:
        print(
            f"  note: bucketlimit.redis has no per-limiter script ({e}); its Redis rows are skipped"
        )
        return []
    capacity, per_micro, unit = _core.exact_units(q.capacity, q.rate, per=q.per)
    # The script exactly as RedisTokenBucketLimiter sends it: its own, the
    # configuration written in, no argument for a cost of 1.
    sha = client.script_load(limiter_script(FRAGMENTS.source, capacity, unit, per_micro).source)
    commands_only = client.script_load(COMMANDS_ONLY)
    execute = client.execute_command

    def raw(key: str) -> list[int]:
        return execute("EVALSHA", sha, 1, "raw:" + key)  # type: ignore[no-any-return]

    def raw_cost(key: str, cost: int) -> list[int]:
        return execute("EVALSHA", sha, 1, "raw:" + key, cost)  # type: ignore[no-any-return]

    def floor(key: str) -> list[int]:
        return execute("EVALSHA", commands_only, 1, "floor:" + key)  # type: ignore[no-any-return]

    rows.append(
        sync_row(
            "EVALSHA TIME + GET + SET PX script (no arithmetic)",
            peers.Subject(floor, lambda k, _c: floor(k), allowed=lambda r: r[0] == 0),  # type: ignore[index]
            "baseline",
        )
    )
    rows.append(
        sync_row(
            "EVALSHA bucketlimit script (raw)",
            # The reply is {retry_after_us, remaining, reset_after_us}: 0 means allowed.
            peers.Subject(raw, raw_cost, allowed=lambda r: r[0] == 0),  # type: ignore[index]
            "us-raw",
        )
    )
    try:
        from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter
    except ImportError as e:
        print(f"  note: bucketlimit.redis is not importable ({e}); limiter rows skipped")
        return rows

    # Failures must surface, not be answered by a fallback: ask for "raise"
    # where the limiter has a failure policy.
    policy: dict[str, Any] = {}
    if "on_store_error" in inspect.signature(RedisTokenBucketLimiter).parameters:
        policy["on_store_error"] = "raise"
    limiter = RedisTokenBucketLimiter(
        peers.redis_client(port), q.capacity, q.rate, per=q.per, **policy
    )
    rows.append(
        sync_row(
            "bucketlimit RedisTokenBucketLimiter.allow",
            peers.Subject(limiter.allow, limiter.allow),
            "us",
        )
    )
    aclient = async_client(port)
    alimiter = AsyncRedisTokenBucketLimiter(aclient, q.capacity, q.rate, per=q.per, **policy)
    rows.append(
        async_row(
            "bucketlimit AsyncRedisTokenBucketLimiter.allow", loop, alimiter.allow, "us-async"
        )
    )
    return rows


def server_side(admin: Any) -> dict[str, dict[str, float]]:
    """Redis's own count and time per command since the last CONFIG RESETSTAT
    (commands a script runs are counted too, and inside EVALSHA's time)."""
    stats: dict[str, dict[str, float]] = admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): {"calls": v["calls"], "usec": v["usec"]}
        for name, v in stats.items()
    }


def measure(
    rows: list[Row], keys: list[str], reps: int, seconds: float, admin: Any
) -> dict[str, Any]:
    # Calls per timing: enough keys' worth of calls for about `seconds`.
    batches: dict[str, list[str]] = {}
    for row in rows:
        row.run(keys)  # warm: scripts loaded, connections open, buckets made
        start = time.perf_counter()
        row.run(keys[:50] if len(keys) >= 50 else keys * (50 // len(keys)))
        per_call = (time.perf_counter() - start) / 50
        calls = max(len(keys), int(seconds / per_call))
        batches[row.name] = (keys * (calls // len(keys) + 1))[:calls]
    timings: dict[str, list[float]] = {row.name: [] for row in rows}
    for rep in range(reps):
        # Round robin, starting one row later each repetition.
        for row in rows[rep % len(rows) :] + rows[: rep % len(rows)]:
            batch = batches[row.name]
            start = time.perf_counter_ns()
            row.run(batch)
            timings[row.name].append((time.perf_counter_ns() - start) / len(batch) / 1000)
    out = {}
    for row in rows:
        # A last, untimed pass: what was answered, and what Redis itself spent.
        admin.config_resetstat()
        results = row.run(keys * max(1, 1000 // len(keys)))
        server = server_side(admin)
        server.pop("config|resetstat", None)
        server.pop("config", None)
        out[row.name] = {
            "server_calls_per_call": {n: v["calls"] / len(results) for n, v in server.items()},
            "server_us_per_call": {n: v["usec"] / len(results) for n, v in server.items()},
            "samples_us": timings[row.name],
            "us": median(timings[row.name]),
            "min_us": min(timings[row.name]),
            "max_us": max(timings[row.name]),
            "allowed": sum(map(row.allowed, results)) / len(results),
            "kind": row.kind,
        }
    return out


def main() -> None:
    port, parser, reps, seconds, cpu = (
        int(sys.argv[1]),
        sys.argv[2],
        int(sys.argv[3]),
        float(sys.argv[4]),
        int(sys.argv[5]),
    )
    os.sched_setaffinity(0, {cpu})
    if (parser == "hiredis") != HIREDIS_AVAILABLE:
        print(json.dumps({"error": f"hiredis available={HIREDIS_AVAILABLE} for parser {parser}"}))
        return
    loop = asyncio.new_event_loop()
    admin = peers.redis_client(port)
    result: dict[str, Any] = {"parser": parser, "workloads": {}}
    for workload, (n, q) in WORKLOADS.items():
        admin.flushall()
        keys = keys_for(n)
        rows = baseline_rows(port, loop) + bucketlimit_rows(port, q, loop)
        for name, factory in peers.REDIS_PEERS.items():
            rows.append(sync_row(name, factory(q, port), "peer"))
        if q is peers.REFUSED:
            # Drain every bucket through the limiter's own call.
            for row in rows:
                for _ in range(q.capacity + 1):
                    row.run(keys)
        result["workloads"][workload] = measure(rows, keys, reps, seconds, admin)
    for client in ASYNC_CLIENTS:
        loop.run_until_complete(client.aclose())
    loop.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
