"""``--concurrency N``: the traffic through a real ``ConcurrencyLimiter`` instead of a
bucket. Each request runs for its service time (``--service``, ``--service-dist``)
holding a permit; one that finds every permit of its key held is refused, or with
``--max-wait`` waits for one in arrival order, and is refused once it has waited
that long.

:func:`run_permits` is a discrete-event simulation on a ``ManualClock``: arrivals,
ends of service (the permit released), expiries (a request that runs longer than
the ``ttl`` loses its permit, as a holder that died would) and the ends of waits,
in time order; at one instant the ends come first (a slot freed at ``t`` serves a
request arriving at ``t``, and a waiter whose wait ends as a slot frees is granted,
as the limiter's own ``acquire`` is). Every grant is the limiter's ``try_acquire``
at that instant; the queue of waiters is kept here, first come first served per
key, as the limiter's ``acquire`` keeps its own (which needs threads or tasks that
really wait).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from bucketlimit import ConcurrencyLimiter, ConcurrencyStats
from bucketlimit._core import clock_to_micros
from bucketlimit._simulate.model import COLUMNS, SHARED_KEY, Request, Settings
from bucketlimit.testing import ManualClock


@dataclass(frozen=True)
class PermitSettings:
    """The concurrency mode's settings; the traffic options are the token mode's."""

    concurrency: int  # permits per key
    service: float  # seconds a request runs (the mean of a distribution)
    service_dist: str = "fixed"
    ttl: float = 60.0  # the permits' ttl
    max_wait: float = 0.0  # seconds a request may wait for a permit; inf: for ever
    pattern: str | None = None
    duration: float | int | None = None
    seed: int = 0
    offered_rate: float | None = None  # requests per second; None: twice the limit
    clients: int = 1
    shared: bool = False
    replay: str | Path | None = None

    @property
    def sustained(self) -> float:
        """Requests per second one key's permits serve when busy: N per service time."""
        return self.concurrency / self.service

    def traffic(self) -> Settings:
        """The token mode's settings whose traffic this mode replays: a bucket of
        ``concurrency`` that refills at :attr:`sustained` (so the patterns' sizes and
        default rates are those of the permits), each request costing 1."""
        return Settings(
            capacity=self.concurrency,
            rate=self.sustained,
            per=1,
            cost=1,
            pattern=self.pattern,
            duration=self.duration,
            seed=self.seed,
            offered_rate=self.offered_rate,
            clients=self.clients,
            shared=self.shared,
            replay=self.replay,
        )


class Served(NamedTuple):
    """What became of one request (a ``--format csv`` row)."""

    request: Request
    service_us: int
    start_us: int | None  # None: refused
    wait_us: int  # until it started, or was refused
    token: int  # the permit's fencing token (0: refused)


@dataclass
class PermitClient:
    """One client's requests and what became of them."""

    key: str
    bucket: str  # the limiter key it takes permits of (its own, or SHARED_KEY)
    offered: int = 0
    admitted: int = 0
    waited: int = 0  # admitted after a wait
    refused: int = 0
    peak: int = 0  # its requests running at once, at most


@dataclass
class PermitReplay:
    """What the run counted: outcomes, waits, peaks, and per time bin."""

    offered: int = 0
    admitted: int = 0
    refused_at_once: int = 0  # every permit held, and no wait allowed
    timed_out: int = 0  # refused after waiting max_wait
    waits_us: list[int] = field(default_factory=list)  # of the admitted that waited
    peak_in_flight: int = 0  # requests running at once (every key), at most
    peak_at_us: int = 0
    peak_waiting: int = 0  # requests waiting at once (every key), at most
    peak_waiting_at_us: int = 0
    busy_us: int = 0  # service time of the admitted within the run, summed
    last_end_us: int = 0
    admitted_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)  # by start
    refused_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)  # when refused
    waited_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)  # by arrival
    # The first client's key: its requests running, and waiting, at most in each bin.
    in_flight_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    waiting_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    clients: dict[str, PermitClient] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)  # with record=True, by arrival
    stats: ConcurrencyStats | None = None  # the limiter's, at the end

    @property
    def refused(self) -> int:
        return self.refused_at_once + self.timed_out

    @property
    def waited(self) -> int:
        return len(self.waits_us)


# What happens at an instant, in this order: a service ends (its permit released), a
# permit expires, a wait ends; then requests arrive.
_END, _EXPIRY, _GIVE_UP = 0, 1, 2


class _Run:
    """The state of one run: the event heap, the queues, what is running."""

    def __init__(
        self,
        limiter: ConcurrencyLimiter,
        clock: ManualClock,
        settings: PermitSettings,
        duration_us: int,
        keys: Sequence[str],
        record: bool,
    ) -> None:
        self.limiter = limiter
        self.clock = clock
        self.shared = settings.shared
        self.ttl_us = clock_to_micros(limiter.ttl)
        self.max_wait_us = (
            None if settings.max_wait == float("inf") else clock_to_micros(settings.max_wait)
        )
        self.duration_us = duration_us
        self.record = record
        self.replay = PermitReplay()
        for key in keys:
            self.replay.clients[key] = PermitClient(key, SHARED_KEY if self.shared else key)
        self.first = keys[0] if keys else None
        self.events: list[tuple[int, int, int, Any]] = []  # (time, kind, order, payload)
        self.order = 0
        self.queues: dict[str, deque[int]] = {}  # bucket -> waiting request indices
        self.waiting: dict[int, tuple[Request, int]] = {}  # index -> (request, service)
        self.running: dict[str, int] = {}  # bucket -> requests running
        self.runs_of: dict[str, int] = {}  # client key -> its requests running
        self.total_running = 0
        self.total_waiting = 0
        self.outcomes: dict[int, Served] = {}
        self.permits: dict[int, Any] = {}  # token -> the permit of a request that runs
        self.bin = 0  # the bin of the latest event, for the per-bin peaks

    # -- time and bins ---------------------------------------------------------------

    def bin_of(self, t: int) -> int:
        return min(COLUMNS - 1, t * COLUMNS // self.duration_us)

    def at(self, t: int) -> None:
        """Moves the clock to ``t``, carrying the first key's levels into the bins passed."""
        self.clock.set(t / 1e6)
        self.carry(self.bin_of(t))

    def carry(self, b: int) -> None:
        """The bins after the latest event's, up to ``b``, start at the levels now."""
        while self.bin < b:
            self.bin += 1
            self.replay.in_flight_per_bin[self.bin] = self._first_running()
            self.replay.waiting_per_bin[self.bin] = self._first_waiting()

    def _bucket_of_first(self) -> str | None:
        if self.first is None:
            return None
        return SHARED_KEY if self.shared else self.first

    def _first_running(self) -> int:
        bucket = self._bucket_of_first()
        return 0 if bucket is None else self.running.get(bucket, 0)

    def _first_waiting(self) -> int:
        bucket = self._bucket_of_first()
        return 0 if bucket is None else len(self.queues.get(bucket, ()))

    def _note_levels(self) -> None:
        replay, b = self.replay, self.bin
        replay.in_flight_per_bin[b] = max(replay.in_flight_per_bin[b], self._first_running())
        replay.waiting_per_bin[b] = max(replay.waiting_per_bin[b], self._first_waiting())

    def push(self, t: int, kind: int, payload: Any) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, kind, self.order, payload))

    # -- the events ------------------------------------------------------------------

    def arrive(self, index: int, request: Request, service_us: int) -> None:
        t = request.at
        self.at(t)
        bucket = SHARED_KEY if self.shared else request.key
        client = self._client(request.key, bucket)
        client.offered += 1
        self.replay.offered += 1
        queue = self.queues.setdefault(bucket, deque())
        if not queue:  # nobody waits: the limiter decides now
            permit = self.limiter.try_acquire(bucket)
            if permit:
                self.start(index, request, service_us, t, permit)
                return
        if self.max_wait_us == 0:
            self.refuse(index, request, service_us, t, at_once=True)
            return
        queue.append(index)  # first come, first served
        self.waiting[index] = (request, service_us)
        self.total_waiting += 1
        if self.total_waiting > self.replay.peak_waiting:
            self.replay.peak_waiting, self.replay.peak_waiting_at_us = self.total_waiting, t
        self.replay.waited_per_bin[self.bin_of(t)] += 1
        if self.max_wait_us is not None:
            self.push(t + self.max_wait_us, _GIVE_UP, index)
        self._note_levels()

    def start(self, index: int, request: Request, service_us: int, t: int, permit: Any) -> None:
        replay = self.replay
        token = permit.token
        self.permits[token] = permit
        bucket = SHARED_KEY if self.shared else request.key
        client = replay.clients[request.key]
        wait = t - request.at
        replay.admitted += 1
        client.admitted += 1
        if wait:
            replay.waits_us.append(wait)
            client.waited += 1
        replay.admitted_per_bin[self.bin_of(t)] += 1
        replay.busy_us += max(0, min(t + service_us, self.duration_us) - t)
        self.running[bucket] = self.running.get(bucket, 0) + 1
        self.runs_of[request.key] = self.runs_of.get(request.key, 0) + 1
        client.peak = max(client.peak, self.runs_of[request.key])
        self.total_running += 1
        if self.total_running > replay.peak_in_flight:
            replay.peak_in_flight, replay.peak_at_us = self.total_running, t
        self.push(t + service_us, _END, (request.key, bucket, token))
        if service_us > self.ttl_us:  # it loses its permit while it still runs
            self.push(t + self.ttl_us, _EXPIRY, bucket)
        if self.record:
            self.outcomes[index] = Served(request, service_us, t, wait, token)
        self._note_levels()

    def refuse(self, index: int, request: Request, service_us: int, t: int, at_once: bool) -> None:
        replay = self.replay
        if at_once:
            replay.refused_at_once += 1
        else:
            replay.timed_out += 1
        replay.clients[request.key].refused += 1
        replay.refused_per_bin[self.bin_of(t)] += 1
        if self.record:
            self.outcomes[index] = Served(request, service_us, None, t - request.at, 0)

    def end(self, t: int, key: str, bucket: str, token: int) -> None:
        self.at(t)
        self.permits.pop(token).release()  # frees nothing when it expired meanwhile
        self.running[bucket] -= 1
        self.runs_of[key] -= 1
        self.total_running -= 1
        self.replay.last_end_us = max(self.replay.last_end_us, t)
        self.serve(bucket, t)

    def serve(self, bucket: str, t: int) -> None:
        """Hands the free permits of ``bucket`` to its waiters, first come first."""
        queue = self.queues.get(bucket)
        while queue:
            index = queue[0]
            if index not in self.waiting:  # it gave up: gone from the queue
                queue.popleft()
                continue
            permit = self.limiter.try_acquire(bucket)
            if not permit:
                break
            queue.popleft()
            request, service_us = self.waiting.pop(index)
            self.total_waiting -= 1
            self.start(index, request, service_us, t, permit)
        self._note_levels()

    def give_up(self, t: int, index: int) -> None:
        found = self.waiting.pop(index, None)
        if found is None:  # it was served before its wait ended
            return
        self.at(t)
        request, service_us = found
        self.total_waiting -= 1
        self.refuse(index, request, service_us, t, at_once=False)
        self._note_levels()

    def _client(self, key: str, bucket: str) -> PermitClient:
        client = self.replay.clients.get(key)
        if client is None:
            client = self.replay.clients[key] = PermitClient(key, bucket)
        return client


def run_permits(
    limiter: ConcurrencyLimiter,
    clock: ManualClock,
    requests: Sequence[Request],
    services_us: Sequence[int],
    settings: PermitSettings,
    duration_us: int,
    *,
    keys: Sequence[str] = (),
    record: bool = False,
) -> PermitReplay:
    """Replays ``requests`` (in time order; ``services_us[i]`` is how long request
    ``i`` runs) through ``limiter`` on ``clock``; ``record`` keeps every request's
    :class:`Served` (the CSV rows), in arrival order."""
    run = _Run(limiter, clock, settings, duration_us, keys, record)

    def until(t: int | None) -> None:
        """Handles every event up to ``t`` (``None``: all of them)."""
        events = run.events
        while events and (t is None or events[0][0] <= t):
            when, kind, _, payload = heapq.heappop(events)
            if kind == _END:
                run.end(when, *payload)
            elif kind == _EXPIRY:
                run.at(when)
                run.serve(payload, when)
            else:
                run.give_up(when, payload)

    for index, request in enumerate(requests):
        until(request.at)
        run.arrive(index, request, services_us[index])
    until(None)  # the requests still running, or waiting, after the last arrival
    run.carry(COLUMNS - 1)
    replay = run.replay
    replay.stats = limiter.stats()
    if record:
        replay.served = [run.outcomes[i] for i in range(len(requests))]
    return replay
