"""What one redis-server spends per call, read from the server itself.

Used by ``benches.redis_scale`` and ``benches.script_study``: a server of our
own (the tests' runner, tests/support/redis_servers.py: loopback, a free port,
no persistence), optionally with redis-cell loaded, and the two readings:

- :func:`server_us`: ``CONFIG RESETSTAT``, ``calls`` calls, then ``INFO
  commandstats``. Redis counts every command it runs, those a script or a module
  runs too (inside EVALSHA's own time). The time of a decision is the time of
  the commands the *client* sent (``top``: EVALSHA/EVAL, or a module's command),
  so each inner command is counted once, inside its script; the inner commands
  are reported as counts per call, not added.
- :func:`server_cpu`: ``used_cpu_sys + used_cpu_user`` of ``INFO cpu``: the
  server process's CPU, network I/O included.

Run as a module from the repository root (``python -m benches.redis_scale``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.support.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
#: EVALSHA and EVAL: the commands a script-based limiter sends.
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro")
#: redis-cell, built from its crate (crates.io) by :func:`redis_cell_module`.
REDIS_CELL_VERSION = "0.2.2"


def load() -> str:
    """The load average now, as ``uptime`` prints it."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def redis_cell_module(log: Callable[[str], None] = print) -> Path | None:
    """``libredis_cell.so``, built once under target/redis-cell from the crate's
    source as cargo fetches it; None (and why, through ``log``) if it cannot be had."""
    built = ROOT / "target" / "redis-cell" / "target" / "release" / "libredis_cell.so"
    if built.exists():
        return built
    cargo = shutil.which("cargo")
    if cargo is None:
        log("  note: redis-cell not measured: no cargo to build it")
        return None
    work = ROOT / "target" / "redis-cell"
    try:
        # A throw-away manifest that depends on the crate: `cargo fetch` brings its
        # source into cargo's registry, which is then built on its own (a dylib).
        with tempfile.TemporaryDirectory(prefix="redis-cell-fetch-") as scratch:
            manifest = Path(scratch) / "Cargo.toml"
            manifest.write_text(
                '[package]\nname = "fetch-redis-cell"\nversion = "0.0.0"\nedition = "2021"\n'
                f'[dependencies]\nredis-cell = "={REDIS_CELL_VERSION}"\n'
            )
            (Path(scratch) / "src").mkdir()
            (Path(scratch) / "src" / "lib.rs").write_text("")
            subprocess.run(
                [cargo, "fetch", "--manifest-path", str(manifest)],
                check=True,
                capture_output=True,
                timeout=300,
            )
        home = Path(os.environ.get("CARGO_HOME", Path.home() / ".cargo"))
        sources = sorted(home.glob(f"registry/src/*/redis-cell-{REDIS_CELL_VERSION}"))
        if not sources:
            log("  note: redis-cell not measured: cargo fetched no source for it")
            return None
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(sources[0], work)
        log(f"  building redis-cell {REDIS_CELL_VERSION} (cargo build --release) ...")
        subprocess.run(
            [cargo, "build", "--release", "--quiet"],
            cwd=work,
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log(f"  note: redis-cell not measured: its build failed ({e}) {detail[-500:]!r}")
        return None
    return built if built.exists() else None


def start_server(directory: Path, module: Path | None = None) -> RedisServer:
    """A redis-server of our own on a free loopback port (stopped by the caller)."""
    extra = ["--loadmodule", str(module)] if module is not None else []
    return RedisServer(directory, extra_args=extra).start()


def client(port: int, **options: Any) -> redis.Redis:
    """One connection, no pool checkout per command (as benches/peers.py)."""
    return redis.Redis(host="127.0.0.1", port=port, single_connection_client=True, **options)


@dataclass
class Cost:
    """What the server spent on ``calls`` calls."""

    calls: int
    us_per_call: float  # the commands the client sent (inner commands inside them)
    inner_per_call: dict[str, float]  # every other command the server counted, per call
    top_per_call: float  # how many client commands per call (1.0 for one EVALSHA)
    cpu_us_per_call: float  # the server's CPU (INFO cpu), its network I/O included


def commandstats(admin: redis.Redis) -> dict[str, tuple[int, int]]:
    """command -> (calls, usec) since the last CONFIG RESETSTAT."""
    stats: dict[str, dict[str, float]] = admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in stats.items()
        if not name.startswith("cmdstat_config")
    }


def server_us(
    admin: redis.Redis, run: Callable[[], object], calls: int, top: Iterable[str] = SCRIPT_COMMANDS
) -> Cost:
    """``run()`` makes ``calls`` calls; what the server spent on them."""
    top = set(top)
    admin.config_resetstat()
    cpu = server_cpu(admin)
    run()
    cpu = server_cpu(admin) - cpu
    stats = commandstats(admin)
    stats.pop("info", None)  # ours, around the run
    us = sum(usec for name, (_, usec) in stats.items() if name in top)
    sent = sum(n for name, (n, _) in stats.items() if name in top)
    inner = {name: n / calls for name, (n, _) in stats.items() if name not in top}
    return Cost(calls, us / calls, inner, sent / calls, cpu * 1e6 / calls)


def server_cpu(admin: redis.Redis) -> float:
    """The server's CPU seconds so far (system + user)."""
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


@dataclass
class Summary:
    """A subject's server cost over interleaved batches."""

    us: float  # median over batches of the per-call time
    q25_us: float  # lower quartile: the cost when the machine let the server run
    min_us: float
    cpu_us: float  # median server CPU per call
    inner_per_call: dict[str, float]
    batches: int


def quartile(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def sample(
    admin: redis.Redis,
    subjects: dict[str, tuple[Callable[[], object], int, tuple[str, ...]]],
    batches: int,
) -> dict[str, Summary]:
    """Interleaved at the finest grain: each round runs one batch of every subject,
    the order shifted by one each round. ``subjects``: name -> (run one batch, calls
    in a batch, the commands the client sends). A noisy moment (another process on
    the server's CPU) lands on one batch of one subject, and the median over
    batches drops it; the lower quartile is what the server costs when it runs
    undisturbed."""
    names = list(subjects)
    costs: dict[str, list[Cost]] = {name: [] for name in names}
    for b in range(batches):
        k = b % len(names)
        for name in names[k:] + names[:k]:
            run, calls, top = subjects[name]
            costs[name].append(server_us(admin, run, calls, top))
    out = {}
    for name, cs in costs.items():
        us = [c.us_per_call for c in cs]
        out[name] = Summary(
            us=statistics.median(us),
            q25_us=quartile(us),
            min_us=min(us),
            cpu_us=statistics.median(c.cpu_us_per_call for c in cs),
            inner_per_call=cs[-1].inner_per_call,
            batches=batches,
        )
    return out


def own_form(template: str, capacity: int, unit: int, p: int) -> str:
    """An older bucket.lua's (or a study variant's) own form for one limiter: its line
    marked ``config`` given the three numbers (those scripts read exactly three
    there), comment lines dropped."""
    lines = []
    for line in template.splitlines():
        if line.rstrip().endswith("-- config"):
            line = line.split("=", 1)[0] + f"= {capacity}, {unit}, {p}"
        if line.strip() and not line.lstrip().startswith("--"):
            lines.append(line)
    return "\n".join(lines) + "\n"
