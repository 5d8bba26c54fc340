"""``register_prometheus_multiprocess``: each process's limiters in prometheus_client's
multiprocess files, summed by ``MultiProcessCollector``.

prometheus_client chooses where its numbers live when it is first imported,
from ``PROMETHEUS_MULTIPROC_DIR``: each case runs in a fresh interpreter started
with the variable set, forks real processes, and prints what a scrape sums.
(tests/metrics/test_metrics_workers.py does the same under gunicorn.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from bucketlimit import ConfigurationError
from bucketlimit.metrics import LimiterMetrics

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="os.fork")

SCRAPE = '''
def sample(name, **labels):
    return name + json.dumps(labels, sort_keys=True)


def scrape():
    """{sample name and labels: value}, as MultiProcessCollector sums them."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return {
        sample(s.name, **s.labels): s.value for family in registry.collect() for s in family.samples
    }
'''


def run_in_multiprocess_mode(tmp_path: Path, code: str) -> dict[str, Any]:
    """Runs ``code`` (which sets ``result``) in a fresh interpreter in multiprocess mode."""
    folder = tmp_path / "multiproc"
    folder.mkdir()
    program = (
        "import json, os, sys\n"
        "from prometheus_client import CollectorRegistry\n"
        "from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead\n"
        "from bucketlimit import TokenBucketLimiter\n"
        "from bucketlimit.metrics import LimiterMetrics\n"
        + SCRAPE
        + textwrap.dedent(code)
        + "\nprint(json.dumps(result))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", program],
        env={**_environ(), "PROMETHEUS_MULTIPROC_DIR": str(folder)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr == ""
    data: dict[str, Any] = json.loads(completed.stdout.splitlines()[-1])
    return data


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}


def sample(name: str, **labels: str) -> str:
    """A sample's key in what ``scrape()`` returns (the same function as in SCRAPE)."""
    return name + json.dumps(labels, sort_keys=True)


def allowed(policy: str) -> str:
    return sample("bucketlimit_decisions_total", outcome="allowed", policy=policy)


def refused(policy: str) -> str:
    return sample("bucketlimit_decisions_total", outcome="refused", policy=policy)


def keys(policy: str) -> str:
    return sample("bucketlimit_keys", policy=policy)


def test_forked_workers_publish_their_own_decisions_and_the_scrape_sums_them(
    tmp_path: Path,
) -> None:
    result = run_in_multiprocess_mode(
        tmp_path,
        """
        limiters = LimiterMetrics()
        api = limiters.add("api", TokenBucketLimiter(10, 0))
        # No timed publication in this test: the processes publish when they exit.
        export = limiters.register_prometheus_multiprocess(interval=3600)
        for _ in range(4):
            api.allow("parent")  # before the fork: the parent's, and only the parent's
        workers = []
        for n in range(3):
            pid = os.fork()
            if pid == 0:
                for _ in range(12):
                    api.allow(f"worker-{n}")  # 10 allowed, then 2 refused
                sys.exit(0)  # a normal exit: the export publishes a last time
            workers.append(pid)
        for pid in workers:
            assert os.waitpid(pid, 0)[1] == 0
            mark_process_dead(pid)  # what gunicorn's child_exit hook does
        export.sync()
        result = scrape()
        """,
    )
    # Each worker inherited the parent's 4 in stats() and published only its own.
    assert result[allowed("api")] == 4 + 3 * 10
    assert result[refused("api")] == 3 * 2
    # The workers are gone: only the live parent's one bucket is summed.
    assert result[keys("api")] == 1


def test_forked_workers_histograms_are_summed_bucket_by_bucket(tmp_path: Path) -> None:
    result = run_in_multiprocess_mode(
        tmp_path,
        """
        from bucketlimit._histogram import WAIT_BUCKETS, Histogram

        class Waits:
            def __init__(self):
                self.histogram = Histogram(WAIT_BUCKETS)

            def stats(self):
                return {}

            def histograms(self):
                return [("wait_seconds", {"resource": "tokens"}, self.histogram)]

        waits = Waits()
        limiters = LimiterMetrics({"api": waits})
        export = limiters.register_prometheus_multiprocess(interval=3600)
        waits.histogram.observe(0.0)  # before the fork: the parent's, and only the parent's
        workers = []
        for n in range(3):
            pid = os.fork()
            if pid == 0:
                waits.histogram.observe(0.0)
                waits.histogram.observe(2.0)
                export.sync()
                waits.histogram.observe(2.0)  # published at the exit
                sys.exit(0)
            workers.append(pid)
        for pid in workers:
            assert os.waitpid(pid, 0)[1] == 0
        export.sync()
        result = scrape()
        """,
    )
    labels = {"policy": "api", "resource": "tokens"}
    assert result[sample("bucketlimit_wait_seconds_count", **labels)] == 1 + 3 * 3
    assert result[sample("bucketlimit_wait_seconds_sum", **labels)] == 3 * 4.0
    assert result[sample("bucketlimit_wait_seconds_bucket", le="0.0", **labels)] == 1 + 3
    assert result[sample("bucketlimit_wait_seconds_bucket", le="1.0", **labels)] == 1 + 3
    assert result[sample("bucketlimit_wait_seconds_bucket", le="2.5", **labels)] == 1 + 3 * 3
    assert result[sample("bucketlimit_wait_seconds_bucket", le="+Inf", **labels)] == 1 + 3 * 3


def test_a_removed_limiter_keeps_its_counts_and_its_gauges_go_to_zero(tmp_path: Path) -> None:
    result = run_in_multiprocess_mode(
        tmp_path,
        """
        limiters = LimiterMetrics()
        api = limiters.add("api", TokenBucketLimiter(2, 0))
        export = limiters.register_prometheus_multiprocess(interval=3600)
        for key in "abc":
            api.allow(key)
        export.sync()
        before = scrape()
        limiters.remove("api")
        export.sync()
        removed = scrape()
        limiters.add("api", api)  # the same limiter again: nothing counted twice
        api.allow("a")
        export.sync()
        result = {"before": before, "removed": removed, "again": scrape()}
        assert limiters.register_prometheus_multiprocess(interval=3600) is export
        try:
            limiters.register_prometheus_multiprocess(interval=5)
        except ValueError as error:
            result["error"] = str(error)
        """,
    )
    assert result["before"][allowed("api")] == 3
    assert result["before"][keys("api")] == 3
    assert result["removed"][allowed("api")] == 3
    assert result["removed"][keys("api")] == 0
    assert result["again"][allowed("api")] == 4
    assert result["again"][keys("api")] == 3
    assert result["error"] == (
        "these limiters are exported already with namespace 'bucketlimit' and interval "
        "3600.0, not 'bucketlimit' and 5.0"
    )


def test_the_thread_publishes_every_interval(tmp_path: Path) -> None:
    result = run_in_multiprocess_mode(
        tmp_path,
        """
        import time

        limiters = LimiterMetrics()
        api = limiters.add("api", TokenBucketLimiter(5, 0))
        limiters.register_prometheus_multiprocess(interval=0.01)
        for _ in range(7):
            api.allow("k")
        refused = sample("bucketlimit_decisions_total", outcome="refused", policy="api")
        deadline = time.monotonic() + 20
        seen = scrape()
        while seen.get(refused, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # a real thread on a real clock: wait for its next round
            seen = scrape()
        result = seen
        """,
    )
    assert result[allowed("api")] == 5
    assert result[refused("api")] == 2


def test_prometheus_client_imported_before_the_variable_is_a_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / "multiproc"
    folder.mkdir()
    code = (
        "import os, prometheus_client\n"
        f"os.environ['PROMETHEUS_MULTIPROC_DIR'] = {str(folder)!r}\n"
        "from bucketlimit.metrics import LimiterMetrics\n"
        "LimiterMetrics().register_prometheus_multiprocess()\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env=_environ(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1
    assert completed.stderr.splitlines()[-1] == (
        "bucketlimit._errors.ConfigurationError: PROMETHEUS_MULTIPROC_DIR was set after "
        "prometheus_client was imported, so it keeps its numbers in memory: set it before "
        "the process starts"
    )
    assert list(folder.iterdir()) == []


def test_multiprocess_needs_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(ConfigurationError, match="set PROMETHEUS_MULTIPROC_DIR to an existing"):
        LimiterMetrics().register_prometheus_multiprocess()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="missing"):
        LimiterMetrics().register_prometheus_multiprocess()


@pytest.mark.parametrize(
    ("interval", "error", "message"),
    [
        ("1", TypeError, "interval must be a number of seconds, got str"),
        (True, TypeError, "interval must be a number of seconds, got bool"),
        (0, ValueError, "interval must be a finite number of seconds > 0, got 0"),
        (float("inf"), ValueError, "got inf"),
        (float("nan"), ValueError, "got nan"),
    ],
)
def test_a_bad_interval_is_refused(interval: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        LimiterMetrics().register_prometheus_multiprocess(interval=interval)  # type: ignore[arg-type]


def test_a_collector_in_multiprocess_mode_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One worker's numbers at each scrape was the bug: say what to do instead."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    with pytest.raises(ConfigurationError, match=r"call register_prometheus_multiprocess\(\)"):
        LimiterMetrics().register_prometheus(registry)
    assert list(registry.collect()) == []
