"""``--compare fixed-window``: the same requests through a fixed-window counter."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from bucketlimit import TokenBucketLimiter
from bucketlimit._simulate.counting import Comparison, busiest_key
from bucketlimit._simulate.model import COLUMNS, SHARED_KEY, Request, Settings


def window_like_bucket_us(settings: Settings, limiter: TokenBucketLimiter) -> int | None:
    """The fixed window with the bucket's capacity and long-run rate: capacity
    tokens per capacity / rate seconds (None for rate 0: one window)."""
    if limiter.rate == 0:
        return None
    return max(1, round(settings.capacity / limiter.rate * 1e6))


def fixed_window(
    requests: Sequence[Request],
    capacity: int,
    window_us: int | None,
    duration_us: int,
    *,
    shared: bool = False,
    origin_us: int = 0,
) -> Comparison:
    """The same requests through a fixed-window counter per key (one for all with
    ``shared``): windows start at multiples of ``window_us`` on the clock that
    read ``origin_us`` at time 0, and each admits at most ``capacity`` tokens."""
    comparison = Comparison("fixed window", window_us, origin_us)
    spent: dict[str, tuple[int, int]] = {}  # key -> (window index, tokens spent in it)
    for request in requests:
        key = SHARED_KEY if shared else request.key
        window = 0 if window_us is None else (origin_us + request.at) // window_us
        index, used = spent.get(key, (window, 0))
        if index != window:
            used = 0
        if used + request.cost <= capacity:
            used += request.cost
            comparison.admitted += 1
            comparison.admitted_cost += request.cost
            comparison.admitted_per_bin[request.at * COLUMNS // duration_us] += 1
            comparison.admitted_at.setdefault(key, array("q")).append(request.at)
        spent[key] = (window, used)
    comparison.busiest_second = busiest_key(comparison.admitted_at)
    return comparison
