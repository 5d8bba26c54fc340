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

An app's limits go on a fake clock with ``limits_on_clock`` (the ``limits_clock``
fixture). A test that moves time with freezegun or time-machine needs nothing: when
its module imports either (or it asks for their ``freezer`` / ``time_machine``
fixtures) the plugin puts every limit on :class:`PatchedTimeClock` for the test, as
the ``limits_patched_time`` fixture does, so a test ported from flask-limiter or
slowapi passes unchanged (``@pytest.mark.bucketlimit_real_clock`` opts out).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from bucketlimit._core import ConcurrencyLimiter, TokenBucketLimiter

__all__ = [
    "ManualClock",
    "PatchedTimeClock",
    "limits_clock",
    "limits_on_clock",
    "limits_patched_time",
    "manual_clock",
    "reset_limits",
]

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


class PatchedTimeClock:
    """A clock for tests that use freezegun or time-machine: it reads ``time.time()``
    anew at every call, so ``freeze_time(...)`` / ``frozen.tick(5)`` (freezegun) and
    ``travel(...)`` / ``traveller.shift(5)`` (time-machine) move every limiter built
    on it, and every app limit put on it with :func:`limits_on_clock`.

    The limiters' own clock cannot follow them: the default one is read inside Rust
    (the CPU's monotonic counter, which neither library patches), and
    ``clock=time.monotonic`` is the function as it was at construction
    (time-machine never patches ``time.monotonic``). ``time.time()`` is the one
    function both patch, looked up when called. For tests only: the wall clock
    steps when the system's time is set.
    """

    __slots__ = ()

    def __call__(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "PatchedTimeClock()"


# A lock held by another thread at fork() would stay held for ever in the child:
# every clock gets a new one there.
_CLOCKS: weakref.WeakSet[ManualClock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for clock in list(_CLOCKS):
        clock._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- an app's limits on a fake clock ------------------------------------------------------


def _twin(limiter: Any, clock: Callable[[], float]) -> TokenBucketLimiter:
    """An in-process limiter with ``limiter``'s capacity and rate, deciding on ``clock``."""
    per = float(getattr(limiter, "per", 1) or 1)
    given = limiter.rate * per
    rate: float = round(given) if abs(given - round(given)) < 1e-9 else given
    return TokenBucketLimiter(limiter.capacity, rate, clock, per=per)


def _concurrency_twin(limiter: Any, clock: Callable[[], float]) -> ConcurrencyLimiter:
    """An in-process concurrency limiter with ``limiter``'s limit and ttl, on ``clock``."""
    return ConcurrencyLimiter(limiter.limit, ttl=getattr(limiter, "ttl", 60.0), clock=clock)


def _on_clock(limit: Any, clock: Callable[[], float], saved: list[tuple[Any, Any, Any]]) -> None:
    from bucketlimit.web import is_limiter

    original = limit.limiter
    concurrency = limit.concurrency
    saved.append((limit, original, concurrency))
    if concurrency is not None:
        limit.concurrency = _concurrency_twin(concurrency, clock)
    if original is None:  # concurrency alone
        return
    if is_limiter(original):
        limit.limiter = _twin(original, clock)
        return
    twins: dict[int, tuple[Any, TokenBucketLimiter]] = {}

    def twin_of(limiter: Any) -> TokenBucketLimiter:
        found = twins.get(id(limiter))
        if found is None:  # keeps the original alive, so its id is not reused
            found = twins[id(limiter)] = (limiter, _twin(limiter, clock))
        return found[1]

    def choose(plan: Any) -> Any:
        if isinstance(plan, tuple) and len(plan) == 2:
            return plan[0], twin_of(plan[1])
        return twin_of(plan)

    def plan_on_clock(request: Any) -> Any:
        plan = original(request)
        if inspect.isawaitable(plan):

            async def chosen() -> Any:
                return choose(await plan)

            return chosen()
        return choose(plan)

    limit.limiter = plan_on_clock


@contextlib.contextmanager
def limits_on_clock(clock: Callable[[], float] | None = None) -> Iterator[Callable[[], float]]:
    """Every web limit (Flask, FastAPI, ASGI, Litestar, Django), those that exist and
    those made inside the block, decides on ``clock`` (a new :class:`ManualClock` by
    default), each with a fresh in-process bucket of the same capacity and rate
    (a Redis limiter too), and a limit's ``concurrency=`` with a fresh in-process
    ``ConcurrencyLimiter`` of the same limit and ttl (its permits expire on the
    clock); on exit each gets its own limiters back. Plan functions keep choosing,
    each plan's limiter replaced by its twin on the clock::

        with limits_on_clock() as clock:
            assert client.get("/").status_code == 200
            clock.advance(1)
    """
    with _limits_on(ManualClock() if clock is None else clock, lambda limit: True) as on:
        yield on


@contextlib.contextmanager
def _limits_on(
    clock: Callable[[], float], chosen: Callable[[Any], bool]
) -> Iterator[Callable[[], float]]:
    """:func:`limits_on_clock` for the limits ``chosen`` says."""
    from bucketlimit.web import live_limits, watch_limits

    saved: list[tuple[Any, Any, Any]] = []

    def hook(limit: Any) -> None:
        if chosen(limit):
            _on_clock(limit, clock, saved)

    try:
        with watch_limits(hook):
            for limit in live_limits():
                hook(limit)
            yield clock
    finally:
        for limit, original, concurrency in reversed(saved):
            if concurrency is not None:
                limit.concurrency = concurrency
            limit.limiter = original


def reset_limits() -> None:
    """Empties the buckets of every in-process limiter behind a web limit (each
    ``TokenBucketLimiter``'s ``clear()``): every client starts with a full bucket.
    Call it between tests that share a module-level app; Redis limiters keep their
    state (flush the test database instead). Concurrency limiters are left alone:
    they hold only the permits of responses still open, which closing those
    responses releases (a test client's streamed response too: close it)."""
    from bucketlimit.web import live_limits

    for limit in live_limits():
        limiter = limit.limiter
        if isinstance(limiter, TokenBucketLimiter):
            limiter.clear()


#: The libraries that patch ``time.time()`` (freezegun, time-machine).
_TIME_PATCHERS = frozenset({"freezegun", "time_machine"})
#: Their pytest fixtures (pytest-freezer's and time-machine's own).
_TIME_FIXTURES = frozenset({"freezer", "time_machine"})
#: The marker that keeps a test's limits on their own clocks under those libraries.
REAL_CLOCK_MARKER = "bucketlimit_real_clock"


def _patches_time(value: object) -> bool:
    """Whether a module-level name of a test module is freezegun or time-machine
    (the module, or anything imported from it)."""
    if inspect.ismodule(value):
        return value.__name__.split(".")[0] in _TIME_PATCHERS
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in _TIME_PATCHERS


def uses_patched_time(module: object, fixtures: Iterable[str] = ()) -> bool:
    """Whether a test moves time with freezegun or time-machine: its module imports
    either, or it asks for their fixtures (``freezer``, ``time_machine``)."""
    if _TIME_FIXTURES.intersection(fixtures):
        return True
    return module is not None and any(_patches_time(v) for v in vars(module).values())


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is only needed for the fixture
    pass
else:

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line(
            "markers",
            f"{REAL_CLOCK_MARKER}: keep the app's limits on their own clocks in a test that "
            "uses freezegun or time-machine (bucketlimit.testing)",
        )

    @pytest.fixture
    def limits_patched_time() -> Iterator[PatchedTimeClock]:
        """Every web limit on :class:`PatchedTimeClock` with empty state for the test
        (:func:`limits_on_clock`), so that freezegun and time-machine move them; each
        gets its own limiter back afterwards. Automatic in a test whose module imports
        either library (or that asks for ``freezer`` or ``time_machine``)."""
        clock = PatchedTimeClock()
        with limits_on_clock(clock):
            yield clock

    @pytest.fixture(autouse=True)
    def _bucketlimit_limits_follow_patched_time(
        request: pytest.FixtureRequest,
    ) -> Iterator[None]:
        """Under freezegun or time-machine (:func:`uses_patched_time`), every web
        limit made from a limit string (as the peers' limits are) follows the patched
        time for the test, so a test ported from flask-limiter or slowapi that ticks
        a frozen clock passes unchanged; a limit given a limiter keeps it (and its
        clock); ``@pytest.mark.bucketlimit_real_clock`` keeps them all as they are."""
        module = getattr(request, "module", None) if request.scope == "function" else None
        if (
            request.node.get_closest_marker(REAL_CLOCK_MARKER) is not None
            or "limits_patched_time" in request.fixturenames
            or not uses_patched_time(module, request.fixturenames)
        ):
            yield
            return
        with _limits_on(PatchedTimeClock(), lambda limit: limit.limit_string is not None):
            yield

    @pytest.fixture
    def manual_clock() -> ManualClock:
        """A fresh ``ManualClock`` starting at 0.0."""
        return ManualClock()

    @pytest.fixture
    def limits_clock() -> Iterator[ManualClock]:
        """Every web limit on a fresh ``ManualClock`` with empty state for the test
        (:func:`limits_on_clock`); each gets its own limiter back afterwards."""
        clock = ManualClock()
        with limits_on_clock(clock):
            yield clock
