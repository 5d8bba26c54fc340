"""``python -m bucketlimit simulate``: replay synthetic traffic through a real limiter.

The simulation never sleeps: it steps a :class:`~bucketlimit.testing.ManualClock`
to each arrival, so a minute of traffic replays in milliseconds and the same
arguments always print the same report. Every decision in the report is an
answer of the real :class:`~bucketlimit.TokenBucketLimiter`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate, count
from typing import TextIO

from bucketlimit import TokenBucketLimiter
from bucketlimit._core import clock_to_micros
from bucketlimit.testing import ManualClock

PATTERNS = ("steady", "burst", "poisson")

KEY = "simulated-client"
COLUMNS = 60  # chart width: one column per time bin
LEVEL_ROWS = 8  # height of the bucket-level chart
MAX_REQUESTS = 5_000_000  # keeps a typo in --duration from running for hours

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
    pattern: str
    duration: float | int
    seed: int = 0
    offered_rate: float | None = None  # requests per second; None: twice the limit
    acquire: bool = False  # pace requests (reserve and wait) instead of refusing them
    max_wait: float | None = None  # with acquire: the longest wait; None: no limit


@dataclass(frozen=True)
class Traffic:
    arrivals: list[int]  # request times in integer microseconds, sorted
    offered_rate: float  # average requests per second
    limit_rate: float  # requests per second the limit sustains
    shape: str


@dataclass
class Replay:
    """What the limiter answered, summed up and per time bin."""

    offered: int = 0
    admitted: int = 0
    # The most requests admitted at a single clock reading, and when.
    largest_instant: int = 0
    largest_instant_at: int = 0
    # The longest run of consecutive admitted requests, and its first/last times.
    longest_run: int = 0
    run_span: tuple[int, int] = (0, 0)
    admitted_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    refused_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)
    level_per_bin: list[int] = field(default_factory=lambda: [0] * COLUMNS)


def simulate(settings: Settings, out: TextIO, *, ascii_only: bool = False) -> Replay:
    """Validates ``settings``, replays the traffic and writes the report to ``out``."""
    limiter, clock, duration_us = _build(settings)
    traffic = make_traffic(settings, limiter.rate, duration_us)
    if settings.acquire:
        replay, paced = run_paced(limiter, clock, settings, traffic.arrivals, duration_us)
    else:
        replay = run(limiter, clock, settings.cost, traffic.arrivals, duration_us)
    text = report(settings, limiter, traffic, replay, duration_us, ascii_only=ascii_only)
    if settings.acquire:
        text += paced_report(settings, paced)
    out.write(text)
    return replay


def _build(settings: Settings) -> tuple[TokenBucketLimiter, ManualClock, int]:
    """The limiter checks its own arguments; its errors become usage errors."""
    if settings.pattern not in PATTERNS:
        raise SimulationError(f"unknown pattern {settings.pattern!r}: choose from {PATTERNS}")
    clock = ManualClock()
    try:
        limiter = TokenBucketLimiter(settings.capacity, settings.rate, clock, per=settings.per)
        limiter.peek(KEY, settings.cost)  # rejects a cost the limiter would reject
    except (TypeError, ValueError) as error:
        raise SimulationError(str(error)) from None
    try:
        # The limiter's own rounding to microseconds, and its range check.
        duration_us = clock_to_micros(settings.duration)
    except (TypeError, ValueError):
        duration_us = 0
    if duration_us <= 0:
        raise SimulationError(
            f"duration must be a finite number of seconds >= 1e-06, got {settings.duration!r}"
        )
    if settings.offered_rate is not None and not 0 < settings.offered_rate < float("inf"):
        raise SimulationError(
            f"offered rate must be a finite number > 0, got {settings.offered_rate!r}"
        )
    return limiter, clock, duration_us


def make_traffic(settings: Settings, tokens_per_second: float, duration_us: int) -> Traffic:
    """Arrival times for the pattern; only ``poisson`` draws from ``settings.seed``."""
    seconds = duration_us / 1e6
    # The request rate the limit sustains; with rate 0 (a one-off quota) the
    # quota spread over the whole run, so the default traffic still exceeds it.
    limit = tokens_per_second / settings.cost or settings.capacity / settings.cost / seconds
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
    return Traffic(arrivals, offered, limit, shape)


def _check_volume(requests: float) -> None:
    if requests > MAX_REQUESTS:
        raise SimulationError(
            f"about {requests:.0f} requests is too many to replay (at most {MAX_REQUESTS}): "
            "shorten --duration or lower --offered-rate or --capacity"
        )


def _until(end_us: int, times: Iterable[int]) -> list[int]:
    """The times before ``end_us`` of a nondecreasing, endless sequence."""
    taken = []
    for t in times:
        if t >= end_us:
            break
        taken.append(t)
    return taken


def bin_end(b: int, duration_us: int) -> int:
    """First microsecond after bin ``b``; bin b holds the times t with t*COLUMNS//duration == b."""
    return -(-(b + 1) * duration_us // COLUMNS)


def run(
    limiter: TokenBucketLimiter,
    clock: ManualClock,
    cost: int,
    arrivals: list[int],
    duration_us: int,
) -> Replay:
    """Asks the limiter about every arrival and samples the bucket at each bin end."""
    replay = Replay(offered=len(arrivals))
    run_length = run_start = 0
    instant, at_instant = -1, 0
    b = 0
    for t in arrivals:
        while t >= bin_end(b, duration_us):
            _sample_level(replay, limiter, clock, b, duration_us)
            b += 1
        clock.set(t / 1e6)
        if t != instant:
            instant, at_instant = t, 0
        if limiter.allow(KEY, cost):
            replay.admitted += 1
            replay.admitted_per_bin[b] += 1
            at_instant += 1
            if at_instant > replay.largest_instant:
                replay.largest_instant, replay.largest_instant_at = at_instant, t
            if run_length == 0:
                run_start = t
            run_length += 1
            if run_length > replay.longest_run:
                replay.longest_run, replay.run_span = run_length, (run_start, t)
        else:
            replay.refused_per_bin[b] += 1
            run_length = 0
    while b < COLUMNS:
        _sample_level(replay, limiter, clock, b, duration_us)
        b += 1
    return replay


def _sample_level(
    replay: Replay, limiter: TokenBucketLimiter, clock: ManualClock, b: int, duration_us: int
) -> None:
    # Whole tokens in the bucket: peek spends nothing, and for cost 1 it
    # reports the tokens left after a hypothetical spend when it would allow.
    clock.set(bin_end(b, duration_us) / 1e6)
    decision = limiter.peek(KEY)
    replay.level_per_bin[b] = decision.remaining + int(decision.allowed)


def report(
    settings: Settings,
    limiter: TokenBucketLimiter,
    traffic: Traffic,
    replay: Replay,
    duration_us: int,
    *,
    ascii_only: bool = False,
) -> str:
    cost = settings.cost
    seconds = duration_us / 1e6
    refused = replay.offered - replay.admitted
    bound = settings.capacity + limiter.rate * seconds
    admitted_cost = replay.admitted * cost
    start, end = replay.run_span
    lines = [
        f"simulate: capacity {settings.capacity}, rate {_num(settings.rate)} per "
        f"{_num(settings.per)} s ({_num(limiter.rate)} tokens/s), cost {cost}",
        f"traffic:  {_num(seconds)} s of {traffic.shape}",
        f"          {_num(traffic.offered_rate)} requests/s on average, "
        f"{traffic.offered_rate / traffic.limit_rate:.3g}x what the limit sustains",
        "",
        f"{'':10}{'requests':>10}{'cost':>10}",
        f"{'offered':10}{replay.offered:>10}{replay.offered * cost:>10}",
        f"{'admitted':10}{replay.admitted:>10}{replay.admitted * cost:>10}",
        f"{'refused':10}{refused:>10}{refused * cost:>10}",
        "",
        f"largest burst admitted: {_requests(replay.largest_instant)} at one instant"
        + (f" (t={_num(replay.largest_instant_at / 1e6)} s)" if replay.largest_instant else ""),
        f"longest admitted run:   {_requests(replay.longest_run)} in a row, none refused"
        + (f" ({_span(start, end)})" if replay.longest_run else ""),
        f"admitted per second:    {admitted_cost / seconds:.3f} on average "
        f"(cost {admitted_cost} over {_num(seconds)} s)",
        f"bound over T seconds:   capacity + rate/per*T = {settings.capacity} + "
        f"{_num(limiter.rate)}*{_num(seconds)} = {_num(bound)} ({bound / seconds:.3f}/s)",
        f"admitted / bound:       {100 * admitted_cost / bound:.1f}%",
        "",
    ]
    lines += chart(settings.capacity, replay, seconds, ascii_only=ascii_only)
    return "\n".join(lines) + "\n"


def chart(capacity: int, replay: Replay, seconds: float, *, ascii_only: bool) -> list[str]:
    """The bucket level as bars, then admissions and refusals as sparklines."""
    blocks = ASCII_BLOCKS if ascii_only else BLOCKS
    label = len(str(capacity)) + 1
    lines = [f"bucket level: whole tokens at the end of each {_num(seconds / COLUMNS)} s bin"]
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


def _sparkline(counts: list[int], blocks: str) -> str:
    top = max(counts) or 1
    # Any nonzero count shows at least the lowest block, so no activity hides.
    return "".join(blocks[0 if n == 0 else max(1, round(n / top * 8))] for n in counts)


def _span(start_us: int, end_us: int) -> str:
    if start_us == end_us:
        return f"t={_num(start_us / 1e6)} s"
    return f"t={_num(start_us / 1e6)}..{_num(end_us / 1e6)} s"


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
