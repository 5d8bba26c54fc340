"""Test helpers: a clock you step by hand, and the ``manual_clock`` fixture.

The package registers this module as a pytest plugin, so once bucketlimit is
installed every test can ask for ``manual_clock``::

    def test_refill(manual_clock):
        limiter = TokenBucketLimiter(1, 1, clock=manual_clock)
        assert limiter.allow("k")
        assert not limiter.allow("k")
        manual_clock.advance(1)
        assert limiter.allow("k")

Waiting runs on it too: a limiter built with a ``ManualClock`` waits with the
clock's :meth:`ManualClock.sleep` (``acquire``) and :meth:`ManualClock.sleep_async`
(``acquire_async``), which advance the clock instead of sleeping, so tests of
code that waits for tokens never sleep either.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import weakref

__all__ = ["ManualClock", "manual_clock"]

_NS = 1_000_000_000


def _to_ns(seconds: float, what: str) -> int:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"{what} must be an int or float, got {type(seconds).__name__}")
    if isinstance(seconds, float) and not math.isfinite(seconds):
        raise ValueError(f"{what} must be finite, got {seconds!r}")
    return round(seconds * _NS) if isinstance(seconds, float) else seconds * _NS


class ManualClock:
    """A clock that moves only when told to; call it to read seconds.

    Time is kept in whole nanoseconds, so any number of small steps adds up
    exactly (``advance(0.1)`` ten times is exactly one second).
    """

    __slots__ = ("__weakref__", "_lock", "_ns")

    def __init__(self, start: float = 0.0) -> None:
        self._ns = _to_ns(start, "start")
        self._lock = threading.Lock()
        _CLOCKS.add(self)

    def __call__(self) -> float:
        return self._ns / _NS

    @property
    def now(self) -> float:
        """The current reading, in seconds."""
        return self._ns / _NS

    def advance(self, seconds: float) -> None:
        """Moves the clock forward; a negative step is a ``ValueError``."""
        step = _to_ns(seconds, "seconds")
        if step < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds!r})")
        with self._lock:
            self._ns += step

    def set(self, seconds: float) -> None:
        """Moves the clock to ``seconds``; going backwards is a ``ValueError``."""
        target = _to_ns(seconds, "seconds")
        with self._lock:
            if target < self._ns:
                raise ValueError(
                    f"a clock cannot go back: set({seconds!r}) while now is {self.now!r}"
                )
            self._ns = target

    def sleep(self, seconds: float) -> None:
        """Waits ``seconds`` by advancing the clock at once, as if this caller had
        slept alone; a limiter built with this clock waits with it (``acquire``).

        A negative step is a ``ValueError``, as for :meth:`advance`.
        """
        self.advance(seconds)

    async def sleep_async(self, seconds: float) -> None:
        """The awaitable twin of :meth:`sleep` (``acquire_async`` awaits it): advances
        the clock, then yields to the event loop once, as a real sleep would."""
        self.advance(seconds)
        await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"ManualClock(now={self.now!r})"


# A lock held by another thread at fork() would stay held for ever in the child:
# every clock gets a new one there.
_CLOCKS: weakref.WeakSet[ManualClock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for clock in list(_CLOCKS):
        clock._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is only needed for the fixture
    pass
else:

    @pytest.fixture
    def manual_clock() -> ManualClock:
        """A fresh ``ManualClock`` starting at 0.0."""
        return ManualClock()
