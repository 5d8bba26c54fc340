"""Runs a command several times in a row while a CPU-bound process holds one core.

    python scripts/under_load.py [--runs N] -- COMMAND ...

The suite must pass on a busy machine, not only on an idle one: this starts
``python -c "while True: pass"`` (one core kept busy for the whole time), runs
COMMAND ``N`` times (default 3), stops the busy process, and prints each run's exit
status and wall time. Exits non-zero if any run failed. ``make check-loaded`` runs
the Python suite this way.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

BUSY = [sys.executable, "-c", "while True: pass"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="how many runs in a row (3)")
    parser.add_argument("command", nargs="+", help="the command, after --")
    options = parser.parse_args(argv)
    if options.runs < 1:
        parser.error(f"--runs must be at least 1, got {options.runs}")
    busy = subprocess.Popen(BUSY)
    results: list[tuple[int, float]] = []
    try:
        for run in range(1, options.runs + 1):
            print(f"=== run {run} of {options.runs}, one core busy (pid {busy.pid})", flush=True)
            start = time.monotonic()
            status = subprocess.run(options.command).returncode
            results.append((status, time.monotonic() - start))
    finally:
        busy.kill()
        busy.wait()
    print("\nrun  status  seconds (one core busy)")
    for run, (status, seconds) in enumerate(results, 1):
        print(f"{run:<5}{'passed' if status == 0 else f'rc {status}':<8}{seconds:>7.0f}")
    return 0 if all(status == 0 for status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
