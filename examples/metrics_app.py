"""Metrics of a pre-fork server on one port: a WSGI app under ``gunicorn --workers 4``.

Each worker decides with its own limiter and publishes its numbers to
prometheus_client's multiprocess files; ``/metrics``, whichever worker answers
it, sums every worker's (docs/metrics.md, "Pre-fork servers"). Run it from the
repository root, with an empty folder for the files:

    rm -rf /tmp/metrics && mkdir /tmp/metrics
    PROMETHEUS_MULTIPROC_DIR=/tmp/metrics gunicorn -c examples/gunicorn_metrics.py \\
        --chdir examples metrics_app:app --workers 4

    curl -i 'localhost:8000/hello?key=alice'
    curl -s localhost:8000/metrics | grep bucketlimit_decisions

Environment:
  PROMETHEUS_MULTIPROC_DIR      the folder of the multiprocess files (required)
  BUCKETLIMIT_CAPACITY          requests a key may burst (default 10)
  BUCKETLIMIT_RATE              requests per second it gets back (default 1)
  BUCKETLIMIT_METRICS_INTERVAL  seconds between two publications of a worker (default 1)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from bucketlimit import TokenBucketLimiter
from bucketlimit.metrics import LimiterMetrics

limiters = LimiterMetrics()
hello = limiters.add(
    "hello",
    TokenBucketLimiter(
        int(os.environ.get("BUCKETLIMIT_CAPACITY", "10")),
        float(os.environ.get("BUCKETLIMIT_RATE", "1")),
    ),
)
# In every worker (this module is imported by each; with --preload, once before
# the fork, which works too): publish this process's numbers to the files.
limiters.register_prometheus_multiprocess(
    interval=float(os.environ.get("BUCKETLIMIT_METRICS_INTERVAL", "1"))
)

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    worker = [("X-Worker", str(os.getpid()))]
    path = environ.get("PATH_INFO", "/")
    if path == "/metrics":
        registry = CollectorRegistry()  # a fresh one per scrape, as prometheus_client says
        MultiProcessCollector(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), *worker])
        return [generate_latest(registry)]
    if path == "/health":  # no decision: which worker answers
        start_response("200 OK", [("Content-Type", "text/plain"), *worker])
        return [b"ok\n"]
    key = parse_qs(environ.get("QUERY_STRING", "")).get("key", ["anonymous"])[0]
    decision = hello.allow(key)
    status = "200 OK" if decision else "429 Too Many Requests"
    start_response(status, [("Content-Type", "text/plain"), *worker])
    return [b"hello\n" if decision else b"slow down\n"]
