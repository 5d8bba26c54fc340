"""The native core of bucketlimit (Rust, PyO3). Hand-written stubs, checked by stubtest."""

from collections.abc import Callable, Coroutine, Generator, Iterable, Sequence
from typing import Any, SupportsIndex, final

from bucketlimit._stats import LimiterStats

__all__ = [
    "MAX_DEBT_CAPACITIES",
    "MAX_KEY_BYTES",
    "Acquiring",
    "Decision",
    "Reservation",
    "TokenBucketLimiter",
    "__version__",
    "acquire_all",
    "acquire_all_async",
    "allow_all",
    "check_cost",
    "check_key",
    "clock_to_micros",
    "exact_units",
    "reserve_all",
]

MAX_DEBT_CAPACITIES: int
MAX_KEY_BYTES: int
__version__: str

#: One check: ``(limiter, key)`` charged the call's cost, or ``(limiter, key, cost)``.
_Check = tuple[TokenBucketLimiter, str] | tuple[TokenBucketLimiter, str, SupportsIndex]

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
    ) -> Acquiring:
        """``acquire`` for asyncio (a coroutine); a cancelled waiter gives its tokens back."""
    def charge(self, key: str, cost: SupportsIndex) -> Decision:
        """Records use that already happened: any cost >= 1, debt allowed."""
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
    def checks(self) -> tuple[tuple[TokenBucketLimiter, str, int], ...]:
        """Every bucket of the reservation: ``(limiter, key, cost)``."""
    @property
    def decision(self) -> Decision:
        """The ``Decision`` to report: allowed, or refused with ``retry_after``."""
    def __bool__(self) -> bool: ...
    def cancel(self) -> None:
        """Gives every token back, capped at capacity and by docs/design.md §4 "Giving
        back" (not what a later waiter would share). Once; nothing for a refusal."""
    def settle(self, used: SupportsIndex | Sequence[SupportsIndex]) -> None:
        """The actual use: gives back ``cost - used``, or charges ``used - cost`` more.

        One ``used`` for every bucket, or a sequence with one per bucket. Once.
        """

@final
class Acquiring(Coroutine[Any, Any, Decision]):
    """The coroutine of ``acquire_async`` and ``acquire_all_async``: ``await`` it, or
    give it to ``asyncio.create_task`` / ``asyncio.wait_for``."""

    def __await__(self) -> Generator[Any, None, Decision]: ...
    def __iter__(self) -> Acquiring: ...
    def __next__(self) -> Any: ...
    def send(self, value: Any, /) -> Any: ...
    def throw(self, error: Any, value: Any = None, traceback: Any = None, /) -> Any: ...
    def close(self) -> None: ...

def allow_all(checks: Iterable[_Check], cost: SupportsIndex = 1) -> Decision:
    """Spends each check's cost from every bucket only if all of them allow."""

def reserve_all(
    checks: Iterable[_Check], cost: SupportsIndex = 1, *, max_wait: float | None = None
) -> Reservation:
    """Reserves from every bucket at once, all or nothing; the delay is the longest."""

def acquire_all(
    checks: Iterable[_Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Decision:
    """``reserve_all``, then blocks for its delay; refused at once beyond ``timeout``."""

def acquire_all_async(
    checks: Iterable[_Check], cost: SupportsIndex = 1, *, timeout: float | None = None
) -> Acquiring:
    """``acquire_all`` for asyncio."""

def exact_units(
    capacity: SupportsIndex, rate: float | SupportsIndex, *, per: float | SupportsIndex = 1
) -> tuple[int, int, int]:
    """``(capacity, units refilled per microsecond, units per token)``, validated."""

def clock_to_micros(seconds: Any) -> int:
    """A clock reading in whole microseconds, by the limiter's own rule."""

def check_cost(cost: object, capacity: int) -> int:
    """Checks a cost as the limiter does (int, 1 <= cost <= capacity) and returns it."""

def check_key(key: str) -> str:
    """Checks a key as the limiter does and returns it."""
