"""The native core of bucketlimit (Rust, PyO3). Hand-written stubs, checked by stubtest."""

from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable, Sequence
from types import TracebackType
from typing import Any, Generic, Literal, SupportsIndex, TypeVar, final, overload

from bucketlimit._stats import ConcurrencyStats, LimiterStats

__all__ = [
    "MAX_DEBT_CAPACITIES",
    "MAX_KEY_BYTES",
    "Acquiring",
    "ConcurrencyLimiter",
    "Decision",
    "Leases",
    "Permit",
    "Reservation",
    "TokenBucketLimiter",
    "__version__",
    "acquire_all",
    "acquire_all_async",
    "allow_all",
    "check_charge",
    "check_cost",
    "check_key",
    "clock_to_micros",
    "combine",
    "exact_units",
    "observation_cap",
    "reserve_all",
]

_Answer = TypeVar("_Answer", covariant=True)

MAX_DEBT_CAPACITIES: int
MAX_KEY_BYTES: int
__version__: str

#: One check: ``(limiter, key)`` charged the call's cost, or ``(limiter, key, cost)``.
_Check = tuple[TokenBucketLimiter, str] | tuple[TokenBucketLimiter, str, SupportsIndex]
#: One permit of a concurrency limiter: ``(limiter, key)`` or ``(limiter, key, 1)``.
_PermitCheck = tuple[ConcurrencyLimiter, str] | tuple[ConcurrencyLimiter, str, Literal[1]]

@final
class Decision:
    """The answer to one request: immutable, truthy when allowed, equal by value."""

    @property
    def allowed(self) -> bool:
        """Whether the request was admitted (and its cost spent)."""
    @property
    def retry_after(self) -> float:
        """Seconds until this same request would pass if nobody else spends.

        0.0 when allowed; ``math.inf`` when it never can (rate 0).
        """
    @property
    def remaining(self) -> int:
        """Whole tokens left after this decision."""
    @property
    def reset_after(self) -> float:
        """Seconds until the bucket is full again (``math.inf`` when never)."""
    @property
    def limit(self) -> int:
        """The bucket's capacity."""
    @property
    def degraded(self) -> bool:
        """True only when a distributed limiter answered from its fallback."""
    def __new__(
        cls,
        allowed: bool,
        retry_after: float,
        remaining: SupportsIndex,
        reset_after: float,
        limit: SupportsIndex,
        degraded: bool = False,
    ) -> Decision:
        """Every field is checked: ``TypeError`` for the wrong type, ``ValueError`` for a
        negative or NaN wait, or a count outside 0 .. 2**64 - 1."""
    def __bool__(self) -> bool: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...
    def __reduce__(self) -> tuple[type[Decision], tuple[bool, float, int, float, int, bool]]: ...

@final
class TokenBucketLimiter:
    """An in-process token-bucket limiter: one bucket per key, exact integer arithmetic.

    ``capacity`` tokens at most (the burst), refilled at ``rate`` tokens per ``per``
    seconds. ``clock`` is any zero-argument callable returning seconds; ``None`` uses
    a monotonic clock inside Rust. ``max_keys`` bounds the buckets held in memory.
    """

    def __new__(
        cls,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
        max_keys: SupportsIndex | None = None,
    ) -> TokenBucketLimiter: ...
    @staticmethod
    def _fallback(
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
    ) -> TokenBucketLimiter:
        """A limiter whose every answer says ``degraded=True``: a distributed limiter's
        local fallback (``bucketlimit._redis``)."""
    def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """Refills the key's bucket and spends ``cost`` tokens if it holds that many."""
    def peek(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """What ``allow`` would answer now; changes no state at all."""
    def refund(self, key: str, cost: SupportsIndex) -> None:
        """Gives back ``cost`` tokens reserved but not used; never above capacity."""
    def reserve(
        self, key: str, cost: SupportsIndex = 1, *, max_wait: float | None = None
    ) -> Reservation:
        """Takes ``cost`` tokens now, in debt if need be; ``delay`` says when they are yours.

        Refused at once, spending nothing, when the wait would exceed ``max_wait``
        seconds (``None``: no limit but the debt bound).
        """
    def acquire(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> Decision:
        """Blocks (GIL released) until the tokens are yours, or refuses at once when
        the wait would exceed ``timeout`` seconds."""
    def acquire_async(
        self, key: str, cost: SupportsIndex = 1, *, timeout: float | None = None
    ) -> Acquiring[Decision]:
        """``acquire`` for asyncio (a coroutine); a cancelled waiter gives its tokens back."""
    def charge(self, key: str, cost: SupportsIndex) -> Decision:
        """Records use that already happened: any cost >= 1, debt allowed."""
    def observe(
        self,
        key: str,
        remaining: SupportsIndex,
        *,
        limit: SupportsIndex | None = None,
        reset_after: float | None = None,
        retry_after: float | None = None,
        at: float | None = None,
    ) -> Decision:
        """Applies what an upstream reported for ``key`` (docs/design.md §4, "Following
        the upstream"): the bucket holds at most ``remaining`` tokens as of ``at``
        (refilled since at its own rate), never more than it did. With ``reset_after``
        (seconds until the upstream is full again) it reaches ``min(capacity,
        limit)`` no sooner than the upstream; with ``retry_after`` (a 429's hold) no
        request passes before then, and one token is there at its end, whatever the
        report says besides. ``at`` is a reading of the limiter's clock
        (``time.monotonic()`` for the built-in one; default: now); a stale report only
        bounds what it still implies. Answers the bucket as it stands after it:
        allowed when it holds a token, ``retry_after`` the wait for one."""
    def reset(self, key: str) -> None:
        """Makes the key's bucket full again."""
    def clear(self) -> None:
        """Forgets every bucket and releases the table's memory."""
    def __len__(self) -> int: ...
    def stats(self) -> LimiterStats:
        """Counters: allowed, refused, keys, evicted, refused_new_keys."""
    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float:
        """Tokens per second (``rate / per`` as given)."""
    @property
    def per(self) -> float: ...
    @property
    def max_keys(self) -> int | None: ...

@final
class Leases:
    """The leases one Redis limiter holds in this process (docs/design.md §6, "Hot
    keys: leases"), on its clock: the built-in monotonic clock, or the one given.
    Driven by ``bucketlimit._redis.leases``; times are µs of that clock."""

    def __new__(
        cls, capacity: SupportsIndex, clock: Callable[[], float] | None = None
    ) -> Leases: ...
    def take(self, key: str, cost: SupportsIndex = 1) -> Decision | None:
        """The lease's answer to ``allow(key, cost)``: allowed (spent from it), refused
        while it waits its turn, or ``None`` when no lease answers."""
    def peek(self, key: str, cost: SupportsIndex = 1) -> Decision | None:
        """What ``take`` would answer now, changing nothing."""
    def begin(self, key: str, cost: SupportsIndex) -> Decision | tuple[int, int, int, int] | None:
        """After ``take`` answered ``None``: a ``Decision`` (a lease answers after all),
        ``None`` (another caller renews this key: ask the shared bucket), or
        ``(unused, asked, elapsed, holders)`` to renew (``elapsed`` -1: no lease yet)."""
    def grant(
        self, key: str, tokens: int, start: int, deadline: int, reset_at: int, holders: int
    ) -> None:
        """The store granted a lease: ``tokens`` usable from ``start`` until ``deadline``
        (``reset_at`` ``2**63 - 1``: the bucket never fills)."""
    def ask(self, key: str, cost: int) -> None:
        """Counts ``cost`` tokens asked of ``key`` that no lease answered."""
    def end(self, key: str) -> None:
        """The key's renewal or give-back ended without a lease."""
    def due(self, most: int, idle: int) -> list[tuple[str, int]]:
        """Up to ``most`` ``(key, unused)`` leases past their deadline, taken out to be
        given back; keys idle ``idle`` µs are forgotten."""
    def drain(self) -> list[tuple[str, int]]:
        """Every ``(key, unused)`` lease holding tokens or recorded in the store (a
        spent one: unused 0), taken out to be given back."""
    def clear(self) -> None:
        """Forgets every lease and count (a forked child)."""
    def now(self) -> int:
        """This object's clock, in µs."""
    @property
    def hits(self) -> int:
        """Calls answered from a lease."""
    @property
    def waits(self) -> int:
        """Calls refused while a lease waited its turn."""
    def __len__(self) -> int: ...

@final
class Reservation:
    """Tokens taken from one or more buckets; truthy when granted.

    Use them after ``delay`` seconds; ``cancel()`` gives them back, ``settle(used)``
    turns the estimate into the actual use.
    """

    @property
    def delay(self) -> float:
        """Seconds until the tokens are yours (0.0: now); for a refusal, the wait it
        would have needed (``math.inf`` when never)."""
    @property
    def cost(self) -> int:
        """The tokens reserved (of the first bucket, for ``reserve_all``)."""
    @property
    def key(self) -> str:
        """The key (of the first bucket, for ``reserve_all``)."""
    @property
    def checks(self) -> tuple[tuple[TokenBucketLimiter | ConcurrencyLimiter, str, int], ...]:
        """Every check of the reservation: ``(limiter, key, cost)``, a permit's cost 1."""
    @property
    def permits(self) -> tuple[Permit, ...]:
        """The permits a granted reservation holds (``*_all`` with concurrency
        limiters), in the order of its checks; empty for a refusal."""
    @property
    def decision(self) -> Decision:
        """The ``Decision`` to report: allowed, or refused with ``retry_after``."""
    def __bool__(self) -> bool: ...
    def wait(self) -> Decision:
        """Blocks (GIL released) until the tokens are yours: ``delay`` after the
        reservation was made, on its limiter's clock (its ``sleep`` when it has one).
        Returns ``decision``; at once for a refusal. An exception while waiting
        cancels the reservation before it propagates."""
    def wait_async(self) -> Acquiring[Decision]:
        """``wait`` for asyncio (a coroutine answering ``decision``); cancelled while
        it sleeps, it cancels the reservation."""
    def cancel(self) -> None:
        """Gives every token back, capped at capacity and by docs/design.md §4 "Giving
        back" (not what a later waiter would share), and releases its permits. Once;
        nothing for a refusal."""
    def settle(self, used: SupportsIndex | Sequence[SupportsIndex]) -> None:
        """The actual use: gives back ``cost - used``, or charges ``used - cost`` more;
        releases its permits.

        One ``used`` for every check, or a sequence with one per check (a permit's is
        checked and otherwise ignored). Once.
        """

@final
class Acquiring(Coroutine[Any, Any, _Answer], Generic[_Answer]):
    """The coroutine of every ``acquire_async``: ``TokenBucketLimiter.acquire_async``,
    ``acquire_all_async`` and ``Reservation.wait_async`` (answering the ``Decision``,
    or with concurrency limiters among the checks the ``Reservation``) and
    ``ConcurrencyLimiter.acquire_async`` (the ``Permit``). ``await`` it, or give it to
    ``asyncio.create_task`` / ``asyncio.wait_for``. Cancelled, closed or collected
    while it waits, it gives back what it holds or waits for."""

    def __await__(self) -> Generator[Any, None, _Answer]: ...
    def __iter__(self) -> Acquiring[_Answer]: ...
    def __next__(self) -> Any: ...
    def send(self, value: Any, /) -> Any: ...
    def throw(self, error: Any, value: Any = None, traceback: Any = None, /) -> Any: ...
    def close(self) -> None: ...

@final
class ConcurrencyLimiter:
    """An in-process concurrency limiter: at most ``limit`` permits held per key.

    A permit not released within ``ttl`` seconds (since it was granted or last
    renewed) expires and frees its slot. Callers that wait are granted in arrival
    order (per key); every grant carries a fencing token, larger for every later
    grant of the key. ``clock`` is any zero-argument callable returning seconds
    (``None``: a monotonic clock inside Rust); ``max_keys`` bounds the keys held.
    """

    def __new__(
        cls,
        limit: SupportsIndex,
        *,
        ttl: float | SupportsIndex = 60.0,
        clock: Callable[[], float] | None = None,
        max_keys: SupportsIndex | None = None,
    ) -> ConcurrencyLimiter: ...
    def try_acquire(self, key: str) -> Permit:
        """A permit now, or a refusal (falsy); never waits, never jumps the queue."""
    def acquire(self, key: str, *, timeout: float | None = None) -> Permit:
        """Blocks (GIL released) until a permit is handed to it, in arrival order; a
        refusal (falsy) as soon as ``timeout`` seconds have passed."""
    def acquire_async(self, key: str, *, timeout: float | None = None) -> Acquiring[Permit]:
        """``acquire`` for asyncio (a coroutine); cancelled while it waits, it leaves the
        queue and holds nothing."""
    def in_flight(self, key: str) -> int:
        """Permits of ``key`` held now."""
    def stats(self) -> ConcurrencyStats:
        """Counters (granted, refused, released, expired, abandoned, refused_new_keys)
        and what is held now (keys, in_flight, waiting)."""
    @property
    def limit(self) -> int: ...
    @property
    def ttl(self) -> float:
        """Seconds a permit lives without a renewal."""
    @property
    def max_keys(self) -> int | None: ...

@final
class Permit:
    """A concurrency permit, truthy when granted; a refusal is falsy and holds nothing.

    A context manager, sync (``with``) and async (``async with``), that releases it on
    exit.
    """

    @property
    def key(self) -> str: ...
    @property
    def token(self) -> int:
        """The fencing token: larger for every later grant of the key (0 for a refusal),
        so a store can reject work from a holder whose permit expired."""
    @property
    def decision(self) -> Decision:
        """``limit`` = the limit, ``remaining`` = the permits free after this one; for a
        refusal ``retry_after`` = the time until a slot is sure to be free for it if no
        holder releases or renews (docs/design.md §4, "Permits")."""
    def __bool__(self) -> bool: ...
    def release(self) -> None:
        """Frees its slot for the key's first waiter. Once: later calls, and a call on a
        refusal or on an expired permit, free nothing (of anyone else's)."""
    def renew(self) -> bool:
        """Extends it to ``ttl`` seconds from now; False when it expired (or was
        released, or refused)."""
    def valid(self) -> bool:
        """Whether it is held now: granted, not released, not expired."""
    def __enter__(self) -> Permit: ...
    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
        /,
    ) -> None: ...
    def __aenter__(self) -> Awaitable[Permit]: ...
    def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
        /,
    ) -> Awaitable[None]: ...

# With concurrency limiters among the checks, allow_all, acquire_all and
# acquire_all_async answer the Reservation holding their permits.
@overload  # token buckets alone: the Decision (the second overload is the Reservation)
def allow_all(checks: Iterable[_Check], cost: SupportsIndex = 1) -> Decision: ...  # type: ignore[overload-overlap]
@overload
def allow_all(checks: Iterable[_Check | _PermitCheck], cost: SupportsIndex = 1) -> Reservation: ...
def reserve_all(
    checks: Iterable[_Check | _PermitCheck],
    cost: SupportsIndex = 1,
    *,
    max_wait: float | None = None,
) -> Reservation:
    """Reserves from every bucket at once, all or nothing; the delay is the longest.
    Concurrency limiters' permits are taken if free now."""

@overload  # token buckets alone (the next overload: with concurrency limiters)
def acquire_all(  # type: ignore[overload-overlap]
    checks: Iterable[_Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Decision: ...
@overload
def acquire_all(
    checks: Iterable[_Check | _PermitCheck],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Reservation: ...
@overload  # token buckets alone (the next overload: with concurrency limiters)
def acquire_all_async(  # type: ignore[overload-overlap]
    checks: Iterable[_Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Acquiring[Decision]: ...
@overload
def acquire_all_async(
    checks: Iterable[_Check | _PermitCheck],
    cost: SupportsIndex = 1,
    *,
    timeout: float | None = None,
) -> Acquiring[Reservation]: ...
def exact_units(
    capacity: SupportsIndex, rate: float | SupportsIndex, *, per: float | SupportsIndex = 1
) -> tuple[int, int, int]:
    """``(capacity, units refilled per microsecond, units per token)``, validated."""

def observation_cap(
    capacity: SupportsIndex,
    per_micro: SupportsIndex,
    unit: SupportsIndex,
    remaining: SupportsIndex,
    *,
    limit: SupportsIndex | None = None,
    reset_after: float | None = None,
    retry_after: float | None = None,
) -> int:
    """What ``observe`` reduces a report to: the most units the bucket may hold at the
    report's time, for the numbers of ``exact_units`` (the Redis limiter sends it)."""

def clock_to_micros(seconds: Any) -> int:
    """A clock reading in whole microseconds, by the limiter's own rule."""

def check_cost(cost: object, capacity: int) -> int:
    """Checks a cost as the limiter does (int, 1 <= cost <= capacity) and returns it."""

def check_charge(cost: object) -> int:
    """Checks a charge's cost as the limiter does (int, 1 <= cost <= 2**64 - 1)."""

def check_key(key: str) -> str:
    """Checks a key as the limiter does and returns it."""

def combine(decisions: Iterable[Decision]) -> Decision:
    """One decision for several, by the rule of ``allow_all``: allowed if all allow;
    ``retry_after`` the largest among the refusing (0.0 when none refuses, ``math.inf``
    when one never passes); ``remaining``, ``reset_after`` and ``limit`` from the one
    with the fewest remaining (the first on a tie); ``degraded`` if any is. No decision
    is a ``ValueError``, an item that is not a ``Decision`` a ``TypeError``."""
