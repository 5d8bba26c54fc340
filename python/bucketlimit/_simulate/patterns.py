"""The made-up traffic of ``--pattern`` and ``--clients``: arrival times, in microseconds."""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from itertools import accumulate, count

from bucketlimit._simulate.model import (
    KEY,
    Request,
    Settings,
    SimulationError,
    Traffic,
    check_volume,
    num,
)


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
        shape = f"client-1: {shape}; {others}: steady, {num(calm)} requests/s each"
        check_volume(offered * seconds + calm * seconds * (settings.clients - 1))
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
        check_volume(2 * size * len(pairs))
        arrivals = [
            t
            for edge in pairs
            for t in (edge - delta, edge + delta)
            if t < duration_us
            for _ in range(size)
        ]
        offered = len(arrivals) / seconds
        shape = (
            f"boundary, {size} requests at once {num(delta / 1e6)} s before and after every "
            f"{num(window_us / 1e6)} s"
        )
        return arrivals, offered, shape
    offered = settings.offered_rate or 2 * limit
    check_volume(offered * seconds)
    if settings.pattern == "steady":
        # Request i arrives at exactly i / offered seconds.
        arrivals = _until(duration_us, (round(i * 1e6 / offered) for i in count()))
        shape = f"steady, one request every {num(1 / offered)} s"
    elif settings.pattern == "burst":
        # Bursts larger than the bucket: twice the requests a full bucket
        # admits, all at one instant, then idle so the average is `offered`.
        size = 2 * (settings.capacity // settings.cost)
        period_us = max(1, round(size / offered * 1e6))
        offered = size * 1e6 / period_us  # exact after rounding the period
        starts = _until(duration_us, (k * period_us for k in count()))
        check_volume(len(starts) * size)  # one burst alone can be huge
        arrivals = [start for start in starts for _ in range(size)]
        shape = f"burst, {size} requests at once every {num(period_us / 1e6)} s, idle between"
    else:
        # Exponential gaps with mean 1/offered: a Poisson process.
        rng = random.Random(settings.seed)
        times = accumulate(rng.expovariate(offered) for _ in count())
        arrivals = _until(duration_us, (round(t * 1e6) for t in times))
        shape = f"poisson, random arrivals (seed {settings.seed})"
    return arrivals, offered, shape


def _until(end_us: int, times: Iterable[int]) -> list[int]:
    """The times before ``end_us`` of a nondecreasing, endless sequence."""
    taken = []
    for t in times:
        if t >= end_us:
            break
        taken.append(t)
    return taken
