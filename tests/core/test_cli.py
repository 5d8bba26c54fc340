"""The command line: ``python -m bucketlimit simulate`` and ``bench``.

Reports are checked against an independent reference bucket written with
``fractions.Fraction``, so a number the command prints is the limiter's real
answer, not just a number that looks plausible.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from fractions import Fraction

import pytest

import bucketlimit
from bucketlimit.__main__ import main
from bucketlimit._bench import PurePythonBucket
from bucketlimit._simulate import COLUMNS, Replay, Settings, bin_end, make_traffic, simulate


def run_cli(*args: str, encoding: str = "utf-8") -> subprocess.CompletedProcess[str]:
    """``python -m bucketlimit ARGS`` in this process: ``main`` writing to streams of
    ``encoding`` (as a terminal's), and its status (argparse's exit too). A process
    of its own costs a third of a second or more: :func:`run_cli_process` is for
    what only a process shows (the command as run, the same seed in another one)."""
    streams = [io.TextIOWrapper(io.BytesIO(), encoding=encoding) for _ in range(2)]
    with contextlib.redirect_stdout(streams[0]), contextlib.redirect_stderr(streams[1]):
        try:
            status = main(list(args))
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else 1
    texts = []
    for stream in streams:
        stream.flush()
        raw = stream.buffer
        assert isinstance(raw, io.BytesIO)
        texts.append(raw.getvalue().decode(encoding))
    return subprocess.CompletedProcess(["bucketlimit", *args], status, texts[0], texts[1])


def run_cli_process(*args: str, encoding: str = "utf-8") -> subprocess.CompletedProcess[str]:
    """``python -m bucketlimit ARGS`` in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "bucketlimit", *args],
        capture_output=True,
        text=True,
        encoding=encoding,
        env={**os.environ, "PYTHONIOENCODING": encoding},
        timeout=120,
        check=False,
    )


def table_row(output: str, name: str) -> tuple[int, int]:
    """(requests, cost) from the summary table's row ``name``."""
    match = re.search(rf"^{name}\s+(\d+)\s+(\d+)$", output, re.MULTILINE)
    assert match, f"no {name!r} row in:\n{output}"
    return int(match[1]), int(match[2])


class ReferenceBucket:
    """docs/design.md §1/§4 in exact fractions: refill from elapsed time, spend when enough."""

    def __init__(self, capacity: int, rate: float, per: float) -> None:
        self.capacity = Fraction(capacity)
        # The shortest decimal form of rate and per, as docs/design.md §4 prescribes.
        self.per_micro = Fraction(repr(rate)) / Fraction(repr(per)) / 1_000_000
        self.tokens = self.capacity
        self.last = 0

    def refill(self, now_us: int) -> None:
        elapsed = max(0, now_us - self.last)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.per_micro)
        self.last = max(self.last, now_us)

    def allow(self, now_us: int, cost: int) -> bool:
        self.refill(now_us)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def whole_tokens(self, now_us: int) -> int:
        self.refill(now_us)
        return math.floor(self.tokens)


CASES = [
    Settings(capacity=10, rate=2, per=1, cost=1, pattern="steady", duration=30),
    Settings(capacity=10, rate=2, per=1, cost=1, pattern="burst", duration=30),
    Settings(capacity=100, rate=100, per=1, cost=1, pattern="poisson", duration=60),
    Settings(capacity=7, rate=2.5, per=1, cost=3, pattern="poisson", duration=20, seed=3),
    Settings(capacity=50, rate=100, per=60, cost=5, pattern="burst", duration=120),
    Settings(capacity=5, rate=0, per=1, cost=1, pattern="steady", duration=10),
    Settings(capacity=3, rate=0.1, per=1, cost=1, pattern="steady", duration=100, offered_rate=0.7),
    Settings(capacity=4, rate=1, per=0.5, cost=2, pattern="poisson", duration=9.5, seed=11),
]


@pytest.mark.parametrize("settings", CASES, ids=lambda s: f"{s.pattern}-{s.capacity}-{s.rate}")
def test_simulate_reports_what_the_reference_bucket_admits(settings: Settings) -> None:
    out = io.StringIO()
    replay = simulate(settings, out)
    assert settings.duration is not None  # made-up traffic, not a replay
    duration_us = round(settings.duration * 1_000_000)
    reference = ReferenceBucket(settings.capacity, settings.rate, settings.per)
    rate = float(Fraction(repr(settings.rate)) / Fraction(repr(settings.per)))
    arrivals = make_traffic(settings, rate, duration_us).arrivals

    admitted = [0] * COLUMNS
    refused = [0] * COLUMNS
    levels = []
    b = 0
    for t in arrivals:
        while t >= bin_end(b, duration_us):
            levels.append(reference.whole_tokens(bin_end(b, duration_us)))
            b += 1
        if reference.allow(t, settings.cost):
            admitted[b] += 1
        else:
            refused[b] += 1
    levels += [reference.whole_tokens(bin_end(b, duration_us)) for b in range(b, COLUMNS)]

    assert replay.offered == len(arrivals) > 0
    assert replay.admitted_per_bin == admitted
    assert replay.refused_per_bin == refused
    assert replay.level_per_bin == levels
    assert replay.admitted == sum(admitted)
    # The contract's bound over the whole run.
    assert replay.admitted * settings.cost <= settings.capacity + rate * settings.duration
    # The printed table is the replay's count.
    text = out.getvalue()
    assert table_row(text, "offered") == (len(arrivals), len(arrivals) * settings.cost)
    assert table_row(text, "admitted") == (sum(admitted), sum(admitted) * settings.cost)
    assert table_row(text, "refused") == (sum(refused), sum(refused) * settings.cost)


def test_traffic_patterns_are_what_they_say() -> None:
    def arrivals(pattern: str, **extra: float) -> list[int]:
        settings = Settings(capacity=10, rate=2, per=1, cost=1, pattern=pattern, duration=30)
        settings = Settings(**{**settings.__dict__, **extra})
        return make_traffic(settings, 2.0, 30_000_000).arrivals

    # steady: twice the limit by default, evenly spaced from t = 0.
    assert arrivals("steady") == list(range(0, 30_000_000, 250_000))
    assert arrivals("steady", offered_rate=3) == [round(i * 1e6 / 3) for i in range(90)]
    # burst: 2 * capacity requests at one instant, every 5 s so the average is 4/s.
    assert arrivals("burst") == [t for t in range(0, 30_000_000, 5_000_000) for _ in range(20)]
    # poisson: sorted, inside the run, about 4/s, and the seed matters.
    poisson = arrivals("poisson")
    assert poisson == sorted(poisson)
    assert poisson[0] > 0
    assert poisson[-1] < 30_000_000
    assert 90 <= len(poisson) <= 150
    assert arrivals("poisson", seed=1) != poisson


def test_steady_admits_the_derived_count(capsys: pytest.CaptureFixture[str]) -> None:
    # Capacity 10, rate 2/s, steady at twice the rate: a request every 0.25 s,
    # 120 in 30 s. Before request k the bucket holds 10 - k/2 tokens while
    # all pass, so k = 0..18 pass (19 in a row) and leave it empty at 4.5 s.
    # From then on every second request finds one token: k = 20, 22, ..., 118
    # pass, 50 more. 69 in all, within the bound 10 + 2 * 30 = 70.
    assert main(["simulate", *simulate_args()]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert table_row(out, "offered") == (120, 120)
    assert table_row(out, "admitted") == (69, 69)
    assert table_row(out, "refused") == (51, 51)
    assert "longest admitted run:   19 requests in a row" in out
    assert "largest burst admitted: 1 request at one instant" in out
    assert "2.300 on average" in out
    assert "= 70 (2.333/s)" in out


def test_simulate_burst_via_subprocess_prints_every_section() -> None:
    result = run_cli_process("simulate", *simulate_args(pattern="burst"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    # Bursts of 20 every 5 s, each finding a full bucket of 10: 6 bursts.
    assert "traffic:  30 s of burst, 20 requests at once every 5 s, idle between" in out
    assert "4 requests/s on average, 2x what the limit sustains" in out
    assert table_row(out, "offered") == (120, 120)
    assert table_row(out, "admitted") == (60, 60)
    assert table_row(out, "refused") == (60, 60)
    assert "largest burst admitted: 10 requests at one instant (t=0 s)" in out
    for section in (
        "longest admitted run:",
        "admitted per second:    2.000 on average",
        "bound over T seconds:   capacity + rate/per*T = 10 + 2*30 = 70",
        "admitted / bound:",
        "bucket level: whole tokens at the end of each 0.5 s bin",
        "requests per bin",
    ):
        assert section in out
    # One full-height block at the start of each 5 s period (10 bins), else empty.
    assert f"admitted |{('█' + ' ' * 9) * 6}|" in out.splitlines()
    chart = out[out.index("bucket level") :].splitlines()
    assert 60 <= max(len(line) for line in chart) <= 72  # fits any terminal


def test_simulate_is_deterministic_for_a_seed() -> None:
    args = simulate_args(capacity="100", rate="100", pattern="poisson", duration="60")
    first = run_cli_process("simulate", *args, "--seed", "7")  # another process, other hashes
    second = run_cli("simulate", *args, "--seed", "7")
    other = run_cli("simulate", *args, "--seed", "8")
    assert first.returncode == second.returncode == other.returncode == 0
    assert first.stdout == second.stdout
    assert "seed 7" in first.stdout
    assert table_row(first.stdout, "offered") != table_row(other.stdout, "offered")


def test_chart_falls_back_to_ascii_when_the_terminal_cannot_draw_blocks() -> None:
    args = ("simulate", *simulate_args(pattern="burst"))
    result = run_cli(*args, encoding="ascii")
    assert result.returncode == 0, result.stderr
    assert result.stdout.isascii()
    assert "@" * 6 in result.stdout  # full cells of the level chart and the sparklines
    forced = run_cli(*args, "--ascii")
    assert forced.stdout == result.stdout


def simulate_args(**options: str | None) -> list[str]:
    """Valid simulate options, with some replaced (or left out with None)."""
    chosen = {"capacity": "10", "rate": "2", "pattern": "steady", "duration": "30", **options}
    return [
        arg
        for name, value in chosen.items()
        if value is not None
        for arg in (f"--{name.replace('_', '-')}", value)
    ]


BAD_ARGUMENTS = {
    "capacity 0": simulate_args(capacity="0"),
    "negative rate": simulate_args(rate="-1"),
    "rate nan": simulate_args(rate="nan"),
    "rate inf": simulate_args(rate="1e400"),
    "per 0": simulate_args(per="0"),
    "cost 0": simulate_args(cost="0"),
    "cost above capacity": simulate_args(cost="11"),
    "duration 0": simulate_args(duration="0"),
    "negative duration": simulate_args(duration="-5", pattern="burst"),
    "infinite duration": simulate_args(duration="inf"),
    "too much traffic": simulate_args(rate="1000000", duration="100000"),
    "one burst too large": simulate_args(capacity="10000000", pattern="burst"),
    "offered rate 0": simulate_args(offered_rate="0"),
    "unknown pattern": simulate_args(pattern="zigzag"),
    "non-numeric capacity": simulate_args(capacity="ten"),
    "float capacity": simulate_args(capacity="2.5"),
    "non-numeric rate": simulate_args(rate="fast"),
    "non-numeric duration": simulate_args(duration="1m"),
    "non-numeric seed": simulate_args(seed="x"),
    "missing pattern": simulate_args(pattern=None),
    "unknown option": [*simulate_args(), "--colour"],
}


@pytest.mark.parametrize("args", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_give_one_line_and_status_2(args: list[str]) -> None:
    result = run_cli("simulate", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("bucketlimit: error: ")


@pytest.mark.parametrize("args", [["frobnicate"], ["bench", "--quick", "--smoke"]])
def test_bad_commands_give_one_line_and_status_2(args: list[str]) -> None:
    result = run_cli(*args)
    assert (result.returncode, result.stdout) == (2, "")
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("bucketlimit: error: ")


def test_no_command_prints_the_usage_and_the_commands() -> None:
    """``bucketlimit`` alone prints the usage and the commands, not one error line."""
    result = run_cli()
    assert (result.returncode, result.stdout) == (2, "")
    lines = result.stderr.splitlines()
    assert lines[0] == "usage: python -m bucketlimit [-h] [--version] COMMAND ..."
    commands = {line.split()[0] for line in lines if line.startswith("    ")}
    assert {"simulate", "bench"} <= commands
    assert "Run 'python -m bucketlimit COMMAND --help' for the options of a command." in lines
    assert lines[-1] == "bucketlimit: error: no command given: choose simulate or bench"
    # The help asked for is the same text, on stdout and with status 0.
    helped = run_cli("--help")
    assert helped.returncode == 0
    assert lines[-2] == ""
    assert helped.stdout == "\n".join(lines[:-2]) + "\n"


@pytest.mark.parametrize("command", ["simulate", "bench"])
def test_each_command_help_has_a_description(command: str) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    usage, description = result.stdout.split("\n\n")[:2]
    assert usage.startswith(f"usage: python -m bucketlimit {command} ")
    assert not description.startswith("options:")
    assert len(description.split()) >= 20  # a paragraph, not a placeholder
    assert "\noptions:\n" in result.stdout


def closed_pipe_run(*args: str) -> subprocess.CompletedProcess[str]:
    """The command writing to a pipe whose reader has already gone (a ``| head``
    that exited): every write fails with EPIPE, wherever it happens."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "bucketlimit", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "extra",
    [
        [],  # the text report: written whole, fails when flushed
        ["--format", "csv"],  # one row per request: fails in the middle
        ["--format", "json"],
    ],
)
def test_a_reader_that_leaves_early_gets_no_traceback(extra: list[str]) -> None:
    """``simulate ... | head`` ends quietly, without a BrokenPipeError traceback."""
    result = closed_pipe_run("simulate", *simulate_args(pattern="burst"), *extra)
    assert (result.returncode, result.stderr) == (1, "")


def test_simulate_into_head_through_a_shell() -> None:
    # 12,000 CSV rows, far more than a pipe holds: head leaves while the
    # command still writes.
    command = [
        sys.executable,
        "-m",
        "bucketlimit",
        "simulate",
        *simulate_args(pattern="burst", duration="3000"),
        "--format",
        "csv",
    ]
    script = (
        " ".join(shlex.quote(arg) for arg in command)
        + ' | head -n 3; echo "$'
        + ('{PIPESTATUS[0]}"')
    )
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "time,key,cost,allowed,retry_after,remaining"
    assert len(lines) == 4
    assert lines[-1] in ("0", "1")  # 1 when head left first; 0 if it all fit in the pipe


def test_limiter_errors_name_the_values() -> None:
    result = run_cli("simulate", *simulate_args(cost="11"))
    assert result.stderr == (
        "bucketlimit: error: cost 11 exceeds capacity 10: the request could never pass\n"
    )


def test_bench_smoke_prints_its_tables() -> None:
    result = run_cli("bench", "--smoke")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"bucketlimit {bucketlimit.__version__} bench (smoke" in out
    assert f"{platform.python_implementation()} {platform.python_version()} on " in out
    assert "ns per allow() call" in out
    for workload in ("1 key, mostly allowed", "10,000 keys, mostly refused"):
        row = next(line for line in out.splitlines() if line.startswith(workload))
        assert len(row[len(workload) :].split()) == 3  # a figure for each implementation
    assert "bytes per key at 10,000 keys" in out
    assert re.search(r"^bucketlimit\s+\d+ bytes/key", out, re.MULTILINE)
    assert re.search(r"^pure Python\+Lock\s+\d+ bytes/key", out, re.MULTILINE)


def test_pure_python_baseline_is_a_token_bucket() -> None:
    # The bench compares against this; it must do the same job, not less.
    bucket = PurePythonBucket(capacity=2, rate=0)
    assert [bucket.allow("k") for _ in range(3)] == [True, True, False]
    assert bucket.allow("other")
    assert len(bucket) == 2


def test_replay_counts_runs_and_instants() -> None:
    replay = simulate(
        Settings(capacity=10, rate=2, per=1, cost=1, pattern="burst", duration=30), io.StringIO()
    )
    assert isinstance(replay, Replay)
    assert (replay.largest_instant, replay.largest_instant_at) == (10, 0)
    assert (replay.longest_run, replay.run_span) == (10, (0, 0))
    assert replay.level_per_bin[-1] == 10  # 5 s after the last burst: full again


def test_simulate_acquire_paces_the_same_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    """--acquire admits what it would refuse, after a wait, within the bound."""
    args = ["simulate", "--capacity", "10", "--rate", "5", "--pattern", "burst"]
    assert main([*args, "--duration", "10", "--acquire", "--ascii"]) == 0
    out = capsys.readouterr().out
    assert "waited:   90 of 100 admitted" in out
    assert "refused:  0" in out
    assert "all admitted, never above capacity + rate/per*T" in out
    assert main([*args, "--duration", "10", "--acquire", "--max-wait", "1", "--ascii"]) == 0
    out = capsys.readouterr().out
    assert "max 1 s" in out
    assert "refused:  0" not in out
    with pytest.raises(SystemExit):
        main([*args, "--duration", "10", "--max-wait", "1"])
    assert "--max-wait needs --acquire" in capsys.readouterr().err
