"""The failure side of the Redis limiters without a misbehaving server (docs/design.md §6).

The breaker and the refusal cache on their own, with time as a parameter; how
every error redis-py raises is sorted (store fault, corrupt bucket, configuration
error, other), from the error replies a real server sends; and the policies seen
through the public API against a store that is not there at all (a loopback port
nothing listens on: every call is refused at connect, at once). The scenarios with
real, misbehaving servers are in test_redis_faults.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis._parsers.base import BaseParser  # how redis-py turns an error reply into a class
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

import bucketlimit
from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._redis.errors import (
    CONFIG,
    CORRUPT,
    EXHAUSTED,
    FAULT,
    OTHER,
    REDIRECTED,
    check_version,
    classify,
)
from bucketlimit._redis.errors import store_error as as_store_error
from bucketlimit._redis.resilience import (
    REFUSAL_CACHE_MAX_AGE,
    Breaker,
    Gate,
    RefusalCache,
)
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    ConfigurationError,
    CorruptBucketError,
    Policy,
    RedisTokenBucketLimiter,
    StoreUnavailableError,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import free_port


class Index:
    """An integer-like object, as a numpy integer is: only ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


class Monotonic:
    """A stand-in for time.monotonic() that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def dead() -> Iterator[redis.Redis]:
    """A client for a loopback port nothing listens on: every command fails at connect."""
    client = redis.Redis(
        host="127.0.0.1", port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    yield client
    client.close()


def bucketlimit_logs(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "bucketlimit" and r.levelno == level
    ]


# -- the breaker ----------------------------------------------------------------------


def test_breaker_skips_then_lets_one_call_probe(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bucketlimit")
    clock = Monotonic()
    breaker = Breaker(2.0, "limiter", "calls are refused", monotonic=clock)
    assert breaker.admit() is Gate.STORE
    breaker.failed(Gate.STORE, TimeoutError("slow"))
    # A call that was already on its way fails too: still one outage.
    breaker.failed(Gate.STORE, TimeoutError("slow"))
    assert breaker.openings == 1
    assert breaker.admit() is Gate.SKIP
    clock.now += 1.999_999
    assert breaker.admit() is Gate.SKIP
    clock.now += 0.000_001
    assert breaker.admit() is Gate.PROBE
    assert breaker.admit() is Gate.SKIP, "one probe at a time"
    breaker.failed(Gate.PROBE, ConnectionError("refused"))
    assert breaker.admit() is Gate.SKIP, "a failed probe waits another interval"
    clock.now += 2
    assert breaker.admit() is Gate.PROBE
    breaker.release(Gate.PROBE)  # cancelled: it told nothing
    assert breaker.admit() is Gate.PROBE, "another call may probe"
    assert "ConnectionError: refused" in breaker.describe()
    breaker.succeeded(Gate.PROBE)
    assert breaker.admit() is Gate.STORE
    assert breaker.openings == 1
    [warning] = bucketlimit_logs(caplog, logging.WARNING)
    assert "limiter: the store failed (TimeoutError: slow); calls are refused" in warning
    [info] = bucketlimit_logs(caplog, logging.INFO)
    assert "answers again after 4.0 s; 4 calls were answered without it" in info
    # The next outage is counted and logged once more.
    breaker.failed(Gate.STORE, TimeoutError("again"))
    assert breaker.openings == 2
    assert len(bucketlimit_logs(caplog, logging.WARNING)) == 2


def test_breaker_with_retry_interval_zero_never_skips(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bucketlimit")
    breaker = Breaker(0, "limiter", "calls are refused", monotonic=Monotonic())
    for _ in range(3):
        assert breaker.admit() is Gate.STORE
        breaker.failed(Gate.STORE, TimeoutError("slow"))
    breaker.succeeded(Gate.STORE)
    assert breaker.openings == 1
    assert len(bucketlimit_logs(caplog, logging.WARNING)) == 1
    assert len(bucketlimit_logs(caplog, logging.INFO)) == 1


def test_breaker_lets_exactly_one_of_many_threads_probe() -> None:
    clock = Monotonic()
    breaker = Breaker(1.0, "limiter", "calls are refused", monotonic=clock)
    breaker.failed(Gate.STORE, TimeoutError("slow"))
    clock.now += 1
    gates: list[Gate] = []
    start = threading.Barrier(32)

    def call() -> None:
        start.wait()
        gates.append(breaker.admit())

    threads = [threading.Thread(target=call) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert gates.count(Gate.PROBE) == 1
    assert gates.count(Gate.SKIP) == 31


# -- the refusal cache ------------------------------------------------------------------

REFUSED = Decision(False, 0.5, 1, 2.5, 3)


def test_refusal_cache_refuses_the_same_or_a_larger_cost_until_the_wait_has_passed() -> None:
    cache = RefusalCache()
    cache.put(b"k", 2, REFUSED, started=10.0)
    assert cache.get(b"k", 2, 10.0) == Decision(False, 0.5, 1, 2.5, 3)
    # The wait still left; reset_after shrinks alike; never degraded.
    assert cache.get(b"k", 3, 10.2) == Decision(False, 0.3, 1, 2.3, 3)
    assert cache.get(b"k", 2, 10.499_999) == Decision(False, 0.000_001, 1, 2.000_001, 3)
    assert cache.get(b"k", 1, 10.2) is None, "a smaller cost may pass: ask the store"
    assert cache.get(b"other", 2, 10.2) is None
    assert cache.get(b"k", 2, 10.5) is None, "the wait has passed"
    assert len(cache) == 0, "an expired entry is dropped"


def test_refusal_cache_trusts_a_refusal_one_second_at_most() -> None:
    cache = RefusalCache()
    never = Decision(False, math.inf, 0, math.inf, 3)  # rate 0: a spent quota
    cache.put(b"quota", 1, never, started=0.0)
    cache.put(b"slow", 1, Decision(False, 60.0, 0, 90.0, 3), started=0.0)
    assert REFUSAL_CACHE_MAX_AGE == 1.0
    assert cache.get(b"quota", 1, 0.999) == never
    assert cache.get(b"slow", 1, 0.5) == Decision(False, 59.5, 0, 89.5, 3)
    # After that the store is asked again: a reset by another process is seen.
    assert cache.get(b"quota", 1, 1.0) is None
    assert cache.get(b"slow", 1, 1.0) is None


def test_refusal_cache_is_bounded_and_forgets_on_drop() -> None:
    cache = RefusalCache(size=3)
    for i in range(5):
        cache.put(b"k%d" % i, 1, REFUSED, started=0.0)
    assert len(cache) == 3
    assert cache.get(b"k0", 1, 0.1) is None, "the oldest went first"
    assert cache.get(b"k4", 1, 0.1) is not None
    cache.put(b"k2", 1, REFUSED, started=0.1)  # refreshed: now the newest
    cache.put(b"k5", 1, REFUSED, started=0.1)
    assert cache.get(b"k2", 1, 0.2) is not None
    assert cache.get(b"k3", 1, 0.2) is None
    cache.drop(b"k2")
    assert cache.get(b"k2", 1, 0.2) is None
    # 4 KB keys cost no more than short ones: they are remembered by a digest.
    cache.put(b"x" * 4096, 1, REFUSED, started=0.2)
    assert cache.get(b"x" * 4096, 1, 0.3) is not None
    assert cache.get(b"x" * 4095, 1, 0.3) is None


# -- sorting errors ------------------------------------------------------------------------

REPLIES = [
    # The server is down, busy or cannot serve now: the failure policy answers.
    ("LOADING Redis is loading the dataset in memory", FAULT),
    (
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        FAULT,
    ),
    ("READONLY You can't write against a read only replica.", FAULT),
    ("OOM command not allowed when used memory > 'maxmemory'.", FAULT),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", FAULT),
    ("TRYAGAIN Multiple keys request during rehashing of slot", FAULT),
    ("CLUSTERDOWN The cluster is down", FAULT),
    (
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        FAULT,
    ),
    ("NOREPLICAS Not enough good replicas to write.", FAULT),
    ("ERR max number of clients reached", FAULT),
    # No retry fixes these: ConfigurationError, whatever the policy.
    ("NOAUTH Authentication required.", CONFIG),
    ("WRONGPASS invalid username-password pair or user is disabled.", CONFIG),
    ("ERR invalid password", CONFIG),
    ("NOPERM User app has no permissions to run the 'evalsha' command", CONFIG),
    ("MOVED 3999 127.0.0.1:6381", CONFIG),
    ("ASK 3999 127.0.0.1:6381", CONFIG),
    ("CROSSSLOT Keys in request don't hash to the same slot", CONFIG),
    ("ERR unknown command 'EVALSHA', with args beginning with: ", CONFIG),
    (
        "ERR Error running script (call to f_0): @user_script:1: Write commands not allowed "
        "after non deterministic commands. Call redis.replicate_commands() at the start",
        CONFIG,
    ),
    # Not the store's: raised as they are.
    ("ERR Error running script (call to f_0): @user_script:9: attempt to index a nil value", OTHER),
    ("WRONGTYPE Operation against a key holding the wrong kind of value", OTHER),
]


@pytest.mark.parametrize(("reply", "kind"), REPLIES)
def test_error_replies_are_sorted(reply: str, kind: str) -> None:
    error = BaseParser.parse_error(reply)  # type: ignore[no-untyped-call]
    assert classify(error) == kind, type(error)


def test_wrongtype_and_the_scripts_corrupt_reply_are_corrupt_buckets() -> None:
    keys = [b"bucketlimit:{k}:k"]
    for reply in (
        "WRONGTYPE Operation against a key holding the wrong kind of value",
        "BUCKETLIMIT corrupt bucket value in key 1 of 1",
    ):
        parsed = BaseParser.parse_error(reply)  # type: ignore[no-untyped-call]
        error = as_store_error(parsed, keys)
        assert isinstance(error, CorruptBucketError)
        assert "bucketlimit:{k}:k" in str(error)
        assert classify(error) == CORRUPT


def raised_in(module: str, error: BaseException) -> BaseException:
    """``error`` as raised by code of ``module`` (its traceback's innermost frame)."""
    namespace: dict[str, Any] = {"__name__": module, "error": error}
    exec("def fail():\n    raise error\n", namespace)
    try:
        namespace["fail"]()
    except BaseException as e:
        return e
    raise AssertionError("unreachable")


def chained(error: BaseException, cause: BaseException) -> BaseException:
    """``error`` as redis-py raises it: ``raise error from cause``."""
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (redis.ConnectionError("Error 111 connecting"), FAULT),
        (redis.TimeoutError("Timeout reading from socket"), FAULT),
        (ConnectionResetError(104, "reset"), FAULT),
        (TimeoutError(), FAULT),
        (asyncio.TimeoutError(), FAULT),
        (redis.exceptions.SlotNotCoveredError("no node"), FAULT),
        (redis.AuthenticationError("invalid"), CONFIG),
        (redis.exceptions.InvalidResponse("Protocol Error: H, b'TTP/1.1'"), CONFIG),
        (redis.exceptions.RedisClusterException("all keys must map to the same key slot"), CONFIG),
        (
            redis.exceptions.RedisClusterException("Cluster mode is not enabled on this node"),
            CONFIG,
        ),
        # No cluster node answers, or the nodes reached do not cover the slots.
        (chained(redis.exceptions.RedisClusterException("no node"), redis.TimeoutError()), FAULT),
        (redis.exceptions.RedisClusterException("Redis Cluster cannot be connected. ..."), FAULT),
        (redis.exceptions.RedisClusterException("All slots are not covered after ..."), FAULT),
        # This process's connection pool is full; the store is fine.
        (redis.exceptions.MaxConnectionsError("Too many connections"), EXHAUSTED),
        (redis.ConnectionError("No connection available."), EXHAUSTED),
        # redis-py's asyncio cluster client during a slot migration.
        (redis.exceptions.ClusterError("TTL exhausted."), REDIRECTED),
        (redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"), FAULT),
        (raised_in("redis.asyncio.connection", AttributeError("'NoneType' ...")), FAULT),
        (raised_in("myapp", AttributeError("'NoneType' ...")), OTHER),
        (ValueError("a bug"), OTHER),
        (asyncio.CancelledError(), OTHER),
        (KeyboardInterrupt(), OTHER),
    ],
)
def test_client_errors_are_sorted(error: BaseException, kind: str) -> None:
    assert classify(error) == kind


def test_server_version_check() -> None:
    check_version({"redis_version": "7.0.15"})
    check_version({"redis_version": "5.0.0"})
    check_version({"node-a": {"redis_version": "7.2.4"}, "node-b": {"redis_version": "6.2.0"}})
    check_version({"redis_version": "unknown"})  # unreadable: the script ran, enough
    check_version(None)  # INFO forbidden
    old = {"redis_version": "4.0.14"}
    for info in (old, {"a": {"redis_version": "7.0.0"}, "b": {"redis_version": "3.2.1"}}):
        with pytest.raises(ConfigurationError, match=r"too old.*5\.0"):
            check_version(info)


# -- configuration ---------------------------------------------------------------------------


def test_failure_settings_are_checked_like_the_core(dead: redis.Redis) -> None:
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"on_store_error": "ignore"}, ValueError, "on_store_error"),
        ({"on_store_error": None}, TypeError, "on_store_error"),
        ({"processes": 0}, ValueError, "processes"),
        ({"processes": 1.5}, TypeError, "processes"),
        ({"processes": True}, TypeError, "processes"),
        ({"processes": "4"}, TypeError, "processes"),
        ({"processes": 10**40}, ValueError, "processes"),
        ({"retry_interval": -1}, ValueError, "retry_interval"),
        ({"retry_interval": math.nan}, ValueError, "retry_interval"),
        ({"retry_interval": math.inf}, ValueError, "retry_interval"),
        ({"retry_interval": "1"}, TypeError, "retry_interval"),
        ({"retry_interval": True}, TypeError, "retry_interval"),
        ({"refusal_cache": 1}, TypeError, "refusal_cache"),
    ]
    for options, error, name in bad:
        with pytest.raises(error, match=name):
            RedisTokenBucketLimiter(dead, 10, 1, **options)
    limiter = RedisTokenBucketLimiter(
        dead,
        10,
        1,
        on_store_error="closed",
        processes=Index(4),
        retry_interval=2,
    )
    assert (limiter.on_store_error, limiter.processes, limiter.retry_interval) == ("closed", 4, 2.0)
    assert limiter.refusal_cache
    assert not RedisTokenBucketLimiter(dead, 10, 1, refusal_cache=False).refusal_cache
    # The cache needs the store's clock: an injected one may jump ahead of real time.
    assert not RedisTokenBucketLimiter(dead, 10, 1, ManualClock()).refusal_cache
    defaults = RedisTokenBucketLimiter(dead, 10, 1)
    assert (defaults.on_store_error, defaults.processes, defaults.retry_interval) == (
        "local",
        1,
        1.0,
    )


def test_a_misspelt_policy_is_refused_by_the_type_checker_and_at_run_time(
    dead: redis.Redis,
) -> None:
    # on_store_error is a Literal. mypy --strict (make lint) reports an
    # unused "type: ignore" if "locl" ever type-checks again.
    with pytest.raises(ValueError, match="on_store_error must be one of"):
        RedisTokenBucketLimiter(dead, 10, 1, on_store_error="locl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_store_error must be one of"):
        AsyncRedisTokenBucketLimiter.from_url(
            "redis://127.0.0.1:1/0",
            10,
            1,
            on_store_error="locl",  # type: ignore[arg-type]
        )


def test_construction_sends_nothing(dead: redis.Redis) -> None:
    """The store is asked at first use (or by check()), never by the constructor."""
    limiter = RedisTokenBucketLimiter(dead, 10, 1, on_store_error="raise")
    assert limiter.stats()["store_calls"] == 0
    with pytest.raises(redis.ConnectionError):
        limiter.check()  # check() reports the client's error, whatever the policy
    url = f"redis://127.0.0.1:{free_port()}/0"
    for cls in (RedisTokenBucketLimiter, AsyncRedisTokenBucketLimiter):
        built: Any = cls.from_url(
            url, 10, 1, on_store_error="open", processes=3, retry_interval=0.5, refusal_cache=False
        )
        assert (built.on_store_error, built.processes, built.retry_interval) == ("open", 3, 0.5)
        assert not built.refusal_cache
        assert built.stats()["store_calls"] == 0
        if cls is RedisTokenBucketLimiter:
            built.client.close()
        else:
            asyncio.run(built.client.aclose())


# -- the policies, against a store that is not there ------------------------------------------


def test_local_holds_this_process_share_refilled_at_exactly_its_share_of_the_rate(
    dead: redis.Redis,
) -> None:
    """capacity 10, 0.1 tokens per 0.5 s, 3 processes: each holds 3 tokens refilled at
    exactly 1/15 token a second, as an in-process TokenBucketLimiter(3, 1, per=15)."""
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(dead, 10, 0.1, clock, per=0.5, processes=3)
    share = TokenBucketLimiter(3, 1, clock, per=15)
    steps = [0, 0, 0, 0, 7.5, 7.499_999, 0.000_001, 0, 15, 14.999_999, 45, 0, 0, 0, 0]
    for i, step in enumerate(steps):
        clock.advance(step)
        for key in ("a", "b"):
            expected = share.allow(key)
            got = limiter.allow(key)
            assert got.degraded, i
            assert (got.allowed, got.retry_after, got.remaining, got.reset_after, got.limit) == (
                expected.allowed,
                expected.retry_after,
                expected.remaining,
                expected.reset_after,
                expected.limit,
            ), (i, key)
    peeked = limiter.peek("a")
    assert peeked.degraded
    assert peeked == Decision(*_fields(share.peek("a")), True)
    stats = limiter.stats()
    assert stats["store_calls"] == 1, "one failure, then the breaker skips the store"
    assert stats["store_errors"] == 1
    assert stats["breaker_openings"] == 1
    assert stats["fallback_decisions"] == 2 * len(steps) + 1
    assert stats["allowed"] + stats["refused"] == 2 * len(steps)


def _fields(d: Decision) -> tuple[bool, float, int, float, int]:
    return (d.allowed, d.retry_after, d.remaining, d.reset_after, d.limit)


def test_local_charges_a_cost_above_the_share_at_the_share(dead: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(dead, 10, 0, clock, processes=4)  # a share of 2
    assert limiter.allow("k", 7) == Decision(True, 0.0, 0, math.inf, 2, True)
    assert limiter.allow("k") == Decision(False, math.inf, 0, math.inf, 2, True)
    with pytest.raises(ValueError, match="capacity"):
        limiter.allow("k", 11)  # still checked against the real capacity
    # 3 processes and capacity 2: never below one request.
    tiny = RedisTokenBucketLimiter(dead, 2, 0, clock, processes=3)
    assert tiny.allow("k", 2) == Decision(True, 0.0, 0, math.inf, 1, True)


def test_local_refund_and_reset_without_the_store(dead: redis.Redis) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(dead, 8, 0, clock, processes=2)  # a share of 4
    assert limiter.allow("k", 3).remaining == 1
    limiter.refund("k", 2)  # lost for the store; this process's share gets it back
    assert limiter.peek("k", 3).allowed
    assert not limiter.peek("k", 4).allowed
    limiter.reset("k")
    assert limiter.peek("k", 4) == Decision(True, 0.0, 0, math.inf, 4, True)
    assert limiter.stats()["store_calls"] == 1


def test_open_and_closed_answer_without_knowing_the_bucket(dead: redis.Redis) -> None:
    opened = RedisTokenBucketLimiter(dead, 10, 1, on_store_error="open")
    closed = RedisTokenBucketLimiter(dead, 10, 1, on_store_error="closed", retry_interval=2.5)
    for _ in range(3):
        assert opened.allow("k", 10) == Decision(True, 0.0, 0, 0.0, 10, True)
        assert opened.peek("k") == Decision(True, 0.0, 0, 0.0, 10, True)
        # retry_after: when the store is asked again.
        assert closed.allow("k") == Decision(False, 2.5, 0, 2.5, 10, True)
        assert closed.peek("k") == Decision(False, 2.5, 0, 2.5, 10, True)
    for limiter in (opened, closed):
        limiter.refund("k", 1)  # lost for the store: nothing to do, nothing raised
        limiter.reset("k")
    assert opened.stats()["allowed"] == 3
    assert closed.stats()["refused"] == 3


def test_raise_lets_the_clients_error_through_then_skips_the_store(dead: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(dead, 10, 1, on_store_error="raise", retry_interval=60)
    with pytest.raises(redis.ConnectionError) as first:
        limiter.allow("k")
    assert type(first.value) is redis.ConnectionError, "the client's own error"
    for call in (
        lambda: limiter.allow("k"),
        lambda: limiter.peek("k"),
        lambda: limiter.refund("k", 1),
        lambda: limiter.reset("k"),
        lambda: bucketlimit.allow_all([(limiter, "k")]),
    ):
        with pytest.raises(StoreUnavailableError, match=r"retry_interval=60") as skipped:
            call()
        assert isinstance(skipped.value, redis.ConnectionError)
    assert limiter.stats()["store_calls"] == 1
    # With the breaker off every call tries the store and raises the client's error.
    eager = RedisTokenBucketLimiter(dead, 10, 1, on_store_error="raise", retry_interval=0)
    for _ in range(3):
        with pytest.raises(redis.ConnectionError) as raised:
            eager.allow("k")
        assert type(raised.value) is redis.ConnectionError
    assert eager.stats()["store_calls"] == 3


def test_allow_all_without_the_store_combines_the_policies(dead: redis.Redis) -> None:
    clock = ManualClock()

    def make(policy: Policy, capacity: int, prefix: str) -> RedisTokenBucketLimiter:
        return RedisTokenBucketLimiter(
            dead, capacity, 0, clock, prefix=prefix, on_store_error=policy, processes=2
        )

    user, world = make("local", 4, "u:"), make("local", 10, "w:")  # shares 2 and 5
    assert bucketlimit.allow_all([(user, "a"), (world, "all")], 2).degraded
    refused = bucketlimit.allow_all([(user, "a"), (world, "all")])
    assert (refused.allowed, refused.degraded, refused.remaining) == (False, True, 0)
    assert world.peek("all", 3).allowed, "a refusal spent nothing from the others"
    assert not world.peek("all", 4).allowed
    # A cost above a share is charged at the smallest share.
    assert bucketlimit.allow_all([(user, "b"), (world, "all")], 4).allowed
    assert world.peek("all", 1).allowed
    assert not world.peek("all", 2).allowed
    opened, closed = make("open", 10, "o:"), make("closed", 10, "c:")
    assert bucketlimit.allow_all([(opened, "x"), (make("open", 3, "o2:"), "x")]) == Decision(
        True, 0.0, 0, 0.0, 10, True
    )
    assert not bucketlimit.allow_all([(user, "c"), (closed, "x")]).allowed
    assert bucketlimit.allow_all([(user, "c"), (opened, "x")]).allowed
    assert user.peek("c").allowed, "the local part decided and was charged"
    assert not user.peek("c", 2).allowed
    with pytest.raises(redis.ConnectionError):
        bucketlimit.allow_all([(user, "c"), (make("raise", 10, "r:"), "x")])


def test_async_policies_without_the_store() -> None:
    async def main() -> None:
        client = redis.asyncio.Redis(
            host="127.0.0.1", port=free_port(), retry=AsyncRetry(NoBackoff(), 0)
        )
        try:
            clock = ManualClock()
            local = AsyncRedisTokenBucketLimiter(client, 4, 0, clock, processes=2)
            closed = AsyncRedisTokenBucketLimiter(client, 4, 0, on_store_error="closed")
            raising = AsyncRedisTokenBucketLimiter(client, 4, 0, on_store_error="raise")
            assert [(await local.allow("k")).allowed for _ in range(3)] == [True, True, False]
            assert (await local.peek("k")).degraded
            await local.refund("k", 1)
            assert (await local.allow("k")).allowed
            await local.reset("k")
            assert (await bucketlimit.allow_all([(local, "k")], 2)).allowed
            assert await closed.allow("k") == Decision(False, 1.0, 0, 1.0, 4, True)
            with pytest.raises(redis.ConnectionError) as first:
                await raising.allow("k")
            assert type(first.value) is redis.ConnectionError
            with pytest.raises(StoreUnavailableError):
                await raising.allow("k")
            for limiter in (local, closed, raising):
                assert limiter.stats()["store_calls"] == 1
                assert limiter.stats()["breaker_openings"] == 1
        finally:
            await client.aclose()

    asyncio.run(main())
