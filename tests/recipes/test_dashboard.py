"""The Grafana dashboard of the LLM gateway (examples/llm_gateway/dashboard.json): a
real Prometheus (Debian's ``prometheus``, tests/support/prometheus.py) scrapes the
gateway of tests/recipes/conftest.py every second while its callers send, then every
PromQL expression of every panel runs through Prometheus's HTTP API and must return
at least one series: a metric renamed in bucketlimit.metrics, or a query written
wrong, fails here.

Grafana's own variables are given the values Grafana would: ``$__rate_interval``,
a range holding several scrapes.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.recipes.gateway import ROOT, Run, Stack, run_callers
from tests.support.prometheus import Prometheus, prometheus_server

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

DASHBOARD = ROOT / "examples" / "llm_gateway" / "dashboard.json"
GRAFANA_VARIABLES = {"$__rate_interval": "5m"}
DEADLINE = 60.0  # seconds for Prometheus to scrape a few times (a hang guard)


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of the dashboard."""
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expression = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expression = expression.replace(variable, value)
            found.append((panel["title"], expression))
    return found


def scraped(prometheus: Prometheus, times: int) -> None:
    deadline = time.monotonic() + DEADLINE
    while prometheus.scrapes("gateway") < times:
        assert time.monotonic() < deadline, f"fewer than {times} scrapes:\n{prometheus.log_tail()}"
        time.sleep(0.2)  # polling interval, not a timing assumption


def test_every_query_of_the_dashboard_returns_data(stack: Stack, run: Run, tmp_path: Path) -> None:
    assert queries(), "the dashboard has no query"
    target = stack.gateway.removeprefix("http://")
    with prometheus_server([target], tmp_path / "prometheus", job="gateway") as prometheus:
        scraped(prometheus, 2)
        up = prometheus.query('up{job="gateway"}')
        assert [float(s["value"][1]) for s in up] == [1.0], "Prometheus cannot scrape the gateway"
        # A little more traffic while it scrapes: the rates and quantiles have data.
        run_callers(replace(stack, shape=replace(stack.shape, duration=3)), seed=36)
        scraped(prometheus, prometheus.scrapes("gateway") + 3)
        empty = []
        for title, expression in queries():
            series = prometheus.query(expression)
            print(f"\n{title}: {expression}\n  {len(series)} series: {series[:4]}")
            if not series:
                empty.append(f"{title}: {expression}")
        assert not empty, "queries with no series:\n" + "\n".join(empty)
