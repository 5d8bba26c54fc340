"""The numbers of a run as data: ``--format json`` (a summary) and ``--format csv``
(one row per request with the limiter's answer), for the token bucket and for the
concurrency mode."""

from __future__ import annotations

import csv
import math
from typing import Any, TextIO

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._simulate.counting import (
    Client,
    Record,
    Replay,
    bin_end,
    bucket_times,
    busiest,
    busiest_key,
)
from bucketlimit._simulate.model import COLUMNS, SECOND_US, Request, Settings, Traffic
from bucketlimit._simulate.permits import PermitReplay, PermitSettings


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


def csv_writer(out: TextIO) -> Record:
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


# -- the concurrency mode (--concurrency) ----------------------------------------------------


def permits_summary(
    settings: PermitSettings, traffic: Traffic, replay: PermitReplay, duration_us: int
) -> dict[str, Any]:
    """Everything the concurrency mode's text report says, as plain data."""
    seconds = duration_us / 1e6
    waits = sorted(replay.waits_us)

    def quantile(q: float) -> float | None:
        return waits[min(len(waits) - 1, int(q * len(waits)))] / 1e6 if waits else None

    return {
        "settings": {
            "concurrency": settings.concurrency,
            "ttl": settings.ttl,
            "service": settings.service,
            "service_dist": settings.service_dist,
            "max_wait": _finite(settings.max_wait),  # null: no limit
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
            "sustained_rate": traffic.limit_rate,
        },
        "offered": replay.offered,
        "admitted": {
            "requests": replay.admitted,
            "at_once": replay.admitted - replay.waited,
            "after_waiting": replay.waited,
        },
        "refused": {
            "requests": replay.refused,
            "at_once": replay.refused_at_once,
            "after_waiting": replay.timed_out,
        },
        # The waits of the admitted requests that waited, in seconds.
        "wait": {"p50": quantile(0.5), "p95": quantile(0.95), "max": quantile(1.0)},
        "peak_in_flight": {"requests": replay.peak_in_flight, "at": replay.peak_at_us / 1e6},
        "peak_waiting": {"requests": replay.peak_waiting, "at": replay.peak_waiting_at_us / 1e6},
        "busy": replay.busy_us / 1e6,
        "last_end": replay.last_end_us / 1e6,
        "clients": [
            {
                "key": c.key,
                "bucket": c.bucket,
                "offered": c.offered,
                "admitted": c.admitted,
                "waited": c.waited,
                "refused": c.refused,
                "peak_in_flight": c.peak,
            }
            for c in replay.clients.values()
        ],
        "bins": [
            {
                "start": bin_end(b - 1, duration_us) / 1e6 if b else 0.0,
                "end": bin_end(b, duration_us) / 1e6,
                "started": replay.admitted_per_bin[b],
                "refused": replay.refused_per_bin[b],
                "queued": replay.waited_per_bin[b],
                "in_flight": replay.in_flight_per_bin[b],
                "waiting": replay.waiting_per_bin[b],
            }
            for b in range(COLUMNS)
        ],
        "stats": replay.stats,
    }


PERMIT_CSV_COLUMNS = ("time", "key", "service", "allowed", "wait", "start", "end", "token")


def permits_csv(out: TextIO, replay: PermitReplay) -> None:
    """``--format csv`` of the concurrency mode: one row per request, by arrival: when
    it came, how long it runs, whether it got a permit, how long it waited (until it
    started or was refused), when it ran, and its permit's fencing token."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(PERMIT_CSV_COLUMNS)
    for served in replay.served:
        started = served.start_us is not None
        writer.writerow(
            (
                f"{served.request.at / 1e6:.6f}",
                served.request.key,
                f"{served.service_us / 1e6:.6f}",
                int(started),
                f"{served.wait_us / 1e6:.6f}",
                f"{served.start_us / 1e6:.6f}" if served.start_us is not None else "",
                f"{(served.start_us + served.service_us) / 1e6:.6f}"
                if served.start_us is not None
                else "",
                served.token,
            )
        )
