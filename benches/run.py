"""bucketlimit's side-by-side benchmarks: one command, from a clean clone.

    python benches/run.py            # about 5-10 minutes
    python benches/run.py --quick    # a smoke run of about a minute

Run with any Python >= 3.10; it prepares its own environment first:

1. a virtual environment at benches/.venv (``--venv`` or
   $BUCKETLIMIT_BENCH_VENV to use another), with the peers and tools of
   benches/requirements.txt and hiredis if it installs;
2. bucketlimit and the PyO3 floor (benches/floor) built in release mode with
   maturin and installed there;
3. then it runs itself inside that environment and measures:
   - in-process ``allow()`` next to the floor, the baselines and the peers'
     in-memory modes, at 1 and 10,000 keys, mostly allowed and mostly refused;
   - bytes per key held at 1,000,000 keys, each library in a fresh process;
   - the slowest single call while 1,000,000 idle keys are evicted;
   - Redis: one local redis-server started here on a free loopback port, one
     connection, with and without hiredis;
   and writes docs/benchmarks.md and docs/benchmarks.png.

Timings are interleaved: each repetition runs every library once, round
robin, and the figure is the median over repetitions. Figures are what a
Python caller pays, loop included; ratios compare rows of the same run. This
is a measurement, never a test: nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import Any

BENCHES = Path(__file__).resolve().parent
ROOT = BENCHES.parent
DEFAULT_VENV = BENCHES / ".venv"
INSIDE = "BUCKETLIMIT_BENCH_INSIDE"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~1 minute smoke run")
    parser.add_argument(
        "--venv",
        type=Path,
        default=Path(os.environ.get("BUCKETLIMIT_BENCH_VENV", DEFAULT_VENV)),
        help="the benchmark's virtual environment (created if missing)",
    )
    parser.add_argument("--no-build", action="store_true", help="use the installed wheels")
    parser.add_argument(
        "--sections",
        default="inproc,memory,eviction,redis",
        help="comma-separated subset of inproc,memory,eviction,redis",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs", help="where benchmarks.md/.png go"
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    return parser.parse_args()


# --- step 1 and 2: the environment ---------------------------------------------


def sh(*cmd: str | Path, cwd: Path = ROOT) -> None:
    print("  $", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), cwd=cwd, check=True)


def prepare(args: argparse.Namespace) -> Path:
    """Creates or updates the benchmark environment; returns its python."""
    venv: Path = args.venv.resolve()
    python = venv / "bin" / "python"
    print(f"== environment: {venv}", flush=True)
    if not python.exists():
        sh(sys.executable, "-m", "venv", venv)
    requirements = BENCHES / "requirements.txt"
    # Reinstall only when the requirements change.
    stamp = (
        venv / f".bench-requirements-{hashlib.sha256(requirements.read_bytes()).hexdigest()[:16]}"
    )
    if not stamp.exists():
        sh(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
        sh(python, "-m", "pip", "install", "-q", "-r", requirements)
        # Optional: the Redis rows are measured with and without it.
        hiredis = subprocess.run([python, "-m", "pip", "install", "-q", "hiredis"], check=False)
        if hiredis.returncode != 0:
            print("  note: hiredis did not install; Redis runs with redis-py's own parser only")
        stamp.touch()
    if not args.no_build:
        build(venv)
    return python


def build(venv: Path) -> None:
    """Release wheels of bucketlimit and the floor, installed into the venv."""
    maturin = venv / "bin" / "maturin"
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    with tempfile.TemporaryDirectory(prefix="bucketlimit-bench-") as wheels:
        sh(maturin, "build", "--release", "--quiet", "-o", wheels, cwd=ROOT)
        sh(
            maturin,
            "build",
            "--release",
            "--quiet",
            "-o",
            wheels,
            "--target-dir",
            target / "bench-floor",
            cwd=BENCHES / "floor",
        )
        found = sorted(Path(wheels).glob("*.whl"))
        sh(
            venv / "bin" / "python",
            "-m",
            "pip",
            "install",
            "-q",
            "--force-reinstall",
            "--no-deps",
            *found,
        )


# --- step 3: measurements --------------------------------------------------------


class Settings:
    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.reps = 3 if quick else 7
        self.seconds = 0.02 if quick else 0.12  # per timing
        self.memory_keys = 100_000 if quick else 1_000_000
        self.eviction_calls = 40_000 if quick else 400_000
        self.redis_rounds = 1 if quick else 2
        self.redis_reps = 2 if quick else 5
        self.redis_seconds = 0.03 if quick else 0.12


def machine() -> dict[str, Any]:
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for dist in [
        "bucketlimit",
        "bucketlimit-floor",
        "token-bucket",
        "limits",
        "pyrate-limiter",
        "throttled-py",
        "redis",
        "hiredis",
    ]:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    redis_server = shutil.which("redis-server")
    if redis_server:
        out = subprocess.run([redis_server, "--version"], capture_output=True, text=True).stdout
        versions["redis-server"] = next(
            (w.split("=")[1] for w in out.split() if w.startswith("v=")), out.strip()
        )
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_before": tuple(round(x, 2) for x in os.getloadavg()),
        "versions": versions,
    }


WORKLOADS = [
    ("1 key, mostly allowed", 1, "allowed"),
    ("1 key, mostly refused", 1, "refused"),
    ("10,000 keys, mostly allowed", 10_000, "allowed"),
    ("10,000 keys, mostly refused", 10_000, "refused"),
]


def keys_for(n: int) -> list[str]:
    # Always 10,000 entries, so every row iterates the same list length;
    # 10-byte keys.
    if n == 1:
        return ["user-00000"] * 10_000
    return [f"user-{i:05d}" for i in range(n)]


def run_loop(allow: Callable[[str], object], keys: list[str], loops: int) -> int:
    """Calls allow once per key, `loops` times; returns nanoseconds."""
    start = time.perf_counter_ns()
    for _ in range(loops):
        for k in keys:
            allow(k)
    return time.perf_counter_ns() - start


def inproc(settings: Settings) -> dict[str, Any]:
    import peers

    print("\n== in-process allow(): ns per call (median of repetitions)", flush=True)
    cases = []  # (workload, library, subject, keys, loops)
    for workload, n, mode in WORKLOADS:
        quota = peers.ALLOWED if mode == "allowed" else peers.REFUSED
        keys = keys_for(n)
        distinct = sorted(set(keys))
        for library, (factory, _kind) in peers.IN_MEMORY.items():
            subject = factory(quota)
            if mode == "refused":
                for k in distinct:
                    subject.allow_cost(k, quota.capacity)  # drain
            per_call = run_loop(subject.allow, keys, 1) / len(keys)  # warm-up and estimate
            loops = max(1, round(settings.seconds * 1e9 / (per_call * len(keys))))
            cases.append((workload, library, subject, keys, loops))

    timings: dict[tuple[str, str], list[float]] = {(c[0], c[1]): [] for c in cases}
    for rep in range(settings.reps):
        for workload, _, _ in WORKLOADS:
            turn = [c for c in cases if c[0] == workload]
            # Round robin across libraries, starting one later each repetition.
            shift = rep % len(turn)
            for _, library, subject, keys, loops in turn[shift:] + turn[:shift]:
                gc.collect()
                # limits' MemoryStorage expires keys from a threading.Timer
                # 10 ms after its last call: let it run now, not during the
                # next library's timing.
                time.sleep(0.03)
                elapsed = run_loop(subject.allow, keys, loops)
                timings[(workload, library)].append(elapsed / (loops * len(keys)))
        print(f"  repetition {rep + 1}/{settings.reps} done", flush=True)

    # An empty loop over the same list: the share of every figure that is
    # the benchmark's own `for` loop.
    loop_ns = median(run_loop(lambda _k: None, keys_for(1), 20) / 200_000 for _ in range(5))

    results: dict[str, Any] = {"loop_ns": loop_ns, "workloads": {}}
    for workload, _, _ in WORKLOADS:
        rows: dict[str, dict[str, Any]] = {}
        for _, library, subject, keys, _loops in [c for c in cases if c[0] == workload]:
            answers = [subject.allow(k) for k in keys[:2000]]
            ns = timings[(workload, library)]
            rows[library] = {
                "ns": median(ns),
                "min_ns": min(ns),
                "max_ns": max(ns),
                "allowed": sum(map(subject.allowed, answers)) / len(answers),
                "kind": peers.IN_MEMORY[library][1],
            }
        floor = rows["PyO3 floor (no-op allow)"]["ns"]
        for row in rows.values():
            row["x_floor"] = row["ns"] / floor
        results["workloads"][workload] = rows
    for _, _, subject, _, _ in cases:
        subject.close()
    print_table_inproc(results)
    return results


def print_table_inproc(results: dict[str, Any]) -> None:
    workloads = list(results["workloads"])
    libraries = list(results["workloads"][workloads[0]])
    print(f"  {'':36}" + "".join(f"{w:>30}" for w in workloads))
    for library in libraries:
        cells = []
        for w in workloads:
            r = results["workloads"][w][library]
            cells.append(f"{r['ns']:>9,.0f} ns {r['x_floor']:>6.2f}x {r['allowed']:>5.0%} ok")
        print(f"  {library:36}" + "".join(f"{c:>30}" for c in cells))
    print(f"  (the benchmark's own empty loop costs {results['loop_ns']:.0f} ns per call)")


def worker(*args: str | float) -> Any:
    out = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=BENCHES,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        print(out.stdout + out.stderr)
        raise RuntimeError(f"{args} failed")
    for line in out.stdout.splitlines():
        if not line.startswith("{"):
            print(f"  {line}")
    return json.loads(out.stdout.splitlines()[-1])


MEMORY_LIBRARIES = [
    "bucketlimit",
    "naive Rust Mutex<HashMap>",
    "pure Python + lock",
    "token-bucket",
    "limits fixed window",
    "limits sliding window counter",
    "pyrate-limiter token bucket",
    "throttled-py token bucket",
]


def memory(settings: Settings) -> dict[str, Any]:
    n = settings.memory_keys
    print(f"\n== memory: bytes per key held at {n:,} keys of 10 bytes (fresh process each)")
    results = {}
    for library in MEMORY_LIBRARIES:
        r = worker("memory.py", "bytes-per-key", library, n)
        results[library] = r
        print(
            f"  {library:36} {r['bytes_per_key']:>8.1f} B/key"
            f"   (filled in {r['fill_seconds']:.1f} s)"
        )
    return {"keys": n, "libraries": results}


def eviction(settings: Settings) -> dict[str, Any]:
    n, calls = settings.memory_keys, settings.eviction_calls
    print(f"\n== eviction: each of {calls:,} calls timed while {n:,} idle keys are forgotten")
    r: dict[str, Any] = worker("memory.py", "eviction", n, calls)
    for label, key in [
        ("filling the table", "fill"),
        ("during eviction", "during_eviction"),
        ("during eviction, on-CPU calls", "during_eviction_on_cpu"),
        ("control: no idle keys", "control"),
    ]:
        s = r[key]
        print(
            f"  {label:32} median {s['median_ns']:>7,.0f} ns  p99 {s['p99_ns']:>8,.0f} ns"
            f"  p99.9 {s['p999_ns']:>9,.0f} ns  max {s['max_ns']:>12,.0f} ns"
            f"  ({s['max_ns'] / s['median_ns']:,.0f}x median)"
        )
    print(
        f"  held {r['held_after_fill']:,} keys after the fill, {r['held_after_calls']:,} after"
        f" the calls ({r['evicted']:,} evicted);"
        f" {r['during_eviction_on_cpu']['descheduled_calls']} calls were descheduled by the OS"
    )
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_section(settings: Settings) -> dict[str, Any] | None:
    print("\n== Redis: one local redis-server, one connection: us per call")
    server = shutil.which("redis-server")
    if server is None:
        print("  note: redis-server is not installed; Redis section skipped")
        return None
    try:
        import bucketlimit.redis  # noqa: F401
    except ImportError as e:
        print(f"  note: bucketlimit.redis is not available yet ({e}); only raw rows are measured")
    port = free_port()
    # The server and the client share one CPU. On a virtual machine a reply
    # that wakes a process on another, idle CPU can cost tens of microseconds
    # that vary from run to run; on one CPU the figures measure the commands.
    cpu = max(os.sched_getaffinity(0))
    print(f"  (redis-server {port} and the client pinned to CPU {cpu})")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )
    try:
        wait_for(port)
        results: dict[str, Any] = {}
        parsers = ["hiredis", "python"]
        if metadata_version("hiredis") is None:
            parsers = ["python"]
            print("  note: hiredis is not installed; measured with redis-py's own parser only")
        # Each parser's process runs `redis_rounds` times, alternating, and
        # the repetitions of all rounds are pooled: a noisy minute then
        # spreads over both parsers instead of landing on one.
        for _ in range(settings.redis_rounds):
            for parser in parsers:
                try:
                    r = worker(
                        "redis_bench.py",
                        port,
                        parser,
                        settings.redis_reps,
                        settings.redis_seconds,
                        cpu,
                    )
                except RuntimeError as e:
                    # The other sections still get written; the verdicts say
                    # what was not measured.
                    print(f"  note: the Redis worker failed ({e}); see its output above")
                    continue
                if "error" in r:
                    print(f"  note: {r['error']}")
                    continue
                results[parser] = merge_rounds(results.get(parser), r)
        for r in results.values():
            print_table_redis(r)
        return results
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def merge_rounds(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Pools the timed repetitions of two runs; the rest comes from the later."""
    if before is None:
        return after
    for workload, rows in after["workloads"].items():
        for name, row in rows.items():
            samples = before["workloads"][workload][name]["samples_us"] + row["samples_us"]
            row.update(
                samples_us=samples, us=median(samples), min_us=min(samples), max_us=max(samples)
            )
    return after


def metadata_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def wait_for(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not answer on port {port}")


def print_table_redis(r: dict[str, Any]) -> None:
    print(f"  parser: {r['parser']}")
    for workload, rows in r["workloads"].items():
        base = rows["EVALSHA trivial script (return {1,0})"]["us"]
        abase = rows["async EVALSHA trivial script"]["us"]
        print(f"   {workload}")
        for name, row in rows.items():
            ref = abase if "async" in row["kind"] else base
            server = row["server_us_per_call"].get("evalsha")
            server_text = f"server {server:5.1f} us" if server is not None else ""
            print(
                f"     {name:50} {row['us']:7.1f} us  {row['us'] / ref:5.2f}x"
                f"  {row['allowed']:>5.0%} ok  {server_text}"
            )


def main() -> None:
    args = parse_args()
    if os.environ.get(INSIDE) != "1":
        python = prepare(args)
        os.execve(
            python,
            [str(python), str(Path(__file__).resolve()), *sys.argv[1:]],
            {**os.environ, INSIDE: "1"},
        )
    import report  # benches/report.py: run as a script, its directory is on sys.path

    settings = Settings(args.quick)
    sections = set(args.sections.split(","))
    env = machine()
    print("\n== machine")
    print(f"  {env['python']} on {env['platform']}")
    print(f"  CPU: {env['cpu']}, {env['cores']} cores; load average {env['load_before']}")
    for dist, version in env["versions"].items():
        print(f"  {dist} {version}")
    started = time.monotonic()
    results: dict[str, Any] = {"machine": env, "quick": args.quick}
    if "inproc" in sections:
        results["inproc"] = inproc(settings)
    if "memory" in sections:
        results["memory"] = memory(settings)
    if "eviction" in sections:
        results["eviction"] = eviction(settings)
    if "redis" in sections:
        results["redis"] = redis_section(settings)
    env["load_after"] = tuple(round(x, 2) for x in os.getloadavg())
    env["seconds"] = time.monotonic() - started
    verdicts = report.targets(results)
    print("\n== targets")
    for v in verdicts:
        print(f"  {v['verdict']:4}  {v['target']}: {v['measured']}")
    print(f"\n  load average at the end {env['load_after']}; measured in {env['seconds']:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_markdown(results, verdicts, args.out / "benchmarks.md")
    report.write_chart(results, args.out / "benchmarks.png")
    print(f"  wrote {args.out / 'benchmarks.md'} and {args.out / 'benchmarks.png'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
