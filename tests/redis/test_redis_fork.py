"""fork() while other threads are inside a Redis limiter.

A lock held by another thread when a process forks stays held for ever in the
child, where that thread does not exist: a fork-unsafe limiter hangs about 1 child
in 20 (15 of 300) on the breaker's lock. Here threads keep the limiters' locks busy
(the breaker's, the refusal cache's, the counters', a ManualClock's) while the main
thread forks real children, each of which must use the same objects and exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings

import pytest
import redis

from bucketlimit.redis import RedisTokenBucketLimiter
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import free_port

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fork() on Windows")

# A fork-unsafe limiter hangs 1 child in 20: all 100 children pass by chance 0.6 % of the time.
CHILDREN = 100
THREADS = 6


def fork_child(body: list[object]) -> int:
    """Forks a child that runs ``body``'s checks and exits 0 (1 on a wrong answer)."""
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a multi-threaded process may deadlock the
        # child: that deadlock is what this test is about.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only os._exit
        code = 1
        try:
            down, refused, clock = body
            assert isinstance(down, RedisTokenBucketLimiter)
            assert isinstance(refused, RedisTokenBucketLimiter)
            assert isinstance(clock, ManualClock)
            ok = down.allow("k").degraded and not refused.allow("spent").allowed
            clock.advance(1)
            ok = ok and down.stats()["fallback_decisions"] > 0
            code = 0 if ok else 1
        finally:
            os._exit(code)
    return pid


@pytest.mark.timeout(120)
def test_children_forked_during_calls_never_hang(redis_client: redis.Redis) -> None:
    # The store is down for `down` (its breaker is open: every call takes its lock);
    # `refused` answers from its refusal cache (its lock); the clock is advanced.
    down = RedisTokenBucketLimiter.from_url(
        f"redis://127.0.0.1:{free_port()}/0", 10**6, 1, retry_interval=3600
    )
    refused = RedisTokenBucketLimiter(redis_client, 1, 0.001)
    assert refused.allow("spent")
    assert not refused.allow("spent")  # cached from now on
    clock = ManualClock()
    assert down.allow("k").degraded
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            down.allow("k")
            refused.allow("spent")
            clock.advance(0.001)
            down.stats()

    threads = [threading.Thread(target=busy) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    hung = wrong = 0
    try:
        for _ in range(CHILDREN):
            pid = fork_child([down, refused, clock])
            deadline = time.monotonic() + 5  # a child needs milliseconds
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    wrong += os.waitstatus_to_exitcode(status) != 0
                    break
                if time.monotonic() > deadline:
                    hung += 1
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.001)
            if hung:
                break  # one is enough to fail: no need to wait for more
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert (hung, wrong) == (0, 0), f"{hung} children hung, {wrong} answered wrongly"
