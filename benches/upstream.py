"""How much of a provider's allowance workers sharing one Redis budget get.

    python -m benches.upstream            # from the repository root; about a minute
    python -m benches.upstream --quick    # the tests' scale, a few seconds a client

Not part of the test suite (tests/upstream/test_mock_provider.py checks, at a
smaller scale, that no request gets 429 and none is sent during a hold). It
starts its own redis-server (the tests' runner: loopback, a free port, no
persistence) and the mock provider under uvicorn (tests/upstream/scenario.py):
true limits 10 % below what the workers are configured with (36,000 tokens per
2-second window against 40,000), another consumer spending 20 % of them, 4
processes of 4 threads sending chat-completion-shaped requests through
``bucketlimit.httpx.RateLimitTransport`` for ten windows, with raw httpx and with
the openai SDK through ``http_client=``. It prints, after the first two windows,
the workers' requests, those refused (429), and the tokens they got as a share of
what the provider allowed them beside the other consumer.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a script, the repository root is not on sys.path
    sys.exit("run it from the repository root as a module: python -m benches.upstream")

import bucketlimit
from tests.support.redis_servers import RedisServer  # the tests' server runner
from tests.upstream import scenario
from tests.upstream.scenario import Scale


def measure(scale: Scale, client: str, directory: Path, redis_url: str) -> str:
    """One run; its figures after the first two windows, as one line."""
    with scenario.provider(scale, directory / f"provider-{client}.log") as url:
        run = scenario.run(scale, url, redis_url, client)
    since = 2 * scale.window
    ours = run.ours(since)
    refused = sum(1 for r in ours if r[2] == 429)
    in_all = sum(1 for r in run.ours() if r[2] == 429)
    admitted = sum(r[3] for r in ours)
    allowed = run.allowed(since)
    return (
        f"{client:7} {len(ours):6} requests, {refused} got 429 ({in_all} in all); "
        f"{admitted} tokens of {allowed:.0f} allowed ({admitted / allowed:.1%})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="the tests' scale")
    quick = parser.parse_args().quick
    scale = (
        Scale(window=0.5, tokens=9_000, requests=450, processes=2, threads=2, windows=4)
        if quick
        else Scale()
    )
    print(
        f"bucketlimit {bucketlimit.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {scale}"
    )
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        server = RedisServer(directory / "redis")
        server.start()
        try:
            for client in ("httpx", "openai"):
                print(measure(scale, client, directory, server.url), flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
