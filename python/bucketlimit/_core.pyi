"""The native core of bucketlimit (Rust, PyO3). Hand-written stubs, checked by stubtest."""

from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex, final

from bucketlimit._stats import LimiterStats

__all__ = [
    "MAX_KEY_BYTES",
    "Decision",
    "TokenBucketLimiter",
    "__version__",
    "allow_all",
    "check_cost",
    "check_key",
    "clock_to_micros",
    "exact_units",
]

MAX_KEY_BYTES: int
__version__: str

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

def allow_all(
    checks: Iterable[tuple[TokenBucketLimiter, str]], cost: SupportsIndex = 1
) -> Decision:
    """Spends ``cost`` from every (limiter, key) only if all of them allow."""

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
