"""Memory workers, each run in a fresh interpreter by ``run.py``.

``python benches/memory.py bytes-per-key LIBRARY N``
    Resident memory added by holding N keys of 10 bytes in LIBRARY's
    in-memory store, divided by N (the key is included: the limiter keeps
    it). Prints one JSON object.

``python benches/memory.py growth N``
    bucketlimit with its built-in clock: N new keys, each call timed, the
    slowest ones reported with their place in the fill (the table's growth).
    Prints one JSON object.

``python benches/memory.py flood SECONDS KEYS_PER_SECOND``
    bucketlimit on a ManualClock, capacity 1 and rate 1: KEYS_PER_SECOND new
    keys every simulated second for SECONDS; a key is full again one second
    after its call, so about KEYS_PER_SECOND buckets are in use at any time.
    Prints the buckets held and evicted after each second.

``python benches/memory.py eviction N CALLS``
    bucketlimit on a ManualClock: touch N keys, step past the time they are
    all full again, then time each of the next CALLS calls (on 100 hot keys)
    while the sweep forgets the idle ones; the same loop on a limiter that
    holds no idle keys is the control. Prints one JSON object.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from array import array
from typing import Any

import peers

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident set size of this process, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def key(i: int) -> str:
    # 10 bytes: "u" and nine digits. Built one at a time, so the harness holds
    # no list of keys and only the limiter's copies count.
    return f"u{i:09d}"


def bytes_per_key(library: str, n: int) -> dict[str, Any]:
    factory, _ = peers.IN_MEMORY[library]
    # Each key spends one of its ten tokens and gets one back an hour later:
    # no library may drop a key during the run.
    subject = factory(peers.REFUSED)
    subject.allow("warm-up-key")  # imports, lazy state and first allocations
    gc.collect()
    before = rss()
    start = time.perf_counter()
    allow = subject.allow
    for i in range(n):
        allow(key(i))
    elapsed = time.perf_counter() - start
    gc.collect()
    after = rss()
    subject.close()
    return {
        "library": library,
        "keys": n,
        "bytes_per_key": (after - before) / n,
        "rss_before": before,
        "rss_after": after,
        "fill_seconds": elapsed,
    }


def percentiles(samples: array[int]) -> dict[str, float]:
    ordered = sorted(samples)
    count = len(ordered)

    def at(q: float) -> float:
        return float(ordered[min(count - 1, int(q * count))])

    return {
        "median_ns": at(0.5),
        "p99_ns": at(0.99),
        "p999_ns": at(0.999),
        "max_ns": float(ordered[-1]),
    }


def timed_calls(allow: Any, keys: list[str], calls: int) -> array[int]:
    """Times each call on its own with perf_counter_ns (its ~50 ns included)."""
    samples = array("q", bytes(8 * calls))
    clock = time.perf_counter_ns
    n = len(keys)
    gc.disable()
    try:
        for i in range(calls):
            k = keys[i % n]
            t0 = clock()
            allow(k)
            samples[i] = clock() - t0
    finally:
        gc.enable()
    return samples


# A call whose wall time exceeds its thread's CPU time by this much was
# descheduled by the OS (another process ran): that wait is the machine's,
# not the limiter's.
DESCHEDULED_NS = 20_000


def timed_calls_on_cpu(allow: Any, keys: list[str], calls: int) -> tuple[array[int], int]:
    """Like :func:`timed_calls`, but drops the calls the OS descheduled.

    The thread's CPU clock is read around each timed call (it costs ~0.5 us,
    outside the timed interval); returns the wall times of the calls that ran
    on the CPU throughout, and how many were dropped.
    """
    samples = array("q")
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    n = len(keys)
    dropped = 0
    gc.disable()
    try:
        for i in range(calls):
            k = keys[i % n]
            c0 = cpu()
            t0 = wall()
            allow(k)
            t1 = wall()
            c1 = cpu()
            if (t1 - t0) - (c1 - c0) > DESCHEDULED_NS:
                dropped += 1
            else:
                samples.append(t1 - t0)
    finally:
        gc.enable()
    return samples, dropped


def _idle_limiter(n: int) -> tuple[Any, Any, dict[str, float]]:
    """A limiter on a ManualClock holding n buckets that are all full now."""
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.testing import ManualClock

    clock = ManualClock()
    limiter = TokenBucketLimiter(10, 1, clock=clock)
    # Each fill call is timed: the table's growth (a rehash of the index, a
    # copy of the entries) lands on single calls here, not during eviction.
    fill = percentiles(timed_calls(limiter.allow, [key(i) for i in range(n)], n))
    clock.advance(100)  # every bucket is full, so forgettable, after 1 s
    return limiter, clock, fill


def eviction(n: int, calls: int) -> dict[str, Any]:
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.testing import ManualClock

    hot = [f"hot-{i:05d}" for i in range(100)]

    limiter, _, fill = _idle_limiter(n)
    held = len(limiter)
    during = percentiles(timed_calls(limiter.allow, hot, calls))
    stats = limiter.stats()
    del limiter

    # The same again, keeping only the calls that stayed on the CPU.
    limiter, _, _ = _idle_limiter(n)
    on_cpu, dropped = timed_calls_on_cpu(limiter.allow, hot, calls)
    del limiter

    control_clock = ManualClock()
    control = TokenBucketLimiter(10, 1, clock=control_clock)
    control_clock.advance(100)
    control_run = percentiles(timed_calls(control.allow, hot, calls))
    return {
        "keys": n,
        "calls": calls,
        "held_after_fill": held,
        "held_after_calls": stats["keys"],
        "evicted": stats["evicted"],
        "fill": fill,
        "during_eviction": during,
        "during_eviction_on_cpu": {**percentiles(on_cpu), "descheduled_calls": dropped},
        "control": control_run,
    }


def growth(n: int) -> dict[str, Any]:
    from bucketlimit import TokenBucketLimiter

    limiter = TokenBucketLimiter(10, 1, per=3600)  # no bucket is full again during the run
    keys = [key(i) for i in range(n)]
    on_cpu_samples = array("q")
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    allow = limiter.allow
    slowest: list[tuple[int, int]] = []
    dropped = 0
    gc.disable()
    try:
        for i, k in enumerate(keys):
            c0 = cpu()
            t0 = wall()
            allow(k)
            t1 = wall()
            c1 = cpu()
            if (t1 - t0) - (c1 - c0) > DESCHEDULED_NS:
                dropped += 1
                continue
            on_cpu_samples.append(t1 - t0)
            if t1 - t0 > 20_000:
                slowest.append((t1 - t0, i))
    finally:
        gc.enable()
    slowest.sort(reverse=True)
    return {
        "keys": n,
        "held": len(limiter),
        "calls_on_cpu": {**percentiles(on_cpu_samples), "descheduled_calls": dropped},
        "slowest_calls_ns_at_key": slowest[:8],
    }


def flood(seconds: int, per_second: int) -> dict[str, Any]:
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.testing import ManualClock

    clock = ManualClock()
    limiter = TokenBucketLimiter(1, 1, clock=clock)
    step = 1 / per_second
    allow = limiter.allow
    held_each_second = []
    i = 0
    for _ in range(seconds):
        for _ in range(per_second):
            allow(key(i))
            i += 1
            clock.advance(step)
        stats = limiter.stats()
        held_each_second.append((stats["keys"], stats["evicted"]))
    return {
        "seconds": seconds,
        "keys_per_second": per_second,
        "in_use_at_any_time": per_second,
        "held_and_evicted_after_each_second": held_each_second,
    }


def main() -> None:
    command = sys.argv[1]
    if command == "bytes-per-key":
        result = bytes_per_key(sys.argv[2], int(sys.argv[3]))
    elif command == "growth":
        result = growth(int(sys.argv[2]))
    elif command == "flood":
        result = flood(int(sys.argv[2]), int(sys.argv[3]))
    elif command == "eviction":
        result = eviction(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
