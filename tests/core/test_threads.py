"""Real threads against one limiter: exact counts, all-or-nothing, no deadlock.

Threads start together from a barrier and the interpreter switches threads
as often as it can, so calls interleave as much as the runtime allows.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator

import pytest

from bucketlimit import TokenBucketLimiter, allow_all
from bucketlimit.testing import ManualClock
from tests.support.threads import run_threads

pytestmark = pytest.mark.interpreters

THREADS = 16
CALLS = 2_000


@pytest.fixture(autouse=True)
def fast_thread_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def whole_tokens(limiter: TokenBucketLimiter, key: str) -> int:
    """Whole tokens the key's bucket holds now (without spending any)."""
    probe = limiter.peek(key, 1)
    return probe.remaining + (1 if probe.allowed else 0)


@pytest.mark.parametrize("clock", ["manual", "builtin"])
@pytest.mark.parametrize("run", range(5))
def test_one_key_admits_exactly_its_capacity(clock: str, run: int) -> None:
    limiter = TokenBucketLimiter(1_000, 0, clock=ManualClock() if clock == "manual" else None)

    def work(_: int) -> int:
        return sum(limiter.allow("k").allowed for _ in range(CALLS))

    admitted = run_threads(THREADS, work)
    assert sum(admitted) == 1_000
    stats = limiter.stats()
    assert (stats["allowed"], stats["refused"]) == (1_000, THREADS * CALLS - 1_000)
    assert whole_tokens(limiter, "k") == 0


def test_random_costs_spend_exactly_the_capacity() -> None:
    limiter = TokenBucketLimiter(1_000, 0, clock=ManualClock())

    def work(index: int) -> tuple[int, int]:
        costs = random.Random(index)
        spent = admitted = 0
        for _ in range(CALLS // 4):
            cost = costs.randint(1, 3)
            if limiter.allow("k", cost):
                spent += cost
                admitted += 1
        return spent, admitted

    results = run_threads(THREADS, work)
    spent = sum(s for s, _ in results)
    assert spent + whole_tokens(limiter, "k") == 1_000
    assert limiter.stats()["allowed"] == sum(a for _, a in results)


def test_each_of_64_keys_admits_exactly_its_capacity() -> None:
    keys = [f"key-{i}" for i in range(64)]
    limiter = TokenBucketLimiter(100, 0, clock=ManualClock())

    def work(index: int) -> Counter[str]:
        admitted: Counter[str] = Counter()
        for call in range(CALLS):
            key = keys[(index * 7 + call) % 64]  # every key gets 500 calls
            if limiter.allow(key):
                admitted[key] += 1
        return admitted

    total: Counter[str] = sum(run_threads(THREADS, work), Counter())
    assert total == dict.fromkeys(keys, 100)
    assert len(limiter) == 64


def test_allow_all_with_a_global_cap_under_threads() -> None:
    clock = ManualClock()
    per_user = TokenBucketLimiter(5, 0, clock=clock)
    everyone = TokenBucketLimiter(50, 0, clock=clock)
    users = [f"user-{i}" for i in range(THREADS)]  # 16 * 5 = 80 > 50

    def work(index: int) -> Counter[str]:
        admitted: Counter[str] = Counter()
        for call in range(400):
            user = users[(index + call % 2) % THREADS]  # two threads per user
            if allow_all([(per_user, user), (everyone, "all")]):
                admitted[user] += 1
        return admitted

    admitted: Counter[str] = sum(run_threads(THREADS, work), Counter())
    assert sum(admitted.values()) == 50
    assert max(admitted.values()) <= 5
    # Nobody was charged for a call the other limiter refused: every bucket
    # holds exactly its capacity minus what it admitted.
    assert whole_tokens(everyone, "all") == 0
    for user in users:
        assert whole_tokens(per_user, user) == 5 - admitted[user], user
    calls = THREADS * 400
    for limiter in (per_user, everyone):
        stats = limiter.stats()
        assert (stats["allowed"], stats["refused"]) == (50, calls - 50)


# A deadlock here would hold the interpreter's lock, so no in-process timeout
# could fire: the threads run in a child process with a hard timeout.
CHILD = textwrap.dedent(
    """
    import json, os, sys, threading
    from bucketlimit import TokenBucketLimiter, allow_all
    from bucketlimit.testing import ManualClock

    sys.setswitchinterval(1e-6)
    manual = ManualClock()
    inside = threading.local()
    limiter = None

    def clock():
        # Calls back into the limiter that is reading it (and, once, makes
        # the limiter read this clock again).
        len(limiter)
        limiter.stats()
        if not getattr(inside, "active", False):
            inside.active = True
            try:
                limiter.peek("nested")
                limiter.allow("nested")
            finally:
                inside.active = False
        return manual()

    limiter = TokenBucketLimiter(1_000, 0, clock=clock)
    other = TokenBucketLimiter(10**9, 0, clock=clock)
    barrier = threading.Barrier(8)
    admitted = [0] * 8

    def work(index):
        barrier.wait()
        for call in range(300):
            if index % 2:
                checks = [(limiter, "k"), (other, "g")]
            else:  # the opposite order: locks must not deadlock
                checks = [(other, "g"), (limiter, "k")]
            admitted[index] += bool(allow_all(checks)) + bool(limiter.allow("k"))
            limiter.peek("k")
            limiter.refund("x", 1)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if any(t.is_alive() for t in threads):
        print("DEADLOCK", flush=True)
        os._exit(3)
    print(json.dumps({"admitted": sum(admitted), "stats": limiter.stats()}))
    """
)


def test_a_clock_that_calls_back_into_the_limiter_does_not_deadlock() -> None:
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the limiter deadlocked: the child process was still running after 120 s")
    assert child.returncode == 0, child.stdout + child.stderr
    result = json.loads(child.stdout)
    # "k" admits exactly its capacity among 8 * 300 * 2 calls. Each of the 5
    # clock readings per loop also made one nested allow on "nested" (1,000
    # tokens, 12,000 asks): it too admits exactly its capacity.
    assert result["admitted"] == 1_000
    stats = result["stats"]
    assert stats["allowed"] == 1_000 + 1_000
    assert stats["allowed"] + stats["refused"] == 8 * 300 * 2 + 8 * 300 * 5
