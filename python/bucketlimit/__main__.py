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
from bucketlimit._simulate import command as simulate_command


class _Parser(argparse.ArgumentParser):
    """Reports a usage error as one line on stderr and exits with status 2.

    argparse would print the whole usage first; one line is easier to read in
    a script's log and easy to test. Sub-command parsers share this class.
    """

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # never more than one line
        self.exit(2, f"bucketlimit: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    program = _program()
    parser = _Parser(
        prog=program,
        description="bucketlimit: a token-bucket rate limiter.",
        epilog=f"Run '{program} COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"bucketlimit {__version__}")
    # Not required by argparse: without a command, main prints the help (argparse
    # would print one line naming a missing COMMAND, and no usage).
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    simulate = commands.add_parser(
        "simulate", help=simulate_command.HELP, description=simulate_command.DESCRIPTION
    )
    simulate_command.add_arguments(simulate)

    bench = commands.add_parser(
        "bench",
        help="measure ns per allow() and bytes per key, next to a pure-Python bucket",
        description="Times allow() from a Python loop on 1 key and on 10,000 keys, with "
        "traffic mostly allowed and mostly refused, three ways: bucketlimit with its Rust "
        "clock, bucketlimit with time.monotonic, and a pure-Python token bucket with a "
        "Lock. Prints the median ns per call of several runs, the loop's own cost, and "
        "the bytes per key at 1,000,000 keys (RSS growth in a fresh process). A "
        "measurement of this machine, not a test: run it where the service runs.",
    )
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer repetitions and calls")
    size.add_argument("--smoke", action="store_true", help="a few thousand calls: checks it runs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2: a usage error)."""
    try:
        status = _run(argv)
        sys.stdout.flush()  # inside the try: a closed pipe fails here, not at exit
    except BrokenPipeError:
        # The reader left early (`... | head`): stop quietly, as other command-line
        # tools do, with status 1. Python would flush stdout again at exit and
        # print a second error: point it at /dev/null first (the recipe of the
        # signal module's documentation, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return status


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        sys.stderr.write(parser.format_help() + "\n")
        parser.error("no command given: choose simulate or bench")
    if args.command == "bench":
        from bucketlimit._bench import bench  # only this command needs it

        bench("smoke" if args.smoke else "quick" if args.quick else "full", sys.stdout)
        return 0
    return simulate_command.run(args, sys.stdout, parser.error)


def _program() -> str:
    """``bucketlimit`` when run as the console script, else ``python -m bucketlimit``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "bucketlimit" if name in ("bucketlimit", "bucketlimit.exe") else "python -m bucketlimit"


if __name__ == "__main__":
    sys.exit(main())
