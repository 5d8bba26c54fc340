"""One limit's settings, counters and shadow logging (``LimitSettings``), and every
limit alive in the process (``live_limits``, ``watch_limits``). The procedure that
applies a limit to a request, and its drivers, are in
:mod:`bucketlimit._web.procedure`; the limits applied to one request are in
:mod:`bucketlimit._web.request_limits`."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypedDict, TypeVar, cast

from bucketlimit import _config
from bucketlimit._core import ConcurrencyLimiter, Decision
from bucketlimit._histogram import Histogram
from bucketlimit._stats import LimitStats
from bucketlimit._web import profiles
from bucketlimit._web.buckets import LimitString
from bucketlimit._web.counting import LimitCounters
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError, LimitStringError
from bucketlimit._web.fields import RefusalHook, partition_key, retry_after_seconds, window_seconds
from bucketlimit._web.limiters import (
    AnyLimiter,
    ConcurrencyLimiterLike,
    is_concurrency_limiter,
    is_limiter,
)
from bucketlimit._web.procedure import H, Procedure, RequestLimitsLike, apply_limit, apply_limits

logger = logging.getLogger("bucketlimit")

#: The counters of a limit's Redis limiters that its ``stats()`` reports too: the
#: store's health, beside the requests (their own decision counters are not: the
#: limit counts its requests itself).
STORE_STATS = (
    "store_calls",
    "store_errors",
    "script_loads",
    "fallback_decisions",
    "refusal_cache_hits",
    "lost_refunds",
    "lost_releases",
    "breaker_openings",
    "breaker_open",
)

R = TypeVar("R")  # the framework's request type

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
#: ``headers=``: a profile (``"draft-11"``, ``"legacy"``, ``"openai"``) or a list.
Headers = str | Sequence[str]
#: ``concurrency=``: at most N requests in flight per key (an in-process
#: ``ConcurrencyLimiter(N)``), or a concurrency limiter (a Redis one across workers).
Concurrency = int | ConcurrencyLimiterLike


# -- every limit of the process: what start-up checks and test helpers walk -------------

_LIVE: weakref.WeakSet[LimitSettings[Any]] = weakref.WeakSet()
_WATCHERS: list[Callable[[LimitSettings[Any]], None]] = []
_REGISTRY_LOCK = threading.Lock()


def live_limits() -> list[LimitSettings[Any]]:
    """Every web limit alive in this process (every adapter's ``Limit``), in no
    particular order: what the start-up store checks (``check_stores``) and
    ``bucketlimit.testing`` walk. A limit no longer referenced drops out."""
    with _REGISTRY_LOCK:
        return list(_LIVE)


@contextlib.contextmanager
def watch_limits(callback: Callable[[LimitSettings[Any]], None]) -> Iterator[None]:
    """Calls ``callback(limit)`` for each web limit made inside the block (after its
    construction), for tools that manage every limit of an app, such as
    ``bucketlimit.testing.limits_on_clock``."""
    with _REGISTRY_LOCK:
        _WATCHERS.append(callback)
    try:
        yield
    finally:
        with _REGISTRY_LOCK:
            _WATCHERS.remove(callback)


def _register(limit: LimitSettings[Any]) -> None:
    with _REGISTRY_LOCK:
        _LIVE.add(limit)
        watchers = list(_WATCHERS)
    for watcher in watchers:
        watcher(limit)


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
        storage: str | None
        headers: Headers | None
        on_refusal: RefusalHook | None
        concurrency: Concurrency | None
        check_store: bool
        scope: str | None


def _check_functions(cost: object, exempt: object, on_refusal: object) -> None:
    """A limit's cost (an int or a function of the request) and its other functions."""
    if not callable(cost):
        if isinstance(cost, bool) or not isinstance(cost, int):
            raise TypeError(f"cost must be an int or a function of the request, got {cost!r}")
        if cost < 1:
            raise ValueError(f"cost must be >= 1, got {cost}")
    if exempt is not None and not callable(exempt):
        raise TypeError(f"exempt must be a predicate of the request, got {exempt!r}")
    if on_refusal is not None and not callable(on_refusal):
        raise TypeError(f"on_refusal must be a function (request, refusal), got {on_refusal!r}")


def _check_max_wait(max_wait: float) -> float:
    if isinstance(max_wait, bool) or not isinstance(max_wait, (int, float)):
        raise TypeError(f"max_wait must be a number of seconds, got {max_wait!r}")
    if not max_wait >= 0:  # also NaN
        raise ValueError(f"max_wait must be >= 0 seconds, got {max_wait!r}")
    return max_wait


def _check_name(name: str, what: str = "name") -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__}")
    # An RFC 9651 String holds printable ASCII only.
    if not name or not all(" " <= ch <= "~" for ch in name):
        raise ValueError(f"{what} must be non-empty printable ASCII, got {name!r}")
    return name


def _limit_texts(text: str) -> list[str]:
    """The limits of a limit string (several joined by ``;``), each checked."""
    try:
        return _config.split_limits(text)
    except ValueError as error:
        raise LimitStringError(
            f"{error}; a Limit takes a limiter, a function of the request returning one, "
            "or a limit string (several joined by ';')"
        ) from None


def _check_concurrency(concurrency: object) -> ConcurrencyLimiterLike:
    """``concurrency=`` checked: an int is an in-process ``ConcurrencyLimiter`` of that
    limit (which checks its range), else it must be a concurrency limiter."""
    if isinstance(concurrency, bool):
        raise TypeError(f"concurrency must be an int or a concurrency limiter, got {concurrency!r}")
    if isinstance(concurrency, int):
        return ConcurrencyLimiter(concurrency)
    if not is_concurrency_limiter(concurrency):
        raise TypeError(
            "concurrency must be an int (the requests in flight per key) or a concurrency "
            f"limiter (ConcurrencyLimiter, RedisConcurrencyLimiter), got {concurrency!r}"
        )
    return cast(ConcurrencyLimiterLike, concurrency)


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

    - ``limiter``: an in-process or Redis limiter, a function of the request
      returning one (a plan's, built once) or ``(policy_name, limiter)``, or a limit
      string (``"100/minute"``, :func:`bucketlimit.parse_limit`) built on
      ``storage`` by :func:`bucketlimit.limiter`. One attribute, read on every
      request: assigning another takes effect at once.
    - ``storage``: the storage URI of a limit string (``memory://``,
      ``redis://...``); ``None``: the app's (each adapter's :meth:`default_storage`),
      read when the limit first decides. A limit string may hold several limits
      joined by ``;`` (``"2/minute;10/hour"``): each is a limit of its own (its
      :attr:`parts`, named by their strings), all applied in order.
    - ``scope``: the buckets a limit string's limiter keeps are one set per
      (scope, limit), the same in process and in Redis: by default the route the
      limit is applied to (:meth:`attach`), else its name; the same ``scope`` on
      several limits shares one set of buckets across their routes
      (flask-limiter's ``shared_limit``).
    - ``key``: a function of the request returning a non-empty ``str`` (default:
      the adapter's ``remote_address``); ``None`` or ``""`` raises
      :class:`KeyFunctionError` rather than sharing one bucket.
    - ``cost``: an ``int`` or a function of the request; a cost above the
      capacity is refused with 413 (it can never pass).
    - ``name``: the policy name in the RateLimit fields; distinct per route
      (default ``"default"``, or the limit string for a limit string).
    - ``shadow``: decide, charge, report (fields, log, :attr:`shadow_refusals`),
      never refuse.
    - ``exempt``: a predicate of the request; true means no limit, no charge, no
      fields.
    - ``max_wait``: seconds a request that would be refused may wait for its
      tokens instead, on the limiter's clock (0, the default: refuse at once); a
      longer wait is refused at once, spending nothing.
    - ``pk``: ``True`` (or a shared secret, ``bytes``) adds draft-11's partition key.
    - ``headers``: the header profile(s), ``"draft-11"``, ``"legacy"``, ``"openai"``
      or a list (``[]``: none); ``None``: the app's (draft-11 unless it says).
    - ``on_refusal``: ``on_refusal(request, refusal)`` returns the response for a
      refusal by this limit (``None``: the app's, else the default problem).
    - ``concurrency``: at most that many requests of a key in flight at once: an
      ``int`` (an in-process ``ConcurrencyLimiter``, one per worker) or a
      concurrency limiter (``RedisConcurrencyLimiter`` across workers). The permit
      is taken first (waiting up to ``max_wait`` for one, in arrival order), then
      the tokens, and held until the response ends, its streamed body included
      (the adapter releases it). With a limiter too, the limit is two policies:
      ``name`` and :attr:`concurrency_name`. A concurrency limiter may also be
      given as ``limiter``, alone.
    - ``check_store``: ask the store of a Redis limiter (``check()``) once per
      process before it first decides, unless the app's start-up asked it already;
      one that does not answer raises :class:`StoreCheckError` (the request fails,
      and the next asks again). ``False``: never ask; the limiter's
      ``on_store_error`` policy answers.

    When several limits apply to a request and one refuses, the others' charges
    are refunded and their permits released: the request did not run. The
    functions may be ``async def`` where the framework is asyncio.
    """

    #: The key when none is given (each adapter's ``remote_address``).
    default_key: ClassVar[staticmethod[[Any], Any] | None] = None
    #: Whether a limit string on a Redis storage gets the asyncio limiter.
    storage_asyncio: ClassVar[bool] = False

    def __init__(
        self,
        limiter: AnyLimiter | PlanFunc[R] | str | ConcurrencyLimiterLike | None = None,
        *,
        concurrency: Concurrency | None = None,
        key: KeyFunc[R] | None = None,
        cost: CostSpec[R] = 1,
        name: str | None = None,
        shadow: bool = False,
        exempt: ExemptFunc[R] | None = None,
        pk: bool | bytes = False,
        max_wait: float = 0,
        storage: str | None = None,
        headers: Headers | None = None,
        on_refusal: RefusalHook | None = None,
        check_store: bool = True,
        scope: str | None = None,
    ) -> None:
        self.max_wait = _check_max_wait(max_wait)
        #: Whether the store of a Redis limiter is asked before it first decides.
        self.checks_store = bool(check_store)
        if key is None:
            key = type(self).default_key
        if not callable(key):
            raise TypeError(f"key must be a function of the request, got {key!r}")
        _check_functions(cost, exempt, on_refusal)
        self.headers = profiles.check_headers(headers)
        self._lock = threading.Lock()
        self._attached = False
        #: The limits of a string of several, each a limit of its own, applied in order.
        self.parts: tuple[LimitSettings[R], ...] = ()
        # A limit string's limiter is built on its storage (else the app's) when needed.
        self._string: LimitString | None = None
        self._pending = False
        self._limiter: Any = None
        self._concurrency: ConcurrencyLimiterLike | None = None
        texts = _limit_texts(limiter) if isinstance(limiter, str) else []
        if len(texts) > 1:
            self.parts = tuple(
                type(self)(
                    text,
                    name=text if name is None else f"{name} {text}",
                    concurrency=concurrency if i == 0 else None,
                    key=key,
                    cost=cost,
                    shadow=shadow,
                    exempt=exempt,
                    pk=pk,
                    max_wait=max_wait,
                    storage=storage,
                    headers=headers,
                    on_refusal=on_refusal,
                    check_store=check_store,
                    scope=scope,
                )
                for i, text in enumerate(texts)
            )
            limiter = concurrency = storage = scope = None
            if name is None:
                name = ";".join(texts)
        if is_concurrency_limiter(limiter) and not is_limiter(limiter):
            if concurrency is not None:
                raise TypeError(
                    f"a concurrency limiter as the limiter ({limiter!r}) and concurrency= "
                    f"({concurrency!r}) too: give one"
                )
            limiter, concurrency = None, cast(ConcurrencyLimiterLike, limiter)
        if concurrency is not None:
            self.concurrency = concurrency
        if limiter is None:
            if concurrency is None and not self.parts:
                raise TypeError(
                    "a Limit needs a limiter (or a function of the request returning one, "
                    "or a limit string), concurrency=, or both"
                )
            if storage is not None or scope is not None:
                raise TypeError(
                    f"storage= and scope= are for a limit string, not for "
                    f"concurrency={concurrency!r}"
                )
        elif isinstance(limiter, str):
            scope = None if scope is None else _check_name(scope, "scope")
            self._string, self._pending = LimitString(texts[0], storage, scope), True
            if name is None:
                name = texts[0]
        elif storage is not None or scope is not None:
            raise TypeError(f"storage= and scope= are for a limit string, not for {limiter!r}")
        else:
            self.limiter = cast("AnyLimiter | PlanFunc[R]", limiter)
        self.key = key
        self.cost = cost
        self.name = _check_name("default" if name is None else name)
        if self.headers is not None and profiles.OPENAI in self.headers:
            profiles.check_openai_name(self.name)
            profiles.check_openai_name(self.concurrency_name)
        self.shadow = bool(shadow)
        self.exempt = exempt
        self.on_refusal = on_refusal
        self._pk_secret = _check_pk(pk)
        #: What the limit counts per request (:meth:`stats`, :meth:`histograms`).
        self.counters = LimitCounters()
        _register(self)

    @property
    def scope(self) -> str | None:
        """The shared scope of a limit string's buckets (``scope=``), or ``None``."""
        return None if self._string is None else self._string.scope

    @property
    def limit_string(self) -> str | None:
        """The limit string whose limiter this limit uses (``"5/minute"``), or ``None``
        when it was given a limiter (or one was assigned since)."""
        string = self._string
        if string is None or not (self._pending or self._limiter is string.built):
            return None
        return string.text

    @property
    def bucket_scope(self) -> str:
        """Whose buckets a limit string's limiter keeps: the ``scope`` given, else the
        route the limit was attached to, else the limit's name."""
        return self.name if self._string is None else self._string.bucket_scope(self.name)

    @property
    def attached(self) -> bool:
        """Whether :meth:`attach` has said where the limit applies."""
        return self._attached

    def attach(self, route: str | None) -> None:
        """Says which route the limit is applied to (``None``: none, as for an app-wide
        limit), so that a limit string keeps that route's buckets
        (:attr:`bucket_scope`). The first call wins: one limit applied to several
        routes keeps one set of buckets, as one in-process limiter does. The adapters
        call it before the limit first decides, naming the first route of the app
        (in the app's own order, so the same in every process) that applies it: an
        endpoint (Flask), a URL pattern (Django), a method and path (FastAPI,
        Litestar); a DRF throttle's limit is its throttle class's."""
        for part in self.parts:
            part.attach(route)
        with self._lock:
            if self._attached:
                return
            self._attached = True
            string = self._string
            if string is not None:
                in_use = string.built is not None and self._limiter is string.built
                rebuilt = string.attach(route, in_use, self.name, self.storage_asyncio)
                if rebuilt is not None:  # built under its name before: now the route's
                    self._limiter = rebuilt

    def default_storage(self) -> str:
        """The storage of a limit string given none: the app's, where the adapter
        knows it (Flask's ``RATELIMIT_STORAGE_URI``, Django's ``BUCKETLIMIT_STORAGE``),
        else ``memory://``. Read once, when the limit first decides."""
        return "memory://"

    def _bind(self, storage: str | None) -> None:
        with self._lock:
            if not self._pending or self._string is None:
                return
            where = storage or self.default_storage()
            self.limiter = self._string.build(where, self.name, self.storage_asyncio)

    @property
    def bound(self) -> bool:
        """False while a limit string waits for its storage (until it first decides,
        or :attr:`limiter` is read, or :meth:`bind`)."""
        if self._pending:
            return False
        return not self.parts or all(part.bound for part in self.parts)

    def bind(self, storage: str | None = None) -> None:
        """Builds a limit string's limiter now: on its own ``storage=``, else on
        ``storage`` (the app's), else on :meth:`default_storage`; nothing for a limit
        that has its limiter."""
        for part in self.parts:
            part.bind(storage)
        self._bind(storage)

    @property
    def limiter(self) -> AnyLimiter | PlanFunc[R] | None:
        """The limiter (or the function choosing one; ``None`` for a limit of
        concurrency alone); assign to replace it. A limit string waiting for the
        app's storage is built on it when first read."""
        if self._pending:
            self._bind(None)
        return cast("AnyLimiter | PlanFunc[R] | None", self._limiter)

    @limiter.setter
    def limiter(self, limiter: AnyLimiter | PlanFunc[R] | None) -> None:
        if limiter is None and (self._concurrency is not None or self.parts):
            # concurrency alone, or a limit of several (its parts have the limiters)
            self._limiter, self._pending = None, False
            return
        if is_limiter(limiter):
            self.check_limiter(cast(AnyLimiter, limiter))
            self._check_can_wait(limiter)
        elif not callable(limiter):
            missing = next(m for m in ("allow", "peek", "refund") if not hasattr(limiter, m))
            raise TypeError(
                f"limiter has no {missing}() method, and is not a function of the request "
                f"returning a limiter: {limiter!r}"
            )
        self._limiter = limiter
        self._pending = False

    @property
    def concurrency(self) -> ConcurrencyLimiterLike | None:
        """The concurrency limiter (``None``: no concurrency limit); assign another
        (or an int: a new in-process one) and it takes effect at once."""
        return self._concurrency

    @concurrency.setter
    def concurrency(self, concurrency: Concurrency) -> None:
        checked = _check_concurrency(concurrency)
        self.check_limiter(checked)
        self._concurrency = checked

    @property
    def concurrency_name(self) -> str:
        """The policy name of the concurrency limit in the fields: :attr:`name` when
        it is the limit's only policy, else ``"<name>-concurrency"`` (next to the
        limiter's ``name``)."""
        if self._limiter is None and not self._pending:
            return self.name
        return f"{self.name}-concurrency"

    @property
    def window(self) -> int | None:
        """The ``w`` of the limiter's policy (``None`` for a plan function)."""
        limiter = self.limiter
        if not is_limiter(limiter):
            return None
        limiter = cast(AnyLimiter, limiter)
        return window_seconds(limiter.capacity, limiter.rate)

    def check_limiter(self, limiter: AnyLimiter | ConcurrencyLimiterLike) -> None:
        """Refuses a limiter (or concurrency limiter) this adapter cannot drive
        (``TypeError``); any by default."""

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
        return self.counters.shadow_refusals

    def stats(self) -> LimitStats:
        """What the limit counted, one outcome per request it decided
        (``requests_allowed``, ``requests_refused``, ``requests_given_back``,
        ``requests_abandoned``; :mod:`bucketlimit._web.counting` says which is
        which), ``shadow_refusals``; with a concurrency limit, its requests' permits
        in this process, named as a concurrency limiter names them: ``granted``,
        ``expired``, ``in_flight`` and ``waiting``; and the store's counters of its
        Redis limiters (``store_calls``, ``store_errors``, ...: :data:`STORE_STATS`,
        the sum of both when it has a limiter and a concurrency limiter). A limit of
        several limit strings counts on its :attr:`parts`. What
        ``bucketlimit.metrics`` exports under the limit's name."""
        stats = self.counters.stats(permits=self._concurrency is not None)
        for limiter in self._own_limiters():
            for name, value in limiter.stats().items():
                if name in STORE_STATS and isinstance(value, int):
                    stats[name] = stats.get(name, 0) + value
        return cast(LimitStats, stats)

    def histograms(self) -> list[tuple[str, dict[str, str], Histogram]]:
        """The limit's histograms, ``(name, labels, histogram)``: the seconds each
        request waited for its tokens (``wait_seconds``, ``resource="tokens"``) and
        for its permit (``resource="permit"``) when it may wait (``max_wait``), and
        its Redis limiters' ``store_round_trip_seconds``."""
        found: list[tuple[str, dict[str, str], Histogram]] = []
        if self.max_wait and (self._limiter is not None or self._pending):
            found.append(("wait_seconds", {"resource": "tokens"}, self.counters.token_waits))
        if self.max_wait and self._concurrency is not None:
            found.append(("wait_seconds", {"resource": "permit"}, self.counters.permit_waits))
        for limiter in self._own_limiters():
            timed = getattr(limiter, "histograms", None)
            if callable(timed):
                found += timed()
        return found

    def _own_limiters(self) -> list[Any]:
        """The limiters built for this limit (not a plan function's, nor a limit
        string's before it is built), whose store counters it reports."""
        own = [] if self._pending or not is_limiter(self._limiter) else [self._limiter]
        if self._concurrency is not None:
            own.append(self._concurrency)
        return [limiter for limiter in own if callable(getattr(limiter, "stats", None))]

    def checked_key(self, key: object, where: object) -> str:
        """The key function's answer, or a :class:`KeyFunctionError` if there is none."""
        if isinstance(key, str) and key:
            return key
        raise KeyFunctionError(
            f"the key function {getattr(self.key, '__qualname__', self.key)!r} of limit "
            f"{self.name!r} returned {key!r} for {where}; it must return a non-empty str "
            "(a missing key would put all such requests in one shared bucket)"
        )

    def procedure(
        self,
        request: R,
        limits_of: Callable[[], RequestLimitsLike],
        describe: Callable[[R], str],
        hold: Callable[[AnyLimiter, str, int, Decision], H],
    ) -> Procedure[tuple[H | None, bool]]:
        """Applies this limit to ``request``: the one procedure of every adapter,
        :func:`bucketlimit._web.procedure.apply_limit` (which says what it yields and
        returns), driven by its ``run`` or ``run_async``; a limit of several
        (:attr:`parts`) applies each in order (``apply_limits``)."""
        if self.parts:
            return apply_limits(self.parts, request, limits_of, describe, hold)
        return apply_limit(self, request, limits_of, describe, hold)

    def partition_key(self, name: str, key: str) -> bytes | None:
        """draft-11's ``pk`` of ``key`` under the policy ``name`` (``None`` without ``pk=``)."""
        return None if self._pk_secret is None else partition_key(self._pk_secret, name, key)

    def refuses(self, decision: Decision, key: str, cost: int, where: object) -> bool:
        """Whether to answer 429: counts and logs a shadow limit's would-be refusal."""
        if decision.allowed:
            return False
        if not self.shadow:
            return True
        self.counters.add("shadow_refusals")
        logger.info(
            "shadow limit %r would refuse %s (key %r, cost %d, retry after %s s)",
            self.name,
            str(where),
            key,
            cost,
            retry_after_seconds(decision),
        )
        return False
