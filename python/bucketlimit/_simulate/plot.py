"""``--plot FILE.png``: the run as a picture, drawn with matplotlib (imported only here);
the token bucket's (:func:`figure`) and the concurrency mode's (:func:`permits_figure`)."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bucketlimit import TokenBucketLimiter
from bucketlimit._simulate.counting import Replay, bin_end, bucket_times
from bucketlimit._simulate.model import (
    COLUMNS,
    SECOND_US,
    Settings,
    SimulationError,
    Traffic,
    num,
)
from bucketlimit._simulate.permits import PermitReplay, PermitSettings

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Plotter = Callable[[Path, Settings, TokenBucketLimiter, Traffic, Replay, int], None]

MAX_LINES = 6  # bucket levels drawn; more clients are listed as "first 6 of N"


def plotter() -> Plotter:
    """:func:`draw` once matplotlib is importable; a clear error otherwise."""
    try:
        import matplotlib  # noqa: F401  (only whether it imports)
    except ImportError:
        raise SimulationError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    return draw


def draw(
    path: Path,
    settings: Settings,
    limiter: TokenBucketLimiter,
    traffic: Traffic,
    replay: Replay,
    duration_us: int,
) -> None:
    """Writes :func:`figure` to ``path`` as a PNG."""
    figure(settings, limiter, traffic, replay, duration_us).savefig(path, dpi=100)


def figure(
    settings: Settings,
    limiter: TokenBucketLimiter,
    traffic: Traffic,
    replay: Replay,
    duration_us: int,
) -> Figure:
    """The bucket level, admissions and refusals over time (and the fixed window's
    admissions in any 1 s next to the bucket's, with --compare). A matplotlib
    ``Figure`` of its own, not pyplot's: no window, no display, no global state."""
    from matplotlib.figure import Figure

    seconds = duration_us / 1e6
    edges = [0.0] + [bin_end(b, duration_us) / 1e6 for b in range(COLUMNS)]
    width = seconds / COLUMNS
    panels = 3 if replay.compare is not None else 2
    # Wider than the plots: the legends stand to their right, clear of the lines.
    drawing = Figure(figsize=(11.5, 2.6 * panels + 0.6))
    axes = drawing.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    costs = traffic.costs(settings.cost)
    drawing.suptitle(
        f"bucketlimit simulate: capacity {settings.capacity}, {num(limiter.rate)} tokens/s, {costs}"
    )

    level = axes[0]
    levels = {client.bucket: client.level_per_bin for client in replay.clients.values()}
    shown = list(levels)[:MAX_LINES]
    for bucket in shown:
        level.step(
            edges,
            [settings.capacity, *levels[bucket]],
            where="post",
            label=bucket if len(shown) > 1 else None,
        )
    level.set_ylim(0, settings.capacity * 1.08)
    level.set_ylabel("tokens in bucket")
    level.axhline(settings.capacity, color="grey", linestyle=":", linewidth=1)
    if len(shown) > 1:
        more = f"first {len(shown)} of {len(levels)}" if len(levels) > len(shown) else None
        _legend(level, title=more)

    bins = axes[1]
    starts = edges[:-1]
    # With costs that differ, the bars are tokens: what the bucket meters.
    by_cost = costs.startswith("costs ")
    admitted = replay.admitted_cost_per_bin if by_cost else replay.admitted_per_bin
    refused = replay.refused_cost_per_bin if by_cost else replay.refused_per_bin
    bins.bar(starts, admitted, width=width, align="edge", color="tab:green", label="admitted")
    bins.bar(
        starts,
        refused,
        width=width,
        align="edge",
        color="tab:red",
        bottom=admitted,
        label="refused",
    )
    bins.set_ylabel(f"{'cost (tokens)' if by_cost else 'requests'} per {num(width)} s")
    _legend(bins)

    if replay.compare is not None:
        c = replay.compare
        ax = axes[2]
        key = c.busiest_second[3]
        bucket = replay.clients[key].bucket if key in replay.clients else key
        for times, name, colour in (
            (bucket_times(replay).get(bucket, array("q")), "token bucket", "tab:blue"),
            (c.admitted_at.get(key, array("q")), c.name, "tab:orange"),
        ):
            xs, ys = _trailing_second(times)
            ax.step(xs, ys, where="post", color=colour, label=f"{name} (most: {max(ys)})")
        ax.axhline(
            settings.capacity + limiter.rate,
            color="tab:blue",
            linestyle="--",
            linewidth=1,
            label="bucket bound: capacity + rate*1 s",
        )
        if c.window_us is not None:
            first_edge = -(-c.origin_us // c.window_us) * c.window_us - c.origin_us
            for edge in range(first_edge, duration_us, c.window_us):
                ax.axvline(edge / 1e6, color="grey", linestyle=":", linewidth=0.8)
        ax.set_ylabel(f"{key or 'admitted'}: requests\nadmitted in the last 1 s")
        _legend(ax)
    axes[-1].set_xlabel("time (s)")
    axes[-1].set_xlim(0, seconds)
    drawing.tight_layout()  # counts the legends in: the plots shrink to make room
    return drawing


def _legend(ax: Axes, title: str | None = None) -> None:
    """A legend beside the plot, right of it, so it covers no line or bar."""
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        fontsize="small",
        title=title,
        title_fontsize="small",
    )


def _trailing_second(times: Sequence[int], points: int = 4000) -> tuple[list[float], list[int]]:
    """The number admitted in the 1 s up to each moment, as a step line: up by one
    at each admission, down by one a second later. Long runs keep the highest
    value of each of ``points`` stretches, so no peak is lost."""
    events = sorted([(t, 1) for t in times] + [(t + SECOND_US, -1) for t in times])
    xs, ys, level = [0.0], [0], 0
    for t, step in events:
        level += step
        xs.append(t / 1e6)
        ys.append(level)
    if len(xs) > 2 * points:
        size = -(-len(xs) // points)
        xs = xs[::size]
        ys = [max(ys[i : i + size]) for i in range(0, len(ys), size)]
    return xs, ys


# -- the concurrency mode (--concurrency) ----------------------------------------------------

PermitPlotter = Callable[[Path, PermitSettings, Traffic, PermitReplay, int], None]


def permits_plotter() -> PermitPlotter:
    """:func:`permits_draw` once matplotlib is importable; a clear error otherwise."""
    plotter()  # the same check
    return permits_draw


def permits_draw(
    path: Path,
    settings: PermitSettings,
    traffic: Traffic,
    replay: PermitReplay,
    duration_us: int,
) -> None:
    """Writes :func:`permits_figure` to ``path`` as a PNG."""
    permits_figure(settings, traffic, replay, duration_us).savefig(path, dpi=100)


def permits_figure(
    settings: PermitSettings, traffic: Traffic, replay: PermitReplay, duration_us: int
) -> Figure:
    """The first key's requests in flight and waiting (the most in each bin) with the
    limit, then requests started and refused per bin. A ``Figure`` of its own."""
    from matplotlib.figure import Figure

    seconds = duration_us / 1e6
    edges = [0.0] + [bin_end(b, duration_us) / 1e6 for b in range(COLUMNS)]
    width = seconds / COLUMNS
    drawing = Figure(figsize=(11.5, 5.8))
    axes = drawing.subplots(2, 1, sharex=True, squeeze=False)[:, 0]
    drawing.suptitle(
        f"bucketlimit simulate: concurrency {settings.concurrency}, service "
        f"{settings.service_dist} {num(settings.service)} s, max wait {num(settings.max_wait)} s"
    )
    level = axes[0]
    first = next(iter(replay.clients.values()), None)
    name = "" if first is None or len(replay.clients) == 1 else f" ({first.bucket})"
    level.step(edges, [0, *replay.in_flight_per_bin], where="post", label=f"in flight{name}")
    level.step(
        edges, [0, *replay.waiting_per_bin], where="post", color="tab:orange", label="waiting"
    )
    level.axhline(settings.concurrency, color="grey", linestyle=":", linewidth=1, label="the limit")
    top = max(settings.concurrency, *replay.in_flight_per_bin, *replay.waiting_per_bin)
    level.set_ylim(0, top * 1.08)
    level.set_ylabel("requests, most at once")
    _legend(level)

    bins = axes[1]
    starts = edges[:-1]
    started, refused = replay.admitted_per_bin, replay.refused_per_bin
    bins.bar(starts, started, width=width, align="edge", color="tab:green", label="started")
    bins.bar(
        starts, refused, width=width, align="edge", color="tab:red", bottom=started, label="refused"
    )
    bins.set_ylabel(f"requests per {num(width)} s")
    _legend(bins)
    axes[-1].set_xlabel("time (s)")
    axes[-1].set_xlim(0, seconds)
    drawing.tight_layout()
    return drawing
