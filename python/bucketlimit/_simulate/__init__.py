"""``python -m bucketlimit simulate``: replay traffic through a real limiter.

The simulation never sleeps: it steps a :class:`~bucketlimit.testing.ManualClock`
to each arrival, so a minute of traffic replays in milliseconds and the same
arguments always print the same report. Every decision in the report is an
answer of the real :class:`~bucketlimit.TokenBucketLimiter`.

The traffic is made up (``--pattern``, one client or ``--clients N``) or read
from a CSV file (``--replay``). One function, :func:`~.counting.run`, asks the
limiter about every request in time order; the report (text, JSON or CSV), the
picture (``--plot``) and the fixed-window comparison (``--compare``) only read
what it counted. Another way of deciding (a mode that waits instead of
refusing) slots in as the ``decide`` argument of ``run``. The concurrency mode
(``--concurrency N``) replays the same traffic through a real
:class:`~bucketlimit.ConcurrencyLimiter`, each request holding a permit for its
service time: :func:`~.permits.run_permits`, read by its own report, numbers
and picture.

One concern per module, each importing only those above it here:

- ``model``: settings, requests, traffic, the limits of a run, its error
- ``patterns``: the made-up traffic (``--pattern``, ``--clients``)
- ``replay_file``: the requests of a CSV file (``--replay``)
- ``counting``: the run and what it counts
- ``fixed_window``: the fixed-window counter of ``--compare``
- ``paced``: ``--acquire``, the same traffic paced instead of refused
- ``service``: ``--service`` and ``--service-dist``, how long each request runs
- ``permits``: ``--concurrency``, the run through a concurrency limiter and its counts
- ``report``: the text report and its charts
- ``export``: ``--format json`` and ``--format csv``
- ``plot``: ``--plot`` (matplotlib, imported only when asked)
- ``simulation``: :func:`simulate` (and :func:`simulate_permits`), settings to output
- ``command``: the options of the ``simulate`` command
"""

from __future__ import annotations

from bucketlimit._simulate.counting import Replay, bin_end, run
from bucketlimit._simulate.model import (
    COLUMNS,
    COMPARISONS,
    FORMATS,
    PATTERNS,
    Request,
    Settings,
    SimulationError,
    Traffic,
)
from bucketlimit._simulate.patterns import make_traffic
from bucketlimit._simulate.permits import PermitReplay, PermitSettings, run_permits
from bucketlimit._simulate.simulation import simulate, simulate_permits

__all__ = [
    "COLUMNS",
    "COMPARISONS",
    "FORMATS",
    "PATTERNS",
    "PermitReplay",
    "PermitSettings",
    "Replay",
    "Request",
    "Settings",
    "SimulationError",
    "Traffic",
    "bin_end",
    "make_traffic",
    "run",
    "run_permits",
    "simulate",
    "simulate_permits",
]
