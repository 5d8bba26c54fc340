"""``python -m bucketlimit bench``: ns per ``allow()`` and bytes per key, next to pure Python.

This is a measurement, not a test: figures depend on the machine and on what
else runs on it. Each figure is the median of several timed loops, each loop
calling ``allow`` from Python as a service would; the loop's own cost is
included and printed once so it can be subtracted by eye.
"""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from statistics import median
from typing import TextIO

from bucketlimit import TokenBucketLimiter, __version__

# mode -> (timed repetitions, calls per repetition, keys in the memory probe)
MODES = {
    "full": (5, 200_000, 1_000_000),
    "quick": (3, 50_000, 1_000_000),
    "smoke": (2, 2_000, 10_000),
}

# workload -> (number of keys, capacity, rate): a huge bucket that refills
# faster than any loop allows everything; capacity 1 at rate 1 refuses
# nearly everything once the warm-up pass has drained it.
WORKLOADS = {
    "1 key, mostly allowed": (1, 10**9, 10**9),
    "1 key, mostly refused": (1, 1, 1),
    "10,000 keys, mostly allowed": (10_000, 10**9, 10**9),
    "10,000 keys, mostly refused": (10_000, 1, 1),
}

Allow = Callable[[str], object]


class PurePythonBucket:
    """The baseline: a plain token bucket in Python, as one would write it by hand.

    A dict of key -> [tokens, last time], float arithmetic, ``time.monotonic``
    and one ``threading.Lock``. It answers a bool (no Decision object), never
    forgets a key and is not exact, so it does less work than bucketlimit.
    """

    def __init__(self, capacity: int, rate: float) -> None:
        self._capacity = float(capacity)
        self._rate = float(rate)
        self._buckets: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, cost: int = 1) -> bool:
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = [self._capacity, now]
            elif now > bucket[1]:
                refilled = bucket[0] + (now - bucket[1]) * self._rate
                bucket[0] = min(self._capacity, refilled)
                bucket[1] = now
            if bucket[0] >= cost:
                bucket[0] -= cost
                return True
            return False

    def __len__(self) -> int:
        return len(self._buckets)


IMPLEMENTATIONS: dict[str, Callable[[int, float], Allow]] = {
    "bucketlimit": lambda capacity, rate: TokenBucketLimiter(capacity, rate).allow,
    "bucketlimit+py clock": lambda capacity, rate: (
        TokenBucketLimiter(capacity, rate, time.monotonic).allow
    ),
    "pure Python+Lock": lambda capacity, rate: PurePythonBucket(capacity, rate).allow,
}
HEADINGS = {
    "bucketlimit": ("bucketlimit", "Rust clock"),
    "bucketlimit+py clock": ("bucketlimit", "time.monotonic"),
    "pure Python+Lock": ("pure Python", "dict + Lock"),
}


def bench(mode: str, out: TextIO) -> None:
    reps, calls, memory_keys = MODES[mode]
    write = out.write
    write(f"bucketlimit {__version__} bench ({mode}: median of {reps} runs x {calls} calls)\n")
    write(
        f"{platform.python_implementation()} {platform.python_version()} on "
        f"{platform.platform()}, {os.cpu_count()} CPUs\n\n"
    )

    write("ns per allow() call, from a Python loop (loop cost included)\n")
    write(f"{'workload':<28}" + "".join(f"{top:>15}" for top, _ in HEADINGS.values()) + "\n")
    write(f"{'':<28}" + "".join(f"{bottom:>15}" for _, bottom in HEADINGS.values()) + "\n")
    for name, (n_keys, capacity, rate) in WORKLOADS.items():
        keys = [f"user-{i:05d}" for i in range(n_keys)]
        sequence = keys * max(1, calls // n_keys)  # round robin over the keys
        cells = [
            ns_per_call(make(capacity, rate), sequence, reps) for make in IMPLEMENTATIONS.values()
        ]
        write(f"{name:<28}" + "".join(f"{ns:>15.0f}" for ns in cells) + "\n")
    loop = ns_per_call(len, ["user-00000"] * calls, reps)
    write(f"(the loop with one C call per iteration, len(key), alone: {loop:.0f} ns)\n\n")

    write(
        f"bytes per key at {memory_keys:,} keys of 10 bytes, as RSS growth in a fresh process\n"
        "(capacity 10, rate 0.001: no bucket refills to full, so none is evicted)\n"
    )
    for implementation in ("bucketlimit", "pure Python+Lock"):
        grown, held = _memory_in_subprocess(implementation, memory_keys)
        write(
            f"{implementation:<28}{grown / memory_keys:>8.0f} bytes/key"
            f"  ({held:,} keys held, RSS +{grown / 2**20:.1f} MiB)\n"
        )


def ns_per_call(allow: Allow, sequence: list[str], reps: int) -> float:
    """Median ns per call of ``allow`` over ``reps`` timed passes through ``sequence``."""
    for key in sequence:  # warm-up: creates the buckets and drains the small ones
        allow(key)
    timings = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        for key in sequence:
            allow(key)
        timings.append(time.perf_counter_ns() - start)
    return median(timings) / len(sequence)


def _memory_in_subprocess(implementation: str, n: int) -> tuple[int, int]:
    # A fresh interpreter, so memory freed by the timing runs cannot hide growth.
    code = f"from bucketlimit._bench import probe_memory; probe_memory({implementation!r}, {n})"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    grown, held = result.stdout.split()
    return int(grown), int(held)


def probe_memory(implementation: str, n: int) -> None:
    """Prints the RSS growth from touching ``n`` new keys, and the keys held after."""
    limiter: TokenBucketLimiter | PurePythonBucket
    if implementation == "bucketlimit":
        limiter = TokenBucketLimiter(10, 0.001)
    else:
        limiter = PurePythonBucket(10, 0.001)
    allow = limiter.allow
    allow("warm-up")
    gc.collect()
    before = _rss_bytes()
    for i in range(n):
        # Keys are made and dropped per call, as a request's would be; the
        # pure-Python dict keeps them alive, which is part of its cost.
        allow(f"k{i:09d}")
    print(_rss_bytes() - before, len(limiter))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak RSS, which only grows here anyway
        import resource  # not on Windows, where this bench reports no memory figure

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
