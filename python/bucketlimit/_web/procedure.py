"""How one limit applies to one request: :func:`apply_limit`, the one procedure of
every adapter, written once as a generator of steps, and its two drivers, which
answer the steps in sync code (:func:`run`) or asyncio code (:func:`run_async`).

The procedure reads a limit's settings and writes what it decided into the
request's limits through two protocols, :class:`LimitSettingsLike` and
:class:`RequestLimitsLike`, which name all it uses of them: ``LimitSettings``
(:mod:`bucketlimit._web.limits`, which imports this module) and ``RequestLimits``
(:mod:`bucketlimit._web.request_limits`) are theirs, and this module imports
neither.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from typing import Any, Protocol, TypeVar, cast

from bucketlimit._core import Decision
from bucketlimit._reservations import AsyncReservationLike, ReservationLike
from bucketlimit._web.counting import LimitCounters
from bucketlimit._web.errors import ConfigurationError
from bucketlimit._web.fields import Applied
from bucketlimit._web.limiters import AnyLimiter, ConcurrencyLimiterLike, is_limiter
from bucketlimit._web.reservations import AsyncReservation, Reservation
from bucketlimit._web.startup import check_now, unchecked
from bucketlimit._web.waiting import ClientDisconnected, Waiting, permit_waiting, token_waiting

R = TypeVar("R")  # the framework's request type
R_contra = TypeVar("R_contra", contravariant=True)
H = TypeVar("H", Reservation, AsyncReservation)  # the adapter's kind of reservation
T = TypeVar("T")

#: A call the procedure needs answered: a function and its arguments.
Step = tuple[Callable[..., Any], tuple[Any, ...]]
#: An adapter's procedure: yields steps, is sent their answers, returns its result.
Procedure = Generator[Step, Any, T]


class LimitSettingsLike(Protocol[R_contra]):
    """What the procedure reads and asks of one limit's settings (``LimitSettings``
    has them all; mypy checks it). The limit is also its own entry's owner in the
    request's limits."""

    @property
    def exempt(self) -> Callable[[R_contra], object] | None: ...
    @property
    def key(self) -> Callable[[R_contra], object]: ...
    @property
    def cost(self) -> int | Callable[[R_contra], object]: ...
    @property
    def limiter(self) -> AnyLimiter | Callable[[R_contra], object] | None: ...
    @property
    def concurrency(self) -> ConcurrencyLimiterLike | None: ...
    @property
    def name(self) -> str: ...
    @property
    def concurrency_name(self) -> str: ...
    @property
    def max_wait(self) -> float: ...
    @property
    def headers(self) -> tuple[str, ...] | None: ...
    @property
    def checks_store(self) -> bool: ...
    @property
    def bound(self) -> bool: ...
    def bind(self, storage: str | None) -> None: ...
    def checked_key(self, key: object, where: object) -> str: ...
    def chosen(self, plan: object) -> tuple[AnyLimiter, str]: ...
    def partition_key(self, name: str, key: str) -> bytes | None: ...
    def refuses(self, decision: Decision, key: str, cost: int, where: object) -> bool: ...
    @property
    def counters(self) -> LimitCounters: ...


class RequestLimitsLike(Protocol):
    """What the procedure reads and writes of the limits applied to one request
    (``RequestLimits`` has them all; mypy checks it)."""

    @property
    def storage(self) -> str | None: ...
    @property
    def checks_store(self) -> bool: ...
    def find(self, owner: object) -> Reservation | AsyncReservation | None: ...
    def add(
        self,
        owner: object,
        applied: Applied,
        reservation: Reservation | AsyncReservation,
        headers: tuple[str, ...] | None = ...,
        before: tuple[Applied, ...] = ...,
        *,
        counters: LimitCounters | None = ...,
    ) -> None: ...
    def refused_by(self, owner: object) -> Iterable[Reservation | AsyncReservation]: ...
    def abandoned(self, owner: Any) -> Iterable[Reservation | AsyncReservation]: ...
    def hold(
        self, permit: Any, ttl: float | None, counters: LimitCounters | None = ...
    ) -> None: ...


def apply_limit(
    limit: LimitSettingsLike[R],
    request: R,
    limits_of: Callable[[], RequestLimitsLike],
    describe: Callable[[R], str],
    hold: Callable[[AnyLimiter, str, int, Decision], H],
) -> Procedure[tuple[H | None, bool]]:
    """Applies ``limit`` to ``request`` (``LimitSettings.procedure``).

    It yields each call whose answer may have to be awaited (the app's key, cost,
    exempt and plan functions, the limiter, the refunds) as ``(function, args)``,
    to be sent the answer: Flask and Django's sync views drive it with :func:`run`,
    the ASGI adapters with :func:`run_async`. ``limits_of()`` is the request's
    ``RequestLimits``, ``describe(request)`` says which request it is in logs and
    errors, ``hold`` makes the adapter's kind of reservation. Returns the
    reservation (``None`` when the request is exempt) and whether to refuse
    (``RequestLimits.refusal()`` says how).
    """
    if limit.exempt is not None and (yield limit.exempt, (request,)):
        return None, False
    limits = limits_of()
    found = limits.find(limit)
    if found is not None:  # already applied to this request (app-wide and per route)
        return cast(H, found), False
    where = _Where(describe, request)  # formatted only for an error or a log line
    key = limit.checked_key((yield limit.key, (request,)), where)
    cost = (yield limit.cost, (request,)) if callable(limit.cost) else limit.cost
    if not limit.bound:  # a limit string naming no storage: the app's
        limit.bind(limits.storage)
    chosen = limit.limiter  # read once
    limiter, name = cast(AnyLimiter, chosen), limit.name  # None: concurrency alone
    if chosen is not None and not is_limiter(chosen):  # a plan function: this request's
        limiter, name = limit.chosen((yield cast(Step, (chosen, (request,)))))
    if limit.checks_store and limits.checks_store:  # a store not asked yet in this process
        for each in (limiter, limit.concurrency):
            if unchecked(each):
                yield check_now, (limit, each)
    permit: Any = None  # the request's permit (concurrency=): taken before its tokens
    before: tuple[Applied, ...] = ()
    concurrency = limit.concurrency
    if concurrency is not None:
        permit = yield from _take_permit(limit, concurrency, key, limits)
        conc_name = limit.concurrency_name
        conc = Applied.concurrent(
            permit.decision, conc_name, pk=limit.partition_key(conc_name, key)
        )
        if not permit and limit.refuses(conc.decision, key, 1, where):
            held = hold(limiter, key, 0, conc.decision)
            limits.add(limit, conc, held, limit.headers, counters=limit.counters)
            for other in limits.refused_by(limit):  # the request did not run
                yield other.cancel, ()
            return held, True
        if permit:
            limit.counters.add("permits_granted")
            limits.hold(permit, getattr(concurrency, "ttl", None), limit.counters)
        else:  # a shadow limit's would-be refusal: the request goes on without one
            permit = None
        if limiter is None:  # concurrency alone
            held = hold(limiter, key, 0, conc.decision)
            held.permit = permit
            limits.add(limit, conc, held, limit.headers, counters=limit.counters)
            return held, False
        before = (conc,)
    core: ReservationLike | AsyncReservationLike | None = None
    if can_never_pass(cost, limiter):
        decision = never((yield limiter.peek, (key, limiter.capacity)))
    elif limit.max_wait:  # wait for the tokens, or be refused at once (nothing spent)
        started = time.monotonic()
        try:
            waited = yield token_waiting(limiter, limit.max_wait), (key, cost)
        except ClientDisconnected:  # the wait gave its tokens back; so do the others
            if permit is not None:
                yield permit.release, ()
            for other in limits.abandoned(limit):
                yield other.cancel, ()
            raise
        if not isinstance(waited, Decision):  # a reservation, to settle through
            core, decision = waited, waited.decision
        else:
            decision = waited
        if decision.allowed:  # the limiter's own delay when it says, else as measured
            delay = waited.delay if core is not None else time.monotonic() - started
            limit.counters.token_waits.observe(delay)
    else:
        decision = yield limiter.allow, (key, cost)
    held = hold(limiter, key, cost if decision.allowed else 0, decision)
    held.permit = permit
    if core is not None and decision.allowed:
        held.settle_through(core)
    applied = Applied.of(limiter, decision, name, cost=cost, pk=limit.partition_key(name, key))
    limits.add(limit, applied, held, limit.headers, before, counters=limit.counters)
    if not limit.refuses(decision, key, cost, where):
        return held, False
    if permit is not None:  # the request does not run: its permit goes to the next
        yield permit.release, ()
    for other in limits.refused_by(limit):  # the request did not run: refund the others
        yield other.cancel, ()
    return held, True


def apply_limits(
    parts: Sequence[LimitSettingsLike[R]],
    request: R,
    limits_of: Callable[[], RequestLimitsLike],
    describe: Callable[[R], str],
    hold: Callable[[AnyLimiter, str, int, Decision], H],
) -> Procedure[tuple[H | None, bool]]:
    """Applies the limits of a limit string of several (``"2/minute;10/hour"``) in
    order, as :func:`apply_limit` each: the first that refuses ends it (and gives
    back what those before it charged). Returns the last reservation made."""
    held: H | None = None
    for part in parts:
        held, refused = yield from apply_limit(part, request, limits_of, describe, hold)
        if refused:
            return held, True
    return held, False


def _take_permit(
    limit: LimitSettingsLike[Any],
    concurrency: ConcurrencyLimiterLike,
    key: str,
    limits: RequestLimitsLike,
) -> Procedure[Any]:
    """The request's permit: ``try_acquire``; refused, with ``max_wait`` a wait for one
    in arrival order (its own procedure, so that a client that disconnects while it
    waits leaves the queue and the others give back what they hold), counted while
    it waits and timed (as measured: a permit frees when another request ends; 0
    when it did not wait)."""
    permit = yield concurrency.try_acquire, (key,)
    if not limit.max_wait:
        return permit
    counters = limit.counters
    if permit:
        counters.permit_waits.observe(0.0)
        return permit
    started = time.monotonic()
    counters.add("permits_waiting")
    try:
        permit = yield permit_waiting(concurrency, limit.max_wait), (key,)
    except ClientDisconnected:
        for other in limits.abandoned(limit):
            yield other.cancel, ()
        raise
    finally:
        counters.add("permits_waiting", -1)
    if permit:
        counters.permit_waits.observe(time.monotonic() - started)
    return permit


def can_never_pass(cost: int, limiter: AnyLimiter) -> bool:
    """A cost above the capacity: refused for good (413), not a server error.

    The cost often comes from the client (the tokens it asks for), so a request
    larger than the whole bucket is the client's problem, rather than the
    ``ValueError`` the limiter raises.
    """
    return isinstance(cost, int) and not isinstance(cost, bool) and cost > limiter.capacity


def never(full: Decision) -> Decision:
    """A refusal for a cost above the capacity, built on the bucket's real state.

    ``full`` is ``peek(key, capacity)``: refused unless the bucket is full, and a
    refusal reports the balance and time to full as they are (nothing spent).
    """
    if full.allowed:
        return Decision(False, math.inf, full.limit, 0.0, full.limit)
    return Decision(False, math.inf, full.remaining, full.reset_after, full.limit)


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


# Answers that are never awaitable: checked first, as inspect.isawaitable is slow.
_PLAIN = frozenset({str, int, bool, type(None), Decision, tuple})


async def run_async(
    procedure: Procedure[T], disconnected: Callable[[], Awaitable[object]] | None = None
) -> T:
    """Drives a procedure for an asyncio framework: each step is called, and awaited
    when it answers with an awaitable (an ``async def`` key function, the asyncio
    Redis limiter); a :class:`Waiting` step waits with its asynchronous twin, and
    when ``disconnected()`` (an awaitable that ends when the client goes away) ends
    first, the wait is cancelled, its tokens and the request's other charges are
    given back, and :class:`ClientDisconnected` is raised."""
    return await _drive(procedure, waits_async=True, disconnected=disconnected)


def run(procedure: Procedure[T]) -> T:
    """Drives a procedure for a synchronous framework: the same loop, run to its end
    at once without an event loop (an ``async def`` function must finish without
    suspending); a :class:`Waiting` step is called as it is (the thread sleeps; a
    WSGI server cannot tell that the client left)."""
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


async def _drive(
    procedure: Procedure[T],
    *,
    waits_async: bool,
    disconnected: Callable[[], Awaitable[object]] | None = None,
) -> T:
    """The one loop of both drivers."""
    answer = None
    gone: ClientDisconnected | None = None
    while True:
        try:
            if gone is None:
                function, args = procedure.send(answer)
            else:  # the procedure gives back what the request held, then re-raises
                function, args = procedure.throw(gone)
                gone = None
        except StopIteration as done:
            return cast(T, done.value)
        if waits_async and function.__class__ is Waiting:
            try:
                answer = await function.asynchronous(*args, disconnected)
            except ClientDisconnected as error:
                gone = error
            continue
        answer = function(*args)
        if answer.__class__ not in _PLAIN and inspect.isawaitable(answer):
            answer = await answer
