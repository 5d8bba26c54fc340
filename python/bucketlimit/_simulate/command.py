"""``simulate``'s command line: its options, and the settings and call they make.

``python -m bucketlimit`` (``__main__.py``) adds the command with :data:`HELP`
and :data:`DESCRIPTION`, lets :func:`add_arguments` fill it in, and hands the
parsed arguments to :func:`run`; a usage error goes back through ``usage_error``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TextIO

from bucketlimit._simulate.model import COMPARISONS, FORMATS, PATTERNS, Settings, SimulationError
from bucketlimit._simulate.permits import PermitSettings
from bucketlimit._simulate.service import DISTRIBUTIONS
from bucketlimit._simulate.simulation import simulate, simulate_permits

HELP = "replay traffic through a limiter and chart what it admits"
DESCRIPTION = (
    "Replays traffic (made up, or read from a CSV file) through a real "
    "TokenBucketLimiter on a manual clock (no sleeping) and reports what it admitted: "
    "as text with a chart over time, as JSON or CSV, or as a PNG picture. With "
    "--concurrency N the requests run for their service time through a real "
    "ConcurrencyLimiter instead (at most N at once per key), and the report says how "
    "many waited, how long, how many were refused, and the peak in flight."
)


def _number(text: str) -> int | float:
    """An int when the text is one (exact in the limiter and in the report), else a float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``simulate``."""
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="bucket size in tokens (required but for --concurrency)",
    )
    parser.add_argument(
        "--rate",
        type=_number,
        default=None,
        help="tokens refilled per --per (required but for --concurrency)",
    )
    parser.add_argument("--per", type=_number, default=None, help="seconds (default 1)")
    parser.add_argument("--cost", type=int, default=None, help="tokens per request (default 1)")
    parser.add_argument(
        "--pattern",
        choices=PATTERNS,
        default=None,
        help="steady: evenly spaced requests; burst: idle, then bursts of twice what a "
        "full bucket admits at one instant; poisson: random exponential gaps; boundary: a "
        "full bucket's worth just before and just after every capacity/rate seconds "
        "(a fixed window's worst case). Required unless --replay",
    )
    parser.add_argument(
        "--duration",
        type=_number,
        default=None,
        help="seconds of traffic (required unless --replay, which defaults to the file's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed for poisson (default 0)")
    parser.add_argument(
        "--offered-rate",
        type=float,
        default=None,
        help="average requests per second offered (default: twice what the limit sustains)",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=1,
        help="N clients, each with its own key: client-1 sends --pattern, the others "
        "steady traffic at half the limit (the noisy neighbour); default 1",
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="all clients spend from one bucket (a global limit) instead of one each",
    )
    parser.add_argument(
        "--replay",
        metavar="FILE",
        default=None,
        help="read the requests from a CSV file: a time per row (seconds or ISO 8601), "
        "then optionally a key and a cost; a header row may name time,key,cost",
    )
    parser.add_argument(
        "--compare",
        choices=COMPARISONS,
        default=None,
        help="also run the same requests through a fixed window of capacity tokens per "
        "capacity/rate seconds, and show both",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text (default): a report with charts; json: the numbers; csv: one row per "
        "request with the limiter's answer",
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", default=None, help="also draw a PNG (needs matplotlib)"
    )
    parser.add_argument("--ascii", action="store_true", help="draw the chart with ASCII only")
    parser.add_argument(
        "--acquire",
        action="store_true",
        help="pace the same traffic instead of refusing it: each request reserves and "
        "waits for its tokens; reports the waits and checks the bound",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=None,
        help="with --acquire: the longest a request waits; longer is refused (default: no "
        "limit); with --concurrency: the longest a request waits for a permit, first come "
        "first served (default 0: refused at once; inf: no limit)",
    )
    permits = parser.add_argument_group(
        "concurrency mode", "at most N requests in flight per key instead of a bucket"
    )
    permits.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="replay the traffic through a ConcurrencyLimiter(N): each request holds a "
        "permit for its service time (replaces --capacity, --rate, --per and --cost)",
    )
    permits.add_argument(
        "--service",
        type=_number,
        default=None,
        metavar="SECONDS",
        help="how long each request runs: the time, or the mean of --service-dist "
        "(required with --concurrency)",
    )
    permits.add_argument(
        "--service-dist",
        choices=DISTRIBUTIONS,
        default=None,
        help="fixed (default): every request runs --service; exponential: random with that "
        "mean; lognormal: that mean with a long tail (sigma 1); drawn from --seed",
    )
    permits.add_argument(
        "--ttl",
        type=_number,
        default=None,
        help="the permits' ttl in seconds (default 60): a request that runs longer loses "
        "its permit while it runs",
    )


def run(args: argparse.Namespace, out: TextIO, usage_error: Callable[[str], NoReturn]) -> int:
    """Runs the simulation the parsed ``args`` describe, writing to ``out``."""
    if args.replay is None and (args.pattern is None or args.duration is None):
        usage_error("simulate needs --pattern and --duration (or --replay FILE)")
    if args.concurrency is not None:
        return _run_permits(args, out, usage_error)
    if args.capacity is None or args.rate is None:
        usage_error("simulate needs --capacity and --rate (or --concurrency N)")
    if args.service is not None or args.service_dist is not None or args.ttl is not None:
        usage_error("--service, --service-dist and --ttl need --concurrency")
    settings = Settings(
        capacity=args.capacity,
        rate=args.rate,
        per=1 if args.per is None else args.per,
        cost=1 if args.cost is None else args.cost,
        pattern=args.pattern,
        duration=args.duration,
        seed=args.seed,
        offered_rate=args.offered_rate,
        clients=args.clients,
        shared=args.shared,
        replay=args.replay,
        compare=args.compare,
        acquire=args.acquire,
        max_wait=args.max_wait,
    )
    if args.max_wait is not None and not args.acquire:
        usage_error("--max-wait needs --acquire")
    try:
        simulate(
            settings,
            out,
            ascii_only=args.ascii or not _draws_blocks(out),
            output_format=args.format,
            plot=args.plot,
        )
    except SimulationError as problem:
        usage_error(str(problem))
    return 0


def _run_permits(
    args: argparse.Namespace, out: TextIO, usage_error: Callable[[str], NoReturn]
) -> int:
    """The concurrency mode (``--concurrency N``)."""
    for option in ("capacity", "rate", "per", "cost"):
        if getattr(args, option) is not None:
            usage_error(f"--{option} is the token bucket's: --concurrency takes none")
    if args.acquire or args.compare is not None:
        usage_error("--concurrency goes without --acquire and --compare")
    if args.service is None:
        usage_error("--concurrency needs --service SECONDS (how long a request runs)")
    settings = PermitSettings(
        concurrency=args.concurrency,
        service=args.service,
        service_dist=args.service_dist or "fixed",
        ttl=60 if args.ttl is None else args.ttl,
        max_wait=0.0 if args.max_wait is None else args.max_wait,
        pattern=args.pattern,
        duration=args.duration,
        seed=args.seed,
        offered_rate=args.offered_rate,
        clients=args.clients,
        shared=args.shared,
        replay=args.replay,
    )
    try:
        simulate_permits(
            settings,
            out,
            ascii_only=args.ascii or not _draws_blocks(out),
            output_format=args.format,
            plot=args.plot,
        )
    except SimulationError as problem:
        usage_error(str(problem))
    return 0


def _draws_blocks(stream: object) -> bool:
    """Whether the stream can encode the block characters of the chart."""
    try:
        "█▁".encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True
