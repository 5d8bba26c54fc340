"""The Redis/Valkey module next to the Lua scripts (docs/redis.md, "The module"). Prints.

Two measures, on one redis-server of our own with the module loaded:

- Server µs per decision (INFO commandstats, interleaved batches, one connection,
  1,000 keys): the module's command vs our Lua script vs limits' fixed window vs a
  trivial script (``return 1``), for allow, reserve and a permit's acquire.
- Decisions per second one Redis core sustains, many clients pipelining
  (``redis-benchmark -c 50 -P 64``, random keys of 1,000): the module's allow vs
  the script's own form (EVALSHA, one key, no argument: the common call).

    python -m benches.redis_module [--quick]
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis

import bucketlimit
from benches import peers
from benches.server_stats import client, load, sample, start_server
from bucketlimit.redis import RedisConcurrencyLimiter, RedisTokenBucketLimiter, module_path

KEYS = [f"k{i}" for i in range(1000)]
LUA = ("evalsha", "eval")


def subjects(port: int, calls: int) -> dict[str, tuple[Any, int, tuple[str, ...]]]:
    """name -> (one batch of ``calls`` calls, calls, the commands the client sends)."""
    conn = client(port)
    out: dict[str, tuple[Any, int, tuple[str, ...]]] = {}

    def batch(call: Any) -> Any:
        def run() -> None:
            for i in range(calls):
                call(KEYS[i % len(KEYS)])

        return run

    for engine in ("module", "lua"):
        # A large bucket refilling fast: every allow and reservation is granted at
        # once, so the figures are the common decision's.
        bucket = RedisTokenBucketLimiter(
            conn, 10**6, 10**6, prefix=f"{engine}:", engine=engine, refusal_cache=False
        )
        top = ("bucketlimit.allow",) if engine == "module" else LUA
        out[f"{engine} allow"] = (batch(bucket.allow), calls, top)
        top = ("bucketlimit.reserve",) if engine == "module" else LUA
        out[f"{engine} reserve"] = (batch(bucket.reserve), calls, top)
        permits = RedisConcurrencyLimiter(conn, 10**6, ttl=60, prefix=f"{engine}-p:", engine=engine)
        top = ("bucketlimit.take",) if engine == "module" else LUA
        out[f"{engine} permit acquire"] = (batch(permits.try_acquire), calls, top)
    fixed = peers.limits_fixed_redis(peers.Quota(capacity=10**9, rate=1, per=3600), port)
    out["limits fixed window"] = (batch(fixed.allow), calls, LUA)
    trivial = conn.register_script("return 1")
    out["trivial script"] = (batch(lambda key: trivial(keys=[key])), calls, LUA)
    return out


def throughput(port: int, seconds_each: int) -> dict[str, float]:
    """Decisions a second, ``redis-benchmark`` pipelining from 50 clients."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        print("  redis-benchmark is missing (apt-get install -y redis-tools): not measured")
        return {}
    conn = redis.Redis(port=port)
    lua = RedisTokenBucketLimiter(conn, 10**6, 10**6, prefix="lua-tp:", engine="lua")
    sha = conn.script_load(lua._state.own.source)
    p, unit = lua._state.p, lua._state.unit
    config = [str(10**6), str(unit), str(p)]
    commands = {
        "module allow": ["BUCKETLIMIT.ALLOW", "m:__rand_int__", "", *config, "1"],
        "Lua allow": ["EVALSHA", sha, "1", "l:__rand_int__"],
    }
    out = {}
    for name, argv in commands.items():
        requests = 400_000 * seconds_each
        done = subprocess.run(
            [binary, "-p", str(port), "-c", "50", "-P", "64", "-r", "1000", "-n", str(requests),
             "-q", "--csv", *argv],
            capture_output=True, text=True, timeout=120 + 30 * seconds_each, check=True,
        )  # fmt: skip
        found = re.findall(r'"([0-9.]+)"', done.stdout.splitlines()[-1])
        out[name] = float(found[0]) if found else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    args = parser.parse_args()
    batches, calls, seconds = (6, 500, 1) if args.quick else (30, 2000, 3)
    with tempfile.TemporaryDirectory(prefix="bench-module-") as directory:
        server = start_server(Path(directory), Path(module_path()))
        try:
            admin = redis.Redis(port=server.port)
            version = admin.info("server")["redis_version"]
            print(
                f"bucketlimit {bucketlimit.__version__}, redis-server {version}, "
                f"Python {platform.python_version()}, load before {load()}"
            )
            results = sample(admin, subjects(server.port, calls), batches)
            limits = results["limits fixed window"].us
            print(f"\nServer µs per decision ({batches} interleaved batches of {calls} calls,")
            print("median [lower quartile]; x: the median over limits' fixed window's)")
            for name, summary in results.items():
                print(
                    f"  {name:24} {summary.us:6.2f} [{summary.q25_us:5.2f}]"
                    f"  {summary.us / limits:5.2f}x limits"
                )
            for what in ("allow", "reserve", "permit acquire"):
                ratio = results[f"lua {what}"].us / results[f"module {what}"].us
                print(f"  {what}: the module is {ratio:.1f}x below our Lua")
            print(f"load after the server figures {load()}")
            rates = throughput(server.port, seconds)
            if rates:
                print("\nDecisions a second, one server core, redis-benchmark -c 50 -P 64:")
                for name, rate in rates.items():
                    print(f"  {name:24} {rate:12,.0f}")
                print(f"load after {load()}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
