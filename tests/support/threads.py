"""Real threads for race tests: start together, report errors, and wait (bounded) for
another thread to reach a state."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_threads(count: int, work: Callable[[int], T], timeout: float = 120) -> list[T]:
    """Runs ``work(i)`` in ``count`` threads released together; returns the results."""
    barrier = threading.Barrier(count)
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            barrier.wait()
            results[index] = work(index)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), "threads did not finish"
    if errors:
        raise errors[0]
    return [results[i] for i in range(count)]


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    """Waits until another thread has reached a state (synchronization, not a timing
    assertion): fails after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)
