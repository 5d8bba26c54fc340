"""The LLM gateway of docs/recipes/llm-gateway.md under load, with and without its waiting.

    python -m benches.gateway                      # from the repository root; a few minutes
    python -m benches.gateway --duration 20 --modes waiting,refusing

Not part of the test suite (tests/recipes/test_llm_gateway.py checks the behaviour
at a smaller scale). It starts its own redis-server (the tests' runner: loopback, a
free port, no persistence), the mock provider (60,000 tokens a minute, 6 compute
slots) and the example gateway under ``uvicorn --workers N`` (tests/recipes/gateway.py),
then openai SDK callers: interactive users (one thread each, streaming, reading
about two seconds between questions) and batch jobs (several threads each, back to
back), all with the SDK's ``max_retries=6``. Each mode is one run on fresh buckets:

- ``waiting``: the recipe, a request over a user's limits waits up to 60 s, and up
  to 5 s for the org cap;
- ``refusing``: the same limits refuse at once (``max_wait=0``): the SDK retries
  the 429s, as ``retry-after-ms`` says;
- ``unlimited``: limits too large to matter (what the provider sees without them).

It prints, per run: batch calls that failed and HTTP requests per batch call,
interactive latency (p50, p99), the provider's 429s, the most generations of one
user at the provider at once, the worst window (each user's tokens against its
bucket's exact bound since the start, and the busiest ``window`` seconds of one
user against ``capacity + rate * window``), and a scrape of the gateway after the
run: per limit, allowed + refused + given_back against the answers that reached
it, and the concurrency series.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if not __package__:  # run as a script, the repository root is not on sys.path
    sys.exit("run it from the repository root as a module: python -m benches.gateway")

import bucketlimit
from tests.recipes.gateway import Run, Shape, Stack, gateway_stack, requests_total, run_callers
from tests.support.redis_servers import RedisServer  # the tests' server runner

LIMITS = ("generations", "requests", "tokens", "org-tokens")  # in the order they decide
MODES: dict[str, dict[str, Any]] = {
    "waiting": {},
    "refusing": {"max_wait": 0.0, "org_wait": 0.0},
    "unlimited": {"rpm": 10**6, "tpm": 10**8, "org_tpm": 10**8, "generations": 1000},
}


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def report(mode: str, run: Run, stack: Stack, shape: Shape) -> None:
    batch_calls, batch_failed = run.total(batch=True), run.failed(batch=True)
    latencies = run.latencies(batch=False)
    users = sorted(run.users())
    margins = [run.margin(run.admitted(u), shape.tpm, shape.window) for u in users]
    busiest = max(run.busiest_window(run.admitted(u), shape.window) for u in users)
    bound = shape.tpm * 2  # capacity + rate * window
    org = run.margin(run.admitted(), shape.org_tpm, shape.window)
    print(
        f"{mode}: batch {batch_calls - batch_failed}/{batch_calls} calls succeeded "
        f"({batch_failed} failed, {run.answers(batch=True) / max(batch_calls, 1):.2f} HTTP "
        f"requests a call); interactive {len(latencies)}/{run.total(batch=False)}, "
        f"p50 {quantile(latencies, 0.5):.3f} s, p90 {quantile(latencies, 0.9):.3f} s, "
        f"p99 {quantile(latencies, 0.99):.3f} s, max {max(latencies, default=0):.3f} s; "
        f"provider 429s {run.provider_429s()}; most in flight for one user "
        f"{max(run.most_in_flight(u) for u in users)}; least margin under a user's exact "
        f"bound {min(margins):.0f} tokens (org {org:.0f}); busiest {shape.window:.0f} s "
        f"of one user {busiest:.0f} tokens = {busiest / bound:.2f} x capacity + rate x window",
        flush=True,
    )
    time.sleep(2.5)  # the workers publish their numbers every second
    found = requests_total(stack.scrape())
    reached = len(run.responses)
    for policy in LIMITS:
        outcomes = {o: int(found.get((policy, o), 0)) for o in ("allowed", "refused", "given_back")}
        abandoned = int(found.get((policy, "abandoned"), 0))
        print(
            f"  {policy}: {outcomes}, sum {sum(outcomes.values())} for {reached} answers that "
            f"reached it (abandoned {abandoned})"
        )
        reached -= outcomes["refused"]
    series = [
        line
        for line in stack.scrape().splitlines()
        if line.startswith(
            (
                "bucketlimit_permits_",
                "bucketlimit_wait_seconds_count",
                "bucketlimit_degraded_decisions_total",
                "bucketlimit_store_errors_total",
            )
        )
    ]
    print("  " + "\n  ".join(series))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=float, default=40, help="seconds the callers send")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn workers of the gateway")
    parser.add_argument("--interactive", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--batch-threads", type=int, default=6)
    parser.add_argument("--think", type=float, default=2.0, help="an interactive user's pause, s")
    parser.add_argument("--modes", default="waiting,refusing", help=f"of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every mode, interleaved")
    args = parser.parse_args()
    base = Shape(
        duration=args.duration,
        workers=args.workers,
        interactive=args.interactive,
        batch=args.batch,
        batch_threads=args.batch_threads,
        think=args.think,
    )
    print(
        f"bucketlimit {bucketlimit.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {base}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        server = RedisServer(directory / "redis")
        server.start()
        try:
            for n, mode in enumerate(args.modes.split(",") * args.rounds):
                overrides: dict[str, Any] = MODES[mode]
                shape = replace(base, prefix=f"bench-{n}-{mode}:", **overrides)
                with gateway_stack(shape, server.url, directory / f"{n}-{mode}") as stack:
                    run = run_callers(stack, seed=35)
                    report(mode, run, stack, base)  # measured against the recipe's limits
                print(f"  (load {os.getloadavg()[0]:.1f} after the run)", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
