"""Real threads for race tests: start together, report errors, wait (bounded) for
another thread to reach a state, and interrupt the main thread with a real SIGINT."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
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


@contextmanager
def interrupting_main() -> Iterator[Callable[[], None]]:
    """Entered in the main thread: ``interrupt()`` (called from another thread) raises
    one KeyboardInterrupt in the main thread with a real SIGINT (``pthread_kill``),
    sending it again until the main thread handled it. CPython runs a signal's handler
    between bytecodes, so a SIGINT that lands just before the main thread blocks in a
    wait (after its last check, before the system call) is handled only when that wait
    ends: one SIGINT can leave a test waiting out its 10 s timeouts on a loaded
    machine. Only the first SIGINT raises; the rest do nothing."""
    raised = threading.Event()

    def once(signum: int, frame: FrameType | None) -> None:
        if not raised.is_set():
            raised.set()
            raise KeyboardInterrupt

    def interrupt() -> None:
        main = threading.main_thread().ident
        assert main is not None
        deadline = time.monotonic() + 10
        while not raised.is_set():
            assert time.monotonic() < deadline, "the main thread never handled a SIGINT"
            signal.pthread_kill(main, signal.SIGINT)
            raised.wait(0.05)

    previous = signal.signal(signal.SIGINT, once)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, previous)
