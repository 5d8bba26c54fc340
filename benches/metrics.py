"""What ``bucketlimit.metrics`` costs a decision: ``allow()`` with and without it.

    python -m benches.metrics            # from the repository root; about 30 s
    python -m benches.metrics --quick    # a shorter run

Not part of the test suite. The metrics are pull-based (docs/metrics.md): they
read ``stats()`` when Prometheus scrapes or OpenTelemetry collects, and add
nothing to ``allow()``. This measures that claim, in one process, with the
same limiter settings each time:

1. ``off``: no metrics configured (``bucketlimit.metrics`` never imported).
2. ``registered``: the limiter added to a ``LimiterMetrics`` that is registered
   with a prometheus_client ``CollectorRegistry`` and an opentelemetry-sdk
   ``MeterProvider`` (an ``InMemoryMetricReader``), nobody collecting.
3. ``scraped 100/s``: the same, while another thread collects both every 10 ms
   (a hundred times what a Prometheus server does at its usual 15 s interval):
   what a collection takes from the limiter's lock and the GIL.

Each figure is the median of ``REPEATS`` runs of ``CALLS`` calls over 1,000
keys, in ns per call from a Python loop (the loop itself included). The cases
are interleaved run by run, so a slow moment of a shared machine falls on all.
Needs prometheus-client and opentelemetry-sdk (``make install`` has them).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable

if not __package__:
    sys.exit("run it from the repository root as a module: python -m benches.metrics")

from bucketlimit import TokenBucketLimiter, __version__

KEYS = [f"user-{i}" for i in range(1000)]


def timed(limiter: TokenBucketLimiter, calls: int) -> float:
    """ns per allow() call."""
    allow = limiter.allow
    keys = KEYS * (calls // len(KEYS))
    start = time.perf_counter_ns()
    for key in keys:
        allow(key)
    return (time.perf_counter_ns() - start) / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benches.metrics")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats, calls = (5, 100_000) if args.quick else (11, 300_000)

    # Mostly allowed: capacity far above what the run spends.
    off = TokenBucketLimiter(10**9, 10**6)
    registered = TokenBucketLimiter(10**9, 10**6)
    scraped = TokenBucketLimiter(10**9, 10**6)
    assert "bucketlimit.metrics" not in sys.modules

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from prometheus_client import CollectorRegistry, generate_latest

    from bucketlimit.metrics import LimiterMetrics

    def measured(limiter: TokenBucketLimiter) -> Callable[[], None]:
        limiters = LimiterMetrics({"bench": limiter})
        registry = CollectorRegistry()
        limiters.register_prometheus(registry)
        reader = InMemoryMetricReader()
        limiters.register_opentelemetry(MeterProvider(metric_readers=[reader]))

        def collect() -> None:
            generate_latest(registry)
            reader.get_metrics_data()

        return collect

    measured(registered)
    collect = measured(scraped)
    collections = 0
    scraping = threading.Event()
    stop = threading.Event()

    def scraper() -> None:
        nonlocal collections
        while not stop.is_set():
            if scraping.is_set():
                collect()
                collections += 1
            time.sleep(0.01)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    results: dict[str, list[float]] = {"off": [], "registered": [], "scraped 100/s": []}
    for _ in range(repeats):
        results["off"].append(timed(off, calls))
        results["registered"].append(timed(registered, calls))
        scraping.set()
        results["scraped 100/s"].append(timed(scraped, calls))
        scraping.clear()
    stop.set()
    thread.join()
    started = time.perf_counter()
    collect()
    one_collection_us = (time.perf_counter() - started) * 1e6

    print(
        f"bucketlimit {__version__} benches.metrics: {platform.python_implementation()} "
        f"{platform.python_version()} on {platform.machine()}; median of {repeats} runs of "
        f"{calls} allow() calls, 1,000 keys"
    )
    base = statistics.median(results["off"])
    for name, values in results.items():
        median = statistics.median(values)
        print(
            f"{name:<16}{median:8.1f} ns per call  ({median - base:+6.1f} ns, "
            f"{100 * (median - base) / base:+5.1f}%)  runs {min(values):.0f}..{max(values):.0f}"
        )
    print(f"collections during the scraped runs: {collections}")
    print(
        f"one collection (Prometheus text + OpenTelemetry, 1 limiter): {one_collection_us:.0f} us"
    )


if __name__ == "__main__":
    main()
