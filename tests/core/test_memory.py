"""docs/design.md §5: full buckets are forgotten a little at a time; max_keys bounds the table.

The sweeper's budget per call is the core's business; these tests hold it
only to what docs/design.md promises: memory follows the active keys within a number
of calls proportional to the table (bounded here generously), a second
identical round costs no new memory, and max_keys never admits more than
the contract allows nor resets a bucket that is not full.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import textwrap

import pytest

from bucketlimit import TokenBucketLimiter, allow_all
from bucketlimit.testing import ManualClock

KEYS = 1_000_000
ACTIVE = 10


@pytest.mark.timeout(300)  # a hang guard: a million keys take 1 s idle, 13 s on a crushed machine
def test_idle_keys_are_forgotten_within_a_bounded_number_of_calls() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(2, 1, clock=clock)
    for i in range(KEYS):
        limiter.allow(f"user-{i}")
    assert len(limiter) == KEYS  # each spent a token: none is full yet
    clock.advance(2)  # every one of them is full again
    calls = 0
    while len(limiter) > ACTIVE and calls < KEYS:
        limiter.allow(f"active-{calls % ACTIVE}")
        calls += 1
    # A little sweeping per call: a million idle keys go within 300,000 calls.
    assert calls <= 300_000, f"{len(limiter)} buckets still held after {calls} calls"
    assert len(limiter) == ACTIVE
    stats = limiter.stats()
    assert stats["evicted"] == KEYS
    assert stats["keys"] == ACTIVE


# Peak RSS only grows, so each round is measured in a fresh process.
ROUNDS = textwrap.dedent(
    """
    import json, resource
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.testing import ManualClock

    clock = ManualClock()
    limiter = TokenBucketLimiter(2, 1, clock=clock)

    def one_round(name):
        for i in range(1_000_000):
            limiter.allow(f"{name}-{i:07d}")
        clock.advance(2)
        calls = 0
        while len(limiter) > 10:
            limiter.allow(f"active-{calls % 10}")
            calls += 1
        clock.advance(2)
        return calls

    peaks, calls = [], []
    for name in ("first", "again"):
        calls.append(one_round(name))
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
    print(json.dumps({"peaks_kib": peaks, "calls": calls, "len": len(limiter)}))
    """
)


@pytest.mark.timeout(300)  # a hang guard: 3 s idle, over 30 s on a crushed machine
def test_a_second_round_of_a_million_keys_needs_no_more_memory() -> None:
    child = subprocess.run(
        [sys.executable, "-c", ROUNDS], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr
    result = json.loads(child.stdout)
    first, second = result["peaks_kib"]
    assert second - first <= 10 * 1024, f"peak RSS {first} KiB, then {second} KiB: it grew"
    assert max(result["calls"]) <= 300_000, f"idle keys forgotten in {result['calls']} calls"
    assert result["len"] <= ACTIVE, f"{result['len']} buckets held, {ACTIVE} active"


# -- max_keys --------------------------------------------------------------------


def test_max_keys_refuses_new_keys_and_never_resets_a_drained_one() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(2, 0, clock=clock, max_keys=3)
    assert limiter.allow("a", 2)
    assert limiter.allow("b", 2)
    assert limiter.allow("c", 1)  # not full either: one token left
    for i in range(100):
        refused = limiter.allow(f"new-{i}")
        assert not refused
        assert refused.retry_after == math.inf  # rate 0: no bucket will ever be full
    assert limiter.peek("another") == limiter.allow("another")
    stats = limiter.stats()
    assert stats["refused_new_keys"] == 101
    assert stats["keys"] == len(limiter) == 3
    # The held buckets were not reset to make room.
    assert not limiter.allow("a")
    assert not limiter.allow("b")
    assert limiter.allow("c")
    assert not limiter.allow("c")
    # Room made by hand is used.
    limiter.reset("b")
    assert limiter.allow("new-0")
    assert not limiter.allow("new-1")


def test_a_key_refused_for_room_is_admitted_once_a_held_bucket_is_full() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(4, 1, clock=clock, max_keys=3)
    assert limiter.allow("a", 4)  # full again at 4 s
    assert limiter.allow("b", 2)  # full again at 2 s: the soonest
    assert limiter.allow("c", 3)  # full again at 3 s
    clock.set(0.5)
    refused = limiter.allow("d")
    assert not refused
    assert refused.retry_after == 1.5
    assert limiter.stats()["refused_new_keys"] == 1
    clock.set(1.999999)
    assert not limiter.allow("d")
    clock.set(2.0)
    assert limiter.allow("d")
    assert len(limiter) == 3
    # The buckets that were not full kept their state.
    a = limiter.allow("a", 3)
    assert (a.allowed, a.retry_after, a.remaining) == (False, 1.0, 2)
    c = limiter.allow("c", 4)
    assert (c.allowed, c.retry_after, c.remaining) == (False, 1.0, 3)
    assert limiter.stats()["refused_new_keys"] == 2


def test_waiting_a_refused_new_keys_retry_after_finds_room() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(1_000, 1, clock=clock, max_keys=500)
    for i in range(500):
        clock.advance(0.01)
        assert limiter.allow(f"held-{i}", 100 + (i * 37) % 900)
    refused = limiter.allow("newcomer")
    assert not refused
    assert 0 < refused.retry_after < math.inf
    clock.advance(refused.retry_after)
    assert limiter.allow("newcomer")
    assert len(limiter) <= 500


def test_max_keys_warning_is_logged_once_not_per_call(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    limiter = TokenBucketLimiter(1, 0, clock=ManualClock(), max_keys=2)
    limiter.allow("a")
    limiter.allow("b")
    assert not [r for r in caplog.records if "max_keys" in r.getMessage()]
    for i in range(1_000):
        assert not limiter.allow(f"new-{i}")
    warnings = [r for r in caplog.records if "max_keys" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING


def test_max_keys_warning_uses_the_bucketlimit_logger(caplog: pytest.LogCaptureFixture) -> None:
    # docs/design.md §8: Rust logs under the logger name `bucketlimit`, so an
    # application configures logging.getLogger("bucketlimit") and gets it.
    caplog.set_level(logging.WARNING)
    limiter = TokenBucketLimiter(1, 0, clock=ManualClock(), max_keys=1)
    limiter.allow("a")
    for i in range(10):
        limiter.allow(f"new-{i}")
    names = [r.name for r in caplog.records if "max_keys" in r.getMessage()]
    assert len(names) == 1
    assert names[0] == "bucketlimit" or names[0].startswith("bucketlimit."), names


def test_allow_all_never_holds_more_than_max_keys() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(2, 0, clock=clock, max_keys=2)
    assert limiter.allow("a")
    allow_all([(limiter, "b"), (limiter, "c")])
    assert len(limiter) <= 2


def test_a_clock_that_refers_back_to_its_limiter_is_collected() -> None:
    # The limiter holds its clock; here the clock holds the limiter too. The
    # garbage collector must see the limiter's reference, or the pair leaks.
    import gc
    import weakref

    class Service:
        def __init__(self) -> None:
            self.clock = ManualClock()
            self.limiter = TokenBucketLimiter(1, 1, clock=self.now)

        def now(self) -> float:
            return self.clock()

    service = Service()
    assert service.limiter.allow("k")
    alive = weakref.ref(service)
    del service
    gc.collect()
    assert alive() is None
