"""Leases across real processes (docs/redis.md, "Hot keys: leases").

Processes (tests/support/processes.py) hammer one key of a real redis-server (and of
a 3-node cluster) through leasing limiters on the server's clock, each released by
one barrier, each timestamping every admitted call with ``time.monotonic()`` (one
clock for every process of this machine) before and after it. The assertions:

- never over the cap: in every 1-second window, and over the whole run, the calls
  surely inside it (begun at or after its start, ended by its end) number at most
  capacity + rate * T (the slack: 0.1 % of T for the server's clock running apart
  from the monotonic one, NTP slewing at most 0.05 %);
- the accounts agree: each process's own count is what the store's replies say its
  leases gave it (leased - returned - expired unused, and the shared bucket's
  answers), and the bucket's own arithmetic (it starts empty at a known server
  time, so what it charged is the refill since less what it holds) charged at least
  that;
- leases serve locally: fewer than one store call per 20 admitted calls, 20 times
  fewer script calls than without leases for the same calls (counted by INFO
  commandstats); idle processes among a hot one are not starved; a process killed
  holding a lease: no one gets its tokens before its record expires.

Counts, never rates: how much of the bound a run admits, the refill left idle, the
tokens that expired unused and the hot process's share of the rate depend on the
machine's speed; benches/scenario_figures.py prints them for these scenarios at
their former length (10 s, 3 s), benches/leases.py the throughput.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from bucketlimit.redis import AsyncRedisTokenBucketLimiter, LeasePolicy, RedisTokenBucketLimiter
from tests.support.processes import CONTEXT
from tests.support.redis_servers import command

pytestmark = [pytest.mark.redis, pytest.mark.skipif(sys.platform == "win32", reason="POSIX")]

MICROS = 1_000_000
KEY = "hot"
CAPACITY = 10_000
RATE = 100_000
#: The server's clock may run apart from the monotonic one (NTP slews at most 0.05 %).
CLOCK_SLACK = 0.001


def no_retries_client(url: str, cluster: bool) -> Any:
    # Generous timeouts: on a loaded 2-core machine a timed-out lease call may have
    # run, and its tokens would be lost to the accounts (never to the bound).
    options: dict[str, Any] = {"socket_timeout": 10, "retry": Retry(NoBackoff(), 0)}
    if cluster:
        host, port = url.removeprefix("redis://").split("/")[0].split(":")
        nodes = [ClusterNode(host, int(port))]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, **options)
    return redis.Redis.from_url(url, **options)


@dataclass(frozen=True)
class Job:
    """What one worker process does: hammer ``KEY`` for ``seconds`` (``pace``: at most
    that many calls a second, else as fast as it can; ``calls``: stop after that many
    calls, which the sync kind only counts) with ``kind`` of client."""

    url: str
    cluster: bool
    kind: str  # "sync", "asyncio" (tasks), "threads" (batching=True)
    seconds: float
    capacity: int = CAPACITY
    rate: int = RATE
    lease: bool = True
    pace: float | None = None
    workers: int = 1  # tasks or threads
    policy: LeasePolicy | None = None
    calls: int | None = None


@dataclass
class Result:
    admitted: int
    refused: int
    stats: dict[str, int]
    file: str  # the (before, after) pairs of the admitted calls


def hammer(
    allow: Callable[[], Any],
    until: float,
    pace: float | None,
    times: array[float],
    calls: int | None = None,
) -> int:
    """Calls ``allow`` until ``until`` or ``calls`` calls (at most ``pace`` a second,
    sleeping between calls); appends (before, after) of each admitted call."""
    refused = 0
    monotonic = time.monotonic
    step = 0.0 if pace is None else 1.0 / pace
    next_call = monotonic()
    while True:
        before = monotonic()
        if before >= until or (calls is not None and refused + len(times) // 2 >= calls):
            return refused
        if step and before < next_call:
            # Sleep, not spin: a paced process must leave the cores to the others (seven
            # spinning "idle" ones held the hot one to 79 % of the rate in one CI run).
            time.sleep(next_call - before)
            continue
        next_call += step
        if allow():
            times.append(before)
            times.append(monotonic())
        else:
            refused += 1


async def hammer_async(allow: Callable[[], Any], until: float, times: array[float]) -> int:
    refused = 0
    monotonic = time.monotonic
    while (before := monotonic()) < until:
        if await allow():
            times.append(before)
            times.append(monotonic())
        else:
            refused += 1
    return refused


def worker(job: Job, barrier: Any, directory: str, index: int) -> Result:
    lease: Any = job.policy or True if job.lease else False
    client = no_retries_client(job.url, job.cluster)
    options = {"prefix": "leases:", "lease": lease}
    times: array[float] = array("d")
    if job.kind == "asyncio":

        async def main() -> tuple[int, dict[str, int]]:
            async_client: Any
            if job.cluster:
                async_client = redis.asyncio.RedisCluster.from_url(
                    job.url, socket_timeout=10, retry=redis.asyncio.retry.Retry(NoBackoff(), 0)
                )
            else:
                async_client = redis.asyncio.Redis.from_url(
                    job.url, socket_timeout=10, retry=redis.asyncio.retry.Retry(NoBackoff(), 0)
                )
            limiter = AsyncRedisTokenBucketLimiter(async_client, job.capacity, job.rate, **options)
            await limiter.allow("warm-up")  # connects and loads the script before the start
            barrier.wait()
            until = time.monotonic() + job.seconds
            counts = await asyncio.gather(
                *(
                    hammer_async(lambda: limiter.allow(KEY), until, times)
                    for _ in range(job.workers)
                )
            )
            await limiter.aclose()
            stats = cast("dict[str, int]", dict(limiter.stats()))
            await async_client.aclose()
            return sum(counts), stats

        refused, stats = asyncio.run(main())
    else:
        batching = job.kind == "threads"
        limiter = RedisTokenBucketLimiter(
            client, job.capacity, job.rate, batching=batching, **options
        )
        limiter.allow("warm-up")
        barrier.wait()
        until = time.monotonic() + job.seconds
        if job.kind == "sync":
            refused = hammer(lambda: limiter.allow(KEY), until, job.pace, times, job.calls)
        else:
            per_thread = [array("d") for _ in range(job.workers)]
            refusals = [0] * job.workers

            def run(i: int) -> None:
                refusals[i] = hammer(lambda: limiter.allow(KEY), until, job.pace, per_thread[i])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(job.workers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            refused = sum(refusals)
            for each in per_thread:
                times.extend(each)
        limiter.close()
        stats = cast("dict[str, int]", dict(limiter.stats()))
    client.close()
    path = Path(directory) / f"times-{index}"
    with path.open("wb") as file:
        times.tofile(file)
    # The warm-up call is one more decision, of another key.
    return Result(len(times) // 2, refused, stats, str(path))


def _entry(job: Job, barrier: Any, results: Any, directory: str, index: int) -> None:
    try:
        results.put((index, "ok", worker(job, barrier, directory, index)))
    except BaseException as e:  # reported to the test, which fails with it
        barrier.abort()
        results.put((index, "error", repr(e)))


def run_jobs(jobs: Sequence[Job], directory: Path, start: Callable[[], None]) -> list[Result]:
    """Runs each job in its own process; ``start`` runs once they are all ready,
    just before the barrier releases them."""
    barrier = CONTEXT.Barrier(len(jobs) + 1)
    results = CONTEXT.Queue()
    processes = [
        CONTEXT.Process(target=_entry, args=(job, barrier, results, str(directory), i))
        for i, job in enumerate(jobs)
    ]
    for process in processes:
        process.start()
    try:
        while barrier.n_waiting < len(jobs):
            time.sleep(0.01)
            if any(p.exitcode not in (None, 0) for p in processes):
                break
        start()
        with contextlib.suppress(threading.BrokenBarrierError):  # a worker failed: see below
            barrier.wait(timeout=120)
        answers = sorted((results.get(timeout=300) for _ in processes), key=lambda a: a[0])
    finally:
        for process in processes:
            process.join(60)
            if process.exitcode is None:
                process.kill()
    errors = [detail for _, status, detail in answers if status == "error"]
    assert errors == [], f"a worker failed: {errors}"
    return [detail for _, _, detail in answers]


# -- reading the runs ------------------------------------------------------------------


@dataclass
class Calls:
    """Every admitted call of a run: sorted starts, sorted ends, and the calls that
    took longer than a second (a window can only miss those)."""

    befores: list[float]
    afters: list[float]
    long: list[tuple[float, float]]

    @classmethod
    def read(cls, results: Sequence[Result]) -> Calls:
        pairs: list[tuple[float, float]] = []
        for result in results:
            times: array[float] = array("d")
            with open(result.file, "rb") as file:
                times.frombytes(file.read())
            pairs += zip(times[0::2], times[1::2], strict=True)
        return cls(
            sorted(b for b, _ in pairs),
            sorted(a for _, a in pairs),
            [(b, a) for b, a in pairs if a - b > 1.0],
        )

    def inside(self, start: float, end: float) -> int:
        """Calls begun at or after ``start`` and ended by ``end``."""
        ended = bisect.bisect_right(self.afters, end)
        begun_before = bisect.bisect_left(self.befores, start)
        spanning = sum(1 for b, a in self.long if b < start and a > end)
        return ended - begun_before + spanning

    @property
    def span(self) -> float:
        return self.afters[-1] - self.befores[0]


def assert_never_over_the_cap(calls: Calls, capacity: int, rate: int) -> float:
    """Asserts the bound in every 1 s window (5 ms apart) and over the run; answers
    the fullest window's fraction of its bound."""
    length = 1.0
    start = calls.befores[0]
    worst = 0.0
    while start + length <= calls.afters[-1] + length:
        inside = calls.inside(start, start + length)
        bound = capacity + rate * length * (1 + CLOCK_SLACK)
        assert inside <= bound, f"window at +{start - calls.befores[0]:.3f} s: {inside} > {bound}"
        worst = max(worst, inside / bound)
        start += 0.005
    total = len(calls.befores)
    bound = capacity + rate * calls.span * (1 + CLOCK_SLACK)
    assert total <= bound, f"{total} admitted in {calls.span:.3f} s: over the bound {bound:.0f}"
    return worst


def server_micros(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * MICROS + int(micros)


class EmptyStart:
    """Called just before the processes start: stores the bucket empty at the
    server's time (``at``). A keeper holds a lease of the key (2 tokens, for 2
    minutes) throughout, so that the bucket is still there to be read at the end
    (a bucket that refills to full is deleted, and at this rate that takes a tenth
    of a second); its record is read back by the first lease of the run."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.at = 0
        self.read_between = (0.0, 0.0)  # the monotonic clock before and after ``at``
        keeper = LeasePolicy(period=60.0, share=2 / CAPACITY)
        self.keeper = RedisTokenBucketLimiter(
            client, CAPACITY, RATE, prefix="leases:", lease=keeper
        )
        self.keeper.allow(KEY)
        assert self.keeper.allow(KEY).remaining == 1  # a lease of 2: one left in it

    def __call__(self) -> None:
        before = time.monotonic()
        self.at = server_micros(self.client)
        self.read_between = (before, time.monotonic())
        self.client.set(f"leases:{{{KEY}}}:{KEY}", f"0 {self.at}", px=600_000)

    def close(self) -> None:
        self.keeper.close()


def charged_by_the_bucket(client: Any, rate: int, since: int) -> tuple[int, int]:
    """Tokens the bucket charged since ``since`` (it was empty then): its refill since,
    less what it holds (no lease is left out: every process gave its back); and when
    it was last written (the server's µs)."""
    value = client.get(f"leases:{{{KEY}}}:{KEY}")
    balance, last, _, out, _ = (int(x) for x in value.split())
    assert out == 2 * MICROS, f"leases left out besides the keeper's: {value!r}"
    # rate tokens a second: p = rate units a µs, a token is 10**6 units.
    return (rate * (last - since) - balance) // MICROS, last


def refill_outside_the_run(start: EmptyStart, calls: Calls, rate: int, last: int) -> int:
    """The refill the bucket had from its start to the first admitted call and from
    the end of the last one to its last write (the last process's close): no call of
    the run could have had it, so it is no idle of the run. The server's clock and
    the monotonic one tick alike on one machine; mapped through ``start``, both
    stretches come out short, if anything."""
    before, after = start.read_between
    head = (calls.befores[0] - after) * MICROS
    tail = last - start.at - (calls.afters[-1] - before) * MICROS
    return math.floor(rate * (max(0.0, head) + max(0.0, tail)) / MICROS)


def totals(results: Sequence[Result]) -> dict[str, int]:
    keys = results[0].stats
    return {name: sum(r.stats[name] for r in results) for name in keys}


# -- the tests -------------------------------------------------------------------------


@dataclass
class HotKey:
    """One run of :func:`eight_processes_on_one_key`: the admitted calls, the
    processes' summed stats, and the bucket's own account."""

    calls: Calls
    sums: dict[str, int]
    admitted: int
    processes: int
    charged: int  # tokens the bucket charged since it started empty
    outside: int  # refill the bucket had before the first call or after the last

    @property
    def gap(self) -> int:
        """Tokens the bucket charged that no process was admitted nor let expire: the
        refill it could not hold (idle), besides ``outside``."""
        return self.charged - (self.admitted + self.sums["lease_tokens_expired"])


def eight_processes_on_one_key(client: Any, url: str, directory: Path, seconds: float) -> HotKey:
    """8 processes, capacity 10,000, rate 100,000/s, from an empty bucket: the test's
    scenario (benches/scenario_figures.py runs it for 10 s and prints the rates)."""
    start = EmptyStart(client)
    try:
        results = run_jobs([Job(url, False, "sync", seconds)] * 8, directory, start)
        charged, last = charged_by_the_bucket(client, RATE, start.at)
    finally:
        start.close()
    calls = Calls.read(results)
    admitted = sum(r.admitted for r in results)
    outside = refill_outside_the_run(start, calls, RATE, last)
    return HotKey(calls, totals(results), admitted, len(results), charged, outside)


@pytest.mark.timeout(240)
def test_eight_processes_hammering_one_key_never_pass_the_cap(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """8 processes, capacity 10,000, rate 100,000/s, 1.5 s: the bound in every window,
    the accounts, and leases that serve locally."""
    run = eight_processes_on_one_key(redis_client, redis_url, tmp_path, 1.5)
    assert_never_over_the_cap(run.calls, CAPACITY, RATE)
    sums, admitted = run.sums, run.admitted
    warm_ups = run.processes  # one more decision each, of another key
    assert sums["allowed"] == admitted + warm_ups, f"stats {sums} but {admitted} admitted"
    # Each process's own count is what its leases gave it (one thread: it never
    # asked the shared bucket while renewing), the warm-up calls aside.
    leased = sums["lease_tokens"] - sums["lease_tokens_returned"] - sums["lease_tokens_expired"]
    assert leased == admitted + warm_ups, f"leases gave {leased}, {admitted} admitted: {sums}"
    # The bucket charged at least what the processes took (the rest: refill it could
    # not hold; how much is benches/scenario_figures.py's).
    assert run.gap >= 0, f"the bucket charged {run.charged}, {run.gap} fewer than taken: {sums}"
    assert sums["fallback_decisions"] == 0, f"answered without the store: {sums}"
    hits = sums["lease_hits"]
    assert hits >= 0.95 * admitted, f"only {hits} of {admitted} admitted calls from a lease"


@pytest.mark.timeout(240)
def test_every_kind_of_client_on_a_cluster_stays_under_the_cap(
    redis_cluster: Any, redis_cluster_client: RedisCluster, tmp_path: Path
) -> None:
    """A 3-node cluster: two sync processes, two asyncio processes of 4 tasks, two of
    4 threads sharing round trips (batching=True), all leasing, and one process of 4
    threads that does not lease (group commit on a leased key: its batches send that
    key's allows alone), 1.5 s."""
    url = redis_cluster.url
    client = redis_cluster_client  # its nodes emptied for this test
    seconds = 1.5
    jobs = [
        Job(url, True, "sync", seconds),
        Job(url, True, "sync", seconds),
        Job(url, True, "asyncio", seconds, workers=4),
        Job(url, True, "asyncio", seconds, workers=4),
        Job(url, True, "threads", seconds, workers=4),
        Job(url, True, "threads", seconds, workers=4),
        Job(url, True, "threads", seconds, workers=4, lease=False),
    ]
    start = EmptyStart(client)
    try:
        results = run_jobs(jobs, tmp_path, start)
        charged, _ = charged_by_the_bucket(client, RATE, start.at)
    finally:
        start.close()
    calls = Calls.read(results)
    assert_never_over_the_cap(calls, CAPACITY, RATE)
    sums = totals(results)
    admitted = sum(r.admitted for r in results)
    assert sums["allowed"] == admitted + len(results), f"stats {sums} but {admitted} admitted"
    gap = charged - (admitted + sums["lease_tokens_expired"])
    assert gap >= 0, f"the bucket charged {charged}, {gap} fewer than taken: {sums}"
    assert sums["fallback_decisions"] == 0, f"answered without the store: {sums}"
    # The one that does not lease sent its allows to the store, alone, and was
    # answered; how many it got depends on the leases' queue (docs/redis.md, "What
    # it gives up": on a saturated key an allow never jumps the renewals' queue, and
    # in one run of three it got none).
    unleased = results[-1]
    assert unleased.stats["lease_round_trips"] == 0, f"it leased: {unleased.stats}"
    assert unleased.stats["store_calls"] > 0, f"it never asked the store: {unleased.stats}"
    assert unleased.stats["store_errors"] == 0, f"the store failed it: {unleased.stats}"
    assert unleased.admitted + unleased.refused > 0, "it was never answered"


def commands(client: redis.Redis) -> int:
    """Script calls the server ran since the last CONFIG RESETSTAT."""
    stats = command(client, "INFO", "commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


LEASED_CALLS, PACE = 1_000, 2_000  # per process, calls a second at most


@pytest.mark.timeout(180)
def test_leases_take_twenty_times_fewer_commands_for_the_same_calls(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """4 processes of 1,000 calls each, with leases and without: the script calls
    counted by the server. The calls are paced (2,000 a second at most): a lease holds
    half a period of its process's demand, so four leases hold at most 4,000 tokens and
    never wait their turn in the bucket of 10,000; every call is admitted. (Unpaced,
    the first processes' leases are sized before the store counts the others, can take
    most of the bucket, and a later one is refused while its lease waits its turn.)"""
    per_admitted, admitted = {}, {}
    for lease in (False, True):
        redis_client.flushall()
        command(redis_client, "CONFIG", "RESETSTAT")
        job = Job(redis_url, False, "sync", 120.0, lease=lease, pace=PACE, calls=LEASED_CALLS)
        jobs = [job] * 4
        results = run_jobs(jobs, tmp_path, lambda: None)
        admitted[lease] = sum(r.admitted + 1 for r in results)  # and the warm-up calls
        refused = sum(r.refused for r in results)
        assert refused == 0, f"lease={lease}: {refused} refused, with supply for all"
        per_admitted[lease] = commands(redis_client) / admitted[lease]
    assert admitted[True] == admitted[False] == 4 * (LEASED_CALLS + 1), admitted
    assert per_admitted[False] >= 1.0, f"unleased: {per_admitted[False]} scripts per call"
    assert per_admitted[False] >= 20 * per_admitted[True], (
        f"script calls per admitted call: {per_admitted[True]:.4f} leased, "
        f"{per_admitted[False]:.4f} unleased: not 20 times fewer"
    )


@dataclass
class HotAmongIdle:
    hot: Result
    idle: list[Result]
    calls: Calls  # every process's


def one_hot_among_seven_idle(
    client: Any, url: str, directory: Path, seconds: float
) -> HotAmongIdle:
    """One process as fast as it can; seven asking 10 calls a second; from an empty
    bucket. The test's scenario (benches/scenario_figures.py: the hot one's rate)."""
    hot = Job(url, False, "sync", seconds)
    idle = Job(url, False, "sync", seconds, pace=10)
    start = EmptyStart(client)
    try:
        results = run_jobs([hot] + [idle] * 7, directory, start)
    finally:
        start.close()
    return HotAmongIdle(results[0], results[1:], Calls.read(results))


@pytest.mark.timeout(180)
def test_one_hot_process_among_seven_idle_ones_starves_none(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """1.5 s: the cap holds over every process's calls, the hot one is served from
    its leases, and the idle ones are not starved."""
    run = one_hot_among_seven_idle(redis_client, redis_url, tmp_path, 1.5)
    assert_never_over_the_cap(run.calls, CAPACITY, RATE)
    hot = run.hot
    assert hot.stats["lease_hits"] >= 0.95 * hot.admitted, (
        f"the hot process: only {hot.stats['lease_hits']} of {hot.admitted} from a lease"
    )
    # The idle ones' leases wait their turn in the shared bucket (FIFO, at most the
    # policy's max_wait, 0.25 s, behind the hot one's): they never starve, and most of
    # their calls are admitted (25-30 of 30 each in four runs of 3 s).
    idle = [(r.admitted, r.refused) for r in run.idle]
    assert all(admitted >= 2 / 3 * (admitted + refused) for admitted, refused in idle), (
        f"(admitted, refused) of the idle processes: {idle}"
    )


def hold_a_lease(url: str, ready: Any) -> None:
    """Calls until it holds a lease of more than 400 tokens (its demand grows the
    lease to its share, 500), says how many are left in it, and waits to be killed."""
    limiter = RedisTokenBucketLimiter(
        redis.Redis.from_url(url), 1_000, 1_000, prefix="leases:", lease=LeasePolicy(period=0.5)
    )
    while (held := limiter.allow(KEY).remaining) < 400 or not limiter.stats()["lease_hits"]:
        pass  # (the first call is the store's answer: its remaining is the bucket's)
    ready.send(held)
    time.sleep(300)


@pytest.mark.timeout(60)
def test_a_process_killed_holding_a_lease_keeps_its_tokens_spent_until_its_record_expires(
    redis_client: redis.Redis, redis_url: str
) -> None:
    """Capacity 1,000, 1,000 a second: the killed process holds 400 tokens or more of
    a lease of n (period 0.5 s). Until its record expires (1 s after the lease began,
    on the server's clock) the shared bucket holds at most its cap, 1,000 - n; then it
    refills to 1,000 within half a second."""
    theirs, ours = CONTEXT.Pipe(duplex=False)
    process = CONTEXT.Process(target=hold_a_lease, args=(redis_url, ours))
    process.start()
    try:
        assert theirs.poll(60), "the process never held its lease"
        held = theirs.recv()
        assert held >= 400, f"it said it held {held}"
        process.kill()  # SIGKILL
        process.join(10)
    finally:
        if process.exitcode is None:
            process.kill()
    exact = RedisTokenBucketLimiter(redis_client, 1_000, 1_000, prefix="leases:")
    records = redis_client.hgetall(exact.redis_key(KEY) + b":leases")
    [(units, expiry)] = [tuple(map(int, v.split())) for v in records.values()]
    leased = units // MICROS
    assert held < leased <= 500, f"a lease of {leased} of which {held} were left"
    cap = 1_000 - leased
    peeks = 0
    # Checked until just before the record expires, on the server's clock (a hang
    # guard: that is under a second away).
    while server_micros(redis_client) < expiry - 50_000:
        remaining = exact.peek(KEY).remaining
        assert remaining <= cap - 1, f"the bucket holds {remaining}, over its cap {cap}"
        assert not exact.peek(KEY, cap + 1), f"a cost of {cap + 1} passes the cap {cap}"
        peeks += 1
        time.sleep(0.02)
    assert peeks >= 1, "the record expired before the bucket was read"
    while server_micros(redis_client) < expiry + 600_000:
        time.sleep(0.05)
    remaining = exact.peek(KEY).remaining
    assert remaining == 999, f"{remaining} left after a peek of 1: not full 0.6 s after it"
    # The records expire with the last of them (their TTL), the bucket when full.
    assert redis_client.hgetall(exact.redis_key(KEY) + b":leases") == {}, "records left"
