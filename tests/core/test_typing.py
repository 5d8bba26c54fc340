"""The types a user sees: pyright and mypy on a small user module.

The module below is what an application writes. Each line marked
``# expect-error`` is a mistake a type checker must report, and no other line
may be reported: ``stats()["allowed"]`` is an ``int``, a misspelt key is an
error, the Redis limiters' counters are their own, and every reservation is
one of the two reservation protocols. The module is only
type-checked, never run (it needs no Redis server).

Both checkers run as subprocesses; like the Redis tests, a missing checker
skips the test, and fails it under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

USER_MODULE = """\
from bucketlimit import LimiterStats, RedisLimiterStats, TokenBucketLimiter
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter

limiter = TokenBucketLimiter(10, 2)
stats = limiter.stats()
allowed: int = stats["allowed"]
held: int = stats["keys"] + stats["evicted"] + stats["refused_new_keys"]
kept: LimiterStats = stats
wrong: str = stats["refused"]  # expect-error: an int is not a str
typo = stats["allwed"]  # expect-error: no such key
stats["allowed"] = "many"  # expect-error: the value is an int


def store_trouble(redis_limiter: RedisTokenBucketLimiter) -> int:
    counts: RedisLimiterStats = redis_limiter.stats()
    return counts["store_errors"] + counts["breaker_openings"] + counts["fallback_decisions"]


def no_keys_in_redis(redis_limiter: RedisTokenBucketLimiter) -> int:
    return redis_limiter.stats()["keys"]  # expect-error: the buckets live in the store


async def from_asyncio(redis_limiter: AsyncRedisTokenBucketLimiter) -> int:
    return redis_limiter.stats()["refusal_cache_hits"]


mixed: LimiterStats = store_trouble  # expect-error: a function is not stats

from bucketlimit import AsyncReservationLike, ReservationLike  # noqa: E402
from bucketlimit.redis import AsyncRedisReservation, RedisReservation  # noqa: E402


def one_contract(sync: RedisReservation, asynchronous: AsyncRedisReservation) -> None:
    every: list[ReservationLike] = [limiter.reserve("k"), sync]
    awaited: AsyncReservationLike = asynchronous
    crossed: ReservationLike = asynchronous  # expect-error: its wait is a coroutine

from bucketlimit import (  # noqa: E402
    ConcurrencyLimiter,
    ConcurrencyStats,
    Decision,
    Permit,
    Reservation,
    acquire_all,
    acquire_all_async,
    allow_all,
)

inflight = ConcurrencyLimiter(5, ttl=30)
counts: ConcurrencyStats = inflight.stats()
waiting: int = counts["waiting"] + counts["in_flight"] + counts["abandoned"]
no_allowed = counts["allowed"]  # expect-error: permits are granted, not allowed
with inflight.acquire("k", timeout=1) as permit:
    token: int = permit.token
decided: Decision = allow_all([(limiter, "k", 1)])
request: Reservation = allow_all([(limiter, "k", 1), (inflight, "k")])
waited: ReservationLike = acquire_all([(limiter, "k", 3), (inflight, "k", 1)])
acquire_all([(inflight, "k", 2)])  # expect-error: a permit check costs 1


async def permits() -> int:
    got: Permit = await inflight.acquire_async("k")
    async with got:
        both: Reservation = await acquire_all_async([(limiter, "k"), (inflight, "k")])
        return both.permits[0].token
"""


def expected_lines() -> set[int]:
    return {n for n, line in enumerate(USER_MODULE.splitlines(), 1) if "# expect-error" in line}


def missing(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the type checks must run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def user_module(tmp_path: Path) -> Path:
    path = tmp_path / "user_app.py"
    path.write_text(USER_MODULE, encoding="utf-8")
    return path


@pytest.mark.timeout(300)  # the first run may fetch pyright's own package
def test_pyright_reports_exactly_the_mistakes(user_module: Path) -> None:
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent)) or shutil.which(
        "pyright"
    )
    if pyright is None:
        missing("pyright is not installed (pip install pyright)")
        return
    result = subprocess.run(
        [pyright, "--outputjson", "--pythonpath", sys.executable, str(user_module)],
        capture_output=True,
        text=True,
        cwd=user_module.parent,
        timeout=280,
        check=False,
    )
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        missing(f"pyright did not run: {result.stdout[-500:]} {result.stderr[-500:]}")
        return
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    lines = {d["range"]["start"]["line"] + 1 for d in errors}
    assert lines == expected_lines(), json.dumps(errors, indent=1)
    messages = " ".join(d["message"] for d in errors)
    assert '"allwed" is not a defined key in "LimiterStats"' in messages
    assert '"keys" is not a defined key in "RedisLimiterStats"' in messages
    assert '"allowed" is not a defined key in "ConcurrencyStats"' in messages


@pytest.mark.timeout(300)
def test_mypy_reports_exactly_the_mistakes(user_module: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--show-error-codes",
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            str(user_module),
        ],
        capture_output=True,
        text=True,
        cwd=user_module.parent,
        timeout=280,
        check=False,
    )
    if "No module named mypy" in result.stderr:
        missing("mypy is not installed")
    errors = [line for line in result.stdout.splitlines() if ": error: " in line]
    lines = {int(m[1]) for line in errors if (m := re.match(r".*?:(\d+): error", line))}
    assert lines == expected_lines(), result.stdout + result.stderr
    assert 'TypedDict "LimiterStats" has no key "allwed"' in result.stdout
    assert 'TypedDict "RedisLimiterStats" has no key "keys"' in result.stdout
    assert 'TypedDict "ConcurrencyStats" has no key "allowed"' in result.stdout
