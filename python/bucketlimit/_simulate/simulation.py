"""One simulation from settings to report: checks the settings, builds the limiter
on a manual clock, makes or reads the traffic, runs it and writes what was asked.
:func:`simulate` is the token bucket's, :func:`simulate_permits` the concurrency
mode's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TextIO

from bucketlimit import ConcurrencyLimiter, TokenBucketLimiter
from bucketlimit._simulate.counting import Replay, run
from bucketlimit._simulate.export import csv_writer, permits_csv, permits_summary, summary
from bucketlimit._simulate.fixed_window import fixed_window, window_like_bucket_us
from bucketlimit._simulate.model import (
    COMPARISONS,
    FORMATS,
    KEY,
    MAX_CLIENTS,
    PATTERNS,
    Settings,
    SimulationError,
    Traffic,
    checked_duration_us,
)
from bucketlimit._simulate.paced import paced_report, run_paced
from bucketlimit._simulate.patterns import make_traffic
from bucketlimit._simulate.permits import PermitReplay, PermitSettings, run_permits
from bucketlimit._simulate.plot import permits_plotter, plotter
from bucketlimit._simulate.replay_file import read_replay
from bucketlimit._simulate.report import permits_report, report
from bucketlimit._simulate.service import checked_service, service_times
from bucketlimit.testing import ManualClock


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
    draw = plotter() if plot is not None else None  # a missing matplotlib fails first
    limiter, clock = _build(settings)
    traffic, duration_us = _traffic(settings, limiter)
    if settings.acquire:
        arrivals = [request.at for request in traffic.requests]
        replay, paced = run_paced(limiter, clock, settings, arrivals, duration_us)
        text = report(settings, limiter, traffic, replay, duration_us, ascii_only=ascii_only)
        out.write(text + paced_report(settings, paced))
        return replay
    record = csv_writer(out) if output_format == "csv" else None
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
            window_like_bucket_us(settings, limiter),
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
        draw(Path(plot), settings, limiter, traffic, replay, duration_us)
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


def _traffic(settings: Settings, limiter: TokenBucketLimiter) -> tuple[Traffic, int]:
    if settings.replay is not None:
        return read_replay(settings, limiter)
    duration_us = checked_duration_us(settings.duration)
    return make_traffic(settings, limiter.rate, duration_us), duration_us


def simulate_permits(
    settings: PermitSettings,
    out: TextIO,
    *,
    ascii_only: bool = False,
    output_format: str = "text",
    plot: str | Path | None = None,
) -> PermitReplay:
    """The concurrency mode: validates ``settings``, replays the traffic through a
    ``ConcurrencyLimiter`` on a manual clock, each request running its service time,
    and writes the report: text, ``json`` or ``csv`` (one row per request); ``plot``
    also draws a PNG."""
    if output_format not in FORMATS:
        raise SimulationError(f"unknown format {output_format!r}: choose from {FORMATS}")
    draw = permits_plotter() if plot is not None else None  # a missing matplotlib fails first
    limiter, clock, bucket = _build_permits(settings)
    traffic_settings = settings.traffic()
    if settings.replay is not None:
        traffic, duration_us = read_replay(traffic_settings, bucket, permits=True)
    else:
        duration_us = checked_duration_us(settings.duration)
        traffic = make_traffic(traffic_settings, settings.sustained, duration_us)
    drawn = service_times(
        settings.service_dist, settings.service, len(traffic.requests), settings.seed
    )
    services = [
        drawn[i] if request.service_us is None else request.service_us
        for i, request in enumerate(traffic.requests)
    ]
    replay = run_permits(
        limiter,
        clock,
        traffic.requests,
        services,
        settings,
        duration_us,
        keys=traffic.keys,
        record=output_format == "csv",
    )
    if output_format == "text":
        out.write(permits_report(settings, traffic, replay, duration_us, ascii_only=ascii_only))
    elif output_format == "json":
        json.dump(permits_summary(settings, traffic, replay, duration_us), out, indent=2)
        out.write("\n")
    else:
        permits_csv(out, replay)
    if draw is not None and plot is not None:
        draw(Path(plot), settings, traffic, replay, duration_us)
    return replay


def _build_permits(
    settings: PermitSettings,
) -> tuple[ConcurrencyLimiter, ManualClock, TokenBucketLimiter]:
    """The concurrency limiter (it checks its own arguments: its errors become usage
    errors), its clock, and the bucket of the same size and sustained rate that
    sizes the traffic."""
    if settings.replay is None and settings.pattern not in PATTERNS:
        raise SimulationError(f"unknown pattern {settings.pattern!r}: choose from {PATTERNS}")
    if not 1 <= settings.clients <= MAX_CLIENTS:
        raise SimulationError(f"clients must be 1 to {MAX_CLIENTS}, got {settings.clients!r}")
    checked_service(settings.service, settings.service_dist)
    if isinstance(settings.max_wait, bool) or not settings.max_wait >= 0:
        raise SimulationError(f"max wait must be >= 0 seconds (or inf), got {settings.max_wait!r}")
    if settings.offered_rate is not None and not 0 < settings.offered_rate < math.inf:
        raise SimulationError(
            f"offered rate must be a finite number > 0, got {settings.offered_rate!r}"
        )
    clock = ManualClock()
    try:
        limiter = ConcurrencyLimiter(settings.concurrency, ttl=settings.ttl, clock=clock)
        bucket = TokenBucketLimiter(settings.concurrency, settings.sustained)
    except (TypeError, ValueError) as error:
        raise SimulationError(str(error)) from None
    return limiter, clock, bucket
