"""Metrics for Prometheus and OpenTelemetry, read from ``stats()`` when collected.

Name the limiters you want to see, then hand the set to your metrics library::

    from bucketlimit.metrics import LimiterMetrics

    limiters = LimiterMetrics()
    api = limiters.add("api", TokenBucketLimiter(100, 10))
    limiters.register_prometheus()  # prometheus_client's default registry
    limiters.register_opentelemetry()  # the global MeterProvider

Nothing is added to a decision: ``allow()`` runs exactly as without metrics.
The numbers are the limiters' own ``stats()`` counters, read when Prometheus
scrapes (a custom collector) or when OpenTelemetry collects (observable
instruments with callbacks), so an application that configures no metrics
pays nothing, and one that does pays one ``stats()`` call per limiter and
instrument per collection (docs/metrics.md).

Behind a pre-fork server (gunicorn ``-w 4``) each worker counts its own
decisions. Either every worker serves its own ``/metrics`` target (and
Prometheus adds them up), or the workers share one port through
prometheus_client's multiprocess mode: ``register_prometheus_multiprocess()``
publishes each worker's numbers to the multiprocess files, which
``prometheus_client.multiprocess.MultiProcessCollector`` sums at each scrape
(docs/metrics.md, "Pre-fork servers").

Neither library is needed to import this module: each is imported by the
method that uses it (``pip install 'bucketlimit[metrics]'`` installs both).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from bucketlimit._errors import ConfigurationError
from bucketlimit._histogram import (
    ROUND_TRIP_BUCKETS,
    WAIT_BUCKETS,
    Histogram,
    HistogramSnapshot,
)

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
    from prometheus_client.metrics_core import Metric as PrometheusMetric
    from prometheus_client.registry import CollectorRegistry

__all__ = [
    "HISTOGRAMS",
    "METRICS",
    "HistogramMetric",
    "HistogramReading",
    "LimiterMetrics",
    "Metric",
    "MetricsUnavailableError",
    "MultiprocessExport",
    "PrometheusCollector",
    "Reading",
]

#: The environment variable of prometheus_client's multiprocess mode: the folder
#: its per-process files live in.
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
_log = logging.getLogger(__name__)


class HasStats(Protocol):
    """What a limiter needs to be measured: ``TokenBucketLimiter`` and the Redis
    limiters (sync and asyncio) all have it."""

    def stats(self) -> Mapping[str, object]: ...


S = TypeVar("S", bound=HasStats)


class WebLimit(HasStats, Protocol):
    """A web limit, as :meth:`LimiterMetrics.add_limit` reads it."""

    @property
    def name(self) -> str: ...


L = TypeVar("L", bound=WebLimit)


@dataclass(frozen=True)
class Metric:
    """One metric: its name, kind and help, and the ``stats()`` key it reads.

    ``labels`` are fixed labels of this metric's samples, besides ``policy``
    (the name the limiter was added under). A limiter whose ``stats()`` has no
    ``stat`` key reports no sample for the metric (an in-process limiter has
    no store errors, a Redis one holds no keys in this process).
    """

    name: str  # Prometheus: bucketlimit_<name>[_total]; OpenTelemetry: bucketlimit.<name>
    kind: Literal["counter", "gauge"]
    help: str
    stat: str
    labels: Mapping[str, str] = field(default_factory=dict)
    unit: str = "1"  # OpenTelemetry unit (UCUM; "{decision}" is an annotation)


#: Every metric, one row per ``stats()`` counter. A limiter gaining a counter in
#: ``stats()`` gains a metric by one row here. The label values of one name are
#: disjoint, so ``sum()`` over a label counts each event once.
METRICS: tuple[Metric, ...] = (
    Metric(
        "decisions",
        "counter",
        "Decisions by outcome: allowed or refused (each decision once; degraded "
        "ones included, and counted again in degraded_decisions)",
        "allowed",
        {"outcome": "allowed"},
        "{decision}",
    ),
    Metric("decisions", "counter", "", "refused", {"outcome": "refused"}, "{decision}"),
    Metric(
        "degraded_decisions",
        "counter",
        "Answers given without the store (degraded=True), peek() answers included",
        "fallback_decisions",
        {},
        "{decision}",
    ),
    Metric(
        "store_errors", "counter", "Store faults and corrupt buckets", "store_errors", {}, "{error}"
    ),
    Metric("store_calls", "counter", "Commands sent to the store", "store_calls", {}, "{call}"),
    Metric(
        "script_loads", "counter", "Scripts sent whole after NOSCRIPT", "script_loads", {}, "{load}"
    ),
    Metric(
        "refusal_cache_hits",
        "counter",
        "Refusals answered from the refusal cache, without the store",
        "refusal_cache_hits",
        {},
        "{decision}",
    ),
    Metric(
        "lost_refunds",
        "counter",
        "Give-backs (cancel, settle, refund) that could not reach the store: their "
        "tokens stay spent",
        "lost_refunds",
        {},
        "{refund}",
    ),
    Metric(
        "breaker_openings",
        "counter",
        "Store outages: times the circuit breaker opened",
        "breaker_openings",
        {},
        "{opening}",
    ),
    Metric(
        "breaker_open",
        "gauge",
        "Circuit breakers open now (the store, or a cluster node, is skipped): 0 when none",
        "breaker_open",
    ),
    Metric(
        "lease_hits",
        "counter",
        "Decisions answered from a lease, in process (counted in decisions too)",
        "lease_hits",
        {},
        "{decision}",
    ),
    Metric(
        "lease_round_trips",
        "counter",
        "Commands that took or gave back a lease (counted in store_calls too)",
        "lease_round_trips",
        {},
        "{call}",
    ),
    Metric(
        "lease_tokens",
        "counter",
        "Tokens leased: charged to the store's bucket ahead of use",
        "lease_tokens",
        {},
        "{token}",
    ),
    Metric(
        "lease_tokens_returned",
        "counter",
        "Leased tokens given back unused",
        "lease_tokens_returned",
        {},
        "{token}",
    ),
    Metric(
        "lease_tokens_expired",
        "counter",
        "Leased tokens neither used nor given back (the store keeps them spent)",
        "lease_tokens_expired",
        {},
        "{token}",
    ),
    Metric(
        "lost_releases",
        "counter",
        "Permit releases that could not reach the store (those permits expire by their ttl)",
        "lost_releases",
        {},
        "{release}",
    ),
    Metric(
        "requests",
        "counter",
        "Requests a web limit decided, one outcome each: allowed (admitted, and it ran), "
        "refused (by this limit), given_back (admitted, refused by another limit: the "
        "charge given back), abandoned (the client left while it waited)",
        "requests_allowed",
        {"outcome": "allowed"},
        "{request}",
    ),
    Metric("requests", "counter", "", "requests_refused", {"outcome": "refused"}, "{request}"),
    Metric(
        "requests", "counter", "", "requests_given_back", {"outcome": "given_back"}, "{request}"
    ),
    Metric("requests", "counter", "", "requests_abandoned", {"outcome": "abandoned"}, "{request}"),
    Metric(
        "shadow_refusals",
        "counter",
        "Requests a shadow limit would have refused (they ran)",
        "shadow_refusals",
        {},
        "{request}",
    ),
    Metric(
        "permits_granted",
        "counter",
        "Concurrency permits granted, at once or after waiting",
        "granted",
        {},
        "{permit}",
    ),
    Metric(
        "permits_in_flight",
        "gauge",
        "Concurrency permits held now (a web limit: its requests whose response goes on)",
        "in_flight",
        {},
        "{permit}",
    ),
    Metric(
        "permits_waiting", "gauge", "Callers waiting for a permit now", "waiting", {}, "{request}"
    ),
    Metric(
        "permits_expired",
        "counter",
        "Permits freed by their ttl, not by their holder",
        "expired",
        {},
        "{permit}",
    ),
    Metric("keys", "gauge", "Buckets held in memory by in-process limiters", "keys", {}, "{key}"),
    Metric(
        "evicted_keys",
        "counter",
        "Buckets dropped to stay within max_keys",
        "evicted",
        {},
        "{key}",
    ),
    Metric(
        "refused_new_keys",
        "counter",
        "New keys refused because max_keys buckets were all in use",
        "refused_new_keys",
        {},
        "{decision}",
    ),
)


@dataclass(frozen=True)
class HistogramMetric:
    """A histogram of seconds: its name, help, the labels its samples carry besides
    ``policy``, and its buckets' bounds (``bucketlimit._histogram``)."""

    name: str  # Prometheus: bucketlimit_<name>_bucket, _sum, _count
    help: str
    labels: tuple[str, ...]
    bounds: tuple[float, ...]


#: Every histogram, by the name the measured objects' ``histograms()`` give it.
HISTOGRAMS: Mapping[str, HistogramMetric] = {
    h.name: h
    for h in (
        HistogramMetric(
            "wait_seconds",
            "Seconds a request waited for its tokens or its permit (a web limit with "
            "max_wait), each request admitted through the wait once (0: no wait)",
            ("resource",),
            WAIT_BUCKETS,
        ),
        HistogramMetric(
            "store_round_trip_seconds",
            "Seconds the store took to answer a command, from send to reply (a wait "
            "for a free connection included)",
            (),
            ROUND_TRIP_BUCKETS,
        ),
    )
}


@dataclass(frozen=True)
class HistogramReading:
    """One histogram's snapshot for one measured object (several of one name and
    labels, as a web limit's two Redis limiters' round trips, are summed)."""

    metric: HistogramMetric
    policy: str
    extra: tuple[tuple[str, str], ...]  # the labels besides policy
    snapshot: HistogramSnapshot

    @property
    def labels(self) -> dict[str, str]:
        return {"policy": self.policy, **dict(self.extra)}

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """Which histogram of its policy this is: its name and other labels."""
        return self.metric.name, self.extra


@dataclass(frozen=True)
class Reading:
    """One sample: a metric's value for one limiter."""

    metric: Metric
    policy: str
    value: int

    @property
    def labels(self) -> dict[str, str]:
        return {"policy": self.policy, **self.metric.labels}


def read_stats(limiter: HasStats) -> dict[str, int]:
    """The limiter's ``stats()`` (a Redis limiter's includes ``breaker_open``)."""
    return {name: value for name, value in limiter.stats().items() if isinstance(value, int)}


#: ``histograms()`` of a measured object: ``(name, labels, histogram)``.
Timed = list[tuple[str, dict[str, str], Histogram]]


def histograms_of(measured: object) -> Timed:
    """The histograms a measured object has (a web limit, a Redis limiter); none for
    one without ``histograms()`` or with a name this module does not know."""
    found = getattr(measured, "histograms", None)
    if not callable(found):
        return []
    return [entry for entry in found() if entry[0] in HISTOGRAMS]


def merged(histograms: Iterable[Histogram]) -> HistogramSnapshot:
    """The sum of histograms with the same bounds."""
    snapshots = [h.snapshot() for h in histograms]
    bounds = snapshots[0].bounds
    if any(s.bounds != bounds for s in snapshots):
        raise ValueError(f"histograms of different bounds cannot be summed: {snapshots!r}")
    counts = tuple(sum(c) for c in zip(*(s.counts for s in snapshots), strict=True))
    return HistogramSnapshot(bounds, counts, sum(s.sum for s in snapshots))


class LimiterMetrics:
    """Named limiters whose ``stats()`` become metrics when collected.

    Thread-safe: limiters may be added and removed while a collection runs. A
    limiter added is kept (a strong reference) until it is removed.
    """

    def __init__(self, limiters: Mapping[str, HasStats] | None = None) -> None:
        self._lock = threading.Lock()
        self._limiters: dict[str, HasStats] = {}
        self._export: MultiprocessExport | None = None
        # OpenTelemetry histograms (one dict per register_opentelemetry call) and
        # the listeners each measured histogram tells its observations to.
        self._recorders: list[dict[str, Any]] = []
        self._listening: dict[tuple[int, int], tuple[str, Histogram, Callable[[float], None]]] = {}
        for name, limiter in (limiters or {}).items():
            self.add(name, limiter)

    def add(self, name: str, limiter: S) -> S:
        """Measures ``limiter`` under the label ``policy=name``; returns the limiter."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if not name:
            raise ValueError("name must not be empty")
        if not callable(getattr(limiter, "stats", None)):
            raise TypeError(f"limiter must have a stats() method, got {type(limiter).__name__}")
        with self._lock:
            if name in self._limiters and self._limiters[name] is not limiter:
                raise ValueError(f"a limiter named {name!r} is measured already")
            self._limiters[name] = limiter
        histograms_of(limiter)  # asked for once, a Redis limiter times its commands
        self._listen()
        return limiter

    def add_limit(self, limit: L) -> L:
        """Measures a web limit (any adapter's ``Limit``) under its ``name``: what it
        counted per request (``requests{outcome}``, its permits), how long its
        requests waited, and its Redis limiters' store counters and round trips
        (docs/metrics.md, "Web limits"). A limit of several limit strings
        (``"2/minute;10/hour"``) is one policy per part, each under its own name.
        Returns the limit."""
        parts = getattr(limit, "parts", ())
        for part in parts or (limit,):
            self.add(part.name, part)
        return limit

    def remove(self, name: str) -> None:
        """Stops measuring the limiter named ``name`` (KeyError when there is none)."""
        with self._lock:
            del self._limiters[name]
            gone = [key for key, (policy, _, _) in self._listening.items() if policy == name]
            for key in gone:
                _, histogram, listener = self._listening.pop(key)
                histogram.unsubscribe(listener)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._limiters)

    def items(self) -> list[tuple[str, HasStats]]:
        """The measured limiters and their names, now."""
        with self._lock:
            return list(self._limiters.items())

    def read(self, metrics: Iterable[Metric] = METRICS) -> list[Reading]:
        """Every metric's value for every limiter, read now."""
        wanted = list(metrics)
        readings = []
        for policy, limiter in self.items():
            stats = read_stats(limiter)
            readings += [Reading(m, policy, stats[m.stat]) for m in wanted if m.stat in stats]
        return readings

    def read_histograms(self) -> list[HistogramReading]:
        """Every histogram of every measured object, read now."""
        readings = []
        for policy, measured in self.items():
            grouped: dict[tuple[str, tuple[tuple[str, str], ...]], list[Histogram]] = {}
            for name, labels, histogram in histograms_of(measured):
                extra = tuple(sorted(labels.items()))
                grouped.setdefault((name, extra), []).append(histogram)
            readings += [
                HistogramReading(HISTOGRAMS[name], policy, extra, merged(histograms))
                for (name, extra), histograms in grouped.items()
            ]
        return readings

    # -- Prometheus ------------------------------------------------------------------

    def prometheus_collector(self, namespace: str = "bucketlimit") -> PrometheusCollector:
        """A prometheus_client collector of these limiters (register it yourself)."""
        return PrometheusCollector(self, namespace)

    def register_prometheus(
        self, registry: CollectorRegistry | None = None, *, namespace: str = "bucketlimit"
    ) -> PrometheusCollector:
        """Registers a collector with ``registry`` (default: prometheus_client's
        global ``REGISTRY``) and returns it (``registry.unregister(it)`` undoes it).

        A collector reads this process's limiters. With ``PROMETHEUS_MULTIPROC_DIR``
        set (prometheus_client's multiprocess mode, one port for several worker
        processes) it would show one worker's numbers at each scrape, so it raises
        :class:`~bucketlimit.ConfigurationError`: use
        :meth:`register_prometheus_multiprocess` there."""
        prometheus_client = _require("prometheus_client", "register_prometheus")
        if os.environ.get(MULTIPROC_DIR):
            raise ConfigurationError(
                f"{MULTIPROC_DIR} is set ({os.environ[MULTIPROC_DIR]!r}): with one /metrics "
                "port for several processes a collector shows only the process that "
                "answers the scrape; call register_prometheus_multiprocess() in every "
                "worker and serve prometheus_client.multiprocess.MultiProcessCollector "
                "(docs/metrics.md, 'Pre-fork servers')"
            )
        collector = self.prometheus_collector(namespace)
        (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
        return collector

    def register_prometheus_multiprocess(
        self, *, namespace: str = "bucketlimit", interval: float = 1.0
    ) -> MultiprocessExport:
        """Publishes these limiters' numbers to prometheus_client's multiprocess
        files (``PROMETHEUS_MULTIPROC_DIR``), at once, then every ``interval``
        seconds and when the process exits, from a background thread.

        ``MultiProcessCollector`` then reads every worker's numbers at a scrape and
        sums them: counters over every process that ever ran (a worker that
        exited keeps its counts), gauges over the live ones (the server must call
        ``prometheus_client.multiprocess.mark_process_dead(pid)`` when a worker
        exits, gunicorn's ``child_exit`` hook). Call it once per process before or
        after the server forks its workers: a forked worker publishes its own
        decisions only, from the fork on. Returns the export; calling again
        returns the same one."""
        _require("prometheus_client", "register_prometheus_multiprocess")
        interval = _check_interval(interval)
        with self._lock:
            export = self._export
        if export is not None:
            if (export.namespace, export.interval) != (namespace, interval):
                raise ValueError(
                    f"these limiters are exported already with namespace "
                    f"{export.namespace!r} and interval {export.interval!r}, not "
                    f"{namespace!r} and {interval!r}"
                )
            return export
        export = MultiprocessExport(self, namespace, interval)
        with self._lock:
            self._export = export
        return export

    # -- OpenTelemetry ---------------------------------------------------------------

    def register_opentelemetry(
        self, meter_provider: MeterProvider | None = None, *, namespace: str = "bucketlimit"
    ) -> list[Any]:
        """Creates one observable instrument per metric on a meter of
        ``meter_provider`` (default: the global one): counters as observable
        counters, gauges as observable gauges, each read by a callback at
        collection time. Returns the instruments."""
        otel = _require("opentelemetry.metrics", "register_opentelemetry")
        provider = meter_provider if meter_provider is not None else otel.get_meter_provider()
        from bucketlimit import __version__

        meter = provider.get_meter("bucketlimit", __version__)
        instruments: list[Any] = []
        recorders = {
            name: _otel_histogram(meter, f"{namespace}.{name}", metric)
            for name, metric in HISTOGRAMS.items()
        }
        instruments += recorders.values()
        with self._lock:
            self._recorders.append(recorders)
        self._listen()
        for name, rows in _by_name(METRICS).items():
            create = (
                meter.create_observable_counter
                if rows[0].kind == "counter"
                else meter.create_observable_gauge
            )
            instruments.append(
                create(
                    f"{namespace}.{name}",
                    callbacks=[self._observe(rows, otel.Observation)],
                    unit=rows[0].unit,
                    description=rows[0].help,
                )
            )
        return instruments

    def _observe(
        self, rows: list[Metric], observation: type[Observation]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def callback(options: CallbackOptions) -> Iterable[Observation]:
            self._listen()  # histograms that appeared since (a limit string's limiter)
            return [observation(r.value, r.labels) for r in self.read(rows)]

        return callback

    def _listen(self) -> None:
        """Has every measured histogram tell its observations to each OpenTelemetry
        histogram (an instrument the SDK cannot read at collection time)."""
        with self._lock:
            if not self._recorders:
                return
            for policy, measured in self._limiters.items():
                for name, labels, histogram in histograms_of(measured):
                    attributes = {"policy": policy, **labels}
                    for recorder in self._recorders:
                        key = (id(histogram), id(recorder))
                        if key not in self._listening:
                            listener = _recording(recorder[name], attributes)
                            histogram.subscribe(listener)
                            self._listening[key] = (policy, histogram, listener)


class PrometheusCollector:
    """prometheus_client's custom collector: reads the limiters at each scrape."""

    def __init__(self, limiters: LimiterMetrics, namespace: str = "bucketlimit") -> None:
        _require("prometheus_client", "a Prometheus collector")
        self._limiters = limiters
        self._namespace = namespace

    def describe(self) -> Iterator[PrometheusMetric]:
        """The metric families without samples: registering reads no limiter."""
        return iter(self._families())

    def collect(self) -> Iterator[PrometheusMetric]:
        families = self._families()
        by_name = {family.name: family for family in families}
        for reading in self._limiters.read():
            family = by_name[f"{self._namespace}_{reading.metric.name}"]
            family.add_sample(
                family.name + ("_total" if reading.metric.kind == "counter" else ""),
                reading.labels,
                reading.value,
            )
        for timed in self._limiters.read_histograms():
            histogram: Any = by_name[f"{self._namespace}_{timed.metric.name}"]
            snapshot = timed.snapshot
            histogram.add_metric(
                [timed.policy, *(dict(timed.extra)[n] for n in timed.metric.labels)],
                [(_le(bound), count) for bound, count in snapshot.cumulative()],
                snapshot.sum,
            )
        return iter(families)

    def _families(self) -> list[PrometheusMetric]:
        from prometheus_client.metrics_core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        families: list[PrometheusMetric] = []
        for name, rows in _by_name(METRICS).items():
            kind = CounterMetricFamily if rows[0].kind == "counter" else GaugeMetricFamily
            families.append(kind(f"{self._namespace}_{name}", rows[0].help))
        for name, metric in HISTOGRAMS.items():
            families.append(
                HistogramMetricFamily(
                    f"{self._namespace}_{name}", metric.help, labels=["policy", *metric.labels]
                )
            )
        return families


class MultiprocessExport:
    """One process's limiters in prometheus_client's multiprocess files.

    Made by :meth:`LimiterMetrics.register_prometheus_multiprocess`. A background
    thread calls :meth:`sync` every ``interval`` seconds; :meth:`close` (also run
    when the process exits) stops it after a last sync. Counters are published
    as prometheus_client ``Counter`` objects, raised by what each limiter's
    ``stats()`` grew since the last sync; gauges as ``Gauge`` objects in
    ``livesum`` mode (the sum over live processes). A process forked from one
    that exports (a pre-fork server's worker) starts its own thread and
    publishes only what it decides after the fork.
    """

    def __init__(self, limiters: LimiterMetrics, namespace: str, interval: float) -> None:
        directory = os.environ.get(MULTIPROC_DIR)
        if not directory or not os.path.isdir(directory):
            raise ConfigurationError(
                f"register_prometheus_multiprocess() needs prometheus_client's multiprocess "
                f"mode: set {MULTIPROC_DIR} to an existing, empty folder before the "
                f"server starts (got {directory!r})"
            )
        from prometheus_client import values

        if values.ValueClass is values.MutexValue:
            raise ConfigurationError(
                f"{MULTIPROC_DIR} was set after prometheus_client was imported, so it "
                "keeps its numbers in memory: set it before the process starts"
            )
        self.namespace = namespace
        self.interval = interval
        self._limiters = limiters
        self._metrics = {
            name: _multiprocess_metric(f"{namespace}_{name}", rows)
            for name, rows in _by_name(METRICS).items()
        }
        self._lock = threading.Lock()
        # policy -> (limiter, its counters as last published, its gauges' stats)
        self._published: dict[str, tuple[HasStats, dict[str, int], set[str]]] = {}
        # (policy, histogram, its other labels) -> its snapshot as last published
        self._timed: dict[tuple[str, str, tuple[tuple[str, str], ...]], HistogramSnapshot] = {}
        self._histogram_values: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._closed = False
        self._stop = threading.Event()
        # The first publish before the thread: the files exist when this returns, so a
        # scrape in this process never reads one prometheus_client is still creating
        # (empty: a CI run saw struct.error from a scrape right after the register).
        self._sync_logged()
        self._thread = self._start()
        if hasattr(os, "register_at_fork"):  # POSIX: pre-fork servers fork
            os.register_at_fork(
                before=self._before_fork,
                after_in_parent=self._after_fork_in_parent,
                after_in_child=self._after_fork_in_child,
            )
        atexit.register(self.close)

    def sync(self) -> None:
        """Publishes every limiter's ``stats()`` now (nothing once closed)."""
        with self._lock:
            if not self._closed:
                self._publish()

    def close(self) -> None:
        """Stops the thread after one last :meth:`sync`; nothing is published after.
        Runs when the process exits normally; a process that ends with
        ``os._exit`` (as multiprocessing's children do) keeps only what its last
        sync published, unless it calls this first."""
        with self._lock:
            if self._closed:
                return
            self._publish()
            self._closed = True
            self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _publish(self) -> None:
        current = dict(self._limiters.items())
        for policy, limiter in current.items():
            stats = read_stats(limiter)
            known = self._published.get(policy)
            last = known[1] if known is not None and known[0] is limiter else {}
            counters: dict[str, int] = {}
            gauges: set[str] = set()
            for row in METRICS:
                if row.stat not in stats:
                    continue
                value = stats[row.stat]
                sample = self._metrics[row.name].labels(policy=policy, **row.labels)
                if row.kind == "counter":
                    grown = value - last.get(row.stat, 0)
                    if grown > 0:
                        sample.inc(grown)
                    counters[row.stat] = max(value, last.get(row.stat, 0))
                else:
                    sample.set(value)
                    gauges.add(row.stat)
            self._published[policy] = (limiter, counters, gauges)
        for timed in self._limiters.read_histograms():
            self._publish_histogram(timed, self._timed.get((timed.policy, *timed.key)))
            self._timed[(timed.policy, *timed.key)] = timed.snapshot
        for policy, (limiter, counters, gauges) in self._published.items():
            if policy not in current and gauges:
                # Removed: its counts stay (a counter never goes back), its gauges go to 0.
                for row in METRICS:
                    if row.stat in gauges:
                        self._metrics[row.name].labels(policy=policy, **row.labels).set(0)
                self._published[policy] = (limiter, counters, set())

    def _publish_histogram(self, timed: HistogramReading, last: HistogramSnapshot | None) -> None:
        """Adds what a histogram grew by since ``last`` to prometheus_client's
        histogram files (a histogram that shrank is a new one: all of it)."""
        now = timed.snapshot
        if (
            last is None
            or last.bounds != now.bounds
            or any(b < a for a, b in zip(last.counts, now.counts, strict=True))
        ):
            last = HistogramSnapshot(now.bounds, (0,) * len(now.counts), 0.0)
        name = f"{self.namespace}_{timed.metric.name}"
        labels = ["policy", *timed.metric.labels]
        values = [timed.policy, *(dict(timed.extra)[n] for n in timed.metric.labels)]
        bounds = (*now.bounds, math.inf)
        # Every bucket is written, an empty one as 0, as prometheus_client's Histogram
        # does: a scrape shows them all.
        for bound, before, count in zip(bounds, last.counts, now.counts, strict=True):
            bucket = (*values, _le(bound))
            value = self._histogram_value(name, "_bucket", [*labels, "le"], bucket, timed)
            if count > before:
                value.inc(count - before)
        total = self._histogram_value(name, "_sum", labels, values, timed)
        if now.sum > last.sum:
            total.inc(now.sum - last.sum)

    def _histogram_value(
        self,
        name: str,
        suffix: str,
        labels: list[str],
        values: Sequence[str],
        timed: HistogramReading,
    ) -> Any:
        """One sample of a histogram in this process's files: prometheus_client's own
        value class, as its ``Histogram`` writes them, so ``MultiProcessCollector``
        sums every process's buckets and adds ``_count``."""
        from prometheus_client import values as prometheus_values

        key = (name + suffix, tuple(values))
        value = self._histogram_values.get(key)
        if value is None:
            value = self._histogram_values[key] = prometheus_values.ValueClass(
                "histogram", name, name + suffix, labels, list(values), timed.metric.help
            )
        return value

    def _start(self) -> threading.Thread:
        thread = threading.Thread(
            target=self._run, args=(self._stop,), name="bucketlimit-metrics", daemon=True
        )
        thread.start()
        return thread

    def _run(self, stop: threading.Event) -> None:
        # At once, then every interval (a forked child's thread publishes its first
        # numbers here; in the exporting process this repeats the constructor's).
        while True:
            self._sync_logged()
            if stop.wait(self.interval):
                return

    def _sync_logged(self) -> None:
        try:
            self.sync()
        except Exception:  # a limiter's stats() failed: try again next time
            _log.exception("bucketlimit.metrics: publishing to %s failed", MULTIPROC_DIR)

    # A fork while the thread publishes would leave its locks held in the child:
    # hold them across the fork instead.
    def _before_fork(self) -> None:
        self._lock.acquire()
        self._limiters._lock.acquire()

    def _after_fork_in_parent(self) -> None:
        self._limiters._lock.release()
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        self._limiters._lock.release()
        self._lock.release()
        if self._closed:
            return
        # The parent publishes what it decided; this process starts from here.
        # (prometheus_client gives the child files of its own, starting at 0.)
        counters = {row.stat for row in METRICS if row.kind == "counter"}
        self._published = {}
        for policy, limiter in self._limiters.items():
            stats = read_stats(limiter)
            at_fork = {stat: value for stat, value in stats.items() if stat in counters}
            self._published[policy] = (limiter, at_fork, set())
        self._timed = {(t.policy, *t.key): t.snapshot for t in self._limiters.read_histograms()}
        self._histogram_values = {}  # the parent's files: the child writes its own
        self._stop = threading.Event()
        self._thread = self._start()


_MULTIPROCESS_METRICS: dict[str, Any] = {}
_MULTIPROCESS_LOCK = threading.Lock()


def _multiprocess_metric(full_name: str, rows: list[Metric]) -> Any:
    """One prometheus_client metric object per name and process (each holds its
    value in memory too): exports of several ``LimiterMetrics`` in one process
    share it, so their policies must differ."""
    from prometheus_client import Counter, Gauge

    labels = ["policy", *rows[0].labels]
    with _MULTIPROCESS_LOCK:
        metric = _MULTIPROCESS_METRICS.get(full_name)
        if metric is None:
            if rows[0].kind == "counter":
                metric = Counter(full_name, rows[0].help, labels, registry=None)
            else:
                metric = Gauge(
                    full_name, rows[0].help, labels, registry=None, multiprocess_mode="livesum"
                )
            _MULTIPROCESS_METRICS[full_name] = metric
    return metric


def _otel_histogram(meter: Any, name: str, metric: HistogramMetric) -> Any:
    """An OpenTelemetry histogram of seconds with ``metric``'s bounds (the advice is
    ignored by an SDK older than 1.23, which uses its default bounds)."""
    try:
        return meter.create_histogram(
            name,
            unit="s",
            description=metric.help,
            explicit_bucket_boundaries_advisory=list(metric.bounds),
        )
    except TypeError:  # an API without the advisory argument
        return meter.create_histogram(name, unit="s", description=metric.help)


def _recording(instrument: Any, attributes: dict[str, str]) -> Callable[[float], None]:
    def record(seconds: float) -> None:
        instrument.record(seconds, attributes)

    return record


def _le(bound: float) -> str:
    """A bucket's bound as prometheus_client writes ``le`` (``0.5``, ``1.0``,
    ``+Inf``), so that one process's buckets and the multiprocess sum name them
    alike."""
    from prometheus_client import utils

    go_string: Callable[[float], str] = utils.floatToGoString
    return go_string(bound)


def _check_interval(interval: object) -> float:
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise TypeError(f"interval must be a number of seconds, got {type(interval).__name__}")
    if not 0 < interval < math.inf:
        raise ValueError(f"interval must be a finite number of seconds > 0, got {interval!r}")
    return float(interval)


def _by_name(metrics: Iterable[Metric]) -> dict[str, list[Metric]]:
    """The rows of each metric name (``decisions`` has one row per outcome)."""
    grouped: dict[str, list[Metric]] = {}
    for metric in metrics:
        grouped.setdefault(metric.name, []).append(metric)
    return grouped


def _require(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = "prometheus-client" if module.startswith("prometheus") else "opentelemetry-api"
        raise MetricsUnavailableError(
            f"{what} needs the {package} package, which is not installed: "
            f"pip install {package} (or pip install 'bucketlimit[metrics]')"
        ) from None


class MetricsUnavailableError(ConfigurationError, ImportError):
    """The metrics library asked for is not installed."""
