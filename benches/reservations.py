"""Reservations: what they cost and how well waiting wakes.

    python -m benches.reservations --before /path/to/site-packages-of-the-old-build

Measures, on this machine, in one run:

1. ``allow()`` ns/call before and after (the old build imported from ``--before``,
   the current one from the environment), in fresh subprocesses, interleaved
   round by round (before, after, before, after, ...): in-process ``allow()``
   moves by several percent with unrelated code-layout changes, so only the
   interleaved medians of the same run compare;
2. ``reserve()`` ns/call (granted at once and granted with a delay);
3. ``acquire_async`` with 1,000 tasks waiting at once on one key: wake-up
   lateness (actual minus scheduled ready time) p50/p99/max, and the CPU time
   used while they wait (no polling: near zero).

A measurement, never a test: nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from statistics import median, quantiles

CALLS = 200_000

TIMING = """
import json, time
from bucketlimit import TokenBucketLimiter
limiter = TokenBucketLimiter(1_000_000_000, 1_000_000_000)
allow = limiter.allow
for _ in range(20_000):
    allow("user-42")
best = []
for _ in range(5):
    start = time.perf_counter_ns()
    for _ in range({calls}):
        allow("user-42")
    best.append((time.perf_counter_ns() - start) / {calls})
print(json.dumps(min(best)))
"""


def allow_ns(site: str | None, calls: int) -> float:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = site  # the old build shadows the installed one
    out = subprocess.run(
        [sys.executable, "-c", TIMING.format(calls=calls)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd="/",  # not the repository: its python/ must not shadow either build
    ).stdout
    return float(json.loads(out))


def reserve_ns(calls: int) -> dict[str, float]:
    from bucketlimit import TokenBucketLimiter

    now = time.perf_counter_ns
    result = {}
    for name, limiter in (
        ("reserve, granted now", TokenBucketLimiter(10**9, 10**9)),
        ("reserve, granted with a delay", TokenBucketLimiter(1, 1)),
        ("allow (same process)", TokenBucketLimiter(10**9, 10**9)),
    ):
        call = limiter.allow if name.startswith("allow") else limiter.reserve
        best = []
        for _ in range(5):
            if name.endswith("delay"):
                limiter.clear()
            start = now()
            for _ in range(calls):
                call("user-42")
            best.append((now() - start) / calls)
        result[name] = min(best)
    return result


async def wake_lateness(tasks: int, rate: float) -> dict[str, float]:
    from bucketlimit import TokenBucketLimiter

    # Capacity 10: the debt bound (1,000 capacities) leaves room for every waiter.
    limiter = TokenBucketLimiter(10, rate, clock=time.monotonic)
    lateness: list[float] = []

    head = 200  # tokens of debt ahead of the tasks: 100 ms, longer than starting them

    async def waiter(k: int, base: float) -> None:
        assert await limiter.acquire_async("k")
        lateness.append(time.monotonic() - (base + (head + k) / rate))

    # Put the bucket in debt at a known time, deep enough that it cannot refill to
    # full (and restart the schedule) while the tasks start: task k's tokens are
    # then scheduled at exactly base + (head + k) / rate.
    base = time.monotonic()
    limiter.charge("k", head + 10)
    cpu = time.process_time()
    wall = time.monotonic()
    await asyncio.gather(*(waiter(k, base) for k in range(1, tasks + 1)))
    cpu_used = time.process_time() - cpu
    wall_used = time.monotonic() - wall
    cuts = quantiles(lateness, n=100)
    return {
        "tasks": tasks,
        "wall_s": wall_used,
        "cpu_s": cpu_used,
        "cpu_per_wall": cpu_used / wall_used,
        "lateness_p50_ms": cuts[49] * 1e3,
        "lateness_p99_ms": cuts[98] * 1e3,
        "lateness_max_ms": max(lateness) * 1e3,
        "lateness_min_ms": min(lateness) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="site-packages dir holding the old build's bucketlimit")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    calls = 20_000 if args.quick else CALLS
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.before:
        before, after = [], []
        for _ in range(args.rounds):
            before.append(allow_ns(args.before, calls))
            after.append(allow_ns(None, calls))
        print(f"allow() ns/call, {args.rounds} interleaved rounds (best of 5 per round):")
        print(f"  before: median {median(before):.1f}  rounds {[round(x, 1) for x in before]}")
        print(f"  after:  median {median(after):.1f}  rounds {[round(x, 1) for x in after]}")
        print(f"  after/before: {median(after) / median(before):.3f}")
    for name, ns in reserve_ns(calls).items():
        print(f"{name:32} {ns:7.1f} ns/call")
    result = asyncio.run(wake_lateness(100 if args.quick else 1000, 2000.0))
    print("acquire_async, 1,000 tasks waiting on one key (rate 2,000/s: 0.6 s of waits):")
    print(
        f"  wake-up lateness p50 {result['lateness_p50_ms']:.3f} ms, "
        f"p99 {result['lateness_p99_ms']:.3f} ms, max {result['lateness_max_ms']:.3f} ms, "
        f"min {result['lateness_min_ms']:.3f} ms"
    )
    print(
        f"  CPU while waiting: {result['cpu_s'] * 1e3:.1f} ms over {result['wall_s']:.3f} s "
        f"of wall time ({100 * result['cpu_per_wall']:.1f}%)"
    )


if __name__ == "__main__":
    main()
