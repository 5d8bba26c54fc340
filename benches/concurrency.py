"""Concurrency permits in process: what a permit costs, next to the
standard library's semaphores (not keyed) in the same run.

    python -m benches.concurrency [--rounds 7] [--pairs 200000]

Each case takes a permit and gives it back, uncontended, ``--pairs`` times in a
loop, in interleaved rounds (every case once per round, in turn), so that the
medians of one run compare; the load average is printed before and after. Cases:

- ``ConcurrencyLimiter.try_acquire`` + ``Permit.release`` (keyed, fencing token,
  ttl), and the same with ``with``;
- ``threading.BoundedSemaphore(5)``: ``acquire()`` + ``release()``;
- ``await ConcurrencyLimiter.acquire_async`` + ``release`` next to ``await
  asyncio.Semaphore(5).acquire()`` + ``release()``, each in one coroutine.

A measurement, never a test: nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from statistics import median

from bucketlimit import ConcurrencyLimiter, __version__


def try_acquire_release(pairs: int) -> int:
    limiter = ConcurrencyLimiter(5)
    take = limiter.try_acquire
    start = time.perf_counter_ns()
    for _ in range(pairs):
        take("user-42").release()
    return time.perf_counter_ns() - start


def with_try_acquire(pairs: int) -> int:
    limiter = ConcurrencyLimiter(5)
    take = limiter.try_acquire
    start = time.perf_counter_ns()
    for _ in range(pairs):
        with take("user-42"):
            pass
    return time.perf_counter_ns() - start


def bounded_semaphore(pairs: int) -> int:
    semaphore = threading.BoundedSemaphore(5)
    acquire, release = semaphore.acquire, semaphore.release
    start = time.perf_counter_ns()
    for _ in range(pairs):
        acquire()
        release()
    return time.perf_counter_ns() - start


def acquire_async_release(pairs: int) -> int:
    async def run() -> int:
        limiter = ConcurrencyLimiter(5)
        take = limiter.acquire_async
        start = time.perf_counter_ns()
        for _ in range(pairs):
            (await take("user-42")).release()
        return time.perf_counter_ns() - start

    return asyncio.run(run())


def asyncio_semaphore(pairs: int) -> int:
    async def run() -> int:
        semaphore = asyncio.Semaphore(5)
        acquire, release = semaphore.acquire, semaphore.release
        start = time.perf_counter_ns()
        for _ in range(pairs):
            await acquire()
            release()
        return time.perf_counter_ns() - start

    return asyncio.run(run())


CASES: list[tuple[str, Callable[[int], int]]] = [
    ("ConcurrencyLimiter try_acquire + release", try_acquire_release),
    ("ConcurrencyLimiter with try_acquire", with_try_acquire),
    ("threading.BoundedSemaphore acquire + release", bounded_semaphore),
    ("ConcurrencyLimiter await acquire_async + release", acquire_async_release),
    ("asyncio.Semaphore await acquire + release", asyncio_semaphore),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=200_000)
    args = parser.parse_args()
    print(
        f"bucketlimit {__version__}, CPython {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs"
    )
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    for _, case in CASES:
        case(args.pairs // 10)  # warm up
    per_pair: dict[str, list[float]] = {name: [] for name, _ in CASES}
    for _ in range(args.rounds):
        for name, case in CASES:
            per_pair[name].append(case(args.pairs) / args.pairs)
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"\nns per take + give back, {args.pairs:,} pairs, {args.rounds} interleaved rounds")
    print(f"{'':50} {'median':>8} {'min':>8}")
    for name, values in per_pair.items():
        print(f"{name:50} {median(values):8.1f} {min(values):8.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
