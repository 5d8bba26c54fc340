"""``--replay FILE``: requests read from a CSV file instead of a pattern."""

from __future__ import annotations

import csv
import re
from datetime import datetime
from pathlib import Path

from bucketlimit import TokenBucketLimiter
from bucketlimit._core import check_cost, clock_to_micros
from bucketlimit._simulate.model import (
    KEY,
    SECOND_US,
    Request,
    Settings,
    SimulationError,
    Traffic,
    check_volume,
    checked_duration_us,
)


def read_replay(
    settings: Settings, limiter: TokenBucketLimiter, *, permits: bool = False
) -> tuple[Traffic, int]:
    """Requests from a CSV file: a time in each row (seconds, or an ISO 8601 date
    and time), then optionally a key and a cost. A first row with a ``time``
    column names the columns (``time``, ``key``, ``cost``, in any order). Times
    count from the earliest (a fixed window of ``--compare`` keeps to the file's
    own clock); the rows need not be sorted.

    With ``permits`` (the concurrency mode) the costs are not read (a request takes
    one permit) and a column named ``service`` in the header, where there is one,
    gives each request's service time in seconds."""
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
    # Without a header: time, key, cost (a cost is not read for permits).
    columns = {"time": 0, "key": 1} if permits else {"time": 0, "key": 1, "cost": 2}
    names = ("time", "key", "service") if permits else ("time", "key", "cost")
    if rows and "time" in (name.strip().lower() for name in rows[0][1]):
        header = [name.strip().lower() for name in rows.pop(0)[1]]
        columns = {name: header.index(name) for name in names if name in header}
    capacity = None if permits else limiter.capacity
    parsed = [_replay_row(path, n, row, columns, settings, capacity) for n, row in rows]
    if not parsed:
        raise SimulationError(f"{str(path)!r} holds no requests")
    start = min(t for t, _, _, _ in parsed)
    requests = sorted(
        (Request(t - start, key, cost, service) for t, key, cost, service in parsed),
        key=lambda r: r.at,
    )
    if settings.duration is None:
        # Whole seconds, past the last request.
        duration_us = -(-(requests[-1].at + 1) // SECOND_US) * SECOND_US
    else:
        duration_us = checked_duration_us(settings.duration)
        requests = [r for r in requests if r.at < duration_us]
    check_volume(len(requests))
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
    capacity: int | None,
) -> tuple[int, str, int, int | None]:
    """``(time, key, cost, service)`` of one row; without ``capacity`` (permits) the
    cost is 1 and the service time is read where the header names it."""

    def cell(name: str) -> str | None:
        i = columns.get(name)
        return row[i].strip() if i is not None and i < len(row) and row[i].strip() else None

    where = f"{path.name} line {n}"
    text = cell("time")
    if text is None:
        raise SimulationError(f"{where}: no time in {row!r}")
    at = _timestamp(text, where)
    key = cell("key") or KEY
    if capacity is None:
        service = cell("service")
        return at, key, 1, None if service is None else _service(service, where)
    cost_text = cell("cost")
    try:
        cost = check_cost(settings.cost if cost_text is None else int(cost_text), capacity)
    except (TypeError, ValueError) as error:
        raise SimulationError(f"{where}: cost {cost_text!r}: {error}") from None
    return at, key, cost, None


def _service(text: str, where: str) -> int:
    """A service time in integer microseconds (at least 1)."""
    try:
        micros = clock_to_micros(float(text))
    except (TypeError, ValueError):
        micros = 0
    if micros <= 0:
        raise SimulationError(f"{where}: service {text!r} is not a number of seconds >= 1e-06")
    return micros


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
