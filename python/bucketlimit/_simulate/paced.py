"""``--acquire``: the same traffic paced (reserve, then wait) instead of refused."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketlimit import TokenBucketLimiter
from bucketlimit._core import clock_to_micros
from bucketlimit._simulate.counting import Replay, bin_end
from bucketlimit._simulate.model import COLUMNS, KEY, Settings, num
from bucketlimit.testing import ManualClock


@dataclass
class Paced:
    """What waiting did: each admitted request's wait, and the bound check."""

    waits_us: list[int] = field(default_factory=list)
    refused: int = 0
    # Every use time replayed through a fresh limiter of the same settings: all
    # admitted means no window held more than capacity + rate/per*T.
    within_bound: bool = True
    # Uses after the end of the traffic (the queue drains after it).
    last_use_us: int = 0


def run_paced(
    limiter: TokenBucketLimiter,
    clock: ManualClock,
    settings: Settings,
    arrivals: list[int],
    duration_us: int,
) -> tuple[Replay, Paced]:
    """Each arrival reserves (as ``acquire`` does) and uses its tokens after its delay."""
    replay, paced = Replay(offered=len(arrivals)), Paced()
    uses: list[int] = []
    for t in arrivals:
        clock.set(t / 1e6)
        reservation = limiter.reserve(KEY, settings.cost, max_wait=settings.max_wait)
        at_bin = min(COLUMNS - 1, t * COLUMNS // duration_us)
        if not reservation:
            paced.refused += 1
            replay.refused_per_bin[at_bin] += 1
            continue
        wait_us = clock_to_micros(reservation.delay)
        paced.waits_us.append(wait_us)
        uses.append(t + wait_us)
        replay.admitted += 1
        replay.admitted_per_bin[min(COLUMNS - 1, (t + wait_us) * COLUMNS // duration_us)] += 1
    for b in range(COLUMNS):
        clock.set(max(clock.now, bin_end(b, duration_us) / 1e6))
        replay.level_per_bin[b] = limiter.peek(KEY).remaining
    check_clock = ManualClock()
    check = TokenBucketLimiter(settings.capacity, settings.rate, check_clock, per=settings.per)
    for use in uses:  # FIFO: the use times come in order
        check_clock.set(use / 1e6)
        paced.within_bound &= bool(check.allow(KEY, settings.cost))
    paced.last_use_us = max(uses, default=0)
    return replay, paced


def paced_report(settings: Settings, paced: Paced) -> str:
    waits = sorted(paced.waits_us)

    def quantile(q: float) -> str:
        return num(waits[min(len(waits) - 1, int(q * len(waits)))] / 1e6) if waits else "-"

    limit = "no limit" if settings.max_wait is None else f"at most {num(settings.max_wait)} s"
    lines = [
        "",
        f"--acquire: each request reserved and waited for its tokens ({limit})",
        f"waited:   {sum(1 for w in waits if w)} of {len(waits)} admitted; "
        f"p50 {quantile(0.5)} s, p90 {quantile(0.9)} s, p99 {quantile(0.99)} s, "
        f"max {quantile(1.0)} s",
        f"refused:  {paced.refused} (their wait would pass max_wait or the debt bound; "
        "they spent nothing)",
        f"last use: t={num(paced.last_use_us / 1e6)} s",
        "bound:    every use replayed at its time through a fresh limiter: "
        + ("all admitted, never above capacity + rate/per*T" if paced.within_bound else "EXCEEDED"),
    ]
    return "\n".join(lines) + "\n"
