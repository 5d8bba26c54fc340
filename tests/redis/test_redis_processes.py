"""Several processes, one Redis: exact counts, all-or-nothing global caps, server time.

Real processes (tests/support/processes.py), each with its own client, released
together by a barrier so that their calls interleave on the server.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import redis

import bucketlimit
from bucketlimit.redis import RedisTokenBucketLimiter
from tests.support.processes import CONTEXT, run_processes

MICROS = 1_000_000


# -- 8 processes x 300 calls on one key: exactly the capacity --------------------------


def spend_one_key(url: str, rounds: int, calls: int, between: Any) -> list[int]:
    """``rounds`` rounds of ``calls`` allows, the processes waiting for each other
    (``between``, a barrier) after each: the admissions of each round."""
    limiter = RedisTokenBucketLimiter(redis.Redis.from_url(url), 1000, 0, prefix="bucketlimit:")
    admitted = []
    for _ in range(rounds):
        admitted.append(sum(limiter.allow("shared").allowed for _ in range(calls)))
        between.wait(60)
    return admitted


def test_eight_processes_admit_exactly_the_capacity(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """8 processes, 3 rounds of 100 calls each, on a capacity of 1,000 at rate 0: the
    first round (800 calls) is admitted whole, the second shares the last 200 among
    whoever gets there first, the third gets nothing: 1,000 in all, whatever the
    order in which the processes ran."""
    between = CONTEXT.Barrier(8)
    rounds = run_processes(spend_one_key, [(redis_url, 3, 100, between)] * 8)
    assert [r[0] for r in rounds] == [100] * 8, f"admitted by round: {rounds}: not all of the first"
    assert sum(r[1] for r in rounds) == 200, f"admitted by round: {rounds}: not 200 in the second"
    assert [r[2] for r in rounds] == [0] * 8, f"admitted by round: {rounds}: some in the third"
    balance, _ = redis_client.get("bucketlimit:{shared}:shared").split()  # type: ignore[union-attr]
    assert balance == b"0", "the bucket holds what nobody was admitted"


# -- a per-user limit plus a global cap, through allow_all -----------------------------

USERS = [f"user-{i}" for i in range(8)]
USER_CAPACITY = 20
GLOBAL_CAPACITY = 100


def spend_with_global_cap(url: str, seed: int, calls: int) -> list[tuple[str, bool]]:
    client = redis.Redis.from_url(url)
    per_user = RedisTokenBucketLimiter(client, USER_CAPACITY, 0, prefix="user:")
    everyone = RedisTokenBucketLimiter(client, GLOBAL_CAPACITY, 0, prefix="global:")
    rng = random.Random(seed)
    # user-0 is a heavy user: it runs into its own limit while the global cap has room.
    weights = [8, 1, 1, 1, 1, 1, 1, 1]
    answers = []
    for _ in range(calls):
        user = rng.choices(USERS, weights)[0]
        decision = bucketlimit.allow_all([(per_user, user), (everyone, "all")])
        answers.append((user, decision.allowed))
    return answers


def test_global_cap_across_processes(redis_client: redis.Redis, redis_url: str) -> None:
    results = run_processes(spend_with_global_cap, [(redis_url, seed, 100) for seed in range(4)])
    admitted = Counter(user for answers in results for user, allowed in answers if allowed)
    refused = sum(not allowed for answers in results for _, allowed in answers)
    assert sum(admitted.values()) == GLOBAL_CAPACITY, f"{admitted}: not the global cap in all"
    assert refused == 400 - GLOBAL_CAPACITY, f"{refused} of 400 refused"
    assert admitted["user-0"] == USER_CAPACITY, "user-0 was refused by its own limit"
    assert all(n <= USER_CAPACITY for n in admitted.values()), f"{admitted}: over a user's limit"
    # Nobody was charged for a refusal: each bucket lost exactly what it admitted.
    for user in USERS:
        value = redis_client.get(f"user:{{{user}}}:{user}")
        balance = USER_CAPACITY * MICROS if value is None else int(value.split()[0])
        assert balance == (USER_CAPACITY - admitted[user]) * MICROS, f"{user} charged a refusal"
    global_balance = redis_client.get("global:{all}:all").split()[0]  # type: ignore[union-attr]
    assert global_balance == b"0", "the global bucket holds what nobody was admitted"


# -- server time: processes with shifted clocks answer alike ---------------------------

HOUR = 3600.0


def shifted_process(url: str, shift: float, key: str, calls: int) -> list[Any]:
    """Shifts this process's time.time and time.monotonic by ``shift`` seconds, then
    calls a limiter that keeps no clock of its own: the server's TIME decides."""
    real_time, real_monotonic = time.time, time.monotonic
    time.time = lambda: real_time() + shift
    time.monotonic = lambda: real_monotonic() + shift
    time.time_ns = lambda: int((real_time() + shift) * 1e9)
    time.monotonic_ns = lambda: int((real_monotonic() + shift) * 1e9)
    # One token per hour: a process that trusted its own shifted clock would see
    # an hour of refill (or none) where the server sees a few milliseconds.
    limiter = RedisTokenBucketLimiter(
        redis.Redis.from_url(url), 5, 1, per=3600, prefix="bucketlimit:"
    )
    decisions = [limiter.allow(key) for _ in range(calls)]
    return [time.time() - real_time(), decisions]


def test_processes_with_shifted_clocks_answer_as_unshifted_ones(
    redis_client: redis.Redis, redis_url: str
) -> None:
    # One process at a time, so that the order of calls is known.
    for key, order in [("k1", [0.0, HOUR, -HOUR, 0.0]), ("k2", [HOUR, -HOUR, 0.0, HOUR])]:
        first = True
        for shift in order:
            [(seen_shift, decisions)] = run_processes(
                shifted_process, [(redis_url, shift, key, 5 if first else 2)]
            )
            assert abs(seen_shift - shift) < 1, "the process's clock really was shifted"
            if first:
                assert [d.allowed for d in decisions] == [True] * 5
                assert [d.remaining for d in decisions] == [4, 3, 2, 1, 0]
            else:
                # As an unshifted process: no refill in the seconds since, no hour
                # gained or lost; the wait is the server's, under an hour.
                for d in decisions:
                    assert not d.allowed, f"shift {shift}: admitted with no refill"
                    assert d.remaining == 0, f"shift {shift}: {d.remaining} left"
                    assert HOUR - 300 < d.retry_after <= HOUR, f"shift {shift}: retry_after {d}"
                    assert 5 * HOUR - 300 < d.reset_after <= 5 * HOUR, f"shift {shift}: {d}"
            first = False
    # The buckets' times are the server's: within a few minutes of its TIME.
    seconds, micros = redis_client.time()
    now = seconds * MICROS + micros
    for key in ("k1", "k2"):
        last = int(redis_client.get(f"bucketlimit:{{{key}}}:{key}").split()[1])  # type: ignore[union-attr]
        assert now - 300 * MICROS < last <= now, f"{key} written at {last}, server time {now}"
