"""Redis at scale: server time per decision, decisions/s from 1 and 4 processes.

    python -m benches.redis_scale            # from the repository root; 3-5 minutes
    python -m benches.redis_scale --quick    # a smoke run, under a minute
    python -m benches.redis_scale --sections server,study   # a subset

Not part of the test suite. It starts its own redis-server (the tests' runner:
loopback, a free port, no persistence), with redis-cell's ``CL.THROTTLE`` loaded
when the crate builds here (benches/server_stats.py), and measures, in one run:

1. ``server``: the server's microseconds per decision (``CONFIG RESETSTAT``, N
   calls, ``INFO commandstats``): the time of the command the client sent
   (EVALSHA, or CL.THROTTLE), which holds the commands its script runs; those
   are counted once, there, and listed as counts per decision. bucketlimit
   allowed and refused next to limits (fixed window, sliding-window counter,
   moving window), throttled-py (token bucket, GCRA, fixed and sliding window,
   leaking bucket), pyrate-limiter (token bucket, RedisStateStore), redis-cell
   and a trivial ``EVALSHA`` (``return 1``). Mostly allowed: 1,000 keys round
   robin, a burst of 10^6; refused: one drained key of 10 per hour.
2. ``client``: microseconds per ``allow()`` on one connection next to a raw
   trivial ``EVALSHA`` through the same redis-py client (client and server
   pinned to one CPU, as benches/run.py does), and the peers the same way.
3. ``asyncio``: decisions per second from one asyncio process with 1, 8, 64 and
   256 tasks calling ``allow`` in a loop (each library's asyncio mode, its
   default connection pool), p50/p99 latency per decision, and the server's CPU
   per decision (``INFO cpu``, used_cpu_sys + used_cpu_user).
4. ``processes``: the same with 4 worker processes of 64 tasks each against the
   one server.
5. ``study``: the design study of benches/script_study (the script's pieces and
   candidate variants; see its FINDINGS.md).

"bucketlimit batched" is the shared round trips: in 1, ``allow_many`` of 1, 8
and 64 decisions per script (µs per decision); in 3 and 4 the asyncio limiter
with ``batching=True`` next to the same limiter with ``batching=False``. Each
measurement is bounded in calls and seconds; every timing repeats, interleaved,
and reports the median.

It runs in the development environment (``make install``; it uses the tests' server
runner) with the peers of benches/requirements.txt installed there
(``pip install -r benches/requirements.txt``); the rows of a missing peer are left
out, saying so. redis-cell is built once, with cargo, under target/redis-cell.
``--markdown PATH`` writes the tables; ``--from-json PATH`` prints those of an
earlier ``--json`` run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import Any

if not __package__:
    sys.exit("run it from the repository root as a module: python -m benches.redis_scale")

import redis
import redis.asyncio

from benches import peers
from benches.server_stats import (
    ROOT,
    client,
    load,
    redis_cell_module,
    sample,
    server_cpu,
    start_server,
)
from bucketlimit import _core
from bucketlimit._redis.script import FRAGMENTS, limiter_script
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter

TRIVIAL = "return 1"
# Mostly allowed: peers.ALLOWED's burst of 10^9 is past the Redis limiter's exact
# range since reservations (a bucket may owe 1000 capacities, and
# 1001 * 10^9 tokens * 10^6 units is past 2^53): 10^6 tokens a key, never drained
# by a run, for every library alike.
ALLOWED = peers.Quota(capacity=10**6, rate=1, per=1)
LONG_WINDOW = peers.Quota(capacity=10**9, rate=1, per=3600)  # for limits' windows only
KEYS = [f"user-{i:05d}" for i in range(1000)]
CONCURRENCY = (1, 8, 64, 256)
PROCESSES, PROCESS_TASKS = 4, 64
BATCHED = "bucketlimit batched"
UNBATCHED = "bucketlimit AsyncRedisTokenBucketLimiter, batching=False"
PER_CALL = (1, 8, 64)  # decisions per allow_many in section 1


@dataclass
class Settings:
    per_batch: int  # calls per server-time batch
    batches: int  # interleaved batches per subject
    reps: int  # interleaved repetitions of the client timings
    client_seconds: float  # per client timing
    async_seconds: float  # per asyncio / processes measurement
    async_reps: int


def settings(quick: bool) -> Settings:
    if quick:
        return Settings(
            per_batch=100, batches=3, reps=2, client_seconds=0.05, async_seconds=0.3, async_reps=1
        )
    return Settings(
        per_batch=200, batches=25, reps=5, client_seconds=0.2, async_seconds=1.0, async_reps=2
    )


def rotate(items: list[Any], rep: int) -> list[Any]:
    k = rep % len(items) if items else 0
    return items[k:] + items[:k]


def config(q: peers.Quota) -> tuple[int, int, int]:
    """A limiter's (capacity, unit, p) for a quota, as it computes them."""
    capacity, per_micro, unit = _core.exact_units(q.capacity, q.rate, per=q.per)
    return capacity, unit, per_micro


# The peers' modules (benches/requirements.txt pins them; the dev environment of
# `make install` does not have them: `pip install -r benches/requirements.txt`).
PEER_MODULES = {"limits": "limits", "pyrate-limiter": "pyrate_limiter", "throttled-py": "throttled"}


def installed(row: str) -> bool:
    """Whether the peer a row names is importable (bucketlimit's rows always are)."""
    for prefix, module in PEER_MODULES.items():
        if row.startswith(prefix.split("-")[0]):
            try:
                __import__(module)
            except ImportError:
                return False
    return True


def versions() -> dict[str, str]:
    out = {}
    for dist in ["bucketlimit", "redis", "hiredis", "limits", "pyrate-limiter", "throttled-py"]:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    out["redis-server"] = next((w[2:] for w in server.split() if w.startswith("v=")), "?")
    return out


# --- 1. server time per decision --------------------------------------------------------


@dataclass
class ServerRow:
    name: str
    workload: str  # "allowed" or "refused"
    allow: Callable[[str], object]
    allowed: Callable[[object], bool]
    keys: list[str]
    top: tuple[str, ...] = ("evalsha", "eval")
    # allow_many rows: decisions per call, and the call (keys -> decisions).
    per_call: int = 1
    many: Callable[[list[str]], list[object]] | None = None


def _sync_limiter(q: peers.Quota, port: int, **options: Any) -> RedisTokenBucketLimiter:
    return RedisTokenBucketLimiter(
        client(port), q.capacity, q.rate, per=q.per, on_store_error="raise", **options
    )


def server_rows(port: int, cell: bool) -> list[ServerRow]:
    rows: list[ServerRow] = []
    c = client(port)
    execute = c.execute_command
    trivial = c.script_load(TRIVIAL)
    for workload, q, keys in [
        ("allowed", ALLOWED, KEYS),
        ("refused", peers.REFUSED, ["user-refused"]),
    ]:

        def add(
            name: str,
            allow: Callable[[str], object],
            allowed: Callable[[object], bool],
            top: tuple[str, ...] = ("evalsha", "eval"),
            prefix: str = "",
            workload: str = workload,
            keys: list[str] = keys,
        ) -> None:
            # Each row its own keys (limits' strategies share their key names).
            prefix = f"{len(rows)}:{prefix}"
            rows.append(ServerRow(name, workload, allow, allowed, [prefix + k for k in keys], top))

        add("trivial EVALSHA (return 1)", lambda _k: execute("EVALSHA", trivial, 0), bool)
        sha = c.script_load(limiter_script(FRAGMENTS.source, *config(q)).source)
        # The call RedisTokenBucketLimiter sends for allow(key): its own script, one
        # key, no argument.
        add(
            "bucketlimit script (the limiter's EVALSHA, raw)",
            lambda k, sha=sha: execute("EVALSHA", sha, 1, k),
            lambda r: r[0] == 0,  # type: ignore[index]
            prefix="raw:",
        )
        limiter = _sync_limiter(q, port, refusal_cache=False)
        # Every refusal asked of the server (the cache would answer them locally).
        add("bucketlimit RedisTokenBucketLimiter.allow, no refusal cache", limiter.allow, bool)
        for n in PER_CALL:
            # Shared round trips: one script deciding n allows (a batch, scripts.md).
            add(f"{BATCHED}: allow_many, {n} per call", limiter.allow, bool, prefix=f"many{n}:")
            rows[-1].per_call, rows[-1].many = n, limiter.allow_many  # type: ignore[assignment]
        for label, factory in [
            ("limits fixed window", peers.limits_fixed_redis),
            ("limits sliding window counter", peers.limits_sliding_redis),
            ("limits moving window", peers.limits_moving_redis),
            ("pyrate-limiter token bucket", peers.pyrate_redis),
        ]:
            if installed(label):
                s = factory(q, port)
                add(label, s.allow, s.allowed)
            if label == "limits fixed window" and installed(label):
                # Its common case, a hit on a live window (one INCRBY): the 1-second
                # windows above over 1,000 keys mostly open a new one (+ EXPIRE).
                live = factory(LONG_WINDOW if workload == "allowed" else q, port)
                add(f"{label}, live windows (1 hour)", live.allow, live.allowed)
        for using in ["token_bucket", "gcra", "fixed_window", "sliding_window", "leaking_bucket"]:
            if not installed("throttled"):
                break
            s = peers.throttled_redis(q, port, using)
            # Its fixed window sends INCRBY (and EXPIRE on a new window) itself, no script.
            top = ("incrby", "expire") if using == "fixed_window" else ("evalsha", "eval")
            add(f"throttled-py {using.replace('_', ' ')}", s.allow, s.allowed, top)
        if cell:
            # CL.THROTTLE key max_burst count period: max_burst + 1 tokens, count per period.
            burst, count, period = q.capacity - 1, q.rate, q.per
            add(
                "redis-cell CL.THROTTLE",
                lambda k, b=burst, n=count, t=period: execute("CL.THROTTLE", k, b, n, t),
                lambda r: r[0] == 0,  # type: ignore[index]
                top=("cl.throttle",),
                prefix="cell:",
            )
    return rows


def server_section(port: int, cell: bool, s: Settings) -> dict[str, Any]:
    print(f"\n== 1. server microseconds per decision (load {load()})", flush=True)
    rows = server_rows(port, cell)
    admin = client(port)
    subjects: dict[str, tuple[Callable[[], object], int, tuple[str, ...]]] = {}
    answers: dict[str, list[object]] = {}
    for row in rows:
        for k in row.keys:
            row.allow(k)  # warm: scripts loaded, buckets made
        if row.workload == "refused":
            for _ in range(peers.REFUSED.capacity + 1):
                row.allow(row.keys[0])  # drained through the library's own call
        name = f"{row.name} | {row.workload}"
        got: list[object] = []
        answers[name] = got
        position = [0]

        # Decisions per batch: a whole number of calls.
        calls = -(-s.per_batch // row.per_call) * row.per_call

        def run(
            row: ServerRow = row,
            got: list[object] = got,
            position: list[int] = position,
            calls: int = calls,
        ) -> None:
            n, keys, allow, many = position[0], row.keys, row.allow, row.many
            if many is None:
                got.extend(allow(keys[i % len(keys)]) for i in range(n, n + calls))
            else:
                for start in range(n, n + calls, row.per_call):
                    picked = [keys[i % len(keys)] for i in range(start, start + row.per_call)]
                    got.extend(many([(k, 1) for k in picked]))  # type: ignore[misc]
            position[0] = n + calls

        subjects[name] = (run, calls, row.top)
    summaries = sample(admin, subjects, s.batches)
    out: dict[str, Any] = {"load_after": load(), "rows": {}}
    for row in rows:
        name = f"{row.name} | {row.workload}"
        r = summaries[name]
        out["rows"].setdefault(row.name, {})[row.workload] = {
            "us": r.us,
            "q25_us": r.q25_us,
            "cpu_us": r.cpu_us,
            "inner_per_call": r.inner_per_call,
            "allowed": sum(map(row.allowed, answers[name])) / len(answers[name]),
        }
    print(f"  {'':50} {'allowed':>26} {'refused':>26}   inner commands per decision (allowed)")
    for name, by in out["rows"].items():
        cells = []
        for w in ("allowed", "refused"):
            r = by[w]
            cells.append(f"{r['us']:6.2f} us [q25 {r['q25_us']:5.2f}] {r['allowed']:4.0%}")
        calls = ", ".join(f"{n} {v:g}" for n, v in sorted(by["allowed"]["inner_per_call"].items()))
        print(f"  {name:50} {cells[0]:>26} {cells[1]:>26}   {calls}")
    if not cell:
        print("  redis-cell CL.THROTTLE: not measured (see the note above)")
    print(
        f"  (median over {s.batches} interleaved batches of {s.per_batch} calls, [lower quartile],"
        f" % allowed; load {load()})"
    )
    return out


# --- 2. client microseconds per call -------------------------------------------------------


class InstantClient(redis.Redis):
    """A redis-py client that never connects: every command gets an allowed reply."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        return [0, 999_999_999, 1_000_000]


def client_section(port: int, s: Settings) -> dict[str, Any]:
    cpu = max(os.sched_getaffinity(0))
    everywhere = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    print(f"\n== 2. client: us per call on one connection (pinned to CPU {cpu}; load {load()})")
    try:
        c = client(port)
        trivial = c.script_load(TRIVIAL)
        limiter = RedisTokenBucketLimiter(
            c, ALLOWED.capacity, ALLOWED.rate, per=ALLOWED.per,
            on_store_error="raise",
        )  # fmt: skip
        sha = c.script_load(limiter_script(FRAGMENTS.source, *config(ALLOWED)).source)
        evalsha, execute = c.evalsha, c.execute_command
        rows: dict[str, Callable[[str], object]] = {
            "trivial EVALSHA through the same client": lambda _k: evalsha(trivial, 0),
            "bucketlimit RedisTokenBucketLimiter.allow": limiter.allow,
            "bucketlimit script, raw EVALSHA (same client)": lambda k: execute(
                "EVALSHA", sha, 1, "raw:" + k
            ),
        }
        for name, factory in peers.REDIS_PEERS.items():
            if installed(name):
                rows[name] = factory(ALLOWED, port).allow
        # What the limiter itself costs in Python, with no I/O: a client whose
        # execute_command answers at once with the reply of an allowed call.
        rows["bucketlimit allow() on an instant stub client (no I/O)"] = RedisTokenBucketLimiter(
            InstantClient(), ALLOWED.capacity, ALLOWED.rate, per=ALLOWED.per,
            on_store_error="raise",
        ).allow  # fmt: skip
        names = list(rows)
        loops: dict[str, int] = {}
        for name in names:
            start = time.perf_counter()
            for k in KEYS:
                rows[name](k)
            per_call = (time.perf_counter() - start) / len(KEYS)
            loops[name] = max(1, round(s.client_seconds / per_call / len(KEYS)))
        samples: dict[str, list[float]] = {n: [] for n in names}
        reps = max(3, s.reps + 2)
        for rep in range(reps):
            for name in rotate(names, rep):
                allow = rows[name]
                start = time.perf_counter_ns()
                for _ in range(loops[name]):
                    for k in KEYS:
                        allow(k)
                samples[name].append(
                    (time.perf_counter_ns() - start) / 1000 / (loops[name] * len(KEYS))
                )
        base = median(samples[names[0]])
        out: dict[str, Any] = {"rows": {}}
        for name in names:
            us = median(samples[name])
            # Ratio per repetition (the rows of one repetition ran back to back).
            ratios = [a / b for a, b in zip(samples[name], samples[names[0]], strict=True)]
            out["rows"][name] = {
                "us": us,
                "x_trivial": us / base,
                "x_trivial_paired": median(ratios),
            }
            print(f"  {name:50} {us:7.1f} us  {us / base:5.2f}x  (paired {median(ratios):.2f}x)")
        print(f"  (median of {reps} interleaved runs, 1,000 keys mostly allowed; load {load()})")
        return out
    finally:
        os.sched_setaffinity(0, everywhere)


# --- 3. and 4. asyncio decisions per second --------------------------------------------------

AsyncAllow = Callable[[str], Awaitable[object]]
# redis.asyncio's pool holds at most 100 connections unless told; at 256 tasks it
# raises MaxConnectionsError. Every library gets this many, one per task at most.
POOL = 512


async def async_subject(name: str, port: int) -> tuple[AsyncAllow, Callable[[], Awaitable[None]]]:
    """(allow, close) for one library's asyncio mode, its default pool, mostly allowed."""
    q = ALLOWED
    if name == "trivial EVALSHA (redis.asyncio)":
        c = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=POOL)
        sha = await c.script_load(TRIVIAL)
        return (lambda _k: c.evalsha(sha, 0)), c.aclose
    if name in (UNBATCHED, BATCHED):
        c = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=POOL)
        limiter = AsyncRedisTokenBucketLimiter(
            c, q.capacity, q.rate, per=q.per, on_store_error="raise", batching=name == BATCHED
        )
        return limiter.allow, c.aclose
    if name.startswith("limits "):
        from limits import RateLimitItemPerSecond
        from limits.aio import strategies
        from limits.aio.storage import RedisStorage

        storage = RedisStorage(
            f"async+redis://127.0.0.1:{port}", implementation="redispy", max_connections=POOL
        )
        cls = {
            "limits fixed window": strategies.FixedWindowRateLimiter,
            "limits sliding window counter": strategies.SlidingWindowCounterRateLimiter,
        }[name]
        window = cls(storage)
        item = RateLimitItemPerSecond(q.capacity, q.per)

        async def close_limits() -> None:
            await storage.bridge.storage.aclose()  # type: ignore[attr-defined]

        return (lambda k: window.hit(item, k)), close_limits
    if name == "throttled-py token bucket":
        from throttled.asyncio import RedisStore, Throttled, per_duration
        from throttled.store.redis_pool import BaseConnectionFactory

        # throttled-py keeps one pool per URL for the process; each measurement
        # runs its own event loop, and a pool from an earlier loop cannot serve it.
        BaseConnectionFactory._pools.clear()
        store = RedisStore(
            server=f"redis://127.0.0.1:{port}/0",
            options={"CONNECTION_POOL_KWARGS": {"max_connections": POOL}},
        )
        quota = per_duration(timedelta(seconds=q.per), limit=q.rate, burst=q.capacity)
        throttle = Throttled(using="token_bucket", quota=quota, store=store)

        async def nothing() -> None:
            return None

        return throttle.limit, nothing
    if name == "pyrate-limiter token bucket":
        from pyrate_limiter import RedisStateStore, WallClock

        c = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=POOL)
        subject = peers._pyrate(q, lambda key: RedisStateStore(c, f"pyrate:{key}"), WallClock())
        return subject.allow, c.aclose  # type: ignore[return-value]
    raise ValueError(name)


ASYNC_LIBRARIES = [
    "trivial EVALSHA (redis.asyncio)",
    BATCHED,
    UNBATCHED,
    "limits fixed window",
    "limits sliding window counter",
    "throttled-py token bucket",
    "pyrate-limiter token bucket",
]


async def drive(
    allow: AsyncAllow, tasks: int, start_at: float, seconds: float, offset: int = 0
) -> tuple[int, list[float]]:
    """``tasks`` tasks calling allow in a loop from ``start_at`` (time.time()) for
    ``seconds``; returns (decisions, latencies in µs). Calls that end after the window
    are not counted."""
    latencies: list[float] = []
    end = start_at + seconds
    clock = time.perf_counter

    async def task(i: int) -> None:
        n = offset + i * 7
        while time.time() < start_at:
            await asyncio.sleep(min(0.01, max(0.0, start_at - time.time())))
        while True:
            t0 = clock()
            await allow(KEYS[n % len(KEYS)])
            t1 = clock()
            if time.time() > end:
                return
            latencies.append((t1 - t0) * 1e6)
            n += 1

    await asyncio.gather(*(task(i) for i in range(tasks)))
    return len(latencies), latencies


async def warm(allow: AsyncAllow, tasks: int) -> None:
    """Every task once: the pool opens its connections, scripts are loaded."""
    await asyncio.gather(*(allow(KEYS[i % len(KEYS)]) for i in range(tasks)))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)] if ordered else math.nan


def one_async(name: str, port: int, tasks: int, seconds: float) -> dict[str, float]:
    admin = client(port)

    async def main() -> dict[str, float]:
        allow, close = await async_subject(name, port)
        try:
            await warm(allow, tasks)
            start_at = time.time() + 0.05
            cpu0 = None

            async def cpu_at(when: float) -> float:
                await asyncio.sleep(max(0.0, when - time.time()))
                return server_cpu(admin)  # blocking, once: a few µs of the window

            reading = asyncio.ensure_future(cpu_at(start_at))
            done, latencies = await drive(allow, tasks, start_at, seconds)
            cpu0 = await reading
            cpu1 = server_cpu(admin)
        finally:
            await close()
        return {
            "decisions_per_s": done / seconds,
            "p50_us": percentile(latencies, 0.5),
            "p99_us": percentile(latencies, 0.99),
            "server_cpu_us_per_decision": (cpu1 - cpu0) * 1e6 / max(1, done),
        }

    try:
        return asyncio.run(main())
    finally:
        admin.close()


def print_async_table(results: dict[str, dict[str, Any]], columns: list[str]) -> None:
    print(f"  {'':56}" + "".join(f"{c:>34}" for c in columns))
    for name, by in results.items():
        cells = []
        for col in columns:
            r = by[col]
            cells.append(
                f"{r['decisions_per_s']:>8,.0f}/s {r['p50_us']:>6,.0f}/{r['p99_us']:>6,.0f} us"
                f" {r['server_cpu_us_per_decision']:>5.1f}"
            )
        print(f"  {name:56}" + "".join(f"{c:>34}" for c in cells))
    print("  (decisions/s, p50/p99 latency per decision, server CPU us per decision)")


def libraries() -> list[str]:
    return [name for name in ASYNC_LIBRARIES if installed(name)]


def asyncio_section(port: int, s: Settings) -> dict[str, Any]:
    print(f"\n== 3. one asyncio process: decisions/s by concurrent tasks (load {load()})")
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rep in range(s.async_reps):
        for tasks in CONCURRENCY:
            for name in rotate(libraries(), rep + tasks):
                r = one_async(name, port, tasks, s.async_seconds)
                samples.setdefault((name, tasks), []).append(r)
        print(f"  repetition {rep + 1}/{s.async_reps} done (load {load()})", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in libraries():
        for tasks in CONCURRENCY:
            runs = samples[(name, tasks)]
            results.setdefault(name, {})[f"{tasks} tasks"] = {
                key: median(r[key] for r in runs) for key in runs[0]
            }
    print_async_table(results, [f"{t} tasks" for t in CONCURRENCY])
    return {"results": results, "load_after": load()}


def worker_main(args: argparse.Namespace) -> None:
    """One of the worker processes of section 4: warms up, prints "ready", reads the
    start time (time.time()) from stdin, runs, prints one JSON line."""

    async def main() -> tuple[int, list[float]]:
        allow, close = await async_subject(args.worker, args.port)
        try:
            await warm(allow, args.tasks)
            print("ready", flush=True)
            start_at = float(sys.stdin.readline())
            return await drive(allow, args.tasks, start_at, args.seconds, args.offset)
        finally:
            await close()

    done, latencies = asyncio.run(main())
    step = max(1, len(latencies) // 20000)  # a sample of them is enough for p50/p99
    print(json.dumps({"decisions": done, "latencies": latencies[::step]}))


def processes_run(name: str, port: int, seconds: float) -> dict[str, float]:
    admin = client(port)
    command = [
        sys.executable, "-m", "benches.redis_scale", "--worker", name, "--port", str(port),
        "--tasks", str(PROCESS_TASKS), "--seconds", str(seconds),
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*command, "--offset", str(i * 250)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    try:
        # Every worker started, connected and warmed up; then all start together.
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a worker for {name} did not start")
        start_at = time.time() + 0.2
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start_at!r}\n")
            p.stdin.flush()
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = server_cpu(admin)
        time.sleep(max(0.0, start_at + seconds - time.time()))
        cpu1 = server_cpu(admin)
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        admin.close()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a worker for {name} failed")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    done = sum(r["decisions"] for r in results)
    latencies = [x for r in results for x in r["latencies"]]
    return {
        "decisions_per_s": done / seconds,
        "p50_us": percentile(latencies, 0.5),
        "p99_us": percentile(latencies, 0.99),
        "server_cpu_us_per_decision": (cpu1 - cpu0) * 1e6 / max(1, done),
    }


def processes_section(port: int, s: Settings) -> dict[str, Any]:
    column = f"{PROCESSES} x {PROCESS_TASKS} tasks"
    print(f"\n== 4. {PROCESSES} worker processes, {PROCESS_TASKS} tasks each (load {load()})")
    samples: dict[str, list[dict[str, float]]] = {}
    for rep in range(s.async_reps):
        for name in rotate(libraries(), rep):
            samples.setdefault(name, []).append(processes_run(name, port, s.async_seconds))
    results: dict[str, dict[str, Any]] = {
        name: {column: {key: median(r[key] for r in samples[name]) for key in samples[name][0]}}
        for name in libraries()
    }
    print_async_table(results, [column])
    return {"results": results, "load_after": load()}


# --- markdown ------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    """The run's tables in Markdown (for FINDINGS.md and docs/benchmarks.md)."""
    env = results["machine"]
    out = [
        f"redis-server {env['versions']['redis-server']}, redis-py {env['versions']['redis']}"
        f" + hiredis {env['versions']['hiredis']}; {env['python']}, {env['cores']} cores;"
        f" load {env['load_before']} at the start, {env.get('load_after', '?')} at the end.",
        "",
    ]
    server = results.get("server")
    if server:
        out += [
            "| server µs per decision | allowed | refused | commands a decision runs |",
            "| --- | ---: | ---: | --- |",
        ]
        for name, by in server["rows"].items():
            inner = ", ".join(
                f"{k} {v:g}" for k, v in sorted(by["allowed"]["inner_per_call"].items())
            )
            cells = [f"{by[w]['us']:.2f} ({by[w]['q25_us']:.2f})" for w in ("allowed", "refused")]
            out.append(f"| {name} | {cells[0]} | {cells[1]} | {inner} |")
        if "redis-cell CL.THROTTLE" not in server["rows"]:
            out.append("| redis-cell CL.THROTTLE | not available | | |")
        out.append("")
    client_rows = results.get("client")
    if client_rows:
        out += [
            "| client, one connection | µs per call | x trivial EVALSHA |",
            "| --- | ---: | ---: |",
        ]
        for name, r in client_rows["rows"].items():
            out.append(f"| {name} | {r['us']:.1f} | {r['x_trivial_paired']:.2f} |")
        out.append("")
    for section, title in [("asyncio", "one asyncio process"), ("processes", "4 processes")]:
        block = results.get(section)
        if not block:
            continue
        first = next(v for v in block["results"].values() if "note" not in v)
        columns = list(first)
        out += [
            f"| {title}: decisions/s, p50/p99 ms, server CPU µs per decision | "
            + " | ".join(columns)
            + " |",
            "| --- |" + " ---: |" * len(columns),
        ]
        for name, by in block["results"].items():
            if "note" in by:
                out.append(f"| {name} | " + " | ".join(["not available"] * len(columns)) + " |")
                continue
            cells = [
                f"{r['decisions_per_s']:,.0f}; {r['p50_us'] / 1000:.1f}/{r['p99_us'] / 1000:.1f};"
                f" {r['server_cpu_us_per_decision']:.1f}"
                for r in by.values()
            ]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


LONE = "bucketlimit RedisTokenBucketLimiter.allow, no refusal cache"
LIMITS_FIXED = "limits fixed window"
DOCS_START, DOCS_END = "<!-- redis-scale: start -->", "<!-- redis-scale: end -->"


def goals(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The Redis goals this run measured: (PASS or MISS, goal, measured)."""
    out: list[tuple[str, str, str]] = []

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    server = results.get("server", {}).get("rows", {})
    if LONE in server and LIMITS_FIXED in server:
        limits = {w: server[LIMITS_FIXED][w]["us"] for w in ("allowed", "refused")}
        lone = {w: server[LONE][w]["us"] / limits[w] for w in ("allowed", "refused")}
        out.append(
            (
                verdict(lone["allowed"] <= 0.8),
                "an allowed decision's server time <= 0.8x limits' fixed-window script",
                f"{lone['allowed']:.2f}x one decision per call ({lone['refused']:.2f}x refused);"
                " a script doing only TIME + GET + SET costs more than limits' one INCRBY"
                " (benches/script_study/FINDINGS.md)",
            )
        )
        for n in (8, 64):
            name = f"{BATCHED}: allow_many, {n} per call"
            if name in server:
                ratio = server[name]["allowed"]["us"] / limits["allowed"]
                out.append(
                    (
                        verdict(ratio <= 0.8),
                        f"the same, decisions sharing a round trip ({n} per call)",
                        f"{ratio:.2f}x",
                    )
                )
    client = results.get("client", {}).get("rows", {})
    allow = client.get("bucketlimit RedisTokenBucketLimiter.allow")
    if allow:
        ratio = allow["x_trivial_paired"]
        out.append(
            (
                verdict(ratio <= 1.1),
                "allow() on one connection <= 1.1x a trivial EVALSHA",
                f"{ratio:.2f}x: the script's own server time is inside every round trip",
            )
        )
    tasks = results.get("asyncio", {}).get("results", {})
    if BATCHED in tasks and "64 tasks" in tasks[BATCHED]:
        ours = tasks[BATCHED]["64 tasks"]["decisions_per_s"]
        peers_64 = {
            name: by["64 tasks"]["decisions_per_s"]
            for name, by in tasks.items()
            if not name.startswith(("bucketlimit", "trivial")) and "64 tasks" in by
        }
        if peers_64:
            best, best_rate = max(peers_64.items(), key=lambda item: item[1])
            out.append(
                (
                    verdict(ours >= 3 * best_rate),
                    "one asyncio process, 64 tasks: >= 3x the best peer's decisions/s",
                    f"{ours / best_rate:.1f}x ({ours:,.0f}/s;"
                    f" best peer {best}, {best_rate:,.0f}/s)",
                )
            )
    return out


def docs_section(results: dict[str, Any]) -> str:
    """The "Redis at scale" section of docs/benchmarks.md: goals, then the tables."""
    rows = [f"| {v} | {goal} | {measured} |" for v, goal, measured in goals(results)]
    return "\n".join(
        [
            DOCS_START,
            "## Redis at scale",
            "",
            "Written by `python -m benches.redis_scale --docs docs/benchmarks.md` (`make bench`"
            " runs it after `benches/run.py`). Server time is `INFO commandstats` per command"
            " the client sent (a script's inner commands counted once, inside it), median over"
            " interleaved batches, the lower quartile in brackets; see the module's docstring.",
            "",
            "| | goal | measured |",
            "| --- | --- | --- |",
            *rows,
            "",
            markdown(results),
            DOCS_END,
            "",
        ]
    )


def write_docs(path: Path, results: dict[str, Any]) -> None:
    """Puts the section into ``path``, in place of an earlier one, else at the end."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    section = docs_section(results)
    if DOCS_START in text and DOCS_END in text:
        head, rest = text.split(DOCS_START, 1)
        tail = rest.split(DOCS_END, 1)[1].lstrip("\n")
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


# --- main ---------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--sections",
        default="server,client,asyncio,processes,study",
        help="comma-separated subset of server,client,asyncio,processes,study",
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--markdown", type=Path, help="also write the tables here (Markdown)")
    parser.add_argument(
        "--docs", type=Path, help="write the goals and tables into this file's Redis section"
    )
    parser.add_argument(
        "--from-json", type=Path, help="measure nothing: the Markdown tables of a --json file"
    )
    parser.add_argument("--no-cell", action="store_true", help="do not build or load redis-cell")
    # The worker of section 4 (internal).
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args)
        return
    if args.from_json:
        print(markdown(json.loads(args.from_json.read_text())))
        return
    s = settings(args.quick)
    sections = args.sections.split(",")
    env: dict[str, Any] = {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "load_before": load(),
        "versions": versions(),
    }
    print("== machine")
    print(f"  {env['python']} on {env['platform']}, {env['cores']} cores")
    print(f"  load {env['load_before']}")
    print("  " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    missing = [dist for dist, module in PEER_MODULES.items() if not installed(module)]
    if missing:
        print(
            f"  note: {', '.join(missing)} not installed: their rows are left out"
            " (pip install -r benches/requirements.txt)"
        )
    module = None if args.no_cell else redis_cell_module()
    if args.no_cell:
        print("  note: redis-cell not measured (--no-cell)")
    env["redis-cell"] = str(module) if module else "not available"
    results: dict[str, Any] = {"machine": env, "quick": args.quick}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bucketlimit-scale-") as d:
        server = start_server(Path(d), module)
        # The server on one CPU (the client section pins itself to the same one).
        os.sched_setaffinity(server.process.pid, {max(os.sched_getaffinity(0))})  # type: ignore[union-attr]
        try:
            if "server" in sections:
                results["server"] = server_section(server.port, module is not None, s)
            if "client" in sections:
                results["client"] = client_section(server.port, s)
            if "asyncio" in sections:
                results["asyncio"] = asyncio_section(server.port, s)
            if "processes" in sections:
                results["processes"] = processes_section(server.port, s)
            if "study" in sections:
                from benches.script_study import study

                results["study"] = study.run_all(
                    server.port, s.per_batch, s.batches, 500 if args.quick else 5000
                )
        finally:
            server.stop()
    env["load_after"] = load()
    env["seconds"] = round(time.monotonic() - started)
    print(f"\n  measured in {env['seconds']} s; load {env['load_before']} -> {env['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
        print(f"  wrote {args.json}")
    if args.markdown:
        args.markdown.write_text(markdown(results) + "\n")
        print(f"  wrote {args.markdown}")
    if args.docs:
        write_docs(args.docs, results)
        print(f"  wrote the Redis section of {args.docs}")


if __name__ == "__main__":
    main()
