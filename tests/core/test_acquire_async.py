"""acquire_async / acquire_all_async (docs/design.md §2): cancelled waiters give their
tokens back, timeouts spend nothing, several event loops share one limiter.

Accounting tests use a clock that stands still (a ManualClock read through a
lambda, so the waits are real asyncio sleeps of a few milliseconds while the
bucket never refills): the bucket then ends exactly where the model says.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from bucketlimit import ConcurrencyLimiter, Decision, TokenBucketLimiter, acquire_all_async
from bucketlimit.testing import ManualClock
from tests.support.reference import Line, ReferenceLimiter, answer_of

pytestmark = pytest.mark.interpreters


def frozen_limiter(capacity: int, rate: float) -> tuple[TokenBucketLimiter, ManualClock]:
    clock = ManualClock()
    # A lambda has no sleep_async: the limiter waits with asyncio.sleep.
    return TokenBucketLimiter(capacity, rate, clock=lambda: clock()), clock


def test_acquire_async_waits_on_a_manual_clock(manual_clock: ManualClock) -> None:
    limiter = TokenBucketLimiter(1, 4, clock=manual_clock)

    async def main() -> list[Decision]:
        return [await limiter.acquire_async("k") for _ in range(5)]

    assert all(asyncio.run(main()))
    assert manual_clock.now == 1.0  # exactly the four waits of 0.25 s, no sleeping


def test_a_timeout_refusal_spends_nothing_and_returns_at_once() -> None:
    limiter, _ = frozen_limiter(1, 1)

    async def main() -> Decision:
        assert await limiter.acquire_async("k")
        return await limiter.acquire_async("k", timeout=0.5)

    refused = asyncio.run(main())
    assert not refused
    assert refused.retry_after == 0.5
    assert limiter.peek("k").retry_after == 1.0


def test_1000_tasks_with_cancels_and_wait_for_timeouts_end_where_the_model_says() -> None:
    capacity, rate = 10, 20_000.0  # 1,000 waiters in 50 ms of asyncio sleeps
    limiter, _ = frozen_limiter(capacity, rate)
    rng = random.Random(7)
    # What happened, in order: ("reserve", task, cost, timeout) when a task's
    # acquire_async starts, ("stop", task) when it was cancelled or timed out.
    events: list[tuple[Any, ...]] = []

    async def acquire(task: int, cost: int, timeout: float | None) -> Decision:
        events.append(("reserve", task, cost, timeout))
        try:
            return await limiter.acquire_async("k", cost, timeout=timeout)
        except asyncio.CancelledError:
            events.append(("stop", task))  # its give-back has been made
            raise

    async def main() -> int:
        tasks: list[asyncio.Task[Decision]] = []
        for i in range(1000):
            cost = rng.randint(1, 5)
            if i % 7 == 3:
                timed = asyncio.wait_for(acquire(i, cost, None), rng.random() / 50)
                tasks.append(asyncio.ensure_future(timed))
            elif i % 11 == 5:
                tasks.append(asyncio.create_task(acquire(i, cost, 0.01)))
            else:
                tasks.append(asyncio.create_task(acquire(i, cost, None)))
        await asyncio.sleep(0)  # every task has reserved
        for _ in range(300):
            rng.choice(tasks).cancel()
            await asyncio.sleep(rng.random() / 5000)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if not isinstance(result, Decision):
                # asyncio.TimeoutError: on Python 3.10 it is not the builtin TimeoutError.
                assert isinstance(result, (asyncio.CancelledError, asyncio.TimeoutError))
        return sum(1 for r in results if not isinstance(r, Decision))

    stopped = asyncio.run(main())
    assert stopped > 100
    # Replayed on the model in the order it happened (the clock never moved): every
    # waiter stopped gave its tokens back as docs/design.md §4 "Giving back" says, the
    # last of the queue exactly, one with others waiting behind it without making room
    # for a newcomer alongside or before them.
    model = ReferenceLimiter(capacity, rate)
    held: dict[int, tuple[int, Line | None]] = {}
    granted = 0
    for event in events:
        if event[0] == "reserve":
            _, task, cost, timeout = event
            max_wait = None if timeout is None else round(timeout * 1_000_000)
            answer, _, line = model.reserve_with_line("k", cost, 0, max_wait)
            if answer.allowed:
                held[task] = (cost, line)
                granted += cost
        elif event[1] in held:
            cost, line = held.pop(event[1])
            model.refund("k", cost, 0, line)
    assert answer_of(limiter.peek("k")) == model.peek("k", 1, 0)
    # (Which stops come back depends on where each waiter stood when it stopped, so
    # how much came back varies from run to run; the model says it each time.
    # tests/core/test_reservations.py pins the cases down on a ManualClock.)
    assert granted > 0


def test_cancelled_before_it_starts_takes_nothing() -> None:
    limiter, _ = frozen_limiter(1, 1)

    async def main() -> None:
        task: asyncio.Task[Decision] = asyncio.create_task(limiter.acquire_async("k"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert limiter.peek("k").allowed
    assert len(limiter) == 0


def test_closing_the_coroutine_while_it_waits_gives_the_tokens_back() -> None:
    limiter, _ = frozen_limiter(1, 1)
    limiter.allow("k")

    async def main() -> None:
        waiting: Coroutine[Any, Any, Decision] = limiter.acquire_async("k")
        assert asyncio.iscoroutine(waiting)
        waiting.send(None)  # reserved, now waiting on its sleep
        assert limiter.peek("k").retry_after == 2.0
        waiting.close()
        assert limiter.peek("k").retry_after == 1.0
        with pytest.raises(RuntimeError):
            waiting.send(None)

    asyncio.run(main())


@pytest.mark.parametrize("stop", ["close", "drop"])
@pytest.mark.parametrize("kind", ["acquire_async", "wait_async", "acquire_all_async"])
def test_a_coroutine_closed_or_dropped_while_it_sleeps_gives_back_what_it_holds(
    kind: str, stop: str
) -> None:
    limiter, _ = frozen_limiter(1, 1)
    limiter.allow("k")
    inflight = ConcurrencyLimiter(1, ttl=600)

    async def main() -> None:
        waiting: Coroutine[Any, Any, object] | None
        if kind == "acquire_async":
            waiting = limiter.acquire_async("k")
        elif kind == "wait_async":
            waiting = limiter.reserve("k").wait_async()
        else:  # holding the permit while it sleeps for the tokens
            waiting = acquire_all_async([(limiter, "k"), (inflight, "k")])
        waiting.send(None)  # reserved, now waiting on its sleep
        assert limiter.peek("k").retry_after == 2.0
        assert inflight.in_flight("k") == (kind == "acquire_all_async")
        if stop == "close":
            waiting.close()
        else:
            waiting = None
            gc.collect()
        assert limiter.peek("k").retry_after == 1.0, "the tokens it held are back"
        assert inflight.in_flight("k") == 0, "the permit it held is released"

    asyncio.run(main())


def test_acquire_all_async_cancelled_gives_back_every_bucket() -> None:
    rpm, _ = frozen_limiter(5, 1)
    tpm, _ = frozen_limiter(100, 10)

    async def main() -> None:
        assert await acquire_all_async([(rpm, "org", 1), (tpm, "org", 100)])
        waiter: asyncio.Task[Decision] = asyncio.create_task(
            acquire_all_async([(rpm, "org", 1), (tpm, "org", 50)])
        )
        await asyncio.sleep(0.01)
        assert not rpm.peek("org", 4)
        assert tpm.peek("org").retry_after == 5.1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert rpm.peek("org", 4)
        assert tpm.peek("org").retry_after == 0.1
        refused = await acquire_all_async([(rpm, "org", 1), (tpm, "org", 50)], timeout=1)
        assert not refused
        assert refused.retry_after == 4.0

    asyncio.run(main())


def test_two_event_loops_in_two_threads_share_one_limiter() -> None:
    """Real clock: every call admitted and the k-th token never before
    start + (k - capacity) / rate."""
    capacity, rate = 20, 2000.0
    limiter = TokenBucketLimiter(capacity, rate, clock=time.monotonic)
    done: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2)

    async def many() -> list[Decision]:
        async def one() -> Decision:
            decision = await limiter.acquire_async("k")
            with lock:
                done.append(time.monotonic())
            return decision

        return await asyncio.gather(*(one() for _ in range(200)))

    results: list[list[Decision]] = []

    def thread() -> None:
        barrier.wait()
        results.append(asyncio.run(many()))

    start = time.monotonic()
    threads = [threading.Thread(target=thread) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    assert all(all(r) for r in results)
    for k, at in enumerate(sorted(done), start=1):
        assert at >= start + (k - capacity) / rate - 2e-6, k
