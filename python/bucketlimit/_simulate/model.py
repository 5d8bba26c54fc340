"""What a simulation is made of: its settings, its requests and traffic, its limits.

Every other module of the simulator imports this one and nothing imports it
back; the error every one of them raises for arguments that make no
simulation is here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from bucketlimit._core import clock_to_micros

PATTERNS = ("steady", "burst", "poisson", "boundary")
FORMATS = ("text", "json", "csv")
COMPARISONS = ("fixed-window",)

KEY = "simulated-client"  # the one client's key, without --clients or --replay keys
SHARED_KEY = "shared"  # the one bucket every client spends from with --shared
COLUMNS = 60  # chart width: one column per time bin
MAX_REQUESTS = 5_000_000  # keeps a typo in --duration from running for hours
MAX_CLIENTS = 1000
SECOND_US = 1_000_000  # the burst figure: the most admitted in any 1 s


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
    service_us: int | None = None  # how long it runs (the concurrency mode's replay)


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

    def costs(self, default: int) -> str:
        """What the requests cost, for a title: ``cost 1``, or ``costs 1 to 5`` when
        they differ (a replayed file's); ``default`` when there are none."""
        low = min((request.cost for request in self.requests), default=default)
        high = max((request.cost for request in self.requests), default=default)
        return f"cost {low}" if low == high else f"costs {low} to {high}"


def checked_duration_us(duration: object) -> int:
    """``--duration`` in integer microseconds, or a usage error."""
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


def check_volume(requests: float) -> None:
    """Refuses a run of more than :data:`MAX_REQUESTS` requests before making them."""
    if requests > MAX_REQUESTS:
        raise SimulationError(
            f"about {requests:.0f} requests is too many to replay (at most {MAX_REQUESTS}): "
            "shorten --duration or lower --offered-rate, --capacity or --clients"
        )


def num(x: float) -> str:
    """A number as a person writes it: 2, 0.5, 1e-06."""
    return f"{x:.6g}"
