"""Measures what the stable ABI costs: ns per ``allow()``, per-version build vs abi3.

    python scripts/compare_abi3.py [--rounds 8] [--workdir DIR]

Builds two release wheels of this checkout for the running interpreter, one for
its version only (``--no-default-features``) and one with the ``abi3`` feature
(the default, see Cargo.toml), installs each into its own virtual environment,
then times both in interleaved rounds (ABBA order, so drift and a neighbour's
load fall on both alike). Each figure is the median of one fresh interpreter's
timed loops (``bucketlimit._bench.ns_per_call``); the table gives, per workload,
each build's median over the rounds and the spread of the per-round ratio.

A measurement, not a test: run it on a quiet machine. Needs Rust and maturin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs inside each build's environment: one JSON line of ns per allow() by workload.
PROBE = """
import json
from bucketlimit import TokenBucketLimiter
from bucketlimit._bench import WORKLOADS, ns_per_call
out = {}
for name, (n_keys, capacity, rate) in WORKLOADS.items():
    keys = [f"user-{i:05d}" for i in range(n_keys)]
    out[name] = ns_per_call(TokenBucketLimiter(capacity, rate).allow, keys * (200_000 // n_keys), 5)
print(json.dumps(out))
"""

BUILDS = {"per-version": ["--no-default-features"], "abi3-py310": []}


def build(workdir: Path) -> dict[str, Path]:
    """One environment per build, each with its wheel installed; their Pythons."""
    pythons = {}
    for name, flags in BUILDS.items():
        out = workdir / name
        subprocess.run(
            [
                "maturin",
                "build",
                "--release",
                "--quiet",
                "-i",
                sys.executable,
                "-o",
                str(out),
                *flags,
            ],
            cwd=ROOT,
            check=True,
        )
        (wheel,) = out.glob("*.whl")
        env = workdir / f"venv-{name}"
        venv.create(env, with_pip=True)
        python = env / "bin" / "python"
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
        print(f"{name}: {wheel.name}", flush=True)
        pythons[name] = python
    return pythons


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--workdir", type=Path, help="keep the builds here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        pythons = build(workdir)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in pythons}
        names = list(pythons)
        for i in range(args.rounds):
            for name in names if i % 2 == 0 else reversed(names):
                run = subprocess.run(
                    [pythons[name], "-c", PROBE], capture_output=True, text=True, check=True
                )
                results[name].append(json.loads(run.stdout))
            print(f"round {i + 1}/{args.rounds} done", flush=True)
    base, other = names
    print(f"\nns per allow(), median of {args.rounds} interleaved rounds; ratio = {other}/{base}")
    print(f"{'workload':<30}{base:>12}{other:>12}{'ratio':>8}{'ratio min..max':>18}")
    for workload in results[base][0]:
        a = [r[workload] for r in results[base]]
        b = [r[workload] for r in results[other]]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        print(
            f"{workload:<30}{statistics.median(a):>12.1f}{statistics.median(b):>12.1f}"
            f"{statistics.median(ratios):>8.3f}{min(ratios):>9.3f}..{max(ratios):.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
