"""The run: asks the limiter about every request in time order and counts its answers.

:func:`run` is the one place a decision is made (``decide``, the limiter's
``allow`` by default); :class:`Replay` is what it counted, per client and per
time bin, which the report, the numbers and the picture only read.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._simulate.model import COLUMNS, SECOND_US, SHARED_KEY, Request
from bucketlimit.testing import ManualClock


@dataclass
class Client:
    """One client's requests and answers."""

    key: str
    bucket: str  # the limiter key it spends from (its own, or SHARED_KEY)
    offered: int = 0
    admitted: int = 0
    offered_cost: int = 0
    admitted_cost: int = 0
    waits: list[float] = field(default_factory=list)  # retry_after of each refusal
    admitted_at: array[int] = field(default_factory=lambda: array("q"))
    level_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)

    @property
    def refused(self) -> int:
        return self.offered - self.admitted


@dataclass
class Comparison:
    """The same requests through a fixed window: at most ``capacity`` per window."""

    name: str
    window_us: int | None  # None: one window for the whole run (rate 0)
    origin_us: int = 0  # the clock reading at time 0: windows start at its multiples
    admitted: int = 0
    admitted_cost: int = 0
    admitted_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    admitted_at: dict[str, array[int]] = field(default_factory=dict)  # per key
    # The key with the most admitted in any 1 s: (admitted, first, last time, key).
    busiest_second: tuple[int, int, int, str] = (0, 0, 0, "")


@dataclass
class Replay:
    """What the limiter answered, summed up, per client and per time bin."""

    offered: int = 0
    admitted: int = 0
    offered_cost: int = 0
    admitted_cost: int = 0
    # The most requests admitted at a single clock reading, and when.
    largest_instant: int = 0
    largest_instant_at: int = 0
    # The longest run of consecutive admitted requests, and its first/last times.
    longest_run: int = 0
    run_span: tuple[int, int] = (0, 0)
    # The most admitted in any 1 s: (requests, first and last admitted time).
    busiest_second: tuple[int, int, int] = (0, 0, 0)
    admitted_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    refused_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    # The same in tokens: what the bucket meters when requests cost differently.
    admitted_cost_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    refused_cost_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    # Whole tokens in the first client's bucket at the end of each bin.
    level_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    admitted_at: array[int] = field(default_factory=lambda: array("q"))
    clients: dict[str, Client] = field(default_factory=dict)
    compare: Comparison | None = None
    # Scratch for the counting: the current instant and run.
    _instant: int = field(default=-1, repr=False, compare=False)
    _at_instant: int = field(default=0, repr=False, compare=False)
    _run_length: int = field(default=0, repr=False, compare=False)
    _run_start: int = field(default=0, repr=False, compare=False)

    def count(self, request: Request, bucket: str, decision: Decision, b: int) -> None:
        """Adds one answer, for the request arriving in bin ``b``."""
        t = request.at
        client = self.clients.get(request.key)
        if client is None:
            client = self.clients[request.key] = Client(request.key, bucket)
        self.offered += 1
        self.offered_cost += request.cost
        client.offered += 1
        client.offered_cost += request.cost
        if t != self._instant:
            self._instant, self._at_instant = t, 0
        if not decision.allowed:
            self.refused_per_bin[b] += 1
            self.refused_cost_per_bin[b] += request.cost
            client.waits.append(decision.retry_after)
            self._run_length = 0
            return
        self.admitted += 1
        self.admitted_cost += request.cost
        self.admitted_per_bin[b] += 1
        self.admitted_cost_per_bin[b] += request.cost
        self.admitted_at.append(t)
        client.admitted += 1
        client.admitted_cost += request.cost
        client.admitted_at.append(t)
        self._at_instant += 1
        if self._at_instant > self.largest_instant:
            self.largest_instant, self.largest_instant_at = self._at_instant, t
        if self._run_length == 0:
            self._run_start = t
        self._run_length += 1
        if self._run_length > self.longest_run:
            self.longest_run, self.run_span = self._run_length, (self._run_start, t)


#: What :func:`run` asks about each request (the limiter's ``allow`` by default).
Decide = Callable[[TokenBucketLimiter, str, int], Decision]
#: Called with every request and its answer, in time order (the CSV rows).
Record = Callable[[Request, Decision], None]


def bin_end(b: int, duration_us: int) -> int:
    """First microsecond after bin ``b``; bin b holds the times t with t*COLUMNS//duration == b."""
    return -(-(b + 1) * duration_us // COLUMNS)


def _allow(limiter: TokenBucketLimiter, key: str, cost: int) -> Decision:
    return limiter.allow(key, cost)


def run(
    limiter: TokenBucketLimiter,
    clock: ManualClock,
    requests: Sequence[Request],
    duration_us: int,
    *,
    keys: Sequence[str] = (),
    shared: bool = False,
    decide: Decide = _allow,
    record: Record | None = None,
) -> Replay:
    """Asks the limiter about every request, in time order, and samples each
    client's bucket at each bin end. ``keys``: the clients to list first (the
    first one's bucket is charted); ``shared``: all clients spend from one key."""
    replay = Replay()
    for key in keys:
        replay.clients[key] = Client(key, SHARED_KEY if shared else key)
    b = 0
    for request in requests:
        t = request.at
        while t >= bin_end(b, duration_us):
            _sample_levels(replay, limiter, clock, b, duration_us)
            b += 1
        clock.set(t / 1e6)
        bucket = SHARED_KEY if shared else request.key
        decision = decide(limiter, bucket, request.cost)
        replay.count(request, bucket, decision, b)
        if record is not None:
            record(request, decision)
    while b < COLUMNS:
        _sample_levels(replay, limiter, clock, b, duration_us)
        b += 1
    replay.busiest_second = busiest(replay.admitted_at, SECOND_US)
    return replay


def _sample_levels(
    replay: Replay, limiter: TokenBucketLimiter, clock: ManualClock, b: int, duration_us: int
) -> None:
    # Whole tokens in the bucket: peek spends nothing, and for cost 1 it
    # reports the tokens left after a hypothetical spend when it would allow.
    clock.set(bin_end(b, duration_us) / 1e6)
    levels: dict[str, int] = {}
    for client in replay.clients.values():
        if client.bucket not in levels:
            decision = limiter.peek(client.bucket)
            levels[client.bucket] = decision.remaining + int(decision.allowed)
        client.level_per_bin[b] = levels[client.bucket]
    first = next(iter(replay.clients.values()), None)
    replay.level_per_bin[b] = limiter.capacity if first is None else first.level_per_bin[b]


def busiest(times: Sequence[int], width_us: int) -> tuple[int, int, int]:
    """``(n, first, last)``: the most of the sorted ``times`` in any ``width_us``
    microseconds, and the first and last of them."""
    best = (0, 0, 0)
    lo = 0
    for hi, t in enumerate(times):
        while t - times[lo] >= width_us:
            lo += 1
        if hi - lo + 1 > best[0]:
            best = (hi - lo + 1, times[lo], t)
    return best


def busiest_key(times_by_key: dict[str, array[int]]) -> tuple[int, int, int, str]:
    """The key with the most admitted in any 1 s: ``(n, first, last, key)``."""
    best = (0, 0, 0, "")
    for key, times in times_by_key.items():
        n, first, last = busiest(times, SECOND_US)
        if n > best[0]:
            best = (n, first, last, key)
    return best


def bucket_times(replay: Replay) -> dict[str, array[int]]:
    """The admitted times of each bucket of the limiter."""
    buckets: dict[str, list[array[int]]] = {}
    for client in replay.clients.values():
        buckets.setdefault(client.bucket, []).append(client.admitted_at)
    return {
        bucket: parts[0] if len(parts) == 1 else array("q", sorted(t for p in parts for t in p))
        for bucket, parts in buckets.items()
    }
