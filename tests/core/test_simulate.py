"""``simulate``'s numbers, pictures, clients, replays and the fixed-window comparison.

The numbers the command writes (JSON, CSV) are checked against the limiter's
own counts (``stats()`` of a TokenBucketLimiter fed the same requests) and
against the Fraction reference bucket of test_cli.py, one per key.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import bucketlimit._simulate as package
from bucketlimit import LimiterStats, TokenBucketLimiter
from bucketlimit._simulate import Replay, Request, Settings, make_traffic, run
from bucketlimit._simulate.fixed_window import fixed_window, window_like_bucket_us
from bucketlimit._simulate.plot import figure
from bucketlimit._simulate.replay_file import read_replay
from bucketlimit.testing import ManualClock
from tests.core.test_cli import ReferenceBucket, run_cli, simulate_args, table_row

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def simulate_json(*args: str) -> dict[str, Any]:
    result = run_cli("simulate", *args, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def limiter_counts(
    requests: list[Request], capacity: int, rate: float, *, shared: bool = False
) -> tuple[LimiterStats, Counter[str], Counter[str]]:
    """The limiter's own stats() and admitted/refused per key, for these requests."""
    clock = ManualClock()
    limiter = TokenBucketLimiter(capacity, rate, clock)
    admitted: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    for request in requests:
        clock.set(request.at / 1e6)
        if limiter.allow("shared" if shared else request.key, request.cost):
            admitted[request.key] += 1
        else:
            refused[request.key] += 1
    return limiter.stats(), admitted, refused


def reference_counts(
    requests: list[Request], capacity: int, rate: float
) -> tuple[Counter[str], Counter[str]]:
    """Admitted and refused per key by the exact reference, one bucket per key."""
    buckets: dict[str, ReferenceBucket] = {}
    admitted: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    for request in requests:
        bucket = buckets.setdefault(request.key, ReferenceBucket(capacity, rate, 1))
        if bucket.allow(request.at, request.cost):
            admitted[request.key] += 1
        else:
            refused[request.key] += 1
    return admitted, refused


CASES = {
    "burst, 3 clients": ("burst", 3),
    "poisson, 1 client": ("poisson", 1),
    "steady, 5 clients": ("steady", 5),
    "boundary, 2 clients": ("boundary", 2),
}


@pytest.mark.parametrize(("pattern", "clients"), CASES.values(), ids=CASES.keys())
def test_json_counts_are_the_limiters_own(pattern: str, clients: int) -> None:
    data = simulate_json(
        *simulate_args(capacity="10", rate="2", pattern=pattern, duration="30"),
        "--clients",
        str(clients),
    )
    settings = Settings(10, 2, 1, 1, pattern, 30, clients=clients)
    requests = make_traffic(settings, 2.0, 30_000_000).requests
    stats, admitted, refused = limiter_counts(requests, 10, 2)
    reference_admitted, reference_refused = reference_counts(requests, 10, 2)
    assert (admitted, refused) == (reference_admitted, reference_refused)

    assert data["offered"] == {"requests": len(requests), "cost": len(requests)}
    assert data["admitted"]["requests"] == stats["allowed"] == sum(admitted.values()) > 0
    assert data["refused"]["requests"] == stats["refused"] == sum(refused.values())
    assert data["stats"] == stats
    assert len(data["clients"]) == clients
    for client in data["clients"]:
        key = client["key"]
        assert (client["admitted"], client["refused"]) == (admitted[key], refused[key])
        assert client["admitted_share"] == pytest.approx(admitted[key] / stats["allowed"])
    # The bins add up to the totals, and the per-key bound holds.
    assert sum(b["admitted"] for b in data["bins"]) == stats["allowed"]
    assert sum(b["refused"] for b in data["bins"]) == stats["refused"]
    assert data["bound"]["total"] == (10 + 2 * 30) * clients
    assert all(admitted[key] <= 70 for key in admitted)


def test_csv_has_one_row_per_request_with_the_limiters_answer() -> None:
    args = simulate_args(capacity="10", rate="2", pattern="burst", duration="30")
    result = run_cli("simulate", *args, "--clients", "3", "--format", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == ["time", "key", "cost", "allowed", "retry_after", "remaining"]

    settings = Settings(10, 2, 1, 1, "burst", 30, clients=3)
    requests = make_traffic(settings, 2.0, 30_000_000).requests
    stats, admitted, refused = limiter_counts(requests, 10, 2)
    assert len(rows) == len(requests)
    assert [(float(r["time"]), r["key"]) for r in rows] == [(q.at / 1e6, q.key) for q in requests]
    assert sum(r["allowed"] == "1" for r in rows) == stats["allowed"]
    assert Counter(r["key"] for r in rows if r["allowed"] == "1") == admitted
    assert Counter(r["key"] for r in rows if r["allowed"] == "0") == refused
    # A refused caller is told how long to wait; an admitted one is not.
    assert all(float(r["retry_after"]) > 0 for r in rows if r["allowed"] == "0")
    assert all(float(r["retry_after"]) == 0 for r in rows if r["allowed"] == "1")


def test_burst_figure_is_the_most_admitted_in_any_second(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bucketlimit.__main__ import main

    # Steady at 4/s: while the bucket lasts (0..4.5 s) all four arrivals of a
    # second pass; later every second one. At one instant: always 1.
    assert main(["simulate", *simulate_args()]) == 0
    out = capsys.readouterr().out
    assert "most admitted in 1 s:   4 requests (t=0..0.75 s)" in out
    assert "largest burst admitted: 1 request at one instant" in out
    data = simulate_json(*simulate_args(pattern="poisson", capacity="20", rate="5"))
    busiest = data["busiest_second"]
    # Poisson at 10/s: several in a second, never more than capacity + rate * 1 s.
    assert data["largest_instant"]["admitted"] == 1
    assert 5 < busiest["admitted"] <= 25
    assert busiest["last"] - busiest["first"] < 1


def test_noisy_neighbour_own_buckets_and_shared_bucket() -> None:
    args = [*simulate_args(pattern="burst", duration="60"), "--clients", "4"]
    own = simulate_json(*args)
    shared = simulate_json(*args, "--shared")
    by_key = {c["key"]: c for c in own["clients"]}
    # A bucket each: the steady clients (half the limit) never wait; the
    # bursting one is refused and told how long to wait.
    for key in ("client-2", "client-3", "client-4"):
        assert by_key[key]["refused"] == 0
        assert by_key[key]["wait"] == {"mean": 0.0, "median": 0.0, "max": 0.0}
    noisy = by_key["client-1"]
    assert noisy["refused"] > 0
    assert 0 < noisy["wait"]["median"] <= noisy["wait"]["max"] <= 5
    # One shared bucket: the burst eats the tokens the steady clients needed.
    shared_by_key = {c["key"]: c for c in shared["clients"]}
    assert {c["bucket"] for c in shared["clients"]} == {"shared"}
    assert sum(shared_by_key[k]["refused"] for k in ("client-2", "client-3", "client-4")) > 0
    assert shared["admitted"]["requests"] <= 10 + 2 * 60
    assert shared["stats"]["keys"] == 1


def test_clients_table_in_the_text_report() -> None:
    result = run_cli("simulate", *simulate_args(pattern="burst"), "--clients", "3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "clients: 3, a bucket each" in out
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if line.startswith("client-")
    }
    assert set(rows) == {"client-1", "client-2", "client-3"}
    offered, admitted = int(rows["client-2"][1]), int(rows["client-2"][2])
    assert offered == admitted == 30  # 1 request/s for 30 s, within its own limit
    assert rows["client-2"][-2:] == ["none", "refused"]
    assert "median" in rows["client-1"]
    assert table_row(out, "offered")[0] == sum(int(r[1]) for r in rows.values())


@pytest.mark.timeout(
    120
)  # a hang guard: matplotlib's first import: 1 s idle, 13 s on a crushed machine
def test_plot_writes_a_png(tmp_path: Path) -> None:
    picture = tmp_path / "run.png"
    args = simulate_args(capacity="10", rate="2", pattern="boundary", duration="30")
    result = run_cli(
        "simulate", *args, "--clients", "3", "--compare", "fixed-window", "--plot", str(picture)
    )
    assert result.returncode == 0, result.stderr
    assert "compare: a fixed window" in result.stdout  # the report is still printed
    data = picture.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 20_000  # three panels of lines and bars, not an empty canvas


def test_plot_without_matplotlib_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from bucketlimit.__main__ import main\n"
        f"sys.exit(main(['simulate', *{simulate_args()!r}, '--plot', {str(tmp_path / 'x.png')!r}]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "bucketlimit: error: --plot needs matplotlib, which is not installed: "
        "pip install matplotlib\n"
    )
    assert not (tmp_path / "x.png").exists()


def test_replay_reads_times_keys_and_costs(tmp_path: Path) -> None:
    log = tmp_path / "access.csv"
    # Unsorted, with a header in its own order, epoch seconds and blank cells.
    log.write_text(
        "key,time,cost\n"
        "alice,1700000003.5,\n"
        "alice,1700000000.0,4\n"
        "bob,1700000000.0,10\n"
        "alice,1700000000.0,4\n"
        "alice,1700000000.25,4\n"
        "bob,1700000001.0,\n"
        ",1700000002.0,2\n",
        encoding="utf-8",
    )
    data = simulate_json("--capacity", "10", "--rate", "2", "--replay", str(log))
    requests = [
        Request(0, "alice", 4),
        Request(0, "bob", 10),
        Request(0, "alice", 4),
        Request(250_000, "alice", 4),
        Request(1_000_000, "bob", 1),
        Request(2_000_000, "simulated-client", 2),
        Request(3_500_000, "alice", 1),
    ]
    stats, admitted, refused = limiter_counts(requests, 10, 2)
    # alice: 4, 4 pass (2 left), 4 at 0.25 s finds 2.5: refused; 1 at 3.5 s passes.
    # bob: 10 empties his bucket, 1 s later 2 tokens pay for the next one.
    assert admitted == Counter({"alice": 3, "bob": 2, "simulated-client": 1})
    assert refused == Counter({"alice": 1})
    assert data["offered"] == {"requests": 7, "cost": 26}
    assert data["admitted"] == {"requests": stats["allowed"], "cost": 4 + 4 + 1 + 10 + 1 + 2}
    assert data["settings"]["duration"] == 4  # whole seconds past the last request
    by_key = {c["key"]: (c["admitted"], c["refused"]) for c in data["clients"]}
    assert by_key == {"alice": (3, 1), "bob": (2, 0), "simulated-client": (1, 0)}


def test_replay_takes_iso_times_without_a_header(tmp_path: Path) -> None:
    log = tmp_path / "times.csv"
    log.write_text(
        "".join(f"2024-05-01T12:00:0{i // 4}.{25 * (i % 4):02d}Z\n" for i in range(12)),
        encoding="utf-8",
    )
    data = simulate_json("--capacity", "5", "--rate", "1", "--replay", str(log))
    # 12 requests 0.25 s apart into a bucket of 5 refilled at 1/s: 5 pass, then
    # one every 4 requests (at t = 1.25, 2.25).
    assert data["offered"]["requests"] == 12
    assert data["admitted"]["requests"] == 7
    assert data["settings"]["duration"] == 3


REPLAY_ERRORS = {
    "bad time": ("time\nsoon\n", "access.csv line 2: time 'soon' is neither seconds"),
    "cost above capacity": ("0,k,11\n", "access.csv line 1: cost '11': cost 11 exceeds"),
    "cost not a number": ("0,k,two\n", "access.csv line 1: cost 'two'"),
    "empty": ("\n", "holds no requests"),
}


@pytest.mark.parametrize(("text", "message"), REPLAY_ERRORS.values(), ids=REPLAY_ERRORS.keys())
def test_bad_replay_files_give_one_line_and_status_2(
    tmp_path: Path, text: str, message: str
) -> None:
    log = tmp_path / "access.csv"
    log.write_text(text, encoding="utf-8")
    result = run_cli("simulate", "--capacity", "10", "--rate", "2", "--replay", str(log))
    assert (result.returncode, result.stdout) == (2, "")
    assert len(result.stderr.splitlines()) == 1
    assert message in result.stderr


@pytest.mark.parametrize(
    "extra", [["--pattern", "steady"], ["--clients", "2"], ["--offered-rate", "3"]]
)
def test_replay_refuses_made_up_traffic_options(tmp_path: Path, extra: list[str]) -> None:
    log = tmp_path / "a.csv"
    log.write_text("0\n", encoding="utf-8")
    result = run_cli("simulate", "--capacity", "10", "--rate", "2", "--replay", str(log), *extra)
    assert result.returncode == 2
    assert "--replay takes its traffic from the file" in result.stderr


def test_missing_replay_file_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csv"
    result = run_cli("simulate", "--capacity", "10", "--rate", "2", "--replay", str(missing))
    assert result.returncode == 2
    assert result.stderr.startswith(f"bucketlimit: error: cannot read '{missing}'")


def test_fixed_window_admits_twice_capacity_at_a_boundary(tmp_path: Path) -> None:
    # 10 requests just before t = 5 s and 10 just after: capacity 10 per 5 s.
    log = tmp_path / "edge.csv"
    log.write_text("".join(f"{t}\n" for t in [4.9] * 10 + [5.1] * 10), encoding="utf-8")
    data = simulate_json(
        "--capacity",
        "10",
        "--rate",
        "2",
        "--replay",
        str(log),
        "--compare",
        "fixed-window",
        "--duration",
        "10",
    )
    compare = data["compare"]
    assert compare["window"] == 5
    assert compare["admitted"]["requests"] == 20  # both windows fill
    assert compare["busiest_second"]["fixed_window"]["admitted"] == 20  # in 0.2 s
    # The bucket: 10 at 4.9 s, then 0.4 tokens at 5.1 s: none.
    assert data["admitted"]["requests"] == 10
    assert compare["busiest_second"]["token_bucket"]["admitted"] == 10
    assert compare["busiest_second"]["token_bucket_bound"] == 12


def test_compare_on_the_boundary_pattern_shows_the_double_burst() -> None:
    args = simulate_args(capacity="10", rate="2", pattern="boundary", duration="30")
    result = run_cli("simulate", *args, "--compare", "fixed-window")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "boundary, 10 requests at once 0.25 s before and after every 5 s" in out
    lines = out.splitlines()
    bucket = next(line for line in lines if line.startswith("token bucket "))
    window = next(line for line in lines if line.startswith("fixed window "))
    # Token bucket: 10 at 4.75 s and 1 more at 5.25 s (0.5 s of refill).
    assert bucket.split()[2:4] == ["60", "11"]
    assert "never above capacity + rate*1 s = 12" in bucket
    assert window.split()[3] == "20"
    assert (
        "the fixed window let 20 requests of simulated-client through within 0.5 s, "
        "2x its limit, across a window boundary" in out
    )
    data = simulate_json(*args, "--compare", "fixed-window")
    busiest = data["compare"]["busiest_second"]
    assert busiest["fixed_window"]["admitted"] == 2 * 10
    assert busiest["token_bucket"]["admitted"] <= busiest["token_bucket_bound"]


@pytest.mark.timeout(120)  # a hang guard: three processes: 1 s idle, 10 s on a crushed machine
def test_the_console_script_runs_the_same_command() -> None:
    script = Path(sys.executable).parent / "bucketlimit"
    assert script.exists(), "pip install -e . installs the bucketlimit console script"
    result = subprocess.run(
        [str(script), "simulate", *simulate_args(pattern="burst")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert table_row(result.stdout, "admitted") == (60, 60)
    usage = subprocess.run(
        [str(script), "simulate", "--capacity", "10", "--rate", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert usage.returncode == 2
    assert usage.stderr == (
        "bucketlimit: error: simulate needs --pattern and --duration (or --replay FILE)\n"
    )
    helped = subprocess.run(
        [str(script), "simulate", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert helped.stdout.startswith("usage: bucketlimit simulate ")
    assert run_cli("simulate", "--help").stdout.startswith("usage: python -m bucketlimit simulate")


def plotted(settings: Settings) -> tuple[Figure, Replay]:
    """The ``--plot`` figure of a run, built from the simulator's own steps, and
    rendered once (to memory), so that matplotlib has placed every artist."""
    clock = ManualClock()
    limiter = TokenBucketLimiter(settings.capacity, settings.rate, clock, per=settings.per)
    if settings.replay is not None:
        traffic, duration_us = read_replay(settings, limiter)
    else:
        assert settings.duration is not None
        duration_us = round(settings.duration * 1e6)
        traffic = make_traffic(settings, limiter.rate, duration_us)
    replay = run(
        limiter, clock, traffic.requests, duration_us, keys=traffic.keys, shared=settings.shared
    )
    if settings.compare is not None:
        replay.compare = fixed_window(
            traffic.requests,
            settings.capacity,
            window_like_bucket_us(settings, limiter),
            duration_us,
            shared=settings.shared,
            origin_us=traffic.origin_us,
        )
    drawing = figure(settings, limiter, traffic, replay, duration_us)
    drawing.savefig(io.BytesIO(), format="png")
    return drawing, replay


def test_replay_plot_names_the_files_costs_and_bars_count_tokens(tmp_path: Path) -> None:
    """The replay plot's title names the file's costs (not "cost 1" for costs
    1-5), and its bars count tokens, as the bucket meters cost."""
    log = tmp_path / "costs.csv"
    log.write_text("".join(f"{i / 4},k,{1 + i % 5}\n" for i in range(40)), encoding="utf-8")
    settings = Settings(10, 2, 1, 1, None, None, replay=log)
    drawing, replay = plotted(settings)
    assert [text.get_text() for text in drawing.texts] == [
        "bucketlimit simulate: capacity 10, 2 tokens/s, costs 1 to 5"
    ]
    bins = drawing.axes[1]
    assert bins.get_ylabel().startswith("cost (tokens) per ")
    admitted, refused = bins.containers
    assert admitted.get_label() == "admitted"
    # The bars are the tokens, as the text report's cost column counts them.
    result = run_cli("simulate", "--capacity", "10", "--rate", "2", "--replay", str(log))
    assert result.stdout.startswith(
        "simulate: capacity 10, rate 2 per 1 s (2 tokens/s), costs 1 to 5\n"
    )
    offered_cost = sum(1 + i % 5 for i in range(40))
    admitted_cost = table_row(result.stdout, "admitted")[1]
    assert table_row(result.stdout, "offered")[1] == offered_cost
    assert sum(bar.get_height() for bar in admitted) == admitted_cost == replay.admitted_cost
    assert sum(bar.get_height() for bar in refused) == offered_cost - admitted_cost > 0


def test_a_replay_of_one_cost_says_that_cost(tmp_path: Path) -> None:
    log = tmp_path / "fours.csv"
    log.write_text("".join(f"{i},k,4\n" for i in range(6)), encoding="utf-8")
    result = run_cli("simulate", "--capacity", "10", "--rate", "2", "--replay", str(log))
    assert result.stdout.startswith("simulate: capacity 10, rate 2 per 1 s (2 tokens/s), cost 4\n")
    drawing, _ = plotted(Settings(10, 2, 1, 1, None, None, replay=log))
    assert drawing.texts[0].get_text().endswith(", cost 4")
    assert drawing.axes[1].get_ylabel().startswith("requests per ")


@pytest.mark.parametrize(("shared", "compare"), [(False, None), (False, "fixed-window")])
def test_plot_legends_stand_beside_the_lines(shared: bool, compare: str | None) -> None:
    """A legend never covers its lines: every legend stands right of its panel,
    inside the picture."""
    settings = Settings(10, 2, 1, 1, "burst", 30, clients=8, shared=shared, compare=compare)
    drawing, _ = plotted(settings)
    panels = drawing.axes
    assert len(panels) == (3 if compare else 2)
    legend = panels[0].get_legend()
    assert legend is not None
    assert [text.get_text() for text in legend.get_texts()] == [f"client-{i}" for i in range(1, 7)]
    assert legend.get_title().get_text() == "first 6 of 8"
    picture = drawing.bbox
    for panel in panels:
        legend = panel.get_legend()
        assert legend is not None
        box, plot = legend.get_window_extent(), panel.get_window_extent()
        assert not box.overlaps(plot), (panel.get_ylabel(), box, plot)
        assert box.x0 > plot.x1
        # Inside the picture, not cut off at its edge.
        assert picture.x0 <= box.x0
        assert picture.y0 <= box.y0
        assert box.x1 <= picture.x1
        assert box.y1 <= picture.y1


def test_a_shared_bucket_is_one_line_without_a_legend() -> None:
    # --shared draws the one bucket once, not once per client each labelled "shared".
    drawing, _ = plotted(Settings(10, 2, 1, 1, "burst", 30, clients=8, shared=True))
    level = drawing.axes[0]
    assert len(level.get_lines()) == 2  # the bucket's level and the capacity line
    assert level.get_legend() is None


def test_each_simulator_module_imports_only_those_listed_before_it() -> None:
    """One concern a file, in the order ``bucketlimit/_simulate/__init__.py``
    lists them; a module importing a later one would tie the concerns in a knot."""
    folder = Path(package.__file__).parent
    order = re.findall(r"^- ``(\w+)``:", package.__doc__ or "", re.MULTILINE)
    assert sorted(order) == sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    for position, name in enumerate(order):
        tree = ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))
        imported = {
            node.module.rsplit(".", 1)[1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("bucketlimit._simulate.")
        }
        assert imported <= set(order[:position]), (name, imported - set(order[:position]))
