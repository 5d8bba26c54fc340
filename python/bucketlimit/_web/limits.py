"""One limit's settings, counters and shadow logging (``LimitSettings``), and the
limits applied to one request (``RequestLimits``): several limits on one route
become one field with several members, never repeated fields."""

from __future__ import annotations

import inspect
import logging
import math
import secrets
import threading
import weakref
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypedDict, TypeVar, cast

from bucketlimit import _errors
from bucketlimit._core import Decision
from bucketlimit._web.fields import (
    Applied,
    Refusal,
    partition_key,
    ratelimit_fields,
    refusal_body,
    refusal_headers,
    refusal_status,
    retry_after_seconds,
    window_seconds,
)
from bucketlimit._web.limiters import AnyLimiter, Waited
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

#: A key function: the request's bucket key (or an awaitable of it, in an async app).
KeyFunc = Callable[[R], "str | Awaitable[str]"]
#: A cost: an int, or a function of the request returning one (or an awaitable).
CostFunc = Callable[[R], "int | Awaitable[int]"]
CostSpec = int | CostFunc[R]
#: An exemption: a predicate of the request (or an awaitable of one).
ExemptFunc = Callable[[R], "bool | Awaitable[bool]"]
#: What a plan function returns: the plan's limiter, or (policy name, limiter).
Plan = AnyLimiter | tuple[str, AnyLimiter]
#: A function of the request choosing the limiter (per plan, per API key).
PlanFunc = Callable[[R], "Plan | Awaitable[Plan]"]

# Every limit alive, for bucketlimit.testing (a fake clock, a reset between tests).
_LIVE: weakref.WeakSet[LimitSettings[Any]] = weakref.WeakSet()
# Called with each new limit (bucketlimit.testing.limits_on_clock puts it on the clock).
_ON_CREATE: list[Callable[[LimitSettings[Any]], None]] = []


if TYPE_CHECKING:  # a generic TypedDict needs Python 3.11 at run time

    class LimitOptions(TypedDict, Generic[R], total=False):
        """A limit's keyword arguments, for an adapter that narrows the limiter's type."""

        key: KeyFunc[R] | None
        cost: CostSpec[R]
        name: str
        shadow: bool
        exempt: ExemptFunc[R] | None
        pk: bool | bytes
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


def is_limiter(candidate: object) -> bool:
    """True for a limiter (it has allow, peek and refund), false for a plan function."""
    return all(callable(getattr(candidate, m, None)) for m in ("allow", "peek", "refund"))


def _check_pk(pk: bool | bytes) -> bytes | None:
    if pk is True:
        return secrets.token_bytes(32)
    if pk is False:
        return None
    if isinstance(pk, bytes) and len(pk) >= 16:
        return pk
    if isinstance(pk, bytes):
        raise ValueError(f"pk must be a secret of at least 16 bytes, got {len(pk)}")
    raise TypeError(f"pk must be True, False or a secret (bytes), got {type(pk).__name__}")


class LimitSettings(Generic[R]):
    """One limit, as every adapter's ``Limit`` takes it; everything here is
    framework-free.

    - ``limiter``: an in-process or Redis limiter, or a function of the request
      returning one (a plan's, built once) or ``(policy_name, limiter)``. One
      attribute, read on every request: assigning another takes effect at once.
    - ``key``: a function of the request returning a non-empty ``str`` (default:
      the adapter's ``remote_address``); ``None`` or ``""`` raises
      :class:`KeyFunctionError` rather than sharing one bucket.
    - ``cost``: an ``int`` or a function of the request; a cost above the
      capacity is refused with 413 (it can never pass).
    - ``name``: the policy name in the RateLimit fields; distinct per route.
    - ``shadow``: decide, charge, report (fields, log, :attr:`shadow_refusals`),
      never refuse.
    - ``exempt``: a predicate of the request; true means no limit, no charge, no
      fields.
    - ``max_wait``: seconds a request that would be refused may wait for its
      tokens instead, on the limiter's clock (0, the default: refuse at once); a
      longer wait is refused at once, spending nothing.
    - ``pk``: ``True`` (or a shared secret, ``bytes``) adds draft-11's partition key.

    When several limits apply to a request and one refuses, the others' charges
    are refunded: the request did not run. The functions may be ``async def``
    where the framework is asyncio.
    """

    #: The key when none is given (each adapter's ``remote_address``).
    default_key: ClassVar[staticmethod[[Any], Any] | None] = None

    def __init__(
        self,
        limiter: AnyLimiter | PlanFunc[R],
        *,
        key: KeyFunc[R] | None = None,
        cost: CostSpec[R] = 1,
        name: str = "default",
        shadow: bool = False,
        exempt: ExemptFunc[R] | None = None,
        pk: bool | bytes = False,
        max_wait: float = 0,
    ) -> None:
        self.max_wait = _check_max_wait(max_wait)
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
        self.limiter = limiter
        self.key = key
        self.cost = cost
        self.name = _check_name(name)
        self.shadow = bool(shadow)
        self.exempt = exempt
        self._pk_secret = _check_pk(pk)
        self._lock = threading.Lock()
        self._shadow_refusals = 0
        _LIVE.add(self)
        for hook in _ON_CREATE:
            hook(self)

    @property
    def limiter(self) -> AnyLimiter | PlanFunc[R]:
        """The limiter (or the function choosing one); assign to replace it."""
        return self._limiter

    @limiter.setter
    def limiter(self, limiter: AnyLimiter | PlanFunc[R]) -> None:
        plan = not is_limiter(limiter)
        if not plan:
            self.check_limiter(cast(AnyLimiter, limiter))
            self._check_can_wait(limiter)
        elif not callable(limiter):
            missing = next(m for m in ("allow", "peek", "refund") if not hasattr(limiter, m))
            raise TypeError(
                f"limiter has no {missing}() method, and is not a function of the request "
                f"returning a limiter: {limiter!r}"
            )
        self._limiter = limiter
        self._plan = plan

    @property
    def window(self) -> int | None:
        """The ``w`` of the limiter's policy (``None`` for a plan function)."""
        limiter = self._limiter
        if not is_limiter(limiter):
            return None
        limiter = cast(AnyLimiter, limiter)
        return window_seconds(limiter.capacity, limiter.rate)

    def check_limiter(self, limiter: AnyLimiter) -> None:
        """Refuses a limiter this adapter cannot drive (``TypeError``); any by default."""

    def _check_can_wait(self, limiter: object) -> None:
        if self.max_wait and not callable(getattr(limiter, "acquire", None)):
            raise TypeError(f"max_wait needs a limiter that can wait (acquire()): {limiter!r}")

    def chosen(self, plan: object) -> tuple[AnyLimiter, str]:
        """The limiter and policy name a plan function returned, checked."""
        name = self.name
        if isinstance(plan, tuple) and len(plan) == 2:
            name, plan = _check_name(plan[0]), plan[1]
        if not is_limiter(plan):
            raise ConfigurationError(
                f"the plan function of limit {self.name!r} returned {plan!r}; it must "
                "return a limiter or (policy name, limiter)"
            )
        limiter = cast(AnyLimiter, plan)
        self.check_limiter(limiter)
        self._check_can_wait(limiter)
        return limiter, name

    @property
    def shadow_refusals(self) -> int:
        """Requests a shadow limit would have refused (always 0 when not shadow)."""
        return self._shadow_refusals

    def checked_key(self, key: object, where: object) -> str:
        """The key function's answer, or a :class:`KeyFunctionError` if there is none."""
        if isinstance(key, str) and key:
            return key
        raise KeyFunctionError(
            f"the key function {getattr(self.key, '__qualname__', self.key)!r} of limit "
            f"{self.name!r} returned {key!r} for {where}; it must return a non-empty str "
            "(a missing key would put all such requests in one shared bucket)"
        )

    @staticmethod
    def can_never_pass(cost: int, limiter: AnyLimiter) -> bool:
        """A cost above the capacity: refused for good (413), not a server error.

        The cost often comes from the client (the tokens it asks for), so a request
        larger than the whole bucket is the client's problem, rather than the
        ``ValueError`` the limiter raises.
        """
        return isinstance(cost, int) and not isinstance(cost, bool) and cost > limiter.capacity

    @staticmethod
    def never(full: Decision) -> Decision:
        """A refusal for a cost above the capacity, built on the bucket's real state.

        ``full`` is ``peek(key, capacity)``: refused unless the bucket is full, and a
        refusal reports the balance and time to full as they are (nothing spent).
        """
        if full.allowed:
            return Decision(False, math.inf, full.limit, 0.0, full.limit)
        return Decision(False, math.inf, full.remaining, full.reset_after, full.limit)

    def applied(
        self, decision: Decision, limiter: AnyLimiter, name: str, key: str, cost: int
    ) -> Applied:
        pk = None if self._pk_secret is None else partition_key(self._pk_secret, name, key)
        rate = limiter.rate
        return Applied(name, decision, window_seconds(limiter.capacity, rate), rate, pk, cost)

    def procedure(
        self,
        request: R,
        limits_of: Callable[[], RequestLimits],
        describe: Callable[[R], str],
        hold: Callable[[AnyLimiter, str, int, Decision], H],
    ) -> Procedure[tuple[H | None, bool]]:
        """Applies this limit to ``request``: the one procedure of every adapter.

        It yields each call whose answer may have to be awaited (the app's key, cost,
        exempt and plan functions, the limiter, the refunds) as ``(function, args)``,
        to be sent the answer: Flask and Django's sync views drive it with
        :func:`run`, the ASGI adapters with :func:`run_async`. ``limits_of()`` is the
        request's :class:`RequestLimits`, ``describe(request)`` says which request it
        is in logs and errors, ``hold`` makes the adapter's kind of reservation.
        Returns the reservation (``None`` when the request is exempt) and whether
        to refuse (``RequestLimits.refusal()`` says how).
        """
        if self.exempt is not None and (yield self.exempt, (request,)):
            return None, False
        limits = limits_of()
        found = limits.find(self)
        if found is not None:  # already applied to this request (app-wide and per route)
            return cast(H, found), False
        where = _Where(describe, request)  # formatted only for an error or a log line
        key = self.checked_key((yield self.key, (request,)), where)
        cost = (yield self.cost, (request,)) if callable(self.cost) else self.cost
        limiter, name = cast(AnyLimiter, self._limiter), self.name
        core: Waited | None = None
        if self._plan:  # a plan function: this request's limiter
            limiter, name = self.chosen((yield cast(Step, (self._limiter, (request,)))))
        if self.can_never_pass(cost, limiter):
            decision = self.never((yield limiter.peek, (key, limiter.capacity)))
        elif self.max_wait:  # wait for the tokens, or be refused at once (nothing spent)
            waited = yield self.waiting(limiter), (key, cost)
            if not isinstance(waited, Decision):  # a reservation, to settle through
                core, decision = waited, waited.decision
            else:
                decision = waited
        else:
            decision = yield limiter.allow, (key, cost)
        held = hold(limiter, key, cost if decision.allowed else 0, decision)
        if core is not None and decision.allowed:
            held._settle_through(core)
        limits.add(self, self.applied(decision, limiter, name, key, cost), held)
        if not self.refuses(decision, key, cost, where):
            return held, False
        for other in limits.others(self):  # the request did not run: refund the others
            yield other.cancel, ()
        return held, True

    def waiting(self, limiter: AnyLimiter) -> Waiting:
        """The step that waits up to ``max_wait`` for the tokens: ``acquire`` for a
        synchronous driver, ``acquire_async`` (when the limiter has it) for an async one.
        The in-process limiter answers with its reservation, for the settle."""
        waits: Any = limiter
        timeout = self.max_wait
        acquire = getattr(waits, "_acquire_reservation", waits.acquire)
        acquire_async = getattr(
            waits, "_acquire_reservation_async", getattr(waits, "acquire_async", acquire)
        )
        return Waiting(
            lambda key, cost: acquire(key, cost, timeout=timeout),
            lambda key, cost: acquire_async(key, cost, timeout=timeout),
        )

    def refuses(self, decision: Decision, key: str, cost: int, where: object) -> bool:
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
            str(where),
            key,
            cost,
            retry_after_seconds(decision),
        )
        return False


class _Where:
    """Which request this is, in errors and logs: ``describe(request)`` when shown."""

    __slots__ = ("describe", "request")

    def __init__(self, describe: Callable[[Any], str], request: object) -> None:
        self.describe = describe
        self.request = request

    def __str__(self) -> str:
        return self.describe(self.request)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


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

    def refusal(self) -> Refusal:
        """How to answer the refusal of the last limit applied (the one that refused):
        its status (429, or 413/403 when it can never pass), the fields of every
        limit with ``Retry-After`` and ``Content-Type``, and the problem body."""
        applied = self.entries[-1].applied
        headers = {**self.fields(), **refusal_headers(applied.decision)}
        status = refusal_status(applied)
        return Refusal(status, headers, refusal_body(applied), applied.decision)

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


# Answers that are never awaitable: checked first, as inspect.isawaitable is slow.
_PLAIN = frozenset({str, int, bool, type(None), Decision, tuple})


async def run_async(procedure: Procedure[T]) -> T:
    """Drives a procedure for an asyncio framework: each step is called, and awaited
    when it answers with an awaitable (an ``async def`` key function, the asyncio
    Redis limiter); a :class:`Waiting` step waits with its asynchronous twin."""
    return await _drive(procedure, waits_async=True)


def run(procedure: Procedure[T]) -> T:
    """Drives a procedure for a synchronous framework: the same loop, run to its end
    at once without an event loop (an ``async def`` function must finish without
    suspending); a :class:`Waiting` step is called as it is (the thread sleeps)."""
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
    """The one loop of both drivers."""
    answer = None
    while True:
        try:
            function, args = procedure.send(answer)
        except StopIteration as done:
            return cast(T, done.value)
        if waits_async and function.__class__ is Waiting:
            function = function.asynchronous
        answer = function(*args)
        if answer.__class__ not in _PLAIN and inspect.isawaitable(answer):
            answer = await answer
