"""Client instructions per Redis call, counted by callgrind (the cost measure of docs/design.md §6).

    python -m benches.client_instructions [--small 2000] [--large 12000] [--what allow,...]

Counts instructions, not seconds, so the figure repeats whatever else the machine
is doing. For each workload it runs a child Python under
``valgrind --tool=callgrind`` twice, making ``--small`` and then ``--large`` calls
after the same warm-up, against its own redis-server on a free loopback port
(one connection, hiredis when installed), and prints
``(instructions(large) - instructions(small)) / (large - small)``: the cost of
one more call in the client process, the interpreter, redis-py and the socket
calls' user-space part included; the server's work is in another process and not
counted. Workloads:

- ``raw``: ``execute_command("EVALSHA", ...)`` of the limiter's own script, as
  ``allow`` sends it;
- ``allow``: ``RedisTokenBucketLimiter.allow`` (1,000 keys round robin, all
  allowed);
- ``batched``: ``AsyncRedisTokenBucketLimiter.allow`` from 64 tasks at a time
  (``batching=True``), per allow;
- ``async``: the same with ``batching=False``, per allow.

``PYTHONHASHSEED=0`` in the children. A measurement, never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from benches.redis_reserve import start_server

CHILD = r"""
import asyncio, sys
import redis, redis.asyncio
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter

what, port, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keys = [f"user-{i:04d}" for i in range(1000)]
capacity, rate = 10**6, 10**6
if what in ("raw", "allow"):
    client = redis.Redis(port=port, single_connection_client=True)
    limiter = RedisTokenBucketLimiter(client, capacity, rate, prefix="ci:")
    if what == "raw":
        sha = limiter.allow("warm") and None
        from bucketlimit._redis.script import limiter_script
        from bucketlimit import _core
        c, p, u = _core.exact_units(capacity, rate)
        script = limiter_script(RedisTokenBucketLimiter._script.source, c, u, p)
        bucket = [f"ci:{{{k}}}:{k}".encode() for k in keys]
        run = lambda i: client.execute_command("EVALSHA", script.sha, 1, bucket[i % 1000])
    else:
        run = lambda i: limiter.allow(keys[i % 1000])
    for i in range(2000):
        run(i)
    for i in range(calls):
        run(i)
else:
    async def main():
        client = redis.asyncio.Redis(port=port, max_connections=8)
        limiter = AsyncRedisTokenBucketLimiter(
            client, capacity, rate, prefix="ci:", batching=(what == "batched")
        )
        async def rounds(n):
            for start in range(0, n, 64):
                batch = range(start, start + 64)
                await asyncio.gather(*(limiter.allow(keys[i % 1000]) for i in batch))
        await rounds(2048)
        await rounds(calls)
        await client.aclose()
    asyncio.run(main())
"""


def collected(what: str, port: int, calls: int) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0")
    result = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-c",
            CHILD,
            what,
            str(port),
            str(calls),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", result.stderr)
    if found is None:
        raise SystemExit(f"callgrind printed no total:\n{result.stderr[-2000:]}")
    return int(found[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=2048)
    parser.add_argument("--large", type=int, default=12288)
    parser.add_argument("--what", default="raw,allow,batched")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install -y valgrind)")
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        server, port = start_server(directory)
        try:
            for what in args.what.split(","):
                small = collected(what, port, args.small)
                large = collected(what, port, args.large)
                results[what] = round((large - small) / (args.large - args.small))
                print(f"{what}: {results[what]:,} instructions per call", flush=True)
        finally:
            server.kill()
            server.wait()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
