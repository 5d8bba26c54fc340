"""The built wheel installs and works on every supported CPython, with no Rust anywhere.

For each version (pythons.py): a fresh virtual environment, the wheel installed
offline with no dependencies (the core has none), then a smoke run from outside
the checkout, so the extension loaded is the wheel's. PATH holds no ``cargo``
or ``rustc``: nothing could have been compiled. A missing interpreter skips,
and fails under CI=true.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.conftest import Dist, unavailable, without_rust
from tests.packaging.pythons import VERSIONS, find_python

SMOKE = r"""
import importlib.metadata, sys, threading
from pathlib import Path

import bucketlimit
import bucketlimit._core
from bucketlimit import TokenBucketLimiter, allow_all
from bucketlimit.testing import ManualClock

version, prefix = sys.argv[1], Path(sys.prefix).resolve()
assert "%d.%d" % sys.version_info[:2] == version, sys.version
extension = Path(bucketlimit._core.__file__).resolve()
assert extension.name == "_core.abi3.so" and extension.is_relative_to(prefix), extension
# The Redis module ships beside it (bucketlimit.redis.module_path(), which needs no client).
from bucketlimit._redis.module import module_path
assert Path(module_path()).is_relative_to(prefix), module_path()

clock = ManualClock()
limiter = TokenBucketLimiter(capacity=2, rate=10, clock=clock)
assert limiter.allow("k") and limiter.allow("k", cost=1)
refused = limiter.allow("k")
assert not refused and refused.retry_after == 0.1, refused
for _ in range(10):
    clock.advance(0.01)  # ten exact steps of a hundredth: one token, no epsilon
assert limiter.allow("k") and not limiter.allow("k")
both = allow_all([(TokenBucketLimiter(5, 0), "a"), (TokenBucketLimiter(3, 0), "b")], cost=2)
assert both.allowed and both.remaining == 1, both

shared, admitted, lock = TokenBucketLimiter(capacity=1_000, rate=0), [0], threading.Lock()
def spend():
    for _ in range(200):
        if shared.allow("one key"):
            with lock:
                admitted[0] += 1
threads = [threading.Thread(target=spend) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert admitted[0] == 1_000, admitted

plugins = importlib.metadata.entry_points(group="pytest11")
assert [p.value for p in plugins if p.name == "bucketlimit"] == ["bucketlimit.testing"]
print("smoke ok", bucketlimit.__version__, sys.version.split()[0])
"""


SIMULATE = ["simulate", "--capacity", "10", "--rate", "2", "--pattern", "burst", "--duration", "5"]
# The wheel alone, from the file: no index, no dependencies (the core has none).
OFFLINE = ("--quiet", "--no-index", "--no-deps", "--no-cache-dir")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("version", VERSIONS)
def test_the_wheel_installs_and_runs_without_rust(version: str, dist: Dist, tmp_path: Path) -> None:
    python = find_python(version)
    if python is None:
        unavailable(f"no CPython {version} found (pyenv's ~/.pyenv/versions/{version}.*)")
    env = without_rust()
    venv = tmp_path / f"venv-{version}"
    subprocess.run([python, "-m", "venv", "--without-pip", venv], check=True, env=env)
    target = venv / "bin" / "python"
    # This suite's pip installs into the new environment (pip --python), offline.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", target, "install", *OFFLINE, dist.wheel],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    smoke = subprocess.run(
        [target, "-c", SMOKE, version], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert smoke.returncode == 0, smoke.stderr
    assert smoke.stdout.startswith("smoke ok"), smoke.stdout
    cli = subprocess.run(
        [target, "-m", "bucketlimit", *SIMULATE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert cli.returncode == 0, cli.stderr
    assert "admitted" in cli.stdout, cli.stdout
