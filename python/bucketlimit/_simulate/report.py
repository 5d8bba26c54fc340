"""The text report: the summary table, the burst figures, the clients, the charts;
and the concurrency mode's (:func:`permits_report`)."""

from __future__ import annotations

import math

from bucketlimit import TokenBucketLimiter
from bucketlimit._simulate.counting import Replay, bucket_times, busiest, busiest_key
from bucketlimit._simulate.model import COLUMNS, SECOND_US, Settings, Traffic, num
from bucketlimit._simulate.permits import PermitReplay, PermitSettings

LEVEL_ROWS = 8  # height of the bucket-level chart
CLIENT_ROWS = 20  # clients listed in the text report (JSON and CSV have them all)

# Nine heights per character cell: empty, then 1/8 .. 8/8 filled.
BLOCKS = " ▁▂▃▄▅▆▇█"
ASCII_BLOCKS = " .:-=+*#@"


def report(
    settings: Settings,
    limiter: TokenBucketLimiter,
    traffic: Traffic,
    replay: Replay,
    duration_us: int,
    *,
    ascii_only: bool = False,
) -> str:
    seconds = duration_us / 1e6
    refused = replay.offered - replay.admitted
    refused_cost = replay.offered_cost - replay.admitted_cost
    bound = settings.capacity + limiter.rate * seconds
    buckets = len({client.bucket for client in replay.clients.values()}) or 1
    start, end = replay.run_span
    most, first, last = replay.busiest_second
    bound_line = (
        f"bound over T seconds:   capacity + rate/per*T = {settings.capacity} + "
        f"{num(limiter.rate)}*{num(seconds)} = {num(bound)} ({bound / seconds:.3f}/s)"
    )
    if buckets > 1:
        bound_line += f" per key, {num(bound * buckets)} for {buckets} keys"
    lines = [
        f"simulate: capacity {settings.capacity}, rate {num(settings.rate)} per "
        f"{num(settings.per)} s ({num(limiter.rate)} tokens/s), {traffic.costs(settings.cost)}",
        f"traffic:  {num(seconds)} s of {traffic.shape}",
        f"          {num(traffic.offered_rate)} requests/s on average, "
        f"{traffic.offered_rate / traffic.limit_rate / buckets:.3g}x what "
        + ("the limit sustains" if buckets == 1 else f"{buckets} keys' limits sustain"),
        "",
        f"{'':10}{'requests':>10}{'cost':>10}",
        f"{'offered':10}{replay.offered:>10}{replay.offered_cost:>10}",
        f"{'admitted':10}{replay.admitted:>10}{replay.admitted_cost:>10}",
        f"{'refused':10}{refused:>10}{refused_cost:>10}",
        "",
        f"most admitted in 1 s:   {_requests(most)}" + (f" ({_span(first, last)})" if most else ""),
        f"largest burst admitted: {_requests(replay.largest_instant)} at one instant"
        + (f" (t={num(replay.largest_instant_at / 1e6)} s)" if replay.largest_instant else ""),
        f"longest admitted run:   {_requests(replay.longest_run)} in a row, none refused"
        + (f" ({_span(start, end)})" if replay.longest_run else ""),
        f"admitted per second:    {replay.admitted_cost / seconds:.3f} on average "
        f"(cost {replay.admitted_cost} over {num(seconds)} s)",
        bound_line,
        f"admitted / bound:       {100 * replay.admitted_cost / (bound * buckets):.1f}%",
        "",
    ]
    if len(replay.clients) > 1:
        lines += [*client_table(replay, settings.shared), ""]
    lines += chart(settings.capacity, replay, seconds, ascii_only=ascii_only)
    if replay.compare is not None:
        lines += ["", *comparison(settings, limiter, replay, ascii_only=ascii_only)]
    return "\n".join(lines) + "\n"


def client_table(replay: Replay, shared: bool) -> list[str]:
    """Each client's share, and how long its refused requests were told to wait."""
    clients = sorted(replay.clients.values(), key=lambda c: -c.offered)
    width = max(8, *(len(c.key) for c in clients[:CLIENT_ROWS]))
    lines = [
        f"clients: {len(clients)}, "
        + ("all spending from one bucket" if shared else "a bucket each"),
        f"{'':{width}}{'offered':>9}{'admitted':>9}{'of own':>8}{'share':>8}{'in 1 s':>8}"
        f"   wait when refused (retry_after)",
    ]
    for client in clients[:CLIENT_ROWS]:
        own = 100 * client.admitted / client.offered
        share = 100 * client.admitted / replay.admitted if replay.admitted else 0.0
        waits = sorted(client.waits)
        wait = (
            f"median {_seconds(waits[len(waits) // 2])}, max {_seconds(waits[-1])}"
            if waits
            else "none refused"
        )
        lines.append(
            f"{client.key:{width}}{client.offered:>9}{client.admitted:>9}{own:>7.1f}%"
            f"{share:>7.1f}%{busiest(client.admitted_at, SECOND_US)[0]:>8}   {wait}"
        )
    if len(clients) > CLIENT_ROWS:
        lines.append(f"... and {len(clients) - CLIENT_ROWS} more (all of them: --format json)")
    return lines


def comparison(
    settings: Settings, limiter: TokenBucketLimiter, replay: Replay, *, ascii_only: bool
) -> list[str]:
    """The fixed window next to the token bucket, on the same requests."""
    c = replay.compare
    assert c is not None
    blocks = ASCII_BLOCKS if ascii_only else BLOCKS
    window = "the whole run" if c.window_us is None else f"{num(c.window_us / 1e6)} s"
    bucket_most, b_first, b_last, _ = busiest_key(bucket_times(replay))
    window_most, first, last, key = c.busiest_second
    second_bound = settings.capacity + limiter.rate
    lines = [
        f"compare: a fixed window of {settings.capacity} tokens per {window} "
        "(same capacity, same long-run rate), same requests",
        f"{'':14}{'admitted':>9}{'most in 1 s':>13}   (one key)",
        f"{'token bucket':14}{replay.admitted:>9}{bucket_most:>13}"
        + (f"   {_span(b_first, b_last)}" if bucket_most else "")
        + f", never above capacity + rate*1 s = {num(second_bound)}",
        f"{'fixed window':14}{c.admitted:>9}{window_most:>13}"
        + (f"   {_span(first, last)}" if window_most else ""),
    ]
    if window_most > second_bound:
        lines.append(
            f"the fixed window let {window_most} requests of {key} through within "
            f"{num((last - first) / 1e6)} s, {window_most / settings.capacity:.3g}x its "
            "limit, across a window boundary"
        )
    top = max(*c.admitted_per_bin, *replay.admitted_per_bin) or 1
    lines += [
        f"admitted per bin (full cell = {top})",
        f"token bucket |{_sparkline(replay.admitted_per_bin, blocks, top)}|",
        f"fixed window |{_sparkline(c.admitted_per_bin, blocks, top)}|",
    ]
    return lines


def chart(capacity: int, replay: Replay, seconds: float, *, ascii_only: bool) -> list[str]:
    """The bucket level as bars, then admissions and refusals as sparklines."""
    blocks = ASCII_BLOCKS if ascii_only else BLOCKS
    label = len(str(capacity)) + 1
    lines = [f"bucket level: whole tokens at the end of each {num(seconds / COLUMNS)} s bin"]
    if len(replay.clients) > 1:
        lines[0] += f" ({next(iter(replay.clients.values())).bucket})"
    eighths = [round(level / capacity * LEVEL_ROWS * 8) for level in replay.level_per_bin]
    for row in range(LEVEL_ROWS):
        floor = (LEVEL_ROWS - 1 - row) * 8  # eighths below this row
        cells = "".join(blocks[min(8, max(0, e - floor))] for e in eighths)
        name = str(capacity) if row == 0 else "0" if row == LEVEL_ROWS - 1 else ""
        lines.append(f"{name:>{label}} |{cells}".rstrip())
    lines.append(f"{'':>{label}} +{'-' * COLUMNS}")
    left, right = "0 s", f"{num(seconds)} s"
    lines.append(f"{'':>{label}}  {left}{right:>{COLUMNS - len(left)}}")
    lines.append("")
    admitted, refused = replay.admitted_per_bin, replay.refused_per_bin
    lines.append(
        f"requests per bin (full cell = busiest bin: "
        f"admitted {max(admitted)}, refused {max(refused)})"
    )
    lines.append(f"admitted |{_sparkline(admitted, blocks)}|")
    lines.append(f" refused |{_sparkline(refused, blocks)}|")
    return lines


def _sparkline(counts: list[int], blocks: str, top: int | None = None) -> str:
    top = top or max(counts) or 1
    # Any nonzero count shows at least the lowest block, so no activity hides.
    return "".join(blocks[0 if n == 0 else max(1, round(n / top * 8))] for n in counts)


def _span(start_us: int, end_us: int) -> str:
    if start_us == end_us:
        return f"t={num(start_us / 1e6)} s"
    return f"t={num(start_us / 1e6)}..{num(end_us / 1e6)} s"


def _seconds(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.3g} s"


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"


# -- the concurrency mode (--concurrency) ----------------------------------------------------


def permits_report(
    settings: PermitSettings,
    traffic: Traffic,
    replay: PermitReplay,
    duration_us: int,
    *,
    ascii_only: bool = False,
) -> str:
    """The concurrency mode's report: what waited and how long, what was refused, the
    peak in flight, and the first key's requests in flight over time."""
    seconds = duration_us / 1e6
    buckets = len({client.bucket for client in replay.clients.values()}) or 1
    waits = sorted(replay.waits_us)
    limit = settings.concurrency
    bound = limit * buckets
    wait_rule = (
        "none (refused at once)"
        if settings.max_wait == 0
        else "no limit"
        if math.isinf(settings.max_wait)
        else f"up to {num(settings.max_wait)} s, first come first served"
    )
    expired = replay.stats["expired"] if replay.stats is not None else 0
    lines = [
        f"simulate: concurrency {limit} per key (ttl {num(settings.ttl)} s), "
        f"service {service_text(settings)}, wait {wait_rule}",
        f"traffic:  {num(seconds)} s of {traffic.shape}",
        f"          {num(traffic.offered_rate)} requests/s on average, "
        f"{traffic.offered_rate / traffic.limit_rate / buckets:.3g}x what "
        + ("the permits serve" if buckets == 1 else f"{buckets} keys' permits serve")
        + f" ({limit} per {num(settings.service)} s = {num(settings.sustained)}/s"
        + (" per key)" if buckets > 1 else ")"),
        "",
        f"{'':10}{'requests':>10}",
        f"{'offered':10}{replay.offered:>10}",
        f"{'admitted':10}{replay.admitted:>10}   {replay.admitted - replay.waited} at once, "
        f"{replay.waited} after waiting",
        f"{'refused':10}{replay.refused:>10}   {replay.refused_at_once} at once, "
        f"{replay.timed_out} after waiting the longest allowed",
        "",
        f"waited:          {replay.waited} of {replay.admitted} admitted"
        + (
            f"; p50 {_quantile(waits, 0.5)} s, p95 {_quantile(waits, 0.95)} s, "
            f"max {_quantile(waits, 1.0)} s"
            if waits
            else ""
        ),
        f"most waiting:    {_requests(replay.peak_waiting)} at once"
        + (f" (t={num(replay.peak_waiting_at_us / 1e6)} s)" if replay.peak_waiting else ""),
        f"peak in flight:  {_requests(replay.peak_in_flight)} at once"
        + (f" (t={num(replay.peak_at_us / 1e6)} s)" if replay.peak_in_flight else "")
        + f", the limit {limit}"
        + (f" per key, {bound} for {buckets} keys" if buckets > 1 else ""),
        f"permits expired: {expired}"
        + (
            " (requests that ran longer than the ttl lost their permit: more ran at once)"
            if expired
            else " (no request ran longer than the ttl)"
        ),
        f"served:          {replay.admitted / seconds:.3f} requests/s on average"
        + (f", the last ended at t={num(replay.last_end_us / 1e6)} s" if replay.admitted else ""),
        f"permits busy:    {100 * replay.busy_us / (duration_us * bound):.1f}% of the time "
        f"({bound} permits for {num(seconds)} s)",
        "",
    ]
    if len(replay.clients) > 1:
        lines += [*permit_clients(replay, settings.shared), ""]
    lines += permit_chart(limit, replay, seconds, ascii_only=ascii_only)
    return "\n".join(lines) + "\n"


def service_text(settings: PermitSettings) -> str:
    if settings.service_dist == "fixed":
        return f"{num(settings.service)} s each"
    return f"{settings.service_dist}, {num(settings.service)} s on average (seed {settings.seed})"


def permit_clients(replay: PermitReplay, shared: bool) -> list[str]:
    """Each client's requests: admitted, how many waited, refused, its peak in flight."""
    clients = sorted(replay.clients.values(), key=lambda c: -c.offered)
    width = max(8, *(len(c.key) for c in clients[:CLIENT_ROWS]))
    lines = [
        f"clients: {len(clients)}, "
        + ("all taking permits of one key" if shared else "the permits of a key each"),
        f"{'':{width}}{'offered':>9}{'admitted':>9}{'waited':>8}{'refused':>8}{'peak':>6}",
    ]
    for client in clients[:CLIENT_ROWS]:
        lines.append(
            f"{client.key:{width}}{client.offered:>9}{client.admitted:>9}{client.waited:>8}"
            f"{client.refused:>8}{client.peak:>6}"
        )
    if len(clients) > CLIENT_ROWS:
        lines.append(f"... and {len(clients) - CLIENT_ROWS} more (all of them: --format json)")
    return lines


def permit_chart(
    limit: int, replay: PermitReplay, seconds: float, *, ascii_only: bool
) -> list[str]:
    """The first key's requests in flight (most in each bin) as bars, then starts,
    refusals and waits as sparklines."""
    blocks = ASCII_BLOCKS if ascii_only else BLOCKS
    top = max(limit, *replay.in_flight_per_bin)
    label = len(str(top)) + 1
    first = next(iter(replay.clients.values()), None)
    lines = [
        f"in flight: the most requests running at once in each {num(seconds / COLUMNS)} s bin"
        + (f" ({first.bucket})" if first is not None and len(replay.clients) > 1 else "")
    ]
    eighths = [round(level / top * LEVEL_ROWS * 8) for level in replay.in_flight_per_bin]
    for row in range(LEVEL_ROWS):
        floor = (LEVEL_ROWS - 1 - row) * 8
        cells = "".join(blocks[min(8, max(0, e - floor))] for e in eighths)
        name = str(top) if row == 0 else "0" if row == LEVEL_ROWS - 1 else ""
        lines.append(f"{name:>{label}} |{cells}".rstrip())
    lines.append(f"{'':>{label}} +{'-' * COLUMNS}")
    left, right = "0 s", f"{num(seconds)} s"
    lines.append(f"{'':>{label}}  {left}{right:>{COLUMNS - len(left)}}")
    lines.append("")
    started, refused, waited = (
        replay.admitted_per_bin,
        replay.refused_per_bin,
        replay.waited_per_bin,
    )
    lines.append(
        f"requests per bin (full cell = busiest bin: started {max(started)}, "
        f"refused {max(refused)}, queued {max(waited)})"
    )
    lines.append(f"started |{_sparkline(started, blocks)}|")
    lines.append(f"refused |{_sparkline(refused, blocks)}|")
    lines.append(f" queued |{_sparkline(waited, blocks)}|")
    return lines


def _quantile(sorted_us: list[int], q: float) -> str:
    """The ``q`` quantile (nearest rank) of sorted microseconds, in seconds (3 digits)."""
    return f"{sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))] / 1e6:.3g}"
