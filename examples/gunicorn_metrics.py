"""gunicorn settings for examples/metrics_app.py (``gunicorn -c examples/gunicorn_metrics.py``).

A worker that exits keeps its counters in the multiprocess files (they are
totals), but its gauges (``bucketlimit_keys``, ``bucketlimit_breaker_open``)
must leave the sum of the live workers: prometheus_client does that when told.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import multiprocess


def child_exit(server: Any, worker: Any) -> None:
    multiprocess.mark_process_dead(worker.pid)
