"""``python -m bucketlimit simulate``: replay traffic through a real limiter.

The simulation never sleeps: it steps a :class:`~bucketlimit.testing.ManualClock`
to each arrival, so a minute of traffic replays in milliseconds and the same
arguments always print the same report. Every decision in the report is an
answer of the real :class:`~bucketlimit.TokenBucketLimiter`.

The traffic is made up (``--pattern``, one client or ``--clients N``) or read
from a CSV file (``--replay``). One function, :func:`run`, asks the limiter
about every request in time order; the report (text, JSON or CSV), the picture
(``--plot``) and the fixed-window comparison (``--compare``) only read what it
counted. Another way of deciding (a mode that waits instead of refusing) slots
in as the ``decide`` argument of :func:`run`.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import random
import re
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import accumulate, count
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._core import check_cost, clock_to_micros
from bucketlimit.testing import ManualClock

PATTERNS = ("steady", "burst", "poisson", "boundary")
FORMATS = ("text", "json", "csv")
COMPARISONS = ("fixed-window",)

KEY = "simulated-client"  # the one client's key, without --clients or --replay keys
SHARED_KEY = "shared"  # the one bucket every client spends from with --shared
COLUMNS = 60  # chart width: one column per time bin
LEVEL_ROWS = 8  # height of the bucket-level chart
MAX_REQUESTS = 5_000_000  # keeps a typo in --duration from running for hours
MAX_CLIENTS = 1000
CLIENT_ROWS = 20  # clients listed in the text report (JSON and CSV have them all)
SECOND_US = 1_000_000  # the burst figure: the most admitted in any 1 s

# Nine heights per character cell: empty, then 1/8 .. 8/8 filled.
BLOCKS = " ▁▂▃▄▅▆▇█"
ASCII_BLOCKS = " .:-=+*#@"


class SimulationError(Exception):
    """Arguments that make no simulation; the command line prints it as a usage error."""


@dataclass(frozen=True)
class Settings:
    capacity: int
    rate: float | int
    per: float | int
    cost: int
    pattern: str | None  # None with ``replay``
    duration: float | int | None  # None with ``replay``: up to the file's last request
    seed: int = 0
    offered_rate: float | None = None  # requests per second; None: twice the limit
    clients: int = 1  # client 1 sends ``pattern``; the others steady, within the limit
    shared: bool = False  # every client spends from one bucket (a global limit)
    replay: str | Path | None = None  # a CSV file of requests: time[,key[,cost]]
    compare: str | None = None  # "fixed-window": the same traffic through a fixed window
    acquire: bool = False  # pace requests (reserve and wait) instead of refusing them
    max_wait: float | None = None  # with acquire: the longest wait; None: no limit


class Request(NamedTuple):
    at: int  # integer microseconds from the start of the run
    key: str  # the client
    cost: int


@dataclass(frozen=True)
class Traffic:
    requests: list[Request]  # sorted by time
    offered_rate: float  # average requests per second
    limit_rate: float  # requests per second one bucket sustains
    shape: str
    keys: tuple[str, ...] = ()  # the clients in the order to report them (others: as seen)
    # The clock reading of time 0 (a replay's earliest request): fixed windows
    # start at multiples of their length on this clock, as a real one's would.
    origin_us: int = 0

    @property
    def arrivals(self) -> list[int]:
        return [request.at for request in self.requests]


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
            client.waits.append(decision.retry_after)
            self._run_length = 0
            return
        self.admitted += 1
        self.admitted_cost += request.cost
        self.admitted_per_bin[b] += 1
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


def simulate(
    settings: Settings,
    out: TextIO,
    *,
    ascii_only: bool = False,
    output_format: str = "text",
    plot: str | Path | None = None,
) -> Replay:
    """Validates ``settings``, replays the traffic and writes the report to ``out``:
    text, ``json`` or ``csv`` (one row per request); ``plot`` also draws a PNG."""
    if output_format not in FORMATS:
        raise SimulationError(f"unknown format {output_format!r}: choose from {FORMATS}")
    if settings.acquire and (output_format != "text" or plot is not None):
        raise SimulationError("--acquire reports as text only (no --format or --plot)")
    draw = _plotter() if plot is not None else None  # a missing matplotlib fails first
    limiter, clock = _build(settings)
    traffic, duration_us = _traffic(settings, limiter)
    if settings.acquire:
        arrivals = [request.at for request in traffic.requests]
        replay, paced = run_paced(limiter, clock, settings, arrivals, duration_us)
        text = report(settings, limiter, traffic, replay, duration_us, ascii_only=ascii_only)
        out.write(text + paced_report(settings, paced))
        return replay
    record = _csv_writer(out) if output_format == "csv" else None
    replay = run(
        limiter,
        clock,
        traffic.requests,
        duration_us,
        keys=traffic.keys,
        shared=settings.shared,
        record=record,
    )
    if settings.compare is not None:
        replay.compare = fixed_window(
            traffic.requests,
            settings.capacity,
            _window_us(settings, limiter),
            duration_us,
            shared=settings.shared,
            origin_us=traffic.origin_us,
        )
    if output_format == "text":
        out.write(report(settings, limiter, traffic, replay, duration_us, ascii_only=ascii_only))
    elif output_format == "json":
        json.dump(summary(settings, limiter, traffic, replay, duration_us), out, indent=2)
        out.write("\n")
    if draw is not None and plot is not None:
        draw(Path(plot), settings, limiter, replay, duration_us)
    return replay


def _build(settings: Settings) -> tuple[TokenBucketLimiter, ManualClock]:
    """The limiter checks its own arguments; its errors become usage errors."""
    if settings.replay is None and settings.pattern not in PATTERNS:
        raise SimulationError(f"unknown pattern {settings.pattern!r}: choose from {PATTERNS}")
    if settings.compare is not None and settings.compare not in COMPARISONS:
        raise SimulationError(f"unknown comparison {settings.compare!r}: choose {COMPARISONS}")
    if settings.acquire and (
        settings.clients != 1 or settings.replay is not None or settings.compare is not None
    ):
        raise SimulationError(
            "--acquire paces one client's traffic: it goes without --clients, --replay "
            "and --compare"
        )
    if not 1 <= settings.clients <= MAX_CLIENTS:
        raise SimulationError(f"clients must be 1 to {MAX_CLIENTS}, got {settings.clients!r}")
    clock = ManualClock()
    try:
        limiter = TokenBucketLimiter(settings.capacity, settings.rate, clock, per=settings.per)
        limiter.peek(KEY, settings.cost)  # rejects a cost the limiter would reject
    except (TypeError, ValueError) as error:
        raise SimulationError(str(error)) from None
    if settings.offered_rate is not None and not 0 < settings.offered_rate < float("inf"):
        raise SimulationError(
            f"offered rate must be a finite number > 0, got {settings.offered_rate!r}"
        )
    return limiter, clock


def _duration_us(duration: object) -> int:
    try:
        # The limiter's own rounding to microseconds, and its range check.
        duration_us = clock_to_micros(duration)
    except (TypeError, ValueError):
        duration_us = 0
    if duration_us <= 0:
        raise SimulationError(
            f"duration must be a finite number of seconds >= 1e-06, got {duration!r}"
        )
    return duration_us


def _traffic(settings: Settings, limiter: TokenBucketLimiter) -> tuple[Traffic, int]:
    if settings.replay is not None:
        return read_replay(settings, limiter)
    duration_us = _duration_us(settings.duration)
    return make_traffic(settings, limiter.rate, duration_us), duration_us


def make_traffic(settings: Settings, tokens_per_second: float, duration_us: int) -> Traffic:
    """Requests for the pattern; only ``poisson`` draws from ``settings.seed``.

    With ``clients > 1`` client 1 sends the pattern and every other client sends
    steady traffic at half what one bucket sustains, so the noisy client is the
    only one over the limit.
    """
    seconds = duration_us / 1e6
    # The request rate the limit sustains; with rate 0 (a one-off quota) the
    # quota spread over the whole run, so the default traffic still exceeds it.
    limit = tokens_per_second / settings.cost or settings.capacity / settings.cost / seconds
    first = KEY if settings.clients == 1 else "client-1"
    arrivals, offered, shape = _pattern(settings, limit, duration_us)
    streams = [[Request(t, first, settings.cost) for t in arrivals]]
    if settings.clients > 1:
        calm = limit / 2
        others = "client-2" if settings.clients == 2 else f"client-2..{settings.clients}"
        shape = f"client-1: {shape}; {others}: steady, {_num(calm)} requests/s each"
        _check_volume(offered * seconds + calm * seconds * (settings.clients - 1))
        for i in range(2, settings.clients + 1):
            # Spread the steady clients over the period, so they do not all arrive at once.
            phase = (i - 1) / settings.clients
            times = (round((n + phase) * 1e6 / calm) for n in count())
            streams.append(
                [Request(t, f"client-{i}", settings.cost) for t in _until(duration_us, times)]
            )
        offered += calm * (settings.clients - 1)
    # Time order; at one instant, client 1 first (heapq.merge is stable).
    requests = list(heapq.merge(*streams, key=lambda r: r.at))
    keys = (first, *(f"client-{i}" for i in range(2, settings.clients + 1)))
    return Traffic(requests, offered, limit, shape, keys)


def _pattern(settings: Settings, limit: float, duration_us: int) -> tuple[list[int], float, str]:
    """One client's arrival times, its average rate and a description."""
    seconds = duration_us / 1e6
    if settings.pattern == "boundary":
        if settings.offered_rate is not None:
            raise SimulationError("--offered-rate does not apply to the boundary pattern")
        # A full bucket's worth just before and again just after every multiple
        # of the window (capacity / rate): a fixed window admits both.
        size = settings.capacity // settings.cost
        window_us = max(2, round(size / limit * 1e6))
        delta = max(1, window_us // 20)
        pairs = _until(duration_us + delta, (k * window_us for k in count(1)))
        _check_volume(2 * size * len(pairs))
        arrivals = [
            t
            for edge in pairs
            for t in (edge - delta, edge + delta)
            if t < duration_us
            for _ in range(size)
        ]
        offered = len(arrivals) / seconds
        shape = (
            f"boundary, {size} requests at once {_num(delta / 1e6)} s before and after every "
            f"{_num(window_us / 1e6)} s"
        )
        return arrivals, offered, shape
    offered = settings.offered_rate or 2 * limit
    _check_volume(offered * seconds)
    if settings.pattern == "steady":
        # Request i arrives at exactly i / offered seconds.
        arrivals = _until(duration_us, (round(i * 1e6 / offered) for i in count()))
        shape = f"steady, one request every {_num(1 / offered)} s"
    elif settings.pattern == "burst":
        # Bursts larger than the bucket: twice the requests a full bucket
        # admits, all at one instant, then idle so the average is `offered`.
        size = 2 * (settings.capacity // settings.cost)
        period_us = max(1, round(size / offered * 1e6))
        offered = size * 1e6 / period_us  # exact after rounding the period
        starts = _until(duration_us, (k * period_us for k in count()))
        _check_volume(len(starts) * size)  # one burst alone can be huge
        arrivals = [start for start in starts for _ in range(size)]
        shape = f"burst, {size} requests at once every {_num(period_us / 1e6)} s, idle between"
    else:
        # Exponential gaps with mean 1/offered: a Poisson process.
        rng = random.Random(settings.seed)
        times = accumulate(rng.expovariate(offered) for _ in count())
        arrivals = _until(duration_us, (round(t * 1e6) for t in times))
        shape = f"poisson, random arrivals (seed {settings.seed})"
    return arrivals, offered, shape


def _check_volume(requests: float) -> None:
    if requests > MAX_REQUESTS:
        raise SimulationError(
            f"about {requests:.0f} requests is too many to replay (at most {MAX_REQUESTS}): "
            "shorten --duration or lower --offered-rate, --capacity or --clients"
        )


def _until(end_us: int, times: Iterable[int]) -> list[int]:
    """The times before ``end_us`` of a nondecreasing, endless sequence."""
    taken = []
    for t in times:
        if t >= end_us:
            break
        taken.append(t)
    return taken


def read_replay(settings: Settings, limiter: TokenBucketLimiter) -> tuple[Traffic, int]:
    """Requests from a CSV file: a time in each row (seconds, or an ISO 8601 date
    and time), then optionally a key and a cost. A first row with a ``time``
    column names the columns (``time``, ``key``, ``cost``, in any order). Times
    count from the earliest (a fixed window of ``--compare`` keeps to the file's
    own clock); the rows need not be sorted."""
    assert settings.replay is not None
    path = Path(settings.replay)
    if settings.pattern is not None or settings.offered_rate is not None or settings.clients > 1:
        raise SimulationError(
            "--replay takes its traffic from the file: leave out --pattern, --offered-rate "
            "and --clients"
        )
    try:
        with path.open(newline="", encoding="utf-8") as file:
            rows = [(n, row) for n, row in enumerate(csv.reader(file), 1) if any(row)]
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise SimulationError(f"cannot read {str(path)!r}: {error}") from None
    columns = {"time": 0, "key": 1, "cost": 2}
    if rows and "time" in (name.strip().lower() for name in rows[0][1]):
        header = [name.strip().lower() for name in rows.pop(0)[1]]
        columns = {name: header.index(name) for name in ("time", "key", "cost") if name in header}
    parsed = [_replay_row(path, n, row, columns, settings, limiter.capacity) for n, row in rows]
    if not parsed:
        raise SimulationError(f"{str(path)!r} holds no requests")
    start = min(t for t, _, _ in parsed)
    requests = sorted(
        (Request(t - start, key, cost) for t, key, cost in parsed), key=lambda r: r.at
    )
    if settings.duration is None:
        # Whole seconds, past the last request.
        duration_us = -(-(requests[-1].at + 1) // SECOND_US) * SECOND_US
    else:
        duration_us = _duration_us(settings.duration)
        requests = [r for r in requests if r.at < duration_us]
    _check_volume(len(requests))
    seconds = duration_us / 1e6
    limit = limiter.rate / settings.cost or settings.capacity / settings.cost / seconds
    keys = len({r.key for r in requests})
    shape = f"{len(requests)} requests from {path.name}, {keys} {'key' if keys == 1 else 'keys'}"
    traffic = Traffic(requests, len(requests) / seconds, limit, shape, origin_us=start)
    return traffic, duration_us


def _replay_row(
    path: Path,
    n: int,
    row: list[str],
    columns: dict[str, int],
    settings: Settings,
    capacity: int,
) -> tuple[int, str, int]:
    def cell(name: str) -> str | None:
        i = columns.get(name)
        return row[i].strip() if i is not None and i < len(row) and row[i].strip() else None

    where = f"{path.name} line {n}"
    text = cell("time")
    if text is None:
        raise SimulationError(f"{where}: no time in {row!r}")
    at = _timestamp(text, where)
    key = cell("key") or KEY
    cost_text = cell("cost")
    try:
        cost = check_cost(settings.cost if cost_text is None else int(cost_text), capacity)
    except (TypeError, ValueError) as error:
        raise SimulationError(f"{where}: cost {cost_text!r}: {error}") from None
    return at, key, cost


def _timestamp(text: str, where: str) -> int:
    """Integer microseconds: seconds as a number, or an ISO 8601 date and time."""
    try:
        return clock_to_micros(float(text))
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(_iso_for_python_3_10(text))
    except ValueError:
        raise SimulationError(
            f"{where}: time {text!r} is neither seconds nor an ISO 8601 date and time"
        ) from None
    return round(moment.timestamp() * 1e6) if moment.tzinfo else _naive_us(moment)


# Python 3.10's fromisoformat reads only what isoformat writes: no "Z", and a
# fraction of exactly 3 or 6 digits. 3.11 reads any ISO 8601 time.
_ISO_FRACTION = re.compile(r"(T\d{2}:\d{2}:\d{2})\.(\d{1,6})(?=$|[+-])")


def _iso_for_python_3_10(text: str) -> str:
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    return _ISO_FRACTION.sub(lambda m: f"{m[1]}.{m[2].ljust(6, '0')}", text, count=1)


def _naive_us(moment: datetime) -> int:
    delta = moment - datetime(1970, 1, 1)
    return (delta.days * 86_400 + delta.seconds) * SECOND_US + delta.microseconds


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


def _window_us(settings: Settings, limiter: TokenBucketLimiter) -> int | None:
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


# -- the numbers: JSON and CSV -------------------------------------------------------


def summary(
    settings: Settings,
    limiter: TokenBucketLimiter,
    traffic: Traffic,
    replay: Replay,
    duration_us: int,
) -> dict[str, Any]:
    """Everything the text report says, as plain data (``--format json``)."""
    seconds = duration_us / 1e6
    buckets = len({client.bucket for client in replay.clients.values()}) or 1
    bound = settings.capacity + limiter.rate * seconds
    n, first, last = replay.busiest_second
    data: dict[str, Any] = {
        "settings": {
            "capacity": settings.capacity,
            "rate": settings.rate,
            "per": settings.per,
            "tokens_per_second": limiter.rate,
            "cost": settings.cost,
            "pattern": settings.pattern,
            "replay": None if settings.replay is None else str(settings.replay),
            "clients": len(replay.clients),
            "shared": settings.shared,
            "seed": settings.seed,
            "duration": seconds,
        },
        "traffic": {
            "shape": traffic.shape,
            "offered_rate": traffic.offered_rate,
            "limit_rate": traffic.limit_rate,
        },
        "offered": {"requests": replay.offered, "cost": replay.offered_cost},
        "admitted": {"requests": replay.admitted, "cost": replay.admitted_cost},
        "refused": {
            "requests": replay.offered - replay.admitted,
            "cost": replay.offered_cost - replay.admitted_cost,
        },
        "busiest_second": {"admitted": n, "first": first / 1e6, "last": last / 1e6},
        "largest_instant": {
            "admitted": replay.largest_instant,
            "at": replay.largest_instant_at / 1e6,
        },
        "longest_run": {
            "admitted": replay.longest_run,
            "first": replay.run_span[0] / 1e6,
            "last": replay.run_span[1] / 1e6,
        },
        "bound": {"per_bucket": bound, "buckets": buckets, "total": bound * buckets},
        "clients": [_client_summary(client, replay) for client in replay.clients.values()],
        "bins": [
            {
                "start": bin_end(b - 1, duration_us) / 1e6 if b else 0.0,
                "end": bin_end(b, duration_us) / 1e6,
                "admitted": replay.admitted_per_bin[b],
                "refused": replay.refused_per_bin[b],
                "level": replay.level_per_bin[b],
            }
            for b in range(COLUMNS)
        ],
        "stats": limiter.stats(),
    }
    if replay.compare is not None:
        c = replay.compare
        data["compare"] = {
            "name": settings.compare,
            "window": None if c.window_us is None else c.window_us / 1e6,
            "limit_per_window": settings.capacity,
            "admitted": {"requests": c.admitted, "cost": c.admitted_cost},
            "admitted_per_bin": c.admitted_per_bin,
            # The busiest key's most admitted in any 1 s, on each side.
            "busiest_second": {
                "token_bucket": _busiest_summary(busiest_key(bucket_times(replay))),
                "fixed_window": _busiest_summary(c.busiest_second),
                "token_bucket_bound": settings.capacity + limiter.rate,
            },
        }
    return data


def _busiest_summary(busiest: tuple[int, int, int, str]) -> dict[str, Any]:
    n, first, last, key = busiest
    return {"admitted": n, "first": first / 1e6, "last": last / 1e6, "key": key}


def _client_summary(client: Client, replay: Replay) -> dict[str, Any]:
    n, first, last = busiest(client.admitted_at, SECOND_US)
    waits = sorted(client.waits)
    return {
        "key": client.key,
        "bucket": client.bucket,
        "offered": client.offered,
        "admitted": client.admitted,
        "refused": client.refused,
        "offered_cost": client.offered_cost,
        "admitted_cost": client.admitted_cost,
        "admitted_share": client.admitted / replay.admitted if replay.admitted else 0.0,
        "busiest_second": {"admitted": n, "first": first / 1e6, "last": last / 1e6},
        # retry_after of the refusals: how long a refused caller is told to wait.
        "wait": {
            "mean": _finite(sum(waits) / len(waits)) if waits else 0.0,
            "median": _finite(waits[len(waits) // 2]) if waits else 0.0,
            "max": _finite(waits[-1]) if waits else 0.0,
        },
    }


def _finite(x: float) -> float | None:
    """JSON has no infinity: a wait that never ends (rate 0) is null."""
    return x if math.isfinite(x) else None


CSV_COLUMNS = ("time", "key", "cost", "allowed", "retry_after", "remaining")


def _csv_writer(out: TextIO) -> Record:
    """``--format csv``: one row per request with the limiter's answer."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)

    def record(request: Request, decision: Decision) -> None:
        writer.writerow(
            (
                f"{request.at / 1e6:.6f}",
                request.key,
                request.cost,
                int(decision.allowed),
                f"{decision.retry_after:.6f}",
                decision.remaining,
            )
        )

    return record


# -- the text report -----------------------------------------------------------------


def report(
    settings: Settings,
    limiter: TokenBucketLimiter,
    traffic: Traffic,
    replay: Replay,
    duration_us: int,
    *,
    ascii_only: bool = False,
) -> str:
    seconds = duration_us / 1e6
    refused = replay.offered - replay.admitted
    refused_cost = replay.offered_cost - replay.admitted_cost
    bound = settings.capacity + limiter.rate * seconds
    buckets = len({client.bucket for client in replay.clients.values()}) or 1
    start, end = replay.run_span
    most, first, last = replay.busiest_second
    bound_line = (
        f"bound over T seconds:   capacity + rate/per*T = {settings.capacity} + "
        f"{_num(limiter.rate)}*{_num(seconds)} = {_num(bound)} ({bound / seconds:.3f}/s)"
    )
    if buckets > 1:
        bound_line += f" per key, {_num(bound * buckets)} for {buckets} keys"
    lines = [
        f"simulate: capacity {settings.capacity}, rate {_num(settings.rate)} per "
        f"{_num(settings.per)} s ({_num(limiter.rate)} tokens/s), cost {settings.cost}",
        f"traffic:  {_num(seconds)} s of {traffic.shape}",
        f"          {_num(traffic.offered_rate)} requests/s on average, "
        f"{traffic.offered_rate / traffic.limit_rate / buckets:.3g}x what "
        + ("the limit sustains" if buckets == 1 else f"{buckets} keys' limits sustain"),
        "",
        f"{'':10}{'requests':>10}{'cost':>10}",
        f"{'offered':10}{replay.offered:>10}{replay.offered_cost:>10}",
        f"{'admitted':10}{replay.admitted:>10}{replay.admitted_cost:>10}",
        f"{'refused':10}{refused:>10}{refused_cost:>10}",
        "",
        f"most admitted in 1 s:   {_requests(most)}" + (f" ({_span(first, last)})" if most else ""),
        f"largest burst admitted: {_requests(replay.largest_instant)} at one instant"
        + (f" (t={_num(replay.largest_instant_at / 1e6)} s)" if replay.largest_instant else ""),
        f"longest admitted run:   {_requests(replay.longest_run)} in a row, none refused"
        + (f" ({_span(start, end)})" if replay.longest_run else ""),
        f"admitted per second:    {replay.admitted_cost / seconds:.3f} on average "
        f"(cost {replay.admitted_cost} over {_num(seconds)} s)",
        bound_line,
        f"admitted / bound:       {100 * replay.admitted_cost / (bound * buckets):.1f}%",
        "",
    ]
    if len(replay.clients) > 1:
        lines += [*client_table(replay, settings.shared), ""]
    lines += chart(settings.capacity, replay, seconds, ascii_only=ascii_only)
    if replay.compare is not None:
        lines += ["", *comparison(settings, limiter, replay, ascii_only=ascii_only)]
    return "\n".join(lines) + "\n"


def client_table(replay: Replay, shared: bool) -> list[str]:
    """Each client's share, and how long its refused requests were told to wait."""
    clients = sorted(replay.clients.values(), key=lambda c: -c.offered)
    width = max(8, *(len(c.key) for c in clients[:CLIENT_ROWS]))
    lines = [
        f"clients: {len(clients)}, "
        + ("all spending from one bucket" if shared else "a bucket each"),
        f"{'':{width}}{'offered':>9}{'admitted':>9}{'of own':>8}{'share':>8}{'in 1 s':>8}"
        f"   wait when refused (retry_after)",
    ]
    for client in clients[:CLIENT_ROWS]:
        own = 100 * client.admitted / client.offered
        share = 100 * client.admitted / replay.admitted if replay.admitted else 0.0
        waits = sorted(client.waits)
        wait = (
            f"median {_seconds(waits[len(waits) // 2])}, max {_seconds(waits[-1])}"
            if waits
            else "none refused"
        )
        lines.append(
            f"{client.key:{width}}{client.offered:>9}{client.admitted:>9}{own:>7.1f}%"
            f"{share:>7.1f}%{busiest(client.admitted_at, SECOND_US)[0]:>8}   {wait}"
        )
    if len(clients) > CLIENT_ROWS:
        lines.append(f"... and {len(clients) - CLIENT_ROWS} more (all of them: --format json)")
    return lines


def comparison(
    settings: Settings, limiter: TokenBucketLimiter, replay: Replay, *, ascii_only: bool
) -> list[str]:
    """The fixed window next to the token bucket, on the same requests."""
    c = replay.compare
    assert c is not None
    blocks = ASCII_BLOCKS if ascii_only else BLOCKS
    window = "the whole run" if c.window_us is None else f"{_num(c.window_us / 1e6)} s"
    bucket_most, b_first, b_last, _ = busiest_key(bucket_times(replay))
    window_most, first, last, key = c.busiest_second
    second_bound = settings.capacity + limiter.rate
    lines = [
        f"compare: a fixed window of {settings.capacity} tokens per {window} "
        "(same capacity, same long-run rate), same requests",
        f"{'':14}{'admitted':>9}{'most in 1 s':>13}   (one key)",
        f"{'token bucket':14}{replay.admitted:>9}{bucket_most:>13}"
        + (f"   {_span(b_first, b_last)}" if bucket_most else "")
        + f", never above capacity + rate*1 s = {_num(second_bound)}",
        f"{'fixed window':14}{c.admitted:>9}{window_most:>13}"
        + (f"   {_span(first, last)}" if window_most else ""),
    ]
    if window_most > second_bound:
        lines.append(
            f"the fixed window let {window_most} requests of {key} through within "
            f"{_num((last - first) / 1e6)} s, {window_most / settings.capacity:.3g}x its "
            "limit, across a window boundary"
        )
    top = max(*c.admitted_per_bin, *replay.admitted_per_bin) or 1
    lines += [
        f"admitted per bin (full cell = {top})",
        f"token bucket |{_sparkline(replay.admitted_per_bin, blocks, top)}|",
        f"fixed window |{_sparkline(c.admitted_per_bin, blocks, top)}|",
    ]
    return lines


def chart(capacity: int, replay: Replay, seconds: float, *, ascii_only: bool) -> list[str]:
    """The bucket level as bars, then admissions and refusals as sparklines."""
    blocks = ASCII_BLOCKS if ascii_only else BLOCKS
    label = len(str(capacity)) + 1
    lines = [f"bucket level: whole tokens at the end of each {_num(seconds / COLUMNS)} s bin"]
    if len(replay.clients) > 1:
        lines[0] += f" ({next(iter(replay.clients.values())).bucket})"
    eighths = [round(level / capacity * LEVEL_ROWS * 8) for level in replay.level_per_bin]
    for row in range(LEVEL_ROWS):
        floor = (LEVEL_ROWS - 1 - row) * 8  # eighths below this row
        cells = "".join(blocks[min(8, max(0, e - floor))] for e in eighths)
        name = str(capacity) if row == 0 else "0" if row == LEVEL_ROWS - 1 else ""
        lines.append(f"{name:>{label}} |{cells}".rstrip())
    lines.append(f"{'':>{label}} +{'-' * COLUMNS}")
    left, right = "0 s", f"{_num(seconds)} s"
    lines.append(f"{'':>{label}}  {left}{right:>{COLUMNS - len(left)}}")
    lines.append("")
    admitted, refused = replay.admitted_per_bin, replay.refused_per_bin
    lines.append(
        f"requests per bin (full cell = busiest bin: "
        f"admitted {max(admitted)}, refused {max(refused)})"
    )
    lines.append(f"admitted |{_sparkline(admitted, blocks)}|")
    lines.append(f" refused |{_sparkline(refused, blocks)}|")
    return lines


def _sparkline(counts: list[int], blocks: str, top: int | None = None) -> str:
    top = top or max(counts) or 1
    # Any nonzero count shows at least the lowest block, so no activity hides.
    return "".join(blocks[0 if n == 0 else max(1, round(n / top * 8))] for n in counts)


# -- the picture ---------------------------------------------------------------------

Plotter = Callable[[Path, Settings, TokenBucketLimiter, Replay, int], None]


def _plotter() -> Plotter:
    """:func:`draw` once matplotlib is importable; a clear error otherwise."""
    try:
        import matplotlib
    except ImportError:
        raise SimulationError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")  # files only: no window, no display needed
    return draw


def draw(
    path: Path, settings: Settings, limiter: TokenBucketLimiter, replay: Replay, duration_us: int
) -> None:
    """A PNG: the bucket level, admissions and refusals over time (and the
    fixed window's admissions in any 1 s next to the bucket's, with --compare)."""
    import matplotlib.pyplot as plt

    seconds = duration_us / 1e6
    edges = [0.0] + [bin_end(b, duration_us) / 1e6 for b in range(COLUMNS)]
    width = seconds / COLUMNS
    panels = 3 if replay.compare is not None else 2
    figure, axes = plt.subplots(panels, 1, figsize=(10, 2.6 * panels + 0.6), sharex=True)
    title = (
        f"bucketlimit simulate: capacity {settings.capacity}, "
        f"{_num(limiter.rate)} tokens/s, cost {settings.cost}"
    )
    figure.suptitle(title)

    level = axes[0]
    shown = list(replay.clients.values())[:6]
    for client in shown:
        level.step(
            edges,
            [settings.capacity, *client.level_per_bin],
            where="post",
            label=client.bucket if len(shown) > 1 else None,
        )
    level.set_ylim(0, settings.capacity * 1.08)
    level.set_ylabel("tokens in bucket")
    level.axhline(settings.capacity, color="grey", linestyle=":", linewidth=1)
    if len(shown) > 1:
        level.legend(loc="lower right", fontsize="small")

    bins = axes[1]
    starts = edges[:-1]
    bins.bar(
        starts,
        replay.admitted_per_bin,
        width=width,
        align="edge",
        color="tab:green",
        label="admitted",
    )
    bins.bar(
        starts,
        replay.refused_per_bin,
        width=width,
        align="edge",
        color="tab:red",
        bottom=replay.admitted_per_bin,
        label="refused",
    )
    bins.set_ylabel(f"requests per {_num(width)} s")
    bins.legend(loc="upper right", fontsize="small")

    if replay.compare is not None:
        c = replay.compare
        ax = axes[2]
        key = c.busiest_second[3]
        bucket = replay.clients[key].bucket if key in replay.clients else key
        for times, name, colour in (
            (bucket_times(replay).get(bucket, array("q")), "token bucket", "tab:blue"),
            (c.admitted_at.get(key, array("q")), c.name, "tab:orange"),
        ):
            xs, ys = _trailing_second(times)
            ax.step(xs, ys, where="post", color=colour, label=f"{name} (most: {max(ys)})")
        ax.axhline(
            settings.capacity + limiter.rate,
            color="tab:blue",
            linestyle="--",
            linewidth=1,
            label="bucket bound: capacity + rate*1 s",
        )
        if c.window_us is not None:
            first_edge = -(-c.origin_us // c.window_us) * c.window_us - c.origin_us
            for edge in range(first_edge, duration_us, c.window_us):
                ax.axvline(edge / 1e6, color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylabel(f"{key or 'admitted'}: admitted\nin the last 1 s")
        ax.legend(loc="upper right", fontsize="small")
    axes[-1].set_xlabel("time (s)")
    axes[-1].set_xlim(0, seconds)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _trailing_second(times: Sequence[int], points: int = 4000) -> tuple[list[float], list[int]]:
    """The number admitted in the 1 s up to each moment, as a step line: up by one
    at each admission, down by one a second later. Long runs keep the highest
    value of each of ``points`` stretches, so no peak is lost."""
    events = sorted([(t, 1) for t in times] + [(t + SECOND_US, -1) for t in times])
    xs, ys, level = [0.0], [0], 0
    for t, step in events:
        level += step
        xs.append(t / 1e6)
        ys.append(level)
    if len(xs) > 2 * points:
        size = -(-len(xs) // points)
        xs = xs[::size]
        ys = [max(ys[i : i + size]) for i in range(0, len(ys), size)]
    return xs, ys


# -- numbers as a person writes them ---------------------------------------------


def _span(start_us: int, end_us: int) -> str:
    if start_us == end_us:
        return f"t={_num(start_us / 1e6)} s"
    return f"t={_num(start_us / 1e6)}..{_num(end_us / 1e6)} s"


def _seconds(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.3g} s"


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"


def _num(x: float) -> str:
    """A number as a person writes it: 2, 0.5, 1e-06."""
    return f"{x:.6g}"


# -- --acquire: the same traffic paced instead of refused ---------------------------


@dataclass
class Paced:
    """What waiting did: each admitted request's wait, and the bound check."""

    waits_us: list[int] = field(default_factory=list)
    refused: int = 0
    # Every use time replayed through a fresh limiter of the same settings: all
    # admitted means no window held more than capacity + rate/per*T.
    within_bound: bool = True
    # Uses after the end of the traffic (the queue drains after it).
    last_use_us: int = 0


def run_paced(
    limiter: TokenBucketLimiter,
    clock: ManualClock,
    settings: Settings,
    arrivals: list[int],
    duration_us: int,
) -> tuple[Replay, Paced]:
    """Each arrival reserves (as ``acquire`` does) and uses its tokens after its delay."""
    replay, paced = Replay(offered=len(arrivals)), Paced()
    uses: list[int] = []
    for t in arrivals:
        clock.set(t / 1e6)
        reservation = limiter.reserve(KEY, settings.cost, max_wait=settings.max_wait)
        at_bin = min(COLUMNS - 1, t * COLUMNS // duration_us)
        if not reservation:
            paced.refused += 1
            replay.refused_per_bin[at_bin] += 1
            continue
        wait_us = clock_to_micros(reservation.delay)
        paced.waits_us.append(wait_us)
        uses.append(t + wait_us)
        replay.admitted += 1
        replay.admitted_per_bin[min(COLUMNS - 1, (t + wait_us) * COLUMNS // duration_us)] += 1
    for b in range(COLUMNS):
        clock.set(max(clock.now, bin_end(b, duration_us) / 1e6))
        replay.level_per_bin[b] = limiter.peek(KEY).remaining
    check_clock = ManualClock()
    check = TokenBucketLimiter(settings.capacity, settings.rate, check_clock, per=settings.per)
    for use in uses:  # FIFO: the use times come in order
        check_clock.set(use / 1e6)
        paced.within_bound &= bool(check.allow(KEY, settings.cost))
    paced.last_use_us = max(uses, default=0)
    return replay, paced


def paced_report(settings: Settings, paced: Paced) -> str:
    waits = sorted(paced.waits_us)

    def quantile(q: float) -> str:
        return _num(waits[min(len(waits) - 1, int(q * len(waits)))] / 1e6) if waits else "-"

    limit = "no limit" if settings.max_wait is None else f"at most {_num(settings.max_wait)} s"
    lines = [
        "",
        f"--acquire: each request reserved and waited for its tokens ({limit})",
        f"waited:   {sum(1 for w in waits if w)} of {len(waits)} admitted; "
        f"p50 {quantile(0.5)} s, p90 {quantile(0.9)} s, p99 {quantile(0.99)} s, "
        f"max {quantile(1.0)} s",
        f"refused:  {paced.refused} (their wait would pass max_wait or the debt bound; "
        "they spent nothing)",
        f"last use: t={_num(paced.last_use_us / 1e6)} s",
        "bound:    every use replayed at its time through a fresh limiter: "
        + ("all admitted, never above capacity + rate/per*T" if paced.within_bound else "EXCEEDED"),
    ]
    return "\n".join(lines) + "\n"
