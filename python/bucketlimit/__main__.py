"""The command line: ``python -m bucketlimit {simulate,bench}``, or ``bucketlimit``.

``simulate`` shows what capacity and rate do to a stream of requests;
``bench`` measures the cost of a decision. Run either with ``--help``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from bucketlimit import __version__
from bucketlimit._simulate import (
    COMPARISONS,
    FORMATS,
    PATTERNS,
    Settings,
    SimulationError,
    simulate,
)


class _Parser(argparse.ArgumentParser):
    """Reports a usage error as one line on stderr and exits with status 2.

    argparse would print the whole usage first; one line is easier to read in
    a script's log and easy to test. Sub-command parsers share this class.
    """

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # never more than one line
        self.exit(2, f"bucketlimit: error: {message}\n")


def _number(text: str) -> int | float:
    """An int when the text is one (exact in the limiter and in the report), else a float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=_program(), description="bucketlimit: a token-bucket rate limiter.")
    parser.add_argument("--version", action="version", version=f"bucketlimit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = commands.add_parser(
        "simulate",
        help="replay traffic through a limiter and chart what it admits",
        description="Replays traffic (made up, or read from a CSV file) through a real "
        "TokenBucketLimiter on a manual clock (no sleeping) and reports what it admitted: "
        "as text with a chart over time, as JSON or CSV, or as a PNG picture.",
    )
    sim.add_argument("--capacity", type=int, required=True, help="bucket size in tokens")
    sim.add_argument("--rate", type=_number, required=True, help="tokens refilled per --per")
    sim.add_argument("--per", type=_number, default=1, help="seconds (default 1)")
    sim.add_argument("--cost", type=int, default=1, help="tokens per request (default 1)")
    sim.add_argument(
        "--pattern",
        choices=PATTERNS,
        default=None,
        help="steady: evenly spaced requests; burst: idle, then bursts of twice what a "
        "full bucket admits at one instant; poisson: random exponential gaps; boundary: a "
        "full bucket's worth just before and just after every capacity/rate seconds "
        "(a fixed window's worst case). Required unless --replay",
    )
    sim.add_argument(
        "--duration",
        type=_number,
        default=None,
        help="seconds of traffic (required unless --replay, which defaults to the file's)",
    )
    sim.add_argument("--seed", type=int, default=0, help="random seed for poisson (default 0)")
    sim.add_argument(
        "--offered-rate",
        type=float,
        default=None,
        help="average requests per second offered (default: twice what the limit sustains)",
    )
    sim.add_argument(
        "--clients",
        type=int,
        default=1,
        help="N clients, each with its own key: client-1 sends --pattern, the others "
        "steady traffic at half the limit (the noisy neighbour); default 1",
    )
    sim.add_argument(
        "--shared",
        action="store_true",
        help="all clients spend from one bucket (a global limit) instead of one each",
    )
    sim.add_argument(
        "--replay",
        metavar="FILE",
        default=None,
        help="read the requests from a CSV file: a time per row (seconds or ISO 8601), "
        "then optionally a key and a cost; a header row may name time,key,cost",
    )
    sim.add_argument(
        "--compare",
        choices=COMPARISONS,
        default=None,
        help="also run the same requests through a fixed window of capacity tokens per "
        "capacity/rate seconds, and show both",
    )
    sim.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text (default): a report with charts; json: the numbers; csv: one row per "
        "request with the limiter's answer",
    )
    sim.add_argument(
        "--plot", metavar="FILE.png", default=None, help="also draw a PNG (needs matplotlib)"
    )
    sim.add_argument("--ascii", action="store_true", help="draw the chart with ASCII only")
    sim.add_argument(
        "--acquire",
        action="store_true",
        help="pace the same traffic instead of refusing it: each request reserves and "
        "waits for its tokens; reports the waits and checks the bound",
    )
    sim.add_argument(
        "--max-wait",
        type=float,
        default=None,
        help="with --acquire: the longest a request waits; longer is refused (default: none)",
    )

    bench = commands.add_parser(
        "bench",
        help="measure ns per allow() and bytes per key, next to a pure-Python bucket",
    )
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repetitions and calls")
    size.add_argument("--smoke", action="store_true", help="a few thousand calls: checks it runs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        from bucketlimit._bench import bench  # only this command needs it

        bench("smoke" if args.smoke else "quick" if args.quick else "full", sys.stdout)
        return 0
    if args.replay is None and (args.pattern is None or args.duration is None):
        parser.error("simulate needs --pattern and --duration (or --replay FILE)")
    settings = Settings(
        capacity=args.capacity,
        rate=args.rate,
        per=args.per,
        cost=args.cost,
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
        parser.error("--max-wait needs --acquire")
    try:
        simulate(
            settings,
            sys.stdout,
            ascii_only=args.ascii or not _draws_blocks(sys.stdout),
            output_format=args.format,
            plot=args.plot,
        )
    except SimulationError as error:
        parser.error(str(error))
    return 0


def _program() -> str:
    """``bucketlimit`` when run as the console script, else ``python -m bucketlimit``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "bucketlimit" if name in ("bucketlimit", "bucketlimit.exe") else "python -m bucketlimit"


def _draws_blocks(stream: object) -> bool:
    """Whether the stream can encode the block characters of the chart."""
    try:
        "█▁".encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
