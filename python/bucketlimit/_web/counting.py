"""What a web limit counts, one outcome per request: its ``stats()`` and
``histograms()``, which ``bucketlimit.metrics`` exports under the limit's name
(docs/metrics.md, "Web limits").

A request a limit decides ends in exactly one outcome for that limit:

- ``allowed``: the limit admitted it and the request ran (its charge stands);
- ``refused``: the limit refused it;
- ``given_back``: the limit admitted it, another limit of the request refused it,
  and this limit's charge was given back (the request did not run);
- ``abandoned``: the client went away while the request waited, for this limit
  or a later one (nothing answered; every charge given back).

An admission is counted once the request's fate is known: when another limit
refuses, or when the adapter says the request goes on (``RequestLimits.answered``).
So ``allowed + refused + given_back`` is the requests the limit saw answered.
"""

from __future__ import annotations

import threading
from typing import Final

from bucketlimit._histogram import WAIT_BUCKETS, Histogram, fork_safe

ALLOWED: Final = "allowed"
REFUSED: Final = "refused"
GIVEN_BACK: Final = "given_back"
ABANDONED: Final = "abandoned"
OUTCOMES: Final = (ALLOWED, REFUSED, GIVEN_BACK, ABANDONED)


class LimitCounters:
    """One limit's counters (a lock: many threads serve requests)."""

    __slots__ = (
        "__weakref__",
        "_lock",
        "abandoned",
        "allowed",
        "given_back",
        "permit_waits",
        "permits_expired",
        "permits_granted",
        "permits_in_flight",
        "permits_waiting",
        "refused",
        "shadow_refusals",
        "token_waits",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.allowed = self.refused = self.given_back = self.abandoned = 0
        self.shadow_refusals = 0
        self.permits_granted = self.permits_expired = 0
        self.permits_in_flight = self.permits_waiting = 0
        #: Seconds each request that could wait (``max_wait``) waited for its tokens,
        #: and for its permit.
        self.token_waits = Histogram(WAIT_BUCKETS)
        self.permit_waits = Histogram(WAIT_BUCKETS)
        fork_safe(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def stats(self, permits: bool) -> dict[str, int]:
        """The counters; the permits' too when the limit has a concurrency limit."""
        with self._lock:
            stats = {
                "requests_allowed": self.allowed,
                "requests_refused": self.refused,
                "requests_given_back": self.given_back,
                "requests_abandoned": self.abandoned,
                "shadow_refusals": self.shadow_refusals,
            }
            if permits:  # named as a concurrency limiter's stats() names them
                stats.update(
                    granted=self.permits_granted,
                    expired=self.permits_expired,
                    in_flight=self.permits_in_flight,
                    waiting=self.permits_waiting,
                )
        return stats
