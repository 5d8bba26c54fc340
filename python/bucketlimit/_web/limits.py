"""One limit's settings, counters and shadow logging (``LimitSettings``), and the
limits applied to one request (``RequestLimits``): several limits on one route
become one field with several members, never repeated fields."""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypedDict, TypeVar, cast

from bucketlimit import _errors
from bucketlimit._core import Decision
from bucketlimit._web.fields import Applied, ratelimit_fields, retry_after_seconds, window_seconds
from bucketlimit._web.limiters import AnyLimiter
from bucketlimit._web.reservations import AsyncReservation, Reservation

logger = logging.getLogger("bucketlimit")


class ConfigurationError(_errors.ConfigurationError, RuntimeError):
    """The app configured a limit in a way that cannot work (raised while serving).

    A :class:`bucketlimit.ConfigurationError`, and a ``RuntimeError`` as it always was.
    """


class KeyFunctionError(ConfigurationError):
    """A key function returned no key: that would put every such request in one bucket."""


R = TypeVar("R")  # the framework's request type
H = TypeVar("H", Reservation, AsyncReservation)  # the adapter's kind of reservation
T = TypeVar("T")

#: A call the procedure needs answered: a function and its arguments.
Step = tuple[Callable[..., Any], tuple[Any, ...]]
#: An adapter's procedure: yields steps, is sent their answers, returns its result.
Procedure = Generator[Step, Any, T]

KeyFunc = Callable[[R], Any]
CostSpec = int | Callable[[R], Any]


if TYPE_CHECKING:  # a generic TypedDict needs Python 3.11 at run time

    class LimitOptions(TypedDict, Generic[R], total=False):
        """A limit's keyword arguments, for an adapter that narrows the limiter's type."""

        key: KeyFunc[R] | None
        cost: CostSpec[R]
        name: str
        shadow: bool
        exempt: Callable[[R], Any] | None
        max_wait: float


class Waiting:
    """A step that may wait for tokens: :func:`run` calls ``sync`` (the thread
    sleeps), :func:`run_async` calls ``asynchronous`` and awaits it. Both wait on the
    limiter's clock when it can (a ``ManualClock`` advances instead of sleeping)."""

    __slots__ = ("asynchronous", "sync")

    def __init__(self, sync: Callable[..., Any], asynchronous: Callable[..., Any]) -> None:
        self.sync = sync
        self.asynchronous = asynchronous

    def __call__(self, *args: Any) -> Any:
        return self.sync(*args)


def _check_max_wait(max_wait: float) -> float:
    if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)):
        raise TypeError(f"max_wait must be a number of seconds, got {max_wait!r}")
    if not max_wait >= 0:  # also NaN
        raise ValueError(f"max_wait must be >= 0 seconds, got {max_wait!r}")
    return max_wait


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    # An RFC 9651 String holds printable ASCII only.
    if not name or not all(" " <= ch <= "~" for ch in name):
        raise ValueError(f"name must be non-empty printable ASCII, got {name!r}")
    return name


class LimitSettings(Generic[R]):
    """One limit: limiter, key function, cost, policy name, shadow mode, exemption,
    and how long a request may wait for its tokens (``max_wait``, 0: refuse at once).

    The adapters subclass it; everything here is framework-free.
    """

    #: The key when none is given (each adapter's ``remote_address``).
    default_key: ClassVar[staticmethod[[Any], Any] | None] = None

    def __init__(
        self,
        limiter: AnyLimiter,
        *,
        key: KeyFunc[R] | None = None,
        cost: CostSpec[R] = 1,
        name: str = "default",
        shadow: bool = False,
        exempt: Callable[[R], Any] | None = None,
        max_wait: float = 0,
    ) -> None:
        max_wait = _check_max_wait(max_wait)
        if max_wait and not callable(getattr(limiter, "acquire", None)):
            raise TypeError(f"max_wait needs a limiter that can wait (acquire()): {limiter!r}")
        for method in ("allow", "peek", "refund"):
            if not callable(getattr(limiter, method, None)):
                raise TypeError(f"limiter has no {method}() method: {limiter!r}")
        if key is None:
            key = type(self).default_key
        if not callable(key):
            raise TypeError(f"key must be a function of the request, got {key!r}")
        if not callable(cost):
            if isinstance(cost, bool) or not isinstance(cost, int):
                raise TypeError(f"cost must be an int or a function of the request, got {cost!r}")
            if cost < 1:
                raise ValueError(f"cost must be >= 1, got {cost}")
        if exempt is not None and not callable(exempt):
            raise TypeError(f"exempt must be a predicate of the request, got {exempt!r}")
        self.check_limiter(limiter)
        self.limiter = limiter
        self.key = key
        self.cost = cost
        self.name = _check_name(name)
        self.shadow = bool(shadow)
        self.exempt = exempt
        self.max_wait = max_wait
        self.window = window_seconds(limiter.capacity, limiter.rate)
        self._lock = threading.Lock()
        self._shadow_refusals = 0

    def check_limiter(self, limiter: AnyLimiter) -> None:
        """Refuses a limiter this adapter cannot drive (``TypeError``); any by default."""

    @property
    def shadow_refusals(self) -> int:
        """Requests a shadow limit would have refused (always 0 when not shadow)."""
        return self._shadow_refusals

    def checked_key(self, key: object, where: str) -> str:
        """The key function's answer, or a :class:`KeyFunctionError` if there is none."""
        if isinstance(key, str) and key:
            return key
        raise KeyFunctionError(
            f"the key function {getattr(self.key, '__qualname__', self.key)!r} of limit "
            f"{self.name!r} returned {key!r} for {where}; it must return a non-empty str "
            "(a missing key would put all such requests in one shared bucket)"
        )

    def can_never_pass(self, cost: int) -> bool:
        """A cost above the capacity: refused with no retry time, not a server error.

        The cost often comes from the client (the tokens it asks for), so a request
        larger than the whole bucket is the client's problem: a 429 that says it will
        never pass, rather than the ``ValueError`` the limiter raises.
        """
        return isinstance(cost, int) and not isinstance(cost, bool) and cost > self.limiter.capacity

    @staticmethod
    def never(full: Decision) -> Decision:
        """A refusal for a cost above the capacity, built on the bucket's real state.

        ``full`` is ``peek(key, capacity)``: refused unless the bucket is full, and a
        refusal reports the balance and time to full as they are (nothing spent).
        """
        if full.allowed:
            return Decision(False, math.inf, full.limit, 0.0, full.limit)
        return Decision(False, math.inf, full.remaining, full.reset_after, full.limit)

    def applied(self, decision: Decision) -> Applied:
        return Applied(self.name, decision, self.window)

    def procedure(
        self,
        request: R,
        limits_of: Callable[[], RequestLimits],
        describe: Callable[[R], str],
        hold: Callable[[AnyLimiter, str, int, Decision], H],
    ) -> Procedure[tuple[H | None, bool]]:
        """Applies this limit to ``request``: the one procedure of every adapter.

        It yields each call whose answer may have to be awaited (the app's key, cost
        and exempt functions, the limiter, the refunds) as ``(function, args)``, to
        be sent the answer: Flask drives it with :func:`run`, FastAPI with
        :func:`run_async`. ``limits_of()`` is the request's :class:`RequestLimits`,
        ``describe(request)`` says which request it is in logs and errors, ``hold``
        makes the adapter's kind of reservation. Returns the reservation (``None``
        when the request is exempt) and whether to answer 429.
        """
        if self.exempt is not None and (yield self.exempt, (request,)):
            return None, False
        limits = limits_of()
        found = limits.find(self)
        if found is not None:  # already applied to this request (app-wide and per route)
            return cast(H, found), False
        where = describe(request)
        key = self.checked_key((yield self.key, (request,)), where)
        cost = (yield self.cost, (request,)) if callable(self.cost) else self.cost
        limiter = self.limiter
        if self.can_never_pass(cost):
            decision = self.never((yield limiter.peek, (key, limiter.capacity)))
        elif self.max_wait:  # wait for the tokens, or be refused at once (nothing spent)
            decision = yield self.waiting(), (key, cost)
        else:
            decision = yield limiter.allow, (key, cost)
        held = hold(limiter, key, cost if decision.allowed else 0, decision)
        limits.add(self, self.applied(decision), held)
        if not self.refuses(decision, key, cost, where):
            return held, False
        for other in limits.others(self):  # the request did not run: refund the others
            yield other.cancel, ()
        return held, True

    def waiting(self) -> Waiting:
        """The step that waits up to ``max_wait`` for the tokens: ``acquire`` for a
        synchronous driver, ``acquire_async`` (when the limiter has it) for an async one."""
        limiter: Any = self.limiter
        timeout = self.max_wait
        acquire_async = getattr(limiter, "acquire_async", limiter.acquire)
        return Waiting(
            lambda key, cost: limiter.acquire(key, cost, timeout=timeout),
            lambda key, cost: acquire_async(key, cost, timeout=timeout),
        )

    def refuses(self, decision: Decision, key: str, cost: int, where: str) -> bool:
        """Whether to answer 429: counts and logs a shadow limit's would-be refusal."""
        if decision.allowed:
            return False
        if not self.shadow:
            return True
        with self._lock:
            self._shadow_refusals += 1
        logger.info(
            "shadow limit %r would refuse %s (key %r, cost %d, retry after %s s)",
            self.name,
            where,
            key,
            cost,
            retry_after_seconds(decision),
        )
        return False


@dataclass
class _Entry:
    owner: object
    applied: Applied
    reservation: Reservation | AsyncReservation


class RequestLimits:
    """The limits applied to one request, in order; the one writer of its fields."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[_Entry] = []

    def find(self, owner: object) -> Reservation | AsyncReservation | None:
        """The reservation ``owner`` already made for this request (a limit applies once)."""
        for entry in self.entries:
            if entry.owner is owner:
                return entry.reservation
        return None

    def add(
        self, owner: object, applied: Applied, reservation: Reservation | AsyncReservation
    ) -> None:
        for entry in self.entries:
            if entry.applied.name == applied.name:
                raise ConfigurationError(
                    f"two limits named {applied.name!r} apply to one request; each limit on "
                    "a route needs its own name= (they are reported as one RateLimit "
                    "field with one member per name)"
                )
        self.entries.append(_Entry(owner, applied, reservation))

    def others(self, owner: object) -> list[Reservation | AsyncReservation]:
        """Every reservation but ``owner``'s: refunded when ``owner`` refuses."""
        return [e.reservation for e in self.entries if e.owner is not owner]

    def fields(self) -> dict[str, str]:
        return ratelimit_fields([e.applied for e in self.entries])

    def reservation(self, name: str | None) -> Reservation | AsyncReservation:
        """The reservation of the limit called ``name`` (``None``: the only one)."""
        if name is not None:
            for entry in self.entries:
                if entry.applied.name == name:
                    return entry.reservation
            raise LookupError(f"no limit named {name!r} applied to this request")
        if len(self.entries) == 1:
            return self.entries[0].reservation
        if not self.entries:
            raise LookupError("no limit applied to this request")
        names = [e.applied.name for e in self.entries]
        raise LookupError(f"several limits apply to this request; name one of {names!r}")


async def run_async(procedure: Procedure[T]) -> T:
    """Drives a procedure for an asyncio framework: each step is called, and awaited
    when it answers with an awaitable (an ``async def`` key function, the asyncio
    Redis limiter); a :class:`Waiting` step waits with its asynchronous twin."""
    return await _drive(procedure, waits_async=True)


def run(procedure: Procedure[T]) -> T:
    """Drives a procedure for a synchronous framework: the same loop run to its end at
    once, without an event loop (nothing it awaits there can suspend); a
    :class:`Waiting` step is called as it is (the thread sleeps)."""
    coroutine = _drive(procedure, waits_async=False)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coroutine.close()
    raise ConfigurationError(
        "a key, cost or exempt function of a synchronous framework's limit waited on "
        "something asynchronous; use a plain function there"
    )


async def _drive(procedure: Procedure[T], *, waits_async: bool) -> T:
    answer = None
    while True:
        try:
            function, args = procedure.send(answer)
        except StopIteration as done:
            return cast(T, done.value)
        if waits_async and isinstance(function, Waiting):
            function = function.asynchronous
        answer = function(*args)
        if inspect.isawaitable(answer):
            answer = await answer
