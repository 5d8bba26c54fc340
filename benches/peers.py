"""Adapters that give every limiter in the benchmark one shape.

Each factory takes a :class:`Quota` (``capacity`` tokens of burst, refilled at
``rate`` tokens per ``per`` seconds) and returns a :class:`Subject`: the call
that is timed (``allow(key)``), the same with a cost (to drain a bucket), and
how to read the library's answer as allowed / refused.

Each peer is used the way its documentation shows, in its in-memory mode and,
where it has one, its Redis mode, configured to the closest equivalent of the
token bucket: a window of ``per`` seconds holding ``capacity`` for the window
strategies, a token bucket of ``capacity`` refilling at ``rate/per`` where the
library has one. Only the timed call is wrapped when the library's method does
not take ``(key)`` directly; a bound method is passed as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class Quota:
    """A bucket of ``capacity`` tokens refilling at ``rate`` tokens per ``per`` s."""

    capacity: int
    rate: int
    per: int


# Every call is allowed: a burst larger than any run spends between refills, a
# billion tokens a second. (Within bucketlimit's Redis range: 10**6 units per
# token, so (1 + 1000 capacities of debt) * capacity * 10**6 + p < 2**53.)
ALLOWED = Quota(capacity=8 * 10**6, rate=10**9, per=1)
# Ten tokens, then one an hour: after a drain, every call is refused.
REFUSED = Quota(capacity=10, rate=1, per=3600)


def _truthy(result: object) -> bool:
    return bool(result)


@dataclass
class Subject:
    """One limiter under test."""

    allow: Callable[[str], object]
    allow_cost: Callable[[str, int], object]
    allowed: Callable[[object], bool] = _truthy
    close: Callable[[], None] = field(default=lambda: None)


# --- baselines and bucketlimit ------------------------------------------------


def floor(q: Quota) -> Subject:
    from bucketlimit_floor import Floor

    f = Floor()
    return Subject(f.allow, f.allow)


def naive_rust(q: Quota) -> Subject:
    from bucketlimit_floor import NaiveLimiter

    n = NaiveLimiter(q.capacity, q.rate / q.per)
    return Subject(n.allow, n.allow)


def pure_python(q: Quota) -> Subject:
    from purepy import PurePythonTokenBucket

    p = PurePythonTokenBucket(q.capacity, q.rate, q.per)
    return Subject(p.allow, p.allow)


def bucketlimit_builtin(q: Quota) -> Subject:
    from bucketlimit import TokenBucketLimiter

    limiter = TokenBucketLimiter(q.capacity, q.rate, per=q.per)
    return Subject(limiter.allow, limiter.allow)


def bucketlimit_pyclock(q: Quota) -> Subject:
    from bucketlimit import TokenBucketLimiter

    limiter = TokenBucketLimiter(q.capacity, q.rate, time.monotonic, per=q.per)
    return Subject(limiter.allow, limiter.allow)


# --- in-memory peers -----------------------------------------------------------


def token_bucket(q: Quota) -> Subject:
    import token_bucket as tb

    limiter = tb.Limiter(q.rate / q.per, q.capacity, tb.MemoryStorage())
    return Subject(limiter.consume, limiter.consume)


def _limits_item(q: Quota) -> Any:
    from limits import RateLimitItemPerSecond

    # `capacity` per window of `per` seconds.
    return RateLimitItemPerSecond(q.capacity, q.per)


def _limits(strategy: str, storage: Any, q: Quota) -> Subject:
    from limits import strategies

    cls = {
        "fixed": strategies.FixedWindowRateLimiter,
        "sliding": strategies.SlidingWindowCounterRateLimiter,
        "moving": strategies.MovingWindowRateLimiter,
    }[strategy]
    limiter = cls(storage)
    item = _limits_item(q)
    hit = limiter.hit

    def allow(key: str) -> bool:
        return hit(item, key)

    def allow_cost(key: str, cost: int) -> bool:
        return hit(item, key, cost=cost)

    def close() -> None:
        # MemoryStorage runs a threading.Timer for expiry; let it finish.
        timer = getattr(storage, "timer", None)
        if timer is not None:
            timer.cancel()

    return Subject(allow, allow_cost, close=close)


def limits_fixed(q: Quota) -> Subject:
    from limits.storage import MemoryStorage

    return _limits("fixed", MemoryStorage(), q)


def limits_sliding(q: Quota) -> Subject:
    from limits.storage import MemoryStorage

    return _limits("sliding", MemoryStorage(), q)


def _pyrate(q: Quota, make_store: Callable[[str], Any], clock: Any) -> Subject:
    """pyrate-limiter's token bucket, one bucket per key.

    pyrate routes items to buckets through a BucketFactory; its docs show a
    factory that creates a bucket per item name. A StateBucket holds a
    constant-size state (no per-request log), so no Leaker is scheduled.
    """
    from pyrate_limiter import (
        BucketFactory,
        Duration,
        Limiter,
        Rate,
        RateItem,
        StateBucket,
        TokenBucket,
    )

    rate = Rate(q.rate, Duration.SECOND * q.per, burst=q.capacity)
    algorithm = TokenBucket()

    class PerKey(BucketFactory):
        def __init__(self) -> None:
            self.buckets: dict[str, StateBucket] = {}

        def wrap_item(self, name: str, weight: int = 1) -> RateItem:
            return RateItem(name, clock.now(), weight=weight)

        def get(self, item: RateItem) -> StateBucket:
            bucket = self.buckets.get(item.name)
            if bucket is None:
                bucket = StateBucket([rate], algorithm=algorithm, store=make_store(item.name))
                self.buckets[item.name] = bucket
            return bucket

    limiter = Limiter(PerKey())
    acquire = limiter.try_acquire

    def allow(key: str) -> bool:
        return acquire(key, blocking=False)  # type: ignore[return-value]

    def allow_cost(key: str, cost: int) -> bool:
        return acquire(key, cost, blocking=False)  # type: ignore[return-value]

    return Subject(allow, allow_cost)


def pyrate(q: Quota) -> Subject:
    from pyrate_limiter import InMemoryStateStore, MonotonicClock

    return _pyrate(q, lambda _key: InMemoryStateStore(), MonotonicClock())


def _throttled(q: Quota, store: Any, using: str = "token_bucket") -> Subject:
    from throttled import Throttled, per_duration

    if using in ("fixed_window", "sliding_window"):
        # A window holds `limit` per period, like limits' windows.
        quota = per_duration(timedelta(seconds=q.per), limit=q.capacity)
    else:
        quota = per_duration(timedelta(seconds=q.per), limit=q.rate, burst=q.capacity)
    throttle = Throttled(using=using, quota=quota, store=store)
    limit = throttle.limit

    def allow_cost(key: str, cost: int) -> object:
        return limit(key, cost)

    return Subject(limit, allow_cost, allowed=lambda r: not r.limited)  # type: ignore[attr-defined]


def throttled(q: Quota) -> Subject:
    from throttled import MemoryStore

    # The default MemoryStore is an LRU of 1,024 keys; a limiter that forgets
    # live buckets would be measured on a different job, so make it large.
    return _throttled(q, MemoryStore(options={"MAX_SIZE": 10**7}))


# name -> (factory, kind). Kind "floor" rows are baselines, "us" is bucketlimit.
IN_MEMORY: dict[str, tuple[Callable[[Quota], Subject], str]] = {
    "PyO3 floor (no-op allow)": (floor, "floor"),
    "naive Rust Mutex<HashMap>": (naive_rust, "baseline"),
    "pure Python + lock": (pure_python, "baseline"),
    "bucketlimit": (bucketlimit_builtin, "us"),
    "bucketlimit, clock=time.monotonic": (bucketlimit_pyclock, "us"),
    "token-bucket": (token_bucket, "peer"),
    "limits fixed window": (limits_fixed, "peer"),
    "limits sliding window counter": (limits_sliding, "peer"),
    "pyrate-limiter token bucket": (pyrate, "peer"),
    "throttled-py token bucket": (throttled, "peer"),
}


# --- Redis modes ---------------------------------------------------------------


def redis_client(port: int) -> Any:
    """One connection, no pool checkout per command: the client every Redis
    row uses unless it says otherwise."""
    import redis

    return redis.Redis(host="127.0.0.1", port=port, single_connection_client=True)


def limits_fixed_redis(q: Quota, port: int) -> Subject:
    from limits.storage import RedisStorage

    storage = RedisStorage(f"redis://127.0.0.1:{port}", single_connection_client=True)
    return _limits("fixed", storage, q)


def limits_sliding_redis(q: Quota, port: int) -> Subject:
    from limits.storage import RedisStorage

    storage = RedisStorage(f"redis://127.0.0.1:{port}", single_connection_client=True)
    return _limits("sliding", storage, q)


def limits_moving_redis(q: Quota, port: int) -> Subject:
    from limits.storage import RedisStorage

    storage = RedisStorage(f"redis://127.0.0.1:{port}", single_connection_client=True)
    return _limits("moving", storage, q)


def pyrate_redis(q: Quota, port: int) -> Subject:
    from pyrate_limiter import RedisStateStore, WallClock

    client = redis_client(port)
    return _pyrate(q, lambda key: RedisStateStore(client, f"pyrate:{key}"), WallClock())


def throttled_redis(q: Quota, port: int, using: str = "token_bucket") -> Subject:
    """throttled-py's Redis store: ``using`` is its algorithm (token_bucket, gcra,
    fixed_window, sliding_window, leaking_bucket)."""
    from throttled import RedisStore

    store = RedisStore(
        server=f"redis://127.0.0.1:{port}/0",
        options={"REDIS_CLIENT_KWARGS": {"single_connection_client": True}},
    )
    return _throttled(q, store, using)


REDIS_PEERS: dict[str, Callable[[Quota, int], Subject]] = {
    "limits fixed window": limits_fixed_redis,
    "limits sliding window counter": limits_sliding_redis,
    "pyrate-limiter token bucket": pyrate_redis,
    "throttled-py token bucket": throttled_redis,
}
