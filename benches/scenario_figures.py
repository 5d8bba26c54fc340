"""Time and throughput in the tests' own scenarios: the figures the test suite
prints nowhere and asserts never (a test asserts behaviour, never speed).

    python -m benches.scenario_figures              # from the repository root; a few minutes
    python -m benches.scenario_figures permits      # only the scenarios named
    python -m benches.scenario_figures --quick      # the tests' sizes: a smoke run

Each scenario is the test's own function (imported from tests/), run at the size
the test had when it asserted the figure, against a redis-server started here (the
tests' runner: loopback, a free port, no persistence). Each figure is printed next
to the bound the test once held it to, and the test that runs the scenario now, at
a size that proves its behaviour, not its speed. A measurement, never a test: run
it on a quiet machine (it prints the load average before and after).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a script, the repository root is not on sys.path
    sys.exit("run it from the repository root as a module: python -m benches.scenario_figures")

import redis

from bucketlimit import __version__
from tests.redis import test_redis_faults as faults
from tests.redis import test_redis_lease_processes as lease_processes
from tests.redis import test_redis_permit_processes as permit_processes
from tests.support.redis_servers import RedisServer

#: (figure, value, the bound a test once asserted)
Row = tuple[str, str, str]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def permits(server: RedisServer, quick: bool) -> list[Row]:
    """tests/redis/test_redis_permit_processes.py: 8 processes x 16 tasks on one key
    of limit 10, and a holder of 5 permits killed."""
    client = server.client()
    client.flushall()
    acquisitions = permit_processes.ACQUISITIONS if quick else 100_000
    run = permit_processes.hammer_one_key(server.url, 8, acquisitions)
    assert run.done == acquisitions, "the scenario itself failed"
    assert run.above == 0, "the scenario itself failed"
    killed = permit_processes.kill_a_holder_of_five(server.url)
    client.close()
    ttl = permit_processes.TTL
    late = max(at - (killed.asked + ttl) for at in killed.granted)
    return [
        (
            f"8 processes x 16 tasks, limit 10: {acquisitions:,} acquisitions",
            f"{run.seconds:.1f} s, {acquisitions / run.seconds:,.0f} a second",
            "all within 600 s",
        ),
        (
            f"a killed holder's 5 slots (ttl {ttl:g} s): the last granted after the ttl",
            f"+{late:.3f} s",
            "<= ttl + 1 s",
        ),
    ]


def leases(server: RedisServer, quick: bool) -> list[Row]:
    """tests/redis/test_redis_lease_processes.py: 8 processes hammering one leased key
    (capacity 10,000, 100,000 a second, from an empty bucket), and one hot process
    among seven asking 10 calls a second. Commands per admitted call, leased and not,
    at full speed: benches/leases.py."""
    client = server.client()
    rate = lease_processes.RATE
    with tempfile.TemporaryDirectory(prefix="bench-leases-") as directory:
        client.flushall()
        run = lease_processes.eight_processes_on_one_key(
            client, server.url, Path(directory), 2.0 if quick else 10.0
        )
        worst = lease_processes.assert_never_over_the_cap(run.calls, lease_processes.CAPACITY, rate)
        client.flushall()
        mixed = lease_processes.one_hot_among_seven_idle(
            client, server.url, Path(directory), 1.5 if quick else 3.0
        )
        hot_span = lease_processes.Calls.read([mixed.hot]).span
    client.close()
    span = run.calls.span
    sums = run.sums
    idle = ", ".join(f"{r.admitted}/{r.admitted + r.refused}" for r in mixed.idle)
    return [
        (
            f"8 processes, {span:.1f} s: admitted, of the bound rate x T",
            f"{run.admitted / (rate * span):.1%}",
            ">= 95 %",
        ),
        ("the fullest 1 s window, of its bound", f"{worst:.1%}", "<= 100 % (still asserted)"),
        (
            "refill the bucket could not hold during the run, of rate x T",
            f"{(run.gap - run.outside) / (rate * span):.2%}",
            "<= 1 %",
        ),
        (
            "lease tokens expired unused, of those leased",
            f"{sums['lease_tokens_expired'] / sums['lease_tokens']:.2%}",
            "<= 5 %",
        ),
        (
            "admitted calls answered from a lease",
            f"{sums['lease_hits'] / run.admitted:.2%}",
            ">= 95 % (still asserted)",
        ),
        (
            f"one hot process among 7 idle, {hot_span:.1f} s: admitted, of rate x T",
            f"{mixed.hot.admitted / (rate * hot_span):.1%}",
            ">= 90 %",
        ),
        ("the idle ones: admitted/asked", idle, ">= 2/3 each (still asserted)"),
    ]


def hung_server(server: RedisServer, quick: bool) -> list[Row]:
    """tests/redis/test_redis_faults.py: a server of its own hung (SIGSTOP) under 8
    calling threads, the client's timeout 50 ms, the breaker's retry_interval 1 s."""
    stop, retry = (1.0, 0.25) if quick else (3.0, 1.0)
    with tempfile.TemporaryDirectory(prefix="bench-hung-") as directory:
        hung = RedisServer(Path(directory)).start()
        try:
            hang = faults.hang_the_server(hung, stop, retry, timeout=0.05)
        finally:
            hung.stop()
    during = hang.calls.within(hang.paused, hang.resumed)
    slowest = max(end - start for start, end, _, _ in during)
    return [
        (
            f"commands that reached it while it hung {stop:g} s (retry_interval {retry:g} s)",
            f"{hang.sent}",
            f"<= {faults.THREADS} + {1 + stop / retry:g} probes (still asserted)",
        ),
        (
            f"the slowest of {len(during):,} calls made while it hung {stop:g} s",
            f"{slowest * 1000:.0f} ms",
            f"< {stop / 2:g} s",
        ),
        (
            "from SIGCONT to the first answer from the store",
            f"{hang.recovered - hang.resumed:.2f} s",
            f"<= retry_interval + 1 s = {retry + 1:g} s",
        ),
    ]


SCENARIOS: dict[str, Callable[[RedisServer, bool], list[Row]]] = {
    "permits": permits,
    "leases": leases,
    "hung": hung_server,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("names", nargs="*", help=f"of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="the tests' sizes: a smoke run")
    options = parser.parse_args()
    names = options.names or list(SCENARIOS)
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        parser.error(f"no scenario {sorted(unknown)}: choose from {list(SCENARIOS)}")
    print(
        f"bucketlimit {__version__}, Python {platform.python_version()}, "
        f"redis-py {redis.__version__}; load average {load()} at the start"
    )
    with tempfile.TemporaryDirectory(prefix="bench-scenarios-") as directory:
        server = RedisServer(Path(directory) / "standalone").start()
        try:
            for name in names:
                print(f"\n{name}: " + " ".join((SCENARIOS[name].__doc__ or "").split()))
                print("  | figure | measured | the test once asserted |")
                print("  | --- | ---: | --- |")
                for figure, value, bound in SCENARIOS[name](server, options.quick):
                    print(f"  | {figure} | {value} | {bound} |")
        finally:
            server.stop()
    print(f"\nload average {load()} at the end")


if __name__ == "__main__":
    main()
