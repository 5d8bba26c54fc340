"""``simulate --concurrency N``: traffic through a real ConcurrencyLimiter, each
request holding a permit for its service time.

Every run is checked against an independent reference: a first-come-first-served
queue with N servers per key whose waiters give up after ``max_wait`` (the classic
multi-server queue with reneging, written from its definition below), request by
request. The numbers the command writes (text, JSON, CSV, the picture) are those
of the run, and the run's grants are the limiter's (its ``stats()``).
"""

from __future__ import annotations

import csv
import heapq
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bucketlimit import ConcurrencyLimiter
from bucketlimit.__main__ import main
from bucketlimit._simulate import Request, make_traffic
from bucketlimit._simulate.model import SimulationError
from bucketlimit._simulate.permits import PermitSettings, run_permits
from bucketlimit._simulate.plot import permits_figure
from bucketlimit._simulate.service import service_times
from bucketlimit._simulate.simulation import simulate_permits
from bucketlimit.testing import ManualClock
from tests.core.test_cli import run_cli, run_cli_process


def reference(
    requests: Sequence[Request], services: Sequence[int], limit: int, max_wait_us: float
) -> list[int | None]:
    """Each request's start time (``None``: refused), by the definition of a FIFO queue
    with ``limit`` servers per key and patience ``max_wait_us``: a request starts when
    it arrives or when the earliest of its key's servers frees, whichever is later,
    and leaves instead if that is more than ``max_wait_us`` after it arrived (exactly
    ``max_wait_us`` is still served); one that leaves holds no server."""
    free: dict[str, list[int]] = {}  # per key: when each server is free again
    starts: list[int | None] = []
    for request, service in zip(requests, services, strict=True):
        servers = free.setdefault(request.key, [0] * limit)
        start = max(request.at, servers[0])
        if start - request.at > max_wait_us:
            starts.append(None)
            continue
        heapq.heapreplace(servers, start + service)
        starts.append(start)
    return starts


def peak_of(intervals: Sequence[tuple[int, int]]) -> int:
    """The most half-open intervals ``[start, end)`` that overlap at one moment."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    level = best = 0
    for _, step in events:  # at one instant the ends (-1) come first
        level += step
        best = max(best, level)
    return best


def run(
    requests: list[Request],
    services: list[int],
    limit: int,
    max_wait: float,
    *,
    ttl: float = 3600.0,
    duration_us: int | None = None,
) -> Any:
    clock = ManualClock()
    limiter = ConcurrencyLimiter(limit, ttl=ttl, clock=clock)
    settings = PermitSettings(concurrency=limit, service=1.0, ttl=ttl, max_wait=max_wait)
    end = duration_us or max(r.at for r in requests) + 1
    keys = list(dict.fromkeys(r.key for r in requests))
    return limiter, run_permits(
        limiter, clock, requests, services, settings, end, keys=keys, record=True
    )


traces = st.integers(1, 4).flatmap(
    lambda limit: st.tuples(
        st.just(limit),
        st.lists(
            st.tuples(st.integers(0, 3_000_000), st.integers(1, 2_000_000), st.sampled_from("ab")),
            min_size=1,
            max_size=60,
        ),
        st.sampled_from([0.0, 0.25, 1.0, 2.5, math.inf]),
    )
)


@given(traces)
def test_every_request_starts_when_the_reference_queue_says(
    trace: tuple[int, list[tuple[int, int, str]], float],
) -> None:
    limit, rows, max_wait = trace
    rows.sort(key=lambda row: row[0])
    requests = [Request(at, key, 1) for at, _, key in rows]
    services = [service for _, service, _ in rows]
    limiter, replay = run(requests, services, limit, max_wait)
    expected = reference(requests, services, limit, max_wait * 1_000_000)
    assert [served.start_us for served in replay.served] == expected
    admitted = [start for start in expected if start is not None]
    assert replay.admitted == len(admitted) == limiter.stats()["granted"]
    assert replay.refused == len(expected) - len(admitted)
    waits = [s - r.at for r, s in zip(requests, expected, strict=True) if s is not None]
    assert sorted(replay.waits_us) == sorted(w for w in waits if w > 0)
    if max_wait == 0:
        assert replay.timed_out == 0
    for key in "ab":  # never more than the limit in flight per key, measured
        runs = [
            (s, s + svc)
            for r, s, svc in zip(requests, expected, services, strict=True)
            if s is not None and r.key == key
        ]
        assert peak_of(runs) <= limit
        if runs:
            assert replay.clients[key].peak == peak_of(runs)
    assert limiter.stats()["in_flight"] == 0  # every permit released
    assert limiter.stats()["expired"] == 0


def test_a_request_longer_than_the_ttl_loses_its_permit() -> None:
    """Limit 1, ttl 1 s, each request runs 3 s, one arrives every 0.5 s, max_wait 10 s:
    each permit expires after 1 s while its request still runs, so the next waiter
    is granted then and up to three run at once."""
    requests = [Request(i * 500_000, "k", 1) for i in range(6)]
    limiter, replay = run(requests, [3_000_000] * 6, 1, 10.0, ttl=1.0)
    starts = [served.start_us for served in replay.served]
    assert starts == [0, 1_000_000, 2_000_000, 3_000_000, 4_000_000, 5_000_000]
    assert replay.peak_in_flight == 3
    assert limiter.stats()["expired"] == 6
    assert limiter.stats()["in_flight"] == 0


def test_at_one_instant_a_freed_slot_serves_the_arrival_and_the_waiter_at_its_deadline() -> None:
    # Limit 1: request 0 runs [0, 2 s); request 1 waits from 1 s with max_wait 1 s: its
    # wait ends at 2 s as the slot frees (granted); request 2 arrives at 3 s as 1 ends.
    requests = [Request(0, "k", 1), Request(1_000_000, "k", 1), Request(3_000_000, "k", 1)]
    _, replay = run(requests, [2_000_000, 1_000_000, 1], 1, 1.0)
    assert [s.start_us for s in replay.served] == [0, 2_000_000, 3_000_000]
    assert [s.wait_us for s in replay.served] == [0, 1_000_000, 0]


def test_service_times_are_seeded_and_have_the_mean() -> None:
    assert service_times("fixed", 0.25, 3, 0) == [250_000] * 3
    for kind in ("exponential", "lognormal"):
        draws = service_times(kind, 2.0, 20_000, 7)
        assert draws == service_times(kind, 2.0, 20_000, 7)
        assert draws != service_times(kind, 2.0, 20_000, 8)
        assert min(draws) >= 1
        assert abs(sum(draws) / len(draws) / 1e6 - 2.0) < 0.1  # the mean asked for
    long_tail = sorted(service_times("lognormal", 1.0, 20_000, 1))
    assert long_tail[len(long_tail) // 2] < 0.7e6 < 2.8e6 < long_tail[int(0.95 * 20_000)]


# -- the command ------------------------------------------------------------------------------

PERMITS = ["simulate", "--concurrency", "3", "--service", "2", "--pattern", "burst"]


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def test_the_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_main([*PERMITS, "--duration", "30", "--max-wait", "4"], capsys)
    assert out.startswith(
        "simulate: concurrency 3 per key (ttl 60 s), service 2 s each, "
        "wait up to 4 s, first come first served\n"
        "traffic:  30 s of burst, 6 requests at once every 2 s, idle between\n"
    )
    # Six arrive at once every 2 s and each runs 2 s: three start, three wait; a
    # waiter whose 4 s end as a slot frees is served, so every wait is 4 s.
    assert "admitted          51   3 at once, 48 after waiting" in out
    assert "refused           39   0 at once, 39 after waiting the longest allowed" in out
    assert "waited:          48 of 51 admitted; p50 4 s, p95 4 s, max 4 s" in out
    assert "peak in flight:  3 requests at once (t=0 s), the limit 3" in out
    assert "permits busy:    100.0% of the time" in out
    assert "in flight: the most requests running at once in each 0.5 s bin" in out


def test_the_json_numbers_are_the_limiters(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--pattern", "poisson", "--duration", "60", "--service-dist", "exponential"]
    out = run_main(
        [
            "simulate",
            "--concurrency",
            "4",
            "--service",
            "1",
            *args,
            "--max-wait",
            "2",
            "--format",
            "json",
        ],
        capsys,
    )
    data = json.loads(out)
    assert data["admitted"]["requests"] == data["stats"]["granted"]
    assert data["stats"]["in_flight"] == 0
    assert data["offered"] == data["admitted"]["requests"] + data["refused"]["requests"]
    assert data["peak_in_flight"]["requests"] <= 4
    assert data["wait"]["max"] <= 2.0
    assert data["settings"]["max_wait"] == 2.0
    assert sum(b["started"] for b in data["bins"]) == data["admitted"]["requests"]
    assert max(b["in_flight"] for b in data["bins"]) == data["peak_in_flight"]["requests"]


def test_the_csv_has_one_row_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_main([*PERMITS, "--duration", "10", "--max-wait", "inf", "--format", "csv"], capsys)
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == ["time", "key", "service", "allowed", "wait", "start", "end", "token"]
    assert len(rows) == 30  # 6 every 2 s for 10 s
    assert all(row["allowed"] == "1" for row in rows)  # nobody gives up: no limit
    for row in rows:
        assert math.isclose(float(row["start"]), float(row["time"]) + float(row["wait"]))
        assert math.isclose(float(row["end"]), float(row["start"]) + float(row["service"]))
    tokens = [int(row["token"]) for row in sorted(rows, key=lambda r: float(r["start"]))]
    assert tokens == sorted(tokens)  # fencing tokens grow with every grant


def test_a_replay_file_with_service_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "requests.csv"
    path.write_text("time,key,service\n0,a,2\n0,a,2\n0.5,a,1\n1,b,0.5\n2.5,a,1\n")
    out = run_main(
        [
            "simulate",
            "--concurrency",
            "1",
            "--service",
            "9",
            "--replay",
            str(path),
            "--format",
            "json",
            "--max-wait",
            "1.5",
        ],
        capsys,
    )
    data = json.loads(out)
    # a: runs [0, 2); the second (at 0) would wait 2 s: refused at 1.5 s; the third (at
    # 0.5) waits 1.5 s: served at 2 s, runs [2, 3); the last (at 2.5) waits 0.5 s. b alone.
    assert data["admitted"] == {"requests": 4, "at_once": 2, "after_waiting": 2}
    assert data["refused"] == {"requests": 1, "at_once": 0, "after_waiting": 1}
    assert data["wait"] == {"p50": 1.5, "p95": 1.5, "max": 1.5}
    assert data["last_end"] == 4.0


def test_the_picture(tmp_path: Path) -> None:
    settings = PermitSettings(3, 2.0, pattern="poisson", duration=20, max_wait=1)
    png = tmp_path / "permits.png"
    replay = simulate_permits(settings, io.StringIO(), plot=png)
    assert png.read_bytes().startswith(b"\x89PNG")
    traffic = make_traffic(settings.traffic(), settings.sustained, 20_000_000)
    drawing = permits_figure(settings, traffic, replay, 20_000_000)
    top, bottom = drawing.axes
    assert [line.get_label() for line in top.get_lines()] == ["in flight", "waiting", "the limit"]
    assert [c.get_label() for c in bottom.containers] == ["started", "refused"]


def test_the_same_seed_gives_the_same_report() -> None:
    args = [*PERMITS[:5], "--service-dist", "lognormal", "--pattern", "poisson", "--duration", "30"]
    first = run_cli_process(*args, "--seed", "3")  # another process, other hashes
    assert first.returncode == 0, first.stderr
    assert first.stdout == run_cli(*args, "--seed", "3").stdout
    assert first.stdout != run_cli(*args, "--seed", "4").stdout


BAD = {
    "concurrency 0": ["--concurrency", "0", "--service", "1"],
    "service 0": ["--concurrency", "2", "--service", "0"],
    "service nan": ["--concurrency", "2", "--service", "nan"],
    "no service": ["--concurrency", "2"],
    "ttl 0": ["--concurrency", "2", "--service", "1", "--ttl", "0"],
    "negative max wait": ["--concurrency", "2", "--service", "1", "--max-wait", "-1"],
    "capacity too": ["--concurrency", "2", "--service", "1", "--capacity", "5"],
    "with acquire": ["--concurrency", "2", "--service", "1", "--acquire"],
    "service without concurrency": ["--capacity", "5", "--rate", "1", "--service", "1"],
    "ttl without concurrency": ["--capacity", "5", "--rate", "1", "--ttl", "60"],
    "no capacity, no concurrency": ["--rate", "1"],
    "unknown distribution": ["--concurrency", "2", "--service", "1", "--service-dist", "pareto"],
}


@pytest.mark.parametrize("args", BAD.values(), ids=BAD.keys())
def test_bad_arguments_are_one_line_and_status_2(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["simulate", *args, "--pattern", "steady", "--duration", "10"])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("bucketlimit: error: ")


def test_a_bad_setting_from_python_is_a_simulation_error() -> None:
    with pytest.raises(SimulationError, match="max wait"):
        simulate_permits(
            PermitSettings(2, 1.0, pattern="steady", duration=5, max_wait=math.nan), io.StringIO()
        )
