"""Real processes for the tests: many processes on one store, a holder killed.

They start from a fork server (``multiprocessing``'s "forkserver") that imported
pytest, redis-py and the package once: a process then costs milliseconds, where a
spawned interpreter importing them again costs about 0.4 s of CPU (8 of them, 3 s
on a busy 2-core machine). The fork server has no threads, so a child never
inherits a lock another thread held, as a fork of the test process could. Where
there is no fork server (Windows), processes are spawned.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from typing import Any

if sys.platform != "win32":
    CONTEXT = multiprocessing.get_context("forkserver")
    # Imported by the fork server before its first fork (set before any test starts it).
    CONTEXT.set_forkserver_preload(["pytest", "redis", "redis.asyncio", "bucketlimit.redis"])
else:
    CONTEXT = multiprocessing.get_context("spawn")


def _entry(
    target: Callable[..., Any], barrier: Any, results: Any, index: int, args: tuple[Any, ...]
) -> None:
    if barrier is not None:
        barrier.wait()
    try:
        results.put((index, "ok", target(*args)))
    except BaseException as e:  # reported to the test, which fails with it
        results.put((index, "error", repr(e)))


def run_processes(
    target: Callable[..., Any],
    args: Sequence[tuple[Any, ...]],
    timeout: float = 300,
    *,
    together: bool = True,
) -> list[Any]:
    """Runs ``target(*a)`` for each ``a`` in its own process (``together``: released
    by one barrier, so that their calls interleave); returns their results in the
    order of ``args``. ``timeout`` bounds the wait for each result (a hang guard)."""
    barrier = CONTEXT.Barrier(len(args)) if together else None
    results = CONTEXT.Queue()
    processes = [
        CONTEXT.Process(target=_entry, args=(target, barrier, results, i, a))
        for i, a in enumerate(args)
    ]
    for process in processes:
        process.start()
    try:
        answers = sorted((results.get(timeout=timeout) for _ in processes), key=lambda a: a[0])
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    errors = [detail for _, status, detail in answers if status == "error"]
    assert errors == [], "a process failed"
    codes = [process.exitcode for process in processes]
    assert codes == [0] * len(processes), f"exit codes {codes}"
    return [detail for _, _, detail in answers]
