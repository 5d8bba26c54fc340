"""ConcurrencyLimiter under real threads and real asyncio tasks (docs/design.md §4,
"Permits"): never more than the limit in flight, waiters granted in arrival order,
cancelled and timed-out waiters leave nothing behind, waiting never polls.

These run on the built-in clock (or ``time.monotonic``) with long ttls, so a slot
frees only by a release: what is checked is the hand-off, not time.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bucketlimit import ConcurrencyLimiter, Permit
from tests.support.threads import run_threads, wait_until


@pytest.fixture(autouse=True)
def fast_thread_switching() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


ROUNDS = 500  # per thread: 16,000 hand-offs between 32 threads switching every µs


@pytest.mark.timeout(180)
def test_32_threads_never_hold_more_than_the_limit() -> None:
    limiter = ConcurrencyLimiter(5, ttl=600)
    guard = threading.Lock()
    inside = 0
    most = 0

    def work(_: int) -> int:
        nonlocal inside, most
        for _ in range(ROUNDS):
            with limiter.acquire("k") as permit:
                assert permit
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0)  # let the others in
                with guard:
                    inside -= 1
        return ROUNDS

    done = sum(run_threads(32, work))
    assert done == 32 * ROUNDS, f"{done} acquisitions of {32 * ROUNDS}"
    assert 1 <= most <= 5, f"{most} holders inside at once, limit 5"
    stats = limiter.stats()
    assert stats["granted"] == stats["released"] == 32 * ROUNDS, f"not all released: {stats}"
    assert (stats["in_flight"], stats["waiting"], stats["expired"]) == (0, 0, 0), stats


def test_threads_are_granted_in_arrival_order() -> None:
    limiter = ConcurrencyLimiter(1, ttl=600)
    held = limiter.try_acquire("k")
    order: list[int] = []

    def waiter(index: int) -> None:
        with limiter.acquire("k") as permit:
            assert permit
            order.append(index)

    threads = []
    for index in range(12):
        thread = threading.Thread(target=waiter, args=(index,), daemon=True)
        thread.start()
        threads.append(thread)
        wait_until(lambda: limiter.stats()["waiting"] == len(threads), f"{len(threads)} wait")
    assert not limiter.try_acquire("k")  # no jumping the queue
    held.release()
    for thread in threads:
        thread.join(30)
    assert order == list(range(12))
    assert limiter.in_flight("k") == 0


def test_a_timed_out_thread_leaves_the_queue_and_the_next_one_gets_the_slot() -> None:
    limiter = ConcurrencyLimiter(1, ttl=600)
    held = limiter.try_acquire("k")
    answers: dict[str, Permit] = {}

    def ask(name: str, timeout: float | None) -> None:
        answers[name] = limiter.acquire("k", timeout=timeout)

    impatient = threading.Thread(target=ask, args=("impatient", 0.05), daemon=True)
    impatient.start()
    wait_until(lambda: limiter.stats()["waiting"] == 1, "the first waits")
    patient = threading.Thread(target=ask, args=("patient", None), daemon=True)
    patient.start()
    impatient.join(30)
    assert not answers["impatient"]
    assert limiter.stats()["waiting"] == 1
    held.release()
    patient.join(30)
    assert answers["patient"]
    assert answers["patient"].valid()


def test_waiting_does_not_poll_the_clock() -> None:
    reads = 0

    def clock() -> float:
        nonlocal reads
        reads += 1
        return time.monotonic()

    limiter = ConcurrencyLimiter(1, ttl=600, clock=clock)
    held = limiter.try_acquire("k")
    got: list[Permit] = []
    thread = threading.Thread(target=lambda: got.append(limiter.acquire("k")), daemon=True)
    before = reads
    thread.start()
    wait_until(lambda: limiter.stats()["waiting"] == 1, "it waits")
    waiting_reads = reads
    time.sleep(0.1)  # a waiter that polled would read the clock all along
    polled = reads - waiting_reads
    assert polled <= 1, f"the clock read {polled} times while one waited (stats() reads once)"
    held.release()
    thread.join(30)
    assert got
    assert got[0]
    assert reads - before <= 10  # a few rounds, not a loop


def test_asyncio_waiters_are_granted_in_arrival_order() -> None:
    async def main() -> list[int]:
        limiter = ConcurrencyLimiter(1, ttl=600)
        held = limiter.try_acquire("k")
        order: list[int] = []

        async def waiter(index: int) -> None:
            async with await limiter.acquire_async("k") as permit:
                assert permit
                order.append(index)
                await asyncio.sleep(0)

        tasks = []
        for index in range(20):
            tasks.append(asyncio.create_task(waiter(index)))
            await asyncio.sleep(0)
        assert limiter.stats()["waiting"] == 20
        held.release()
        await asyncio.gather(*tasks)
        assert limiter.in_flight("k") == 0
        return order

    assert asyncio.run(main()) == list(range(20))


@pytest.mark.timeout(60)
def test_1000_tasks_with_cancels_and_wait_for_timeouts_leak_no_permit() -> None:
    rng = random.Random(21)
    limiter = ConcurrencyLimiter(5, ttl=600)
    inside = 0
    most = 0

    async def worker(timeout: float | None) -> str:
        nonlocal inside, most
        permit = await limiter.acquire_async("k", timeout=timeout)
        if not permit:
            return "timed out"
        async with permit:
            inside += 1
            most = max(most, inside)
            try:
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
            finally:
                inside -= 1
        return "done"

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Future[str]] = []
        for i in range(1_000):
            if i % 5 == 1:
                tasks.append(
                    asyncio.ensure_future(asyncio.wait_for(worker(None), rng.random() / 200))
                )
            elif i % 5 == 2:
                task = asyncio.create_task(worker(None))
                loop.call_later(rng.random() / 200, task.cancel)
                tasks.append(task)
            elif i % 5 == 3:
                tasks.append(asyncio.create_task(worker(rng.random() / 200)))
            else:
                tasks.append(asyncio.create_task(worker(None)))
            if i % 50 == 0:
                await asyncio.sleep(0)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert results.count("done") >= 400  # the 400 patient ones, and some others
    assert all(
        r in ("done", "timed out") or isinstance(r, (asyncio.CancelledError, asyncio.TimeoutError))
        for r in results
    ), {type(r) for r in results}
    assert 1 <= most <= 5
    stats = limiter.stats()
    assert (stats["in_flight"], stats["waiting"]) == (0, 0)
    assert limiter.in_flight("k") == 0
    # Every grant was released by its holder, or given back by a waiter
    # cancelled after it was handed the slot (nothing expired: ttl 600 s).
    assert stats["expired"] == 0
    assert 0 <= stats["granted"] - stats["released"] <= stats["abandoned"]


def test_a_waiter_on_another_event_loop_is_woken_by_a_release() -> None:
    limiter = ConcurrencyLimiter(1, ttl=600)
    held = limiter.try_acquire("k")
    got: list[Permit] = []

    def other_loop() -> None:
        async def wait() -> None:
            got.append(await limiter.acquire_async("k"))

        asyncio.run(wait())

    thread = threading.Thread(target=other_loop, daemon=True)
    thread.start()
    wait_until(lambda: limiter.stats()["waiting"] == 1, "the other loop waits")
    held.release()
    thread.join(30)
    assert got
    assert got[0].valid()


def test_a_dropped_or_closed_coroutine_leaves_the_queue() -> None:
    limiter = ConcurrencyLimiter(1, ttl=600)
    held = limiter.try_acquire("k")

    async def main() -> None:
        for stop in ("close", "drop"):
            coroutine = limiter.acquire_async("k")
            awaiting = coroutine.__await__()
            awaiting.send(None)  # its first step: queued, waiting on a future
            assert limiter.stats()["waiting"] == 1
            if stop == "close":
                coroutine.close()
            else:
                del coroutine, awaiting
                gc.collect()
            assert limiter.stats()["waiting"] == 0, stop

    asyncio.run(main())
    held.release()
    assert limiter.try_acquire("k")
    assert limiter.stats()["abandoned"] == 2


def test_a_cancelled_waiter_handed_a_permit_gives_it_to_the_next() -> None:
    async def main() -> None:
        limiter = ConcurrencyLimiter(1, ttl=600)
        held = limiter.try_acquire("k")
        first: asyncio.Task[Permit] = asyncio.create_task(limiter.acquire_async("k"))
        second: asyncio.Task[Permit] = asyncio.create_task(limiter.acquire_async("k"))
        await asyncio.sleep(0)
        held.release()  # hands the slot to the first ...
        first.cancel()  # ... which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await first
        permit = await second
        assert permit.valid()
        assert limiter.in_flight("k") == 1
        permit.release()
        assert limiter.stats()["abandoned"] == 1

    asyncio.run(main())
