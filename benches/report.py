"""Turns the results of ``run.py`` into verdicts, docs/benchmarks.md and a chart."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

US = "bucketlimit"
FLOOR = "PyO3 floor (no-op allow)"
NAIVE = "naive Rust Mutex<HashMap>"
TRIVIAL = "EVALSHA trivial script (return {1,0})"
ASYNC_TRIVIAL = "async EVALSHA trivial script"
REDIS_US = "bucketlimit RedisTokenBucketLimiter.allow"
REDIS_US_ASYNC = "bucketlimit AsyncRedisTokenBucketLimiter.allow"
SLOW_PEERS = [
    "limits fixed window",
    "limits sliding window counter",
    "pyrate-limiter token bucket",
    "throttled-py token bucket",
]


def _verdict(target: str, ok: bool, measured: str) -> dict[str, str]:
    return {"target": target, "verdict": "PASS" if ok else "MISS", "measured": measured}


def targets(results: dict[str, Any]) -> list[dict[str, str]]:
    """Every target this run measured, with PASS or MISS."""
    out = []
    inproc = results.get("inproc")
    if inproc:
        w = inproc["workloads"]
        for keys, limit in [("1 key", 1.5), ("10,000 keys", 1.8)]:
            ratios = {
                name: rows[US]["x_floor"] for name, rows in w.items() if name.startswith(keys)
            }
            out.append(
                _verdict(
                    f"allow() with the built-in clock <= {limit}x the floor at {keys}",
                    all(r <= limit for r in ratios.values()),
                    ", ".join(f"{r:.2f}x ({name.split(', ')[1]})" for name, r in ratios.items()),
                )
            )
        faster = {name: rows[NAIVE]["ns"] / rows[US]["ns"] for name, rows in w.items()}
        out.append(
            _verdict(
                "faster than the naive Rust Mutex<HashMap> limiter",
                all(f > 1 for f in faster.values()),
                "naive/ours "
                + ", ".join(f"{f:.2f}x" for f in faster.values())
                + " over the four workloads",
            )
        )
        tb = min(rows["token-bucket"]["ns"] / rows[US]["ns"] for rows in w.values())
        out.append(
            _verdict(
                ">= 4x faster than token-bucket", tb >= 4, f"at least {tb:.1f}x (worst workload)"
            )
        )
        slowest = min(
            (rows[p]["ns"] / rows[US]["ns"], p, name)
            for name, rows in w.items()
            for p in SLOW_PEERS
        )
        out.append(
            _verdict(
                ">= 25x faster than limits, pyrate-limiter and throttled-py",
                slowest[0] >= 25,
                f"at least {slowest[0]:.1f}x (worst: {slowest[1]}, {slowest[2]})",
            )
        )
    memory = results.get("memory")
    if memory:
        bpk = memory["libraries"][US]["bytes_per_key"]
        out.append(
            _verdict(
                f"<= 100 bytes per key held at {memory['keys']:,} keys of 10 bytes",
                bpk <= 100,
                f"{bpk:.1f} bytes per key",
            )
        )
    ev = results.get("eviction")
    if ev:
        cpu = ev["during_eviction_on_cpu"]
        wall = ev["during_eviction"]
        out.append(
            _verdict(
                f"during eviction of {ev['keys']:,} idle keys no call above 100x the median",
                cpu["max_ns"] <= 100 * cpu["median_ns"],
                f"slowest on-CPU call {cpu['max_ns'] / cpu['median_ns']:,.0f}x the median"
                f" ({cpu['max_ns']:,.0f} ns vs {cpu['median_ns']:,.0f} ns); wall clock incl."
                f" preemption {wall['max_ns'] / wall['median_ns']:,.0f}x; control without"
                f" idle keys {ev['control']['max_ns'] / ev['control']['median_ns']:,.0f}x",
            )
        )
    redis = results.get("redis")
    for parser, r in (redis or {}).items():
        for workload, rows in r["workloads"].items():
            if REDIS_US not in rows:
                out.append(_verdict(f"Redis ({parser}, {workload})", False, "limiter not measured"))
                continue
            ours = rows[REDIS_US]["us"]
            ratio = ours / rows[TRIVIAL]["us"]
            how = ", refusals answered from the local cache" if _cached(rows[REDIS_US]) else ""
            out.append(
                _verdict(
                    f"Redis allow() <= 1.3x a trivial EVALSHA ({parser}, {workload})",
                    ratio <= 1.3,
                    f"{ratio:.2f}x ({ours:.1f} us vs {rows[TRIVIAL]['us']:.1f} us{how})",
                )
            )
            peers = {n: x["us"] for n, x in rows.items() if x["kind"] == "peer"}
            best = min(peers, key=peers.__getitem__)
            out.append(
                _verdict(
                    f"Redis allow() faster than every peer's Redis mode ({parser}, {workload})",
                    ours < peers[best],
                    f"{ours:.1f} us vs the fastest peer, {best}, {peers[best]:.1f} us",
                )
            )
    return out


# --- docs/benchmarks.md ------------------------------------------------------------


def _inproc_table(inproc: dict[str, Any]) -> list[str]:
    workloads = list(inproc["workloads"])
    libraries = list(inproc["workloads"][workloads[0]])
    lines = [
        "| library | " + " | ".join(workloads) + " |",
        "| --- |" + " ---: |" * len(workloads),
    ]
    for library in libraries:
        cells = []
        for w in workloads:
            r = inproc["workloads"][w][library]
            note = "" if r["kind"] == "floor" else f" ({r['x_floor']:.1f}x)"
            cells.append(f"{_ns(r['ns'])}{note}")
        name = f"**{library}**" if library.startswith(US) else library
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    allowed = {
        w: {lib: r["allowed"] for lib, r in rows.items() if r["kind"] != "floor"}
        for w, rows in inproc["workloads"].items()
    }
    shares = []
    for w, by_lib in allowed.items():
        low, high = min(by_lib.values()), max(by_lib.values())
        shares.append(f"{w}: {low:.0%}" + ("" if low == high else f"-{high:.0%}"))
    lines += ["", "Share of calls allowed, across the limiters: " + "; ".join(shares) + "."]
    return lines


def _ns(ns: float) -> str:
    return f"{ns:,.0f} ns" if ns < 10_000 else f"{ns / 1000:,.1f} us"


def _cached(row: dict[str, Any]) -> bool:
    """True when most calls never reached Redis (bucketlimit's refusal cache)."""
    calls: float = row["server_calls_per_call"].get("evalsha", 0.0)
    return calls < 0.5


def _redis_table(r: dict[str, Any]) -> list[str]:
    workloads = list(r["workloads"])
    names = list(r["workloads"][workloads[0]])
    lines = [
        "| | " + " | ".join(workloads) + " | Redis's own time (EVALSHA) |",
        "| --- |" + " ---: |" * (len(workloads) + 1),
    ]
    for name in names:
        cells = []
        for w in workloads:
            rows = r["workloads"][w]
            if name not in rows:
                cells.append("-")
                continue
            row = rows[name]
            ref = rows[ASYNC_TRIVIAL if "async" in row["kind"] else TRIVIAL]["us"]
            ratio = "" if row["kind"] in ("floor", "async-floor") else f" ({row['us'] / ref:.2f}x)"
            cached = " (refusals from the local cache, no round trip)" if _cached(row) else ""
            cells.append(f"{row['us']:.1f} us{ratio}{cached}")
        server = r["workloads"][workloads[0]].get(name, {}).get("server_us_per_call", {})
        evalsha = server.get("evalsha")
        cells.append("-" if evalsha is None else f"{evalsha:.1f} us")
        label = f"**{name}**" if name.startswith(US) else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(results: dict[str, Any], verdicts: list[dict[str, str]], path: Path) -> None:
    env = results["machine"]
    v = env["versions"]
    today = datetime.date.today().isoformat()
    lines = [
        "# Benchmarks",
        "",
        "Written by `python benches/run.py`"
        + (" **--quick** (a smoke run: few repetitions, fewer keys)" if results["quick"] else "")
        + f" on {today}. Run it again to get your machine's figures; ratios between rows of"
        " one run are what to compare.",
        "",
        f"- Machine: {env['cpu']}, {env['cores']} cores; {env['platform']}; {env['python']};"
        f" load average {_load(env['load_before'])} at the start,"
        f" {_load(env.get('load_after', (0, 0, 0)))} at the end.",
        "- Versions: " + ", ".join(f"{name} {version}" for name, version in v.items()) + ".",
        "",
        "![bucketlimit next to the PyO3 floor and the other limiters](benchmarks.png)",
        "",
        "## Targets (in process)",
        "",
        "| | target | measured |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {x['verdict']} | {x['target']} | {x['measured']} |" for x in verdicts]
    inproc = results.get("inproc")
    if inproc:
        lines += [
            "",
            "## In-process `allow()`",
            "",
            "Nanoseconds per call from Python, median of repetitions run round robin across"
            " the libraries, and in brackets the ratio to the PyO3 floor. The figures include"
            f" the benchmark's own `for` loop, about {inproc['loop_ns']:.0f} ns per call.",
            "",
            *_inproc_table(inproc),
        ]
    memory = results.get("memory")
    if memory:
        lines += [
            "",
            f"## Memory: bytes per key held at {memory['keys']:,} keys",
            "",
            "Resident memory added by touching that many 10-byte keys once each, divided by"
            " the number of keys (the key included), each library in a fresh process.",
            "",
            "| library | bytes per key |",
            "| --- | ---: |",
        ]
        lines += [
            f"| {'**' + lib + '**' if lib == US else lib} | {r['bytes_per_key']:,.0f} |"
            for lib, r in memory["libraries"].items()
        ]
    ev = results.get("eviction")
    if ev:
        lines += [
            "",
            "## Latency while idle keys are evicted",
            "",
            f"bucketlimit on a `ManualClock`: {ev['keys']:,} keys touched, the clock stepped"
            f" past the time they are all full again, then each of the next {ev['calls']:,}"
            " calls (on 100 other keys) timed on its own with `time.perf_counter_ns`"
            " (its own ~50 ns included). The sweep forgot"
            f" {ev['evicted']:,} keys; {ev['held_after_calls']:,} were held afterwards. The"
            " on-CPU row repeats the run and drops the calls during which the OS ran another"
            f" process ({ev['during_eviction_on_cpu']['descheduled_calls']} here).",
            "",
            "| | median | p99 | p99.9 | max | max / median |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for label, key in [
            ("filling the table (growth lands on single calls)", "fill"),
            ("during eviction", "during_eviction"),
            ("during eviction, on-CPU calls only", "during_eviction_on_cpu"),
            ("control: the same calls, no idle keys", "control"),
        ]:
            s = ev[key]
            lines.append(
                f"| {label} | {_ns(s['median_ns'])} | {_ns(s['p99_ns'])} | {_ns(s['p999_ns'])}"
                f" | {_ns(s['max_ns'])} | {s['max_ns'] / s['median_ns']:,.0f}x |"
            )
    redis = results.get("redis")
    if redis:
        lines += [
            "",
            "## Redis",
            "",
            "Microseconds per call against one local redis-server over one connection"
            " (`single_connection_client=True`), median of repetitions run round robin; in"
            " brackets the ratio to a trivial `EVALSHA` returning `{1,0}` on the same kind of"
            " connection (the async rows to the async trivial call). The last column is"
            " Redis's own time per `EVALSHA` (`INFO commandstats`, first workload).",
        ]
        for parser, r in redis.items():
            title = "hiredis" if parser == "hiredis" else "redis-py's own parser (no hiredis)"
            lines += ["", f"### {title}", "", *_redis_table(r)]
    lines += ["", "## How it is measured", "", *METHOD]
    path.write_text("\n".join(lines) + "\n")


def _load(load: Any) -> str:
    return "/".join(f"{x:.2f}" for x in load)


METHOD = [
    "- One command, `python benches/run.py` (`make bench`), from a clean clone: it makes"
    " `benches/.venv`, installs the peers pinned in `benches/requirements.txt`, builds"
    " bucketlimit and `benches/floor` with `maturin build --release` and runs the rest"
    " inside that environment. It is never part of the test suite.",
    "- **PyO3 floor**: `benches/floor`, a PyO3 0.30 method with `allow`'s signature and"
    " argument extraction (the key borrowed as UTF-8, the cost as an integer) that only"
    " builds the same six-field frozen `Decision` (allocated the same way, no freelist),"
    " built with the same release profile. Nothing that returns a `Decision` through PyO3"
    " can be faster.",
    "- **naive Rust Mutex<HashMap>**: the same crate: `std::sync::Mutex<HashMap<String, _>>`,"
    " SipHash, a float bucket per key, `Instant::now()` per call; it never forgets a key.",
    "- **pure Python + lock**: `benches/purepy.py`, floats, `time.monotonic`, one"
    " `threading.Lock`, returns a `bool`.",
    "- **Peers**, each in its documented in-memory mode (and Redis mode), closest to a"
    " token bucket: token-bucket's `Limiter.consume`; limits' fixed window and sliding"
    " window counter (`hit`); pyrate-limiter's `TokenBucket` algorithm in a `StateBucket`"
    " per key, through `Limiter.try_acquire(blocking=False)`; throttled-py's token bucket"
    " through `Throttled.limit` (its MemoryStore raised from 1,024 to 10,000,000 keys so"
    " it holds every key).",
    "- **Workloads**: keys of 10 bytes; one key repeated, or 10,000 keys round robin."
    " Mostly allowed: a burst of 10^9 tokens refilling at 1 per second (windows: 10^9 per"
    " second). Mostly refused: 10 tokens refilling at 1 per hour, drained before timing"
    " (windows: 10 per hour).",
    "- **Timing**: each timing calls `allow(key)` in a plain `for` loop over a list of"
    " 10,000 keys for about 0.1 s; every repetition times every library once, round robin,"
    " starting one library later each time; the median over repetitions is reported.",
    "- **Memory**: resident set size (`/proc/self/statm`) after a `gc.collect()`, before"
    " and after touching the keys once each, in a fresh interpreter per library.",
    "- **Redis**: redis-server started by the benchmark on a free loopback port with no"
    " persistence, stopped at the end. The server and the client are pinned to one CPU: on"
    " a virtual machine, waking a process on another idle CPU costs tens of microseconds"
    " that change from run to run (unpinned, the trivial call took 35-110 us here). Each"
    " parser runs in its own process, twice, alternating, and the repetitions are pooled;"
    " the hiredis-less process hides the hiredis module before redis-py is imported.",
]


# --- docs/benchmarks.png ---------------------------------------------------------------


def write_chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("inproc", "memory", "redis") if results.get(p)]
    if not panels:
        return
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.2 * len(panels), 6.2), constrained_layout=True
    )
    axes = [axes] if len(panels) == 1 else list(axes)
    highlight, other, base = "#d1495b", "#8d99ae", "#2e4057"

    def colour(name: str, kind: str) -> str:
        if name.startswith(US) or kind.startswith("us"):
            return highlight
        return base if kind in ("floor", "baseline", "async-floor") else other

    for ax, panel in zip(axes, panels, strict=True):
        if panel == "inproc":
            w = results["inproc"]["workloads"]
            names = list(next(iter(w.values())))
            workloads = list(w)
            height = 0.8 / len(workloads)
            hatches = ["", "//", "..", "xx"]
            for j, workload in enumerate(workloads):
                values = [w[workload][n]["ns"] for n in names]
                ys = [i + j * height for i in range(len(names))]
                ax.barh(
                    ys,
                    values,
                    height=height,
                    color=[colour(n, w[workload][n]["kind"]) for n in names],
                    hatch=hatches[j],
                    edgecolor="white",
                    label=workload,
                )
            ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names)
            ax.set_xscale("log")
            ax.set_xlabel("ns per allow() call, log scale (shorter is faster)")
            ax.set_title("In-process allow()")
            ax.legend(fontsize=7, loc="upper right")
        elif panel == "memory":
            libs = results["memory"]["libraries"]
            names = list(libs)
            values = [libs[n]["bytes_per_key"] for n in names]
            ax.barh(names, values, color=[colour(n, "peer") for n in names])
            for y, v in enumerate(values):
                ax.text(v, y, f" {v:,.0f}", va="center", fontsize=8)
            ax.set_xlabel("bytes per key held (key included)")
            ax.set_title(f"Memory at {results['memory']['keys']:,} keys")
        else:
            redis = results["redis"]
            parser = "hiredis" if "hiredis" in redis else next(iter(redis))
            workload = next(iter(redis[parser]["workloads"]))
            rows = redis[parser]["workloads"][workload]
            names = list(rows)
            values = [rows[n]["us"] for n in names]
            ax.barh(names, values, color=[colour(n, rows[n]["kind"]) for n in names])
            for y, v in enumerate(values):
                ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
            ax.set_xlabel("us per call, one connection")
            ax.set_title(f"Redis ({parser}, {workload})")
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("bucketlimit (red) next to the baselines (dark) and the other limiters (grey)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
