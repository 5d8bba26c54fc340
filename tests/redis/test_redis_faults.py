"""Redis limiters against real, misbehaving servers (docs/design.md §6).

Every server is a real redis-server started for the test (``redis_server_factory``);
hung with SIGSTOP, killed with SIGKILL, restarted empty, made busy, read-only or
out of memory. A loopback TCP proxy (tests/tcp_proxy.py) sits in front when a test
needs to count what was sent, slow the store down or lose a reply after the
command ran.

Timing: assertions are counts, never durations (how long the calls and the
recoveries took is benches/scenario_figures.py's). Waits are bounded polling
(``wait_for``), except the scenarios whose subject is a span of time ("the server
hangs for 1 s", "the store is slow for 1.5 s"). Worker threads rest 2 ms between
calls, so that on a busy 2-core machine the proxy and the server still get the CPU
they need to answer within the clients' timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

import bucketlimit
from bucketlimit import Decision
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    ConfigurationError,
    CorruptBucketError,
    Policy,
    RedisTokenBucketLimiter,
    StoreUnavailableError,
)
from tests.support.processes import CONTEXT
from tests.support.redis_servers import RedisClusterNodes, RedisServer, ServerFactory
from tests.support.tcp_proxy import TcpProxy

MICROS = 1_000_000
POLICIES: tuple[Policy, ...] = ("local", "open", "closed", "raise")


def url_of(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def script_calls(admin: redis.Redis) -> int:
    """EVALSHA and EVAL commands the server ran since its last CONFIG RESETSTAT."""
    stats = admin.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


def balance(admin: redis.Redis, key: str, prefix: str = "bucketlimit:") -> int | None:
    """The stored balance of a plain key's bucket, in units (10**6 a token at rate 0)."""
    value = admin.get(f"{prefix}{{{key}}}:{key}")
    return None if value is None else int(value.split()[0])


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Bounded polling for something that must happen: not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.01)


def warnings_and_infos(records: list[logging.LogRecord]) -> tuple[int, int]:
    ours = [r for r in records if r.name == "bucketlimit"]
    return (
        sum(r.levelno == logging.WARNING for r in ours),
        sum(r.levelno == logging.INFO for r in ours),
    )


@contextmanager
def closing(limiter: RedisTokenBucketLimiter) -> Iterator[RedisTokenBucketLimiter]:
    try:
        yield limiter
    finally:
        limiter.client.close()


class Calls:
    """Decisions recorded as (started, ended, degraded, who), in the order they ended."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, bool, str]] = []

    def record(self, started: float, decision: Decision, who: str) -> None:
        self.calls.append((started, time.monotonic(), decision.degraded, who))  # atomic

    def store_backed_streak(self) -> int:
        """How many of the latest decisions in a row came from the store."""
        streak = 0
        for _, _, degraded, _ in reversed(list(self.calls)):
            if degraded:
                break
            streak += 1
        return streak

    def first_store_backed_after(self, moment: float) -> float | None:
        """When the first decision from the store ended after ``moment``."""
        ends = [end for _, end, degraded, _ in list(self.calls) if end > moment and not degraded]
        return min(ends, default=None)

    def within(self, start: float, end: float) -> list[tuple[float, float, bool, str]]:
        """The calls that started and ended between ``start`` and ``end``."""
        return [call for call in list(self.calls) if start <= call[0] and call[1] < end]


def assert_answered_without_the_store(
    calls: Calls, start: float, end: float, callers: int, stats: dict[str, int]
) -> None:
    """Every call made while the store could not answer (between ``start`` and
    ``end``) was answered without it; none waited for the store to come back: every
    caller made at least two calls in that time (one whose answer came back within
    it, then another). The calls' latencies are benches/scenario_figures.py's."""
    during = calls.within(start, end)
    assert during, "no call was answered while the store could not answer"
    from_the_store = [call for call in during if not call[2]]
    assert from_the_store == [], f"answered by a store that could not answer: {from_the_store}"
    made = Counter(who for _, _, _, who in during)
    stuck = {who: made[who] for who in (f"user-{i}" for i in range(callers)) if made[who] < 2}
    assert stuck == {}, f"callers with fewer than 2 calls answered in {end - start:.1f} s: {stuck}"
    fallback = stats["fallback_decisions"]
    assert fallback >= len(during), f"{len(during)} degraded answers, fallback_decisions {fallback}"


class Workers(Calls):
    """Threads calling ``limiter.allow(their own key)`` until stopped, 2 ms apart."""

    def __init__(self, limiter: RedisTokenBucketLimiter, count: int) -> None:
        super().__init__()
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(limiter, f"user-{i}")) for i in range(count)
        ]

    def _run(self, limiter: RedisTokenBucketLimiter, key: str) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.record(started, limiter.allow(key), key)
                time.sleep(0.002)
        except BaseException as e:  # reported by stop()
            self.errors.append(e)

    def __enter__(self) -> Workers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in self._threads), "a call never returned"
        assert self.errors == [], "a call raised"


def stats_since(limiter: Any, before: Any) -> dict[str, int]:
    """The limiter's counters since ``before`` (one of its ``stats()``)."""
    after = limiter.stats()
    return {name: after[name] - before[name] for name in before}


# -- a hung server: SIGSTOP, 8 threads, socket_timeout 0.25 s ----------------------------

THREADS = 8
#: The client's socket timeout: a loaded machine (a core held busy) delays a healthy
#: reply past 50 ms now and then, which opens the breaker a second time. The counts
#: asserted do not depend on it; benches/scenario_figures.py runs 50 ms.
TIMEOUT = 0.25


@dataclass
class Hang:
    """A server hung for a while under calling threads: what the proxy saw, what the
    calls got, and the limiter's counters over the hang and the recovery."""

    paused: float
    resumed: float
    recovered: float  # the end of the first store-backed call after SIGCONT
    sent: int  # commands that reached the proxy while the server hung
    connections: int  # connections opened meanwhile
    calls: Calls
    stats: dict[str, int]
    logs: list[logging.LogRecord]


def through(
    proxy: TcpProxy, retry: float, prefix: str = "bucketlimit:", timeout: float = TIMEOUT
) -> RedisTokenBucketLimiter:
    """A limiter of a million tokens (100,000 a second) on the proxy, its client
    waiting ``timeout`` for a reply, its breaker's retry_interval ``retry``."""
    return RedisTokenBucketLimiter.from_url(
        url_of(proxy.port), 10**6, 10**5, timeout=timeout, retry_interval=retry, prefix=prefix
    )


class Recorder(logging.Handler):
    """Keeps the records it is given (INFO and above)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def hang_the_server(
    server: RedisServer, stop: float, retry: float, timeout: float = TIMEOUT
) -> Hang:
    """The test's scenario (benches/scenario_figures.py runs it 3 s with retry 1 s and
    timeout 50 ms, and prints how long the calls and the recovery took). Logs at INFO
    are recorded."""
    handler = Recorder()
    records = handler.records
    logger = logging.getLogger("bucketlimit")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with TcpProxy(server.port) as proxy:
            limiter = through(proxy, retry, timeout=timeout)
            with closing(limiter), Workers(limiter, THREADS) as workers:
                wait_for(lambda: workers.store_backed_streak() >= 50 * THREADS, "a healthy store")
                before = limiter.stats()
                logs = len(records)
                sent = proxy.commands()
                paused = time.monotonic()
                server.pause()
                time.sleep(stop)  # the scenario: the server hangs
                sent_during = proxy.commands() - sent
                connections_during = proxy.connections_since(paused)
                resumed = time.monotonic()
                server.resume()
                wait_for(lambda: workers.first_store_backed_after(resumed), "the store again")
                stats = stats_since(limiter, before)
                outage_logs = records[logs:]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    recovered = workers.first_store_backed_after(resumed)
    assert recovered is not None
    return Hang(
        paused, resumed, recovered, sent_during, connections_during, workers, stats, outage_logs
    )


@pytest.mark.timeout(60)
def test_a_hung_server_costs_one_attempt_per_retry_interval(
    redis_server_factory: ServerFactory,
) -> None:
    """While the server hangs (1 s), each thread's call already on its way times out
    (the breaker cannot know sooner); after that the store gets one probe per
    retry_interval (0.25 s), each on a fresh connection, counted at the proxy."""
    stop, retry = 1.0, 0.25
    hang = hang_the_server(redis_server_factory.start(), stop, retry)
    # Store attempts: one call per thread caught on its way, then the probes, each
    # on a new connection (a timed-out connection is closed) and each sending one
    # command (the connection's CLIENT SETINFO, which times out).
    probes = 1 + stop / retry
    assert hang.connections <= probes, f"{hang.connections} connections, {probes} probes at most"
    most = THREADS + probes
    assert hang.sent <= most, f"{hang.sent} commands sent while the server hung, over {most}"
    assert hang.stats["breaker_openings"] == 1, f"not one outage: {hang.stats}"
    assert warnings_and_infos(hang.logs) == (1, 1), "one warning and one info per outage"
    # Every call made while the server hung was answered without it, none waiting
    # for it; once it resumed a probe found it (the hang guard: wait_for's 30 s).
    assert_answered_without_the_store(hang.calls, hang.paused, hang.resumed, THREADS, hang.stats)


def test_an_async_limiter_under_a_hung_server(redis_server_factory: ServerFactory) -> None:
    """The same breaker for AsyncRedisTokenBucketLimiter: 16 tasks, 0.75 s of SIGSTOP."""
    tasks_count, stop_for, retry = 16, 0.75, 0.25
    server = redis_server_factory.start()
    with TcpProxy(server.port) as proxy:

        async def main() -> dict[str, Any]:
            limiter = AsyncRedisTokenBucketLimiter.from_url(
                url_of(proxy.port),
                10**6,
                10**5,
                timeout=TIMEOUT,
                retry_interval=retry,
                prefix="bucketlimit:",
            )
            calls = Calls()
            stop = asyncio.Event()

            async def worker(key: str) -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    calls.record(started, await limiter.allow(key), key)
                    await asyncio.sleep(0.002)

            async def until(condition: Callable[[], object], what: str) -> None:
                deadline = time.monotonic() + 30
                while not condition():
                    assert time.monotonic() < deadline, f"gave up waiting for {what}"
                    await asyncio.sleep(0.01)

            tasks = [asyncio.create_task(worker(f"user-{i}")) for i in range(tasks_count)]
            try:
                await until(lambda: calls.store_backed_streak() >= 400, "a healthy store")
                before = limiter.stats()
                sent, paused = proxy.commands(), time.monotonic()
                server.pause()
                await asyncio.sleep(stop_for)  # the scenario: the server hangs
                result: dict[str, Any] = {
                    "sent": proxy.commands() - sent,
                    "connections": proxy.connections_since(paused),
                    "paused": paused,
                    "resumed": time.monotonic(),
                    "calls": calls,
                }
                server.resume()
                await until(
                    lambda: calls.first_store_backed_after(result["resumed"]), "the store again"
                )
                result["stats"] = stats_since(limiter, before)
                return result
            finally:
                stop.set()
                await asyncio.gather(*tasks)  # every call returned
                await limiter.client.aclose()

        result = asyncio.run(main())
    probes = 1 + stop_for / retry
    connections, sent, stats = result["connections"], result["sent"], result["stats"]
    assert connections <= probes, f"{connections} connections, {probes} probes at most"
    most = tasks_count + probes
    assert sent <= most, f"{sent} commands sent while the server hung, over {most}"
    assert stats["breaker_openings"] == 1, f"not one outage: {stats}"
    assert_answered_without_the_store(
        result["calls"], result["paused"], result["resumed"], tasks_count, stats
    )


@pytest.mark.timeout(60)  # above the two hang guards below, so that either can say what hung
def test_a_cancelled_async_probe_lets_another_call_probe(
    redis_server_factory: ServerFactory,
) -> None:
    server = redis_server_factory.start()
    with TcpProxy(server.port) as proxy:

        async def main() -> None:
            limiter = AsyncRedisTokenBucketLimiter.from_url(
                url_of(proxy.port),
                10,
                10,
                timeout=0.3,
                retry_interval=0.05,
                on_store_error="closed",
                prefix="bucketlimit:",
            )
            try:
                assert not (await limiter.allow("k")).degraded
                proxy.drop_replies = True  # the store runs commands but never answers
                assert (await limiter.allow("k")).degraded  # timed out: the breaker opens
                sent = proxy.commands()

                async def call_until_cancelled() -> None:
                    while True:
                        await limiter.allow("k")
                        await asyncio.sleep(0.001)

                caller = asyncio.create_task(call_until_cancelled())
                deadline = time.monotonic() + 20
                while proxy.commands() == sent:  # until the probe is out, waiting for a reply
                    assert time.monotonic() < deadline, "no probe reached the store"
                    await asyncio.sleep(0.005)
                caller.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await caller
                proxy.drop_replies = False
                # Had the cancelled probe kept its place, the store would never be asked again.
                deadline = time.monotonic() + 20
                while (await limiter.allow("k")).degraded:
                    assert time.monotonic() < deadline, "no call probed the store again"
                    await asyncio.sleep(0.01)
            finally:
                await limiter.client.aclose()

        asyncio.run(main())


# -- a killed server: 4 processes, capacity 400, rate 0 -------------------------------------

KILLED_CALLS = 150


def _spend_after_kill(url: str, ready: Any, go: Any) -> dict[str, list[str]]:
    limiters = {
        policy: RedisTokenBucketLimiter.from_url(
            url, 400, 0, on_store_error=policy, processes=4, prefix=f"{policy}:"
        )
        for policy in POLICIES
    }
    for limiter in limiters.values():
        assert not limiter.peek("k").degraded  # connected, through the store
    ready.wait(60)
    go.wait(60)  # the test kills the server in between
    outcomes: dict[str, list[str]] = {}
    for policy, limiter in limiters.items():
        seen = []
        for _ in range(KILLED_CALLS):
            try:
                decision = limiter.allow("k")
            except redis.ConnectionError as e:
                seen.append(type(e).__name__)
            else:
                seen.append(
                    ("allowed" if decision.allowed else "refused")
                    + (" degraded" if decision.degraded else "")
                )
        outcomes[policy] = seen
    return outcomes


def _entry(results: Any, url: str, ready: Any, go: Any) -> None:
    try:
        results.put(("ok", _spend_after_kill(url, ready, go)))
    except BaseException as e:  # reported to the test, which fails with it
        results.put(("error", repr(e)))


def test_a_killed_server_under_each_policy_from_four_processes(
    redis_server_factory: ServerFactory,
) -> None:
    server = redis_server_factory.start()
    ready, go = CONTEXT.Barrier(5), CONTEXT.Barrier(5)
    results = CONTEXT.Queue()
    processes = [
        CONTEXT.Process(target=_entry, args=(results, server.url, ready, go)) for _ in range(4)
    ]
    for process in processes:
        process.start()
    try:
        ready.wait(120)
        server.kill()
        go.wait(120)
        answers = [results.get(timeout=300) for _ in processes]
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():  # pragma: no cover - a hung child fails the test below
                process.kill()
    assert [status for status, _ in answers] == ["ok"] * 4, answers
    for _, outcome in answers:
        # "closed" admits nothing; "local" at most its share, 400 // 4; "open" everything.
        assert outcome["closed"] == ["refused degraded"] * KILLED_CALLS
        assert outcome["local"] == ["allowed degraded"] * 100 + ["refused degraded"] * (
            KILLED_CALLS - 100
        )
        assert outcome["open"] == ["allowed degraded"] * KILLED_CALLS
        # "raise": the client's error, then the breaker's (also a redis ConnectionError).
        assert outcome["raise"] == ["ConnectionError"] + ["StoreUnavailableError"] * (
            KILLED_CALLS - 1
        )


# -- a reply lost after the script ran --------------------------------------------------------


@pytest.mark.parametrize("policy", ["local", "raise"])
def test_a_lost_reply_charges_exactly_once(
    redis_server_factory: ServerFactory, policy: Policy
) -> None:
    server = redis_server_factory.start()
    admin = server.client()
    with TcpProxy(server.port) as proxy:
        limiter = RedisTokenBucketLimiter.from_url(
            url_of(proxy.port),
            10,
            0,
            timeout=0.5,
            on_store_error=policy,
            retry_interval=0.1,
            prefix="bucketlimit:",
        )
        with closing(limiter):
            assert limiter.allow("k")  # connected and the script loaded: 9 left
            ran = script_calls(admin)
            proxy.drop_next_reply()
            if policy == "raise":
                with pytest.raises(redis.TimeoutError):
                    limiter.allow("k")
            else:
                lost = limiter.allow("k")
                assert lost.degraded  # answered from this process's share
            assert script_calls(admin) - ran == 1, "sent once, never again"
            assert balance(admin, "k") == 8 * MICROS, "the store charged it once"

            def store_backed() -> bool:
                try:
                    return not limiter.allow("k").degraded
                except StoreUnavailableError:
                    return False

            wait_for(store_backed, "the breaker to let a call through")
            assert balance(admin, "k") == 7 * MICROS
            assert script_calls(admin) - ran == 2, "not one script more, once the breaker let it"
    admin.close()


# -- a restart without persistence --------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"on_store_error": "raise", "refusal_cache": False}, {}],
    ids=["raise-no-cache", "defaults"],
)
def test_a_restart_without_persistence_costs_one_fresh_burst(
    redis_server_factory: ServerFactory, options: dict[str, Any]
) -> None:
    """The server comes back empty on the same port: no buckets, no scripts. The
    next calls reconnect and reload the script (NOSCRIPT) with no error surfacing,
    and the empty store admits one fresh burst, no more."""
    server = redis_server_factory.start()
    with closing(
        RedisTokenBucketLimiter.from_url(server.url, 5, 0, **options, prefix="bucketlimit:")
    ) as limiter:
        assert [limiter.allow("k").allowed for _ in range(8)] == [True] * 5 + [False] * 3
        server.restart()
        asked = limiter.stats()["store_calls"]
        after = [limiter.allow("k") for _ in range(20)]

        # With the defaults the refusal cached before the restart answers for up to a
        # second: call on until the store has been asked again, then 20 calls more.
        def call_once() -> bool:
            after.append(limiter.allow("k"))
            return limiter.stats()["store_calls"] > asked

        wait_for(call_once, "a call to reach the restarted store")
        after += [limiter.allow("k") for _ in range(20)]
        stats = limiter.stats()
    assert not any(d.degraded for d in after)
    assert stats["store_errors"] == stats["fallback_decisions"] == stats["breaker_openings"] == 0, (
        f"the restart was taken for an outage: {stats}"
    )
    assert stats["script_loads"] == 2, "loaded at first use and again after the restart"
    assert sum(d.allowed for d in after) == 5, "one fresh burst, no more"
    assert [d.allowed for d in after[-15:]] == [False] * 15


# -- a slow store: no retry amplification ----------------------------------------------------

SLOW_THREADS = 4
SLOW_FOR = 1.5  # seconds: 6 retry intervals
SLOW_RETRY = 0.25


@pytest.mark.timeout(60)
def test_a_slow_store_is_not_amplified_by_retries(redis_server_factory: ServerFactory) -> None:
    """The proxy delays every command by 0.5 s; the client waits 0.25 s. Every call
    would time out; with the breaker the store sees the calls already on their way
    (one per thread) plus one probe per retry_interval. Without it (retry_interval=0)
    every call sends its own command and waits out its own timeout."""
    bound = SLOW_THREADS + 1 + SLOW_FOR / SLOW_RETRY
    server = redis_server_factory.start()
    with TcpProxy(server.port) as proxy:
        protected = through(proxy, SLOW_RETRY)
        unprotected = through(proxy, 0, prefix="u:")
        with closing(protected), closing(unprotected):
            assert not protected.allow("warm").degraded
            assert not unprotected.allow("warm").degraded
            proxy.latency = 2 * TIMEOUT
            before = protected.stats()
            since = time.monotonic()
            with Workers(protected, SLOW_THREADS) as workers:
                time.sleep(SLOW_FOR)  # the scenario: the store is slow
            until = time.monotonic()
            sent = proxy.commands(since=since)
            assert sent <= bound, f"{sent} commands to a slow store in {SLOW_FOR} s, over {bound}"
            connections = proxy.connections_since(since)
            assert connections <= bound, f"{connections} connections in {SLOW_FOR} s, over {bound}"
            assert_answered_without_the_store(
                workers, since, until, SLOW_THREADS, stats_since(protected, before)
            )
            # The same threads without the breaker: every call asks the slow store (a
            # command on its connection, or a new connection's handshake), and waits.
            since = time.monotonic()
            with Workers(unprotected, SLOW_THREADS) as unguarded:
                wait_for(lambda: len(unguarded.calls) >= 2 * bound, "calls without the breaker")
            made = len(unguarded.calls)
            # Counted as the proxy reads them: wait for it to read the last ones.
            wait_for(lambda: proxy.commands(since=since) >= made, f"a command for each of {made}")


# -- a corrupt or foreign value in a bucket's key --------------------------------------------------

CORRUPTIONS: dict[str, Callable[[redis.Redis, str], object]] = {
    "string": lambda client, key: client.set(key, "garbage"),
    "nan": lambda client, key: client.set(key, "nan"),
    "list": lambda client, key: client.rpush(key, "3000000 0"),
    "hash": lambda client, key: client.hset(key, "b", "3000000"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("policy", ["local", "open", "closed"])
def test_a_corrupt_bucket_is_never_admitted(
    redis_client: redis.Redis, corruption: str, policy: Policy
) -> None:
    """A store fault under every policy (even "open"), refused, counted; the store
    answered, so the breaker stays closed for the other keys."""
    limiter = RedisTokenBucketLimiter(
        redis_client, 3, 1, on_store_error=policy, prefix="bucketlimit:"
    )
    other = RedisTokenBucketLimiter(redis_client, 3, 1, on_store_error=policy, prefix="o:")
    CORRUPTIONS[corruption](redis_client, "bucketlimit:{k}:k")
    for _ in range(5):
        assert limiter.allow("k") == Decision(False, 1.0, 0, 1.0, 3, True)
        assert not limiter.peek("k").allowed
        assert not bucketlimit.allow_all([(limiter, "k"), (other, "fine")]).allowed
    limiter.refund("k", 1)  # nothing to give back to: no error either
    assert limiter.allow("fine") == Decision(True, 0.0, 2, 1.0, 3), "the store works"
    stats = limiter.stats()
    assert stats["store_errors"] == 16, f"not every corrupt read counted a store error: {stats}"
    assert stats["fallback_decisions"] == 15, f"not 15 policy answers: {stats}"
    assert stats["breaker_openings"] == 0, f"the breaker opened on a corrupt bucket: {stats}"
    assert redis_client.exists("o:{fine}:fine") == 0, "allow_all spent nothing"
    assert redis_client.type("bucketlimit:{k}:k") in (b"string", b"list", b"hash")


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_bucket_raises_under_raise(redis_client: redis.Redis, corruption: str) -> None:
    limiter = RedisTokenBucketLimiter(
        redis_client, 3, 1, on_store_error="raise", prefix="bucketlimit:"
    )
    CORRUPTIONS[corruption](redis_client, "bucketlimit:{k}:k")
    for _ in range(3):
        with pytest.raises(CorruptBucketError):
            limiter.allow("k")
    assert limiter.allow("fine")
    assert limiter.stats()["store_errors"] == 3, "not one store error per corrupt read"


# -- store faults sent by a live server -----------------------------------------------------------


@contextmanager
def stuck_in_a_script(server: RedisServer) -> Iterator[None]:
    """The server runs an endless script: after 50 ms it answers BUSY to everyone else."""
    with server.client() as admin:
        admin.config_set("busy-reply-threshold", 50)
    killed = threading.Event()

    def run_forever() -> None:
        with server.client() as client:
            try:
                client.eval("while true do end", 0)
            except redis.ResponseError:
                killed.set()  # by SCRIPT KILL below

    runner = threading.Thread(target=run_forever)
    runner.start()
    try:
        wait_for(lambda: _answers_busy(server), "the endless script")
        yield
    finally:
        wait_for(lambda: _kill_script(server), "SCRIPT KILL")
        runner.join(30)
    assert killed.is_set()


def _answers_busy(server: RedisServer) -> bool:
    with server.client() as client:
        try:
            client.ping()
        except redis.ResponseError as e:
            return str(e).startswith("BUSY")
    return False


def _kill_script(server: RedisServer) -> bool:
    with server.client() as client:
        try:
            client.script_kill()
        except redis.ResponseError:
            return False  # not running yet
    return True


@contextmanager
def failing(fault: str, factory: ServerFactory) -> Iterator[RedisServer]:
    """A live server that answers every call to the script with ``fault``."""
    if fault == "CLUSTERDOWN":
        yield factory.start(cluster=True)  # a cluster node that serves no slot
    elif fault == "READONLY":
        primary, copy = factory.start(), factory.start()
        with copy.client() as client:
            client.replicaof("127.0.0.1", primary.port)  # as after a failover
        yield copy
    elif fault == "OOM":
        server = factory.start()
        with server.client() as client:
            client.config_set("maxmemory", 1)
        yield server
    else:
        server = factory.start()
        with stuck_in_a_script(server):
            yield server


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("BUSY", redis.ResponseError),
        ("READONLY", redis.exceptions.ReadOnlyError),
        ("OOM", redis.exceptions.OutOfMemoryError),
        ("CLUSTERDOWN", redis.exceptions.ClusterDownError),
    ],
)
def test_a_live_server_that_cannot_serve_is_a_store_fault(
    redis_server_factory: ServerFactory, fault: str, error: type[Exception]
) -> None:
    with failing(fault, redis_server_factory) as server:
        closed = RedisTokenBucketLimiter.from_url(
            server.url, 3, 1, on_store_error="closed", prefix="bucketlimit:"
        )
        raising = RedisTokenBucketLimiter.from_url(
            server.url, 3, 1, on_store_error="raise", prefix="bucketlimit:"
        )
        with closing(closed), closing(raising):
            assert closed.allow("k") == Decision(False, 1.0, 0, 1.0, 3, True)
            assert closed.stats()["store_errors"] == 1, "not one store error"
            assert closed.stats()["breaker_openings"] == 1, "not one outage"
            with pytest.raises(error) as raised:
                raising.allow("k")
            assert type(raised.value) is error, "the client's own error"
            if fault == "BUSY":
                assert str(raised.value).startswith("BUSY")


# -- configuration errors: raised whatever the policy, never an allow -----------------------------


def assert_configuration_error(
    limiter: RedisTokenBucketLimiter, cause: type[Exception], *, checked: bool = True
) -> None:
    """``checked``: ``check()`` sees it too (it runs the script as a peek, which
    writes nothing, so a user denied only writes passes it)."""
    for _ in range(2):  # every time, not once
        with pytest.raises(ConfigurationError) as raised:
            limiter.allow("k")
        assert isinstance(raised.value.__cause__, cause)
        assert "on_store_error does not apply" in str(raised.value)
    if checked:
        with pytest.raises(ConfigurationError):
            limiter.check()
    stats = limiter.stats()
    assert (stats["allowed"], stats["store_errors"], stats["breaker_openings"]) == (0, 0, 0)


def test_credentials_and_acls_are_configuration_errors(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory.start()
    with server.client() as client:
        client.config_set("requirepass", "secret")
    admin = redis.Redis(port=server.port, password="secret", retry=Retry(NoBackoff(), 0))
    admin.acl_setuser(
        "no-scripts",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        commands=["+@all", "-evalsha", "-eval"],
    )
    admin.acl_setuser(
        "other-keys", enabled=True, passwords=["+pw"], keys=["other:*"], commands=["+@all"]
    )
    # EVALSHA allowed, but not a command the script runs: denied inside the script.
    admin.acl_setuser(
        "no-set", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-set"]
    )
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({}, redis.AuthenticationError),  # NOAUTH
        ({"password": "wrong"}, redis.AuthenticationError),  # WRONGPASS
        ({"username": "no-scripts", "password": "pw"}, redis.exceptions.NoPermissionError),
        ({"username": "other-keys", "password": "pw"}, redis.exceptions.NoPermissionError),
        ({"username": "no-set", "password": "pw"}, redis.ResponseError),
    ]
    for credentials, cause in cases:
        client = redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0), **credentials)
        with closing(
            RedisTokenBucketLimiter(client, 3, 1, on_store_error="open", prefix="bucketlimit:")
        ) as limiter:
            assert_configuration_error(limiter, cause, checked="no-set" not in str(credentials))
    # The right credentials: check() passes and the limiter works.
    client = redis.Redis(port=server.port, password="secret", retry=Retry(NoBackoff(), 0))
    with closing(RedisTokenBucketLimiter(client, 3, 1, prefix="bucketlimit:")) as limiter:
        limiter.check()
        assert limiter.allow("k") == Decision(True, 0.0, 2, 1.0, 3)
    admin.close()


def test_a_server_without_scripting_is_a_configuration_error(
    redis_server_factory: ServerFactory,
) -> None:
    """EVALSHA and EVAL renamed away answer "unknown command", as a server too old
    for the script would: a configuration error, not an outage."""
    rename = ["--rename-command", "EVALSHA", "", "--rename-command", "EVAL", ""]
    server = redis_server_factory.start(extra_args=rename)
    with closing(
        RedisTokenBucketLimiter.from_url(
            server.url, 3, 1, on_store_error="open", prefix="bucketlimit:"
        )
    ) as limiter:
        assert_configuration_error(limiter, redis.ResponseError)
        with pytest.raises(ConfigurationError, match=r"Redis 5\.0"):
            limiter.allow("k")


def test_a_cluster_behind_a_plain_client_is_a_configuration_error(
    redis_cluster: RedisClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    first = redis_cluster.servers[0]
    client = first.client()
    with closing(
        RedisTokenBucketLimiter(client, 3, 1, on_store_error="open", prefix="bucketlimit:")
    ) as limiter:
        # A key of a slot another node serves: the node answers MOVED.
        key = next(
            f"k{i}" for i in range(1000) if key_slot(f"bucketlimit:{{k{i}}}:k{i}".encode()) > 5460
        )
        with pytest.raises(ConfigurationError, match="RedisCluster") as raised:
            limiter.allow(key)
        assert isinstance(raised.value.__cause__, redis.exceptions.MovedError)
    # With a RedisCluster client, check() asks one node and reads every node's version.
    RedisTokenBucketLimiter(redis_cluster_client, 3, 1, prefix="bucketlimit:").check()


def test_check_passes_on_a_healthy_server(redis_client: redis.Redis, redis_url: str) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1, prefix="bucketlimit:")
    limiter.check()
    # No bucket is written: only the heartbeat that counts this process.
    assert redis_client.keys() == [b"bucketlimit:{bucketlimit-processes}:"]

    async def main(url: str) -> None:
        limiter = AsyncRedisTokenBucketLimiter.from_url(url, 3, 1, prefix="bucketlimit:")
        try:
            await limiter.check()
        finally:
            await limiter.client.aclose()

    asyncio.run(main(redis_url))


# -- the refusal cache -----------------------------------------------------------------------------


def test_ten_thousand_calls_from_a_refused_key_cost_at_most_two_commands(
    redis_client: redis.Redis,
) -> None:
    limiter = RedisTokenBucketLimiter(
        redis_client, 1, 1, per=60, prefix="bucketlimit:", processes=1
    )  # one token a minute; no heartbeat among the script calls counted
    assert limiter.allow("k")  # the script is loaded now
    redis_client.config_resetstat()
    first = limiter.allow("k")
    assert not first.allowed
    assert 59 < first.retry_after <= 60, f"retry_after {first.retry_after}: not under a minute"
    decisions = [limiter.allow("k") for _ in range(9_999)]
    assert script_calls(redis_client) <= 2, "more than 2 scripts for 10,000 refused calls"
    assert not any(d.allowed or d.degraded for d in decisions)
    assert all(0 < d.retry_after <= first.retry_after for d in decisions)
    assert all(d.remaining == 0 and d.limit == 1 for d in decisions)
    hits = limiter.stats()["refusal_cache_hits"]
    assert hits >= 9_998, f"{hits} of 9,999 refusals answered from the cache"


def test_a_cached_refusal_ends_when_its_wait_has_passed(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(
        redis_client, 1, 5, prefix="bucketlimit:"
    )  # a token every 0.2 s
    assert limiter.allow("k")
    refused = limiter.allow("k")
    assert not refused.allowed
    calls_before = limiter.stats()["store_calls"]
    # Bounded polling: the key must be admitted again once the wait has passed.
    deadline = time.monotonic() + 30
    while not limiter.allow("k").allowed:
        assert time.monotonic() < deadline, "the key was never admitted again"
    stats = limiter.stats()
    assert stats["refusal_cache_hits"] > 0, "no refusal answered from the cache"
    # The cache waits from before the refusal was sent, so the store may refuse a
    # last time by a few microseconds; a handful of commands, not one per call.
    asked = stats["store_calls"] - calls_before
    assert asked <= 5, f"{asked} store calls while the refusal was cached"


def test_a_cached_refusal_covers_the_same_or_a_larger_cost(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1, per=60, prefix="bucketlimit:")
    assert limiter.allow("k", 2)  # one token left
    assert not limiter.allow("k", 2).allowed  # refused by the store
    calls = limiter.stats()["store_calls"]
    assert not limiter.allow("k", 3).allowed
    assert not limiter.peek("k", 2).allowed
    assert limiter.stats()["store_calls"] == calls, "answered here"
    assert limiter.allow("k", 1).allowed, "a smaller cost asks the store"
    assert limiter.stats()["store_calls"] == calls + 1, "not one store call for the smaller cost"


def test_this_process_giving_tokens_back_drops_the_cached_refusal(
    redis_client: redis.Redis,
) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 2, 1, per=60, prefix="bucketlimit:")
    assert limiter.allow("k", 2)
    assert not limiter.allow("k").allowed
    limiter.refund("k", 1)
    assert limiter.allow("k")
    assert not limiter.allow("k").allowed
    limiter.reset("k")
    assert limiter.allow("k", 2)


def test_a_reset_by_another_process_is_seen_within_a_second(redis_client: redis.Redis) -> None:
    """The cache's one staleness: tokens given back elsewhere are seen once the
    cached refusal expires, after its wait or one second, whichever is first."""
    limiter = RedisTokenBucketLimiter(
        redis_client, 1, 0, prefix="bucketlimit:"
    )  # a quota: refused for ever
    elsewhere = RedisTokenBucketLimiter(redis_client, 1, 0, prefix="bucketlimit:")
    assert limiter.allow("k")
    assert not limiter.allow("k").allowed
    elsewhere.reset("k")
    wait_for(lambda: limiter.allow("k").allowed, "the reset to be seen")


def test_the_refusal_cache_can_be_turned_off(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(
        redis_client, 1, 1, per=60, refusal_cache=False, prefix="bucketlimit:", processes=1
    )
    assert limiter.allow("k")
    for _ in range(50):
        assert not limiter.allow("k").allowed
    stats = limiter.stats()
    assert stats["store_calls"] - stats["script_loads"] == 51, f"not a call each: {stats}"
    assert stats["refusal_cache_hits"] == 0, f"a refusal from the cache turned off: {stats}"


# -- degraded means "without the store", nothing else ---------------------------------------------


def test_degraded_is_never_set_when_the_store_answered(redis_client: redis.Redis) -> None:
    users = RedisTokenBucketLimiter(redis_client, 3, 1, per=60, prefix="u:")
    everyone = RedisTokenBucketLimiter(redis_client, 5, 0, prefix="all:", refusal_cache=False)
    decisions = []
    for i in range(60):
        key = f"user-{i % 4}"
        decisions.append(users.allow(key, 1 + i % 3))
        decisions.append(users.peek(key))
        decisions.append(bucketlimit.allow_all([(users, key), (everyone, "all")]))
        if i % 5 == 0:
            users.refund(key, 1)
    assert {d.allowed for d in decisions} == {True, False}
    assert not any(d.degraded for d in decisions)
    for limiter in (users, everyone):
        stats = limiter.stats()
        assert (stats["store_errors"], stats["fallback_decisions"]) == (0, 0)
