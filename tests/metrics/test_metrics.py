"""``bucketlimit.metrics``: the limiters' stats() as Prometheus and OpenTelemetry metrics.

Each library is read through its own in-memory side: prometheus_client's
``CollectorRegistry`` and opentelemetry-sdk's ``InMemoryMetricReader``. After a
scripted trace run by threads (while other threads keep collecting), every
metric equals the limiter's ``stats()`` and the decisions the threads saw.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, get_type_hints

import flask
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from bucketlimit import (
    ConcurrencyLimiter,
    ConcurrencyStats,
    ConfigurationError,
    LimiterStats,
    LimitStats,
    RedisConcurrencyStats,
    RedisLimiterStats,
    TokenBucketLimiter,
)
from bucketlimit._histogram import ROUND_TRIP_BUCKETS, Histogram
from bucketlimit.flask import Limit, RateLimit
from bucketlimit.metrics import (
    METRICS,
    LimiterMetrics,
    MetricsUnavailableError,
    PrometheusCollector,
)
from bucketlimit.testing import ManualClock

THREADS = 4
CALLS = 600


def otel_points(reader: InMemoryMetricReader) -> dict[tuple[str, frozenset[Any]], int]:
    """{(instrument name, attributes): value} of one collection's counters and gauges."""
    points: dict[tuple[str, frozenset[Any]], int] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "bucketlimit"
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    if not hasattr(point, "value"):  # a histogram's: otel_histogram()
                        continue
                    attributes = frozenset((point.attributes or {}).items())
                    points[metric.name, attributes] = int(point.value)
    return points


def prom(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.fixture
def measured() -> Iterator[tuple[LimiterMetrics, CollectorRegistry, InMemoryMetricReader]]:
    limiters = LimiterMetrics()
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    limiters.register_opentelemetry(provider)
    yield limiters, registry, reader
    provider.shutdown()


def test_metrics_match_stats_after_a_threaded_trace(
    measured: tuple[LimiterMetrics, CollectorRegistry, InMemoryMetricReader],
) -> None:
    limiters, registry, reader = measured
    clock = ManualClock()
    login = limiters.add("login", TokenBucketLimiter(5, 0, clock, max_keys=8))
    api = limiters.add("api", TokenBucketLimiter(40, 1, clock))
    seen: Counter[tuple[str, bool]] = Counter()
    seen_lock = threading.Lock()
    start = threading.Barrier(THREADS + 1)
    done = threading.Event()
    scraped: list[float] = []

    def client(n: int) -> None:
        mine: Counter[tuple[str, bool]] = Counter()
        start.wait()
        for i in range(CALLS):
            # 20 users on an 8-key table: evictions are impossible at rate 0
            # (no bucket is ever full again), so new keys get refused.
            user = f"user-{(n * 7 + i) % 20}"
            mine["login", bool(login.allow(user))] += 1
            mine["api", bool(api.allow(user, 1 + i % 3))] += 1
        with seen_lock:
            seen.update(mine)

    def scraper() -> None:
        start.wait()
        while not done.is_set():
            value = prom(registry, "bucketlimit_decisions_total", policy="api", outcome="allowed")
            scraped.append(value or 0.0)
            otel_points(reader)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(THREADS)]
    collector = threading.Thread(target=scraper)
    for thread in [*threads, collector]:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    done.set()
    collector.join(timeout=20)

    assert len(scraped) > 0
    assert scraped == sorted(scraped)  # a counter never goes back
    points = otel_points(reader)
    for policy, limiter in (("login", login), ("api", api)):
        stats = limiter.stats()
        counts = {
            "allowed": stats["allowed"],
            "refused": stats["refused"],
            "keys": stats["keys"],
            "evicted": stats["evicted"],
            "refused_new_keys": stats["refused_new_keys"],
        }
        assert stats["allowed"] == seen[policy, True] > 0
        assert stats["refused"] == seen[policy, False] > 0
        assert stats["allowed"] + stats["refused"] == THREADS * CALLS
        for outcome, stat in (("allowed", "allowed"), ("refused", "refused")):
            value = prom(registry, "bucketlimit_decisions_total", policy=policy, outcome=outcome)
            assert value == counts[stat]
            key = (
                "bucketlimit.decisions",
                frozenset({"policy": policy, "outcome": outcome}.items()),
            )
            assert points[key] == counts[stat]
        for name, stat in (
            ("keys", "keys"),
            ("evicted_keys", "evicted"),
            ("refused_new_keys", "refused_new_keys"),
        ):
            suffix = "" if name == "keys" else "_total"
            assert prom(registry, f"bucketlimit_{name}{suffix}", policy=policy) == counts[stat]
            assert (
                points[f"bucketlimit.{name}", frozenset({"policy": policy}.items())] == counts[stat]
            )
        # An in-process limiter has no store: no degraded decisions, no store metrics.
        assert (
            prom(registry, "bucketlimit_decisions_total", policy=policy, outcome="degraded") is None
        )
        assert prom(registry, "bucketlimit_store_errors_total", policy=policy) is None
    assert login.stats()["keys"] == 8
    assert login.stats()["refused_new_keys"] > 0


def test_stats_are_read_only_when_collected() -> None:
    class Counting:
        """A limiter stand-in that counts how often it is read."""

        def __init__(self, stats: Mapping[str, int]) -> None:
            self.reads = 0
            self._stats = dict(stats)

        def stats(self) -> dict[str, int]:
            self.reads += 1
            return self._stats

    limiter = Counting({"allowed": 3, "refused": 1, "keys": 2})
    limiters = LimiterMetrics({"api": limiter})
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)  # describe() reads nothing
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    limiters.register_opentelemetry(provider)
    assert limiter.reads == 0
    text = generate_latest(registry).decode()
    assert 'bucketlimit_decisions_total{outcome="allowed",policy="api"} 3.0' in text
    assert 'bucketlimit_keys{policy="api"} 2.0' in text
    assert limiter.reads == 1  # one scrape, one read
    otel_points(reader)
    # One read per instrument with a sample callback: each reads once per collection.
    instruments = len({m.name for m in METRICS})
    assert limiter.reads == 1 + instruments
    provider.shutdown()


def test_every_metric_reads_a_key_some_limiters_stats_has() -> None:
    """``reservations_waiting`` was exposed and no limiter ever filled it. Every row
    now reads a key of some stats() (a limiter's, a concurrency limiter's, a web
    limit's)."""
    keys: set[str] = set()
    for stats in (
        LimiterStats,
        RedisLimiterStats,
        ConcurrencyStats,
        RedisConcurrencyStats,
        LimitStats,
    ):
        keys |= set(get_type_hints(stats))
    assert {m.stat for m in METRICS} <= keys
    assert "reservations_waiting" not in {m.name for m in METRICS}
    limiters = LimiterMetrics({"api": TokenBucketLimiter(1, 1)})
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    assert "reservations_waiting" not in generate_latest(registry).decode()


def test_the_outcomes_of_decisions_add_up() -> None:
    """The outcomes are allowed and refused only: a ``degraded`` outcome would
    overlap them, and a ``sum()`` over the outcomes would count it twice."""
    outcomes = [m.labels["outcome"] for m in METRICS if m.name == "decisions"]
    assert outcomes == ["allowed", "refused"]
    degraded = [m for m in METRICS if m.stat == "fallback_decisions"]
    assert [(m.name, dict(m.labels)) for m in degraded] == [("degraded_decisions", {})]
    # Within every name, the rows' label sets differ: sum() over them is additive.
    for name in {m.name for m in METRICS}:
        rows = [tuple(sorted(m.labels.items())) for m in METRICS if m.name == name]
        assert len(rows) == len(set(rows)), name

    class Degraded:
        """A Redis limiter's stats() after 3 allowed and 2 refused, 4 of them
        (and one peek) answered without the store."""

        def stats(self) -> dict[str, int]:
            return {"allowed": 3, "refused": 2, "fallback_decisions": 5}

    limiters = LimiterMetrics({"api": Degraded()})
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    decisions = [
        sample.value
        for family in registry.collect()
        if family.name == "bucketlimit_decisions"
        for sample in family.samples
    ]
    assert sum(decisions) == 3 + 2  # every decision once
    assert prom(registry, "bucketlimit_degraded_decisions_total", policy="api") == 5


def test_adding_and_removing_limiters() -> None:
    limiters = LimiterMetrics()
    limiter = TokenBucketLimiter(2, 1)
    assert limiters.add("api", limiter) is limiter
    assert limiters.add("api", limiter) is limiter  # the same one again: no change
    with pytest.raises(ValueError, match="a limiter named 'api' is measured already"):
        limiters.add("api", TokenBucketLimiter(2, 1))
    with pytest.raises(TypeError, match="name must be a str, got int"):
        limiters.add(3, limiter)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name must not be empty"):
        limiters.add("", limiter)
    with pytest.raises(TypeError, match="limiter must have a stats\\(\\) method, got object"):
        limiters.add("x", object())  # type: ignore[type-var]
    assert limiters.names() == ["api"]
    limiter.allow("k")
    assert {(r.metric.name, r.value) for r in limiters.read()} >= {("decisions", 1), ("keys", 1)}
    limiters.remove("api")
    assert limiters.read() == []
    with pytest.raises(KeyError):
        limiters.remove("api")


def test_prometheus_collector_can_be_registered_by_hand() -> None:
    limiters = LimiterMetrics({"api": TokenBucketLimiter(2, 1)})
    collector = limiters.prometheus_collector(namespace="myapp_limits")
    assert isinstance(collector, PrometheusCollector)
    registry = CollectorRegistry()
    registry.register(collector)
    assert prom(registry, "myapp_limits_decisions_total", policy="api", outcome="allowed") == 0
    registry.unregister(collector)
    assert prom(registry, "myapp_limits_decisions_total", policy="api", outcome="allowed") is None


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_importing_bucketlimit_loads_no_metrics_library() -> None:
    result = run_python(
        "import sys, bucketlimit\n"
        "from bucketlimit import TokenBucketLimiter\n"
        "TokenBucketLimiter(1, 1).allow('k')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('prometheus', 'opentelemetry', "
        "'bucketlimit.metrics'))))"
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", "")


@pytest.mark.parametrize(
    ("blocked", "call", "package"),
    [
        ("prometheus_client", "register_prometheus()", "prometheus-client"),
        ("opentelemetry", "register_opentelemetry()", "opentelemetry-api"),
    ],
)
def test_a_missing_library_is_a_clear_error(blocked: str, call: str, package: str) -> None:
    result = run_python(
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from bucketlimit.metrics import LimiterMetrics, MetricsUnavailableError\n"
        "from bucketlimit import ConfigurationError\n"
        "try:\n"
        f"    LimiterMetrics().{call}\n"
        "except MetricsUnavailableError as error:\n"
        "    assert isinstance(error, ConfigurationError) and isinstance(error, ImportError)\n"
        "    print(error)\n"
    )
    assert result.returncode == 0, result.stderr
    assert f"needs the {package} package, which is not installed: pip install {package}" in (
        result.stdout
    )
    assert issubclass(MetricsUnavailableError, ConfigurationError)


# -- web limits and histograms -------------------------------------------------------------------


def test_a_web_limit_is_measured_under_its_name_with_one_outcome_per_request(
    measured: tuple[LimiterMetrics, CollectorRegistry, InMemoryMetricReader],
) -> None:
    limiters, registry, reader = measured
    clock = ManualClock()
    requests = Limit(TokenBucketLimiter(10, 0, clock), name="requests")
    tokens = Limit(
        TokenBucketLimiter(3, 1, clock, per=2),
        name="tokens",
        cost=lambda request: int(request.args.get("cost", 1)),
        max_wait=3,
    )
    assert limiters.add_limit(requests) is requests
    limiters.add_limit(tokens)
    app = flask.Flask(__name__)
    RateLimit(requests, app)
    app.add_url_rule("/", "index", tokens(lambda: "hi"))
    client = app.test_client()
    paths = ["/"] * 4 + ["/?cost=10"] * 2  # the 4th waits 2 s; 10 tokens never fit in 3
    statuses = [client.get(path).status_code for path in paths]
    assert statuses == [200, 200, 200, 200, 413, 413]

    def requests_total(policy: str, outcome: str) -> float | None:
        return prom(registry, "bucketlimit_requests_total", policy=policy, outcome=outcome)

    assert requests_total("requests", "allowed") == 4
    assert requests_total("requests", "given_back") == 2
    assert requests_total("tokens", "allowed") == 4
    assert requests_total("tokens", "refused") == 2
    for policy in ("requests", "tokens"):
        answered = sum(
            requests_total(policy, outcome) or 0 for outcome in ("allowed", "refused", "given_back")
        )
        assert answered == len(statuses), f"{policy}: each answered request counted once"
    waits = {"policy": "tokens", "resource": "tokens"}
    assert prom(registry, "bucketlimit_wait_seconds_count", **waits) == 4
    assert prom(registry, "bucketlimit_wait_seconds_sum", **waits) == 2.0
    assert prom(registry, "bucketlimit_wait_seconds_bucket", le="0.0", **waits) == 3
    assert prom(registry, "bucketlimit_wait_seconds_bucket", le="1.0", **waits) == 3
    assert prom(registry, "bucketlimit_wait_seconds_bucket", le="2.5", **waits) == 4
    # The requests limit cannot wait: no histogram of its waits.
    assert prom(registry, "bucketlimit_wait_seconds_count", policy="requests") is None

    points = otel_points(reader)
    refused = frozenset({("policy", "tokens"), ("outcome", "refused")})
    assert points["bucketlimit.requests", refused] == 2
    histogram = otel_histogram(reader, "bucketlimit.wait_seconds", waits)
    assert (histogram.count, histogram.sum) == (4, 2.0)


def otel_histogram(reader: InMemoryMetricReader, name: str, attributes: dict[str, str]) -> Any:
    """The histogram data point of ``name`` with ``attributes`` in one collection."""
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    if dict(point.attributes or {}) == attributes:
                        return point
    raise AssertionError(f"no {name} point with {attributes}")


def test_a_limit_of_several_strings_is_a_policy_per_part() -> None:
    limiters = LimiterMetrics()
    limit = Limit("2/minute;10/hour", storage="memory://")
    limiters.add_limit(limit)
    assert limiters.names() == ["2/minute", "10/hour"]


def test_histograms_of_one_name_and_labels_are_summed_per_policy() -> None:
    class TwoStores:
        """A web limit's view of two Redis limiters: one round-trip histogram each."""

        def __init__(self) -> None:
            self.first = Histogram(ROUND_TRIP_BUCKETS)
            self.second = Histogram(ROUND_TRIP_BUCKETS)

        def stats(self) -> dict[str, int]:
            return {}

        def histograms(self) -> list[tuple[str, dict[str, str], Histogram]]:
            return [
                ("store_round_trip_seconds", {}, self.first),
                ("store_round_trip_seconds", {}, self.second),
            ]

    stores = TwoStores()
    stores.first.observe(0.0002)
    stores.second.observe(0.003)
    stores.second.observe(2.0)  # beyond every bound
    limiters = LimiterMetrics({"api": stores})
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    name = "bucketlimit_store_round_trip_seconds"
    assert prom(registry, f"{name}_count", policy="api") == 3
    assert prom(registry, f"{name}_bucket", policy="api", le="0.00025") == 1
    assert prom(registry, f"{name}_bucket", policy="api", le="0.005") == 2
    assert prom(registry, f"{name}_bucket", policy="api", le="1.0") == 2
    assert prom(registry, f"{name}_bucket", policy="api", le="+Inf") == 3
    assert prom(registry, f"{name}_sum", policy="api") == pytest.approx(2.0032)


def test_otel_histograms_follow_limiters_added_and_removed() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    limiters = LimiterMetrics()
    limiters.register_opentelemetry(provider)
    timed = Histogram(ROUND_TRIP_BUCKETS)

    class Store:
        def stats(self) -> dict[str, int]:
            return {}

        def histograms(self) -> list[tuple[str, dict[str, str], Histogram]]:
            return [("store_round_trip_seconds", {}, timed)]

    limiters.add("store", Store())  # added after the registration
    timed.observe(0.001)
    point = otel_histogram(reader, "bucketlimit.store_round_trip_seconds", {"policy": "store"})
    assert (point.count, point.sum) == (1, 0.001)
    limiters.remove("store")
    timed.observe(0.001)  # no longer recorded
    point = otel_histogram(reader, "bucketlimit.store_round_trip_seconds", {"policy": "store"})
    assert point.count == 1
    provider.shutdown()


def test_a_concurrency_limiter_exports_its_permits() -> None:
    """It exported only ``refused``: no permit granted, held or waited for was seen."""
    inflight = ConcurrencyLimiter(2)
    limiters = LimiterMetrics({"exports": inflight})
    registry = CollectorRegistry()
    limiters.register_prometheus(registry)
    held = [inflight.try_acquire("k"), inflight.try_acquire("k")]
    assert not inflight.try_acquire("k")
    labels = {"policy": "exports"}
    assert prom(registry, "bucketlimit_permits_granted_total", **labels) == 2
    assert prom(registry, "bucketlimit_permits_in_flight", **labels) == 2
    assert prom(registry, "bucketlimit_permits_waiting", **labels) == 0
    assert prom(registry, "bucketlimit_permits_expired_total", **labels) == 0
    assert prom(registry, "bucketlimit_decisions_total", outcome="refused", **labels) == 1
    for permit in held:
        permit.release()
    assert prom(registry, "bucketlimit_permits_in_flight", **labels) == 0
