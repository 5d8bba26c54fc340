"""Histograms of durations in fixed buckets: how long requests waited for their
tokens or permits (the web limits) and how long a store took to answer (the Redis
limiters). Their ``histograms()`` return these; ``bucketlimit.metrics`` exports
them (docs/metrics.md). Imports nothing of the package, so ``_redis`` and ``_web``
both may.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger("bucketlimit")

#: Seconds a request waited (for tokens or a permit): 0 (no wait) to minutes.
WAIT_BUCKETS: tuple[float, ...] = (
    0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
#: Seconds a store took to answer one command: 100 µs to a second.
ROUND_TRIP_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram at one moment: ``counts[i]`` observations fell in bucket ``i``
    (at most ``bounds[i]`` and above the bound before it; the last, beyond every
    bound, is ``+Inf``), ``sum`` of every observation."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations at most that)``, as Prometheus's ``le``
        buckets, ending with ``(inf, count)``."""
        total, out = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class Histogram:
    """Observations of seconds in fixed buckets, safe to share between threads.

    ``observe(seconds)`` counts one; :meth:`snapshot` reads them all. Listeners
    (:meth:`subscribe`) are told each observation as it comes: how an
    OpenTelemetry histogram, which cannot be read at collection time, records
    them. A listener that raises is logged, never raised into the caller.

    ``wanted``: whether anyone reads it. A producer for which measuring is a cost
    on every call (a Redis limiter timing each command) measures only while it is
    (``wanted=False`` until :meth:`want`).
    """

    __slots__ = ("__weakref__", "_counts", "_listeners", "_lock", "_sum", "bounds", "wanted")

    def __init__(self, bounds: Sequence[float], *, wanted: bool = True) -> None:
        bounds = tuple(float(b) for b in bounds)
        if not bounds or any(not math.isfinite(b) for b in bounds):
            raise ValueError(f"bounds must be finite numbers, got {bounds!r}")
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"bounds must increase, got {bounds!r}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()
        self._listeners: tuple[Callable[[float], object], ...] = ()
        self.wanted = wanted
        fork_safe(self)

    def want(self) -> None:
        """Someone reads this histogram: its producer measures from now on."""
        self.wanted = True

    def observe(self, seconds: float) -> None:
        """Counts one observation (a negative one as 0: a clock that stepped back)."""
        if seconds < 0.0:
            seconds = 0.0
        bucket = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[bucket] += 1
            self._sum += seconds
        if self._listeners:
            self._tell(seconds)

    def _tell(self, seconds: float) -> None:
        for listener in self._listeners:
            try:
                listener(seconds)
            except Exception:
                logger.warning("a histogram listener %r failed", listener, exc_info=True)

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            return HistogramSnapshot(self.bounds, tuple(self._counts), self._sum)

    def subscribe(self, listener: Callable[[float], object]) -> None:
        """Tells ``listener(seconds)`` every observation from now on."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def unsubscribe(self, listener: Callable[[float], object]) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()


class _ForkSafe(Protocol):
    def _after_fork(self) -> None: ...


_FORK_SAFE: weakref.WeakSet[_ForkSafe] = weakref.WeakSet()


def fork_safe(obj: _ForkSafe) -> None:
    """Calls ``obj._after_fork()`` in the child of every ``fork()``: a lock held by
    another thread when the process forks stays held in the child, where that
    thread does not exist, so each object holding one makes a new one there."""
    _FORK_SAFE.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_FORK_SAFE):
        obj._after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
