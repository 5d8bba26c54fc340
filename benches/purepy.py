"""A pure-Python token bucket with a lock: the baseline a Python developer
would write in ten minutes, to show what moving the core to Rust buys.

Floats, ``time.monotonic``, one ``threading.Lock`` around a dict of
``[tokens, last]`` lists. It never forgets a key and answers with a plain
``bool`` (the cheapest possible result, which favours the baseline).
"""

from __future__ import annotations

import threading
import time


class PurePythonTokenBucket:
    """Per-key token buckets: ``capacity`` tokens, ``rate`` tokens per ``per`` seconds."""

    __slots__ = ("_buckets", "_capacity", "_lock", "_rate")

    def __init__(self, capacity: int, rate: float, per: float = 1.0) -> None:
        self._capacity = float(capacity)
        self._rate = rate / per
        self._lock = threading.Lock()
        self._buckets: dict[str, list[float]] = {}

    def allow(self, key: str, cost: int = 1) -> bool:
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = [self._capacity, now]
            tokens = min(self._capacity, bucket[0] + (now - bucket[1]) * self._rate)
            bucket[1] = now
            if tokens >= cost:
                bucket[0] = tokens - cost
                return True
            bucket[0] = tokens
            return False

    def __len__(self) -> int:
        return len(self._buckets)
