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

Neither library is needed to import this module: each is imported by the
method that uses it (``pip install 'bucketlimit[metrics]'`` installs both).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from bucketlimit._errors import ConfigurationError

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
    from prometheus_client.metrics_core import Metric as PrometheusMetric
    from prometheus_client.registry import CollectorRegistry

__all__ = ["METRICS", "LimiterMetrics", "Metric", "PrometheusCollector", "Reading"]


class HasStats(Protocol):
    """What a limiter needs to be measured: ``TokenBucketLimiter`` and the Redis
    limiters (sync and asyncio) all have it."""

    def stats(self) -> Mapping[str, object]: ...


S = TypeVar("S", bound=HasStats)


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
#: ``stats()`` gains a metric by one row here. ``reservations_waiting`` is the
#: row for reservations waiting to be settled: it reports as soon as a limiter's
#: ``stats()`` has that key, and nothing before (no limiter has it yet).
METRICS: tuple[Metric, ...] = (
    Metric(
        "decisions",
        "counter",
        "Decisions by outcome: allowed, refused, and degraded (answered without the "
        "store; those are counted as allowed or refused too)",
        "allowed",
        {"outcome": "allowed"},
        "{decision}",
    ),
    Metric("decisions", "counter", "", "refused", {"outcome": "refused"}, "{decision}"),
    Metric("decisions", "counter", "", "fallback_decisions", {"outcome": "degraded"}, "{decision}"),
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
        "1 while the circuit breaker is open (the store is skipped), else 0",
        "breaker_open",
    ),
    Metric("keys", "gauge", "Buckets held in this process", "keys", {}, "{key}"),
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
    Metric(
        "reservations_waiting",
        "gauge",
        "Reservations made and not yet settled",
        "reservations_waiting",
        {},
        "{reservation}",
    ),
)


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
    """The limiter's ``stats()``, with the breaker's state for a Redis limiter."""
    stats = {name: value for name, value in limiter.stats().items() if isinstance(value, int)}
    # The Redis limiters' breaker (bucketlimit._redis.resilience.Breaker); its
    # state is not a counter of stats(), so it is read here.
    breaker = getattr(limiter, "_breaker", None)
    if "breaker_open" not in stats and isinstance(getattr(breaker, "open", None), bool):
        stats["breaker_open"] = int(breaker.open)  # type: ignore[union-attr]
    return stats


class LimiterMetrics:
    """Named limiters whose ``stats()`` become metrics when collected.

    Thread-safe: limiters may be added and removed while a collection runs. A
    limiter added is kept (a strong reference) until it is removed.
    """

    def __init__(self, limiters: Mapping[str, HasStats] | None = None) -> None:
        self._lock = threading.Lock()
        self._limiters: dict[str, HasStats] = {}
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
        return limiter

    def remove(self, name: str) -> None:
        """Stops measuring the limiter named ``name`` (KeyError when there is none)."""
        with self._lock:
            del self._limiters[name]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._limiters)

    def read(self, metrics: Iterable[Metric] = METRICS) -> list[Reading]:
        """Every metric's value for every limiter, read now."""
        with self._lock:
            limiters = list(self._limiters.items())
        wanted = list(metrics)
        readings = []
        for policy, limiter in limiters:
            stats = read_stats(limiter)
            readings += [Reading(m, policy, stats[m.stat]) for m in wanted if m.stat in stats]
        return readings

    # -- Prometheus ------------------------------------------------------------------

    def prometheus_collector(self, namespace: str = "bucketlimit") -> PrometheusCollector:
        """A prometheus_client collector of these limiters (register it yourself)."""
        return PrometheusCollector(self, namespace)

    def register_prometheus(
        self, registry: CollectorRegistry | None = None, *, namespace: str = "bucketlimit"
    ) -> PrometheusCollector:
        """Registers a collector with ``registry`` (default: prometheus_client's
        global ``REGISTRY``) and returns it (``registry.unregister(it)`` undoes it)."""
        prometheus_client = _require("prometheus_client", "register_prometheus")
        collector = self.prometheus_collector(namespace)
        (registry if registry is not None else prometheus_client.REGISTRY).register(collector)
        return collector

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
        instruments = []
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
            return [observation(r.value, r.labels) for r in self.read(rows)]

        return callback


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
        return iter(families)

    def _families(self) -> list[PrometheusMetric]:
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

        families: list[PrometheusMetric] = []
        for name, rows in _by_name(METRICS).items():
            kind = CounterMetricFamily if rows[0].kind == "counter" else GaugeMetricFamily
            families.append(kind(f"{self._namespace}_{name}", rows[0].help))
        return families


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
