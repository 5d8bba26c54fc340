"""RedisTokenBucketLimiter on a real redis-server: API, bad input, stored values, TTLs,
NOSCRIPT recovery, and clients that never retry a command.

Stored buckets are read straight from Redis: one string "B L", the balance in
units (1,000,000 per token at whole-number rates) and the last refill in µs.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

import bucketlimit
from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    CorruptBucketError,
    RedisTokenBucketLimiter,
)
from bucketlimit.redis import allow_all as redis_allow_all
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import RedisServer, ServerFactory

#: stats() of a limiter without leases: its lease counters are 0.
NO_LEASES = {
    "lease_hits": 0,
    "lease_round_trips": 0,
    "lease_tokens": 0,
    "lease_tokens_returned": 0,
    "lease_tokens_expired": 0,
}

MICROS = 1_000_000


class Index:
    """An integer-like object, as a numpy integer is: only ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def stored(client: redis.Redis, key: str, prefix: str = "bucketlimit:") -> tuple[int, int] | None:
    """The bucket of ``key`` (plain keys only: no characters to escape)."""
    value = client.get(f"{prefix}{{{key}}}:{key}")
    if value is None:
        return None
    balance, last = value.split()
    return int(balance), int(last)


def server_micros(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * MICROS + micros


# -- the basics ----------------------------------------------------------------


def test_same_answers_as_in_process_and_stored_as_integers(redis_client: redis.Redis) -> None:
    clock = ManualClock(start=5)
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1, clock, processes=1)  # no heartbeat key
    local = TokenBucketLimiter(3, 1, clock)
    for _ in range(4):
        assert limiter.allow("k") == local.allow("k")
    assert stored(redis_client, "k", limiter.prefix) == (0, 5 * MICROS)
    clock.advance(0.5)
    assert limiter.peek("k", 2) == local.peek("k", 2)
    assert stored(redis_client, "k", limiter.prefix) == (0, 5 * MICROS), "a peek writes nothing"
    limiter.refund("k", 1)
    local.refund("k", 1)
    assert stored(redis_client, "k", limiter.prefix) == (1_500_000, 5_500_000)
    assert limiter.allow("k", 2) == local.allow("k", 2)  # refused: 1.5 tokens
    assert stored(redis_client, "k", limiter.prefix) == (1_500_000, 5_500_000), (
        "a refusal writes nothing"
    )
    assert limiter.allow("k") == local.allow("k") == Decision(True, 0.0, 0, 2.5, 3)
    limiter.reset("k")
    local.reset("k")
    assert redis_client.dbsize() == 0
    assert limiter.allow("k", 3) == local.allow("k", 3)


def test_properties_repr_and_stats(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 10, 100, per=60, prefix="api:", processes=1)
    local = TokenBucketLimiter(10, 100, per=60)
    assert (limiter.capacity, limiter.rate, limiter.per) == (10, local.rate, 60.0)
    assert limiter.prefix == "api:"
    assert repr(limiter) == (
        f"RedisTokenBucketLimiter(capacity=10, rate={local.rate * 60!r}, per=60.0, prefix='api:')"
    )
    assert limiter.client is redis_client
    for _ in range(12):
        limiter.allow("k")
    limiter.peek("k")
    # The 12th call and the peek are answered by the refusal cache (test_redis_faults.py).
    assert limiter.stats() == {
        "allowed": 10,
        "refused": 2,
        "store_calls": 12,
        "script_loads": 1,
        "store_errors": 0,
        "fallback_decisions": 0,
        "breaker_openings": 0,
        "breaker_open": 0,
        "refusal_cache_hits": 2,
        "lost_refunds": 0,
        **NO_LEASES,
    }


def test_rate_zero_is_a_quota_and_never_refills(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 2, 0, prefix="bucketlimit:")
    assert limiter.allow("q", 2)
    refused = limiter.allow("q")
    assert refused == Decision(False, math.inf, 0, math.inf, 2)
    assert redis_client.pttl("bucketlimit:{q}:q") == -1, "a quota keeps no TTL"


def test_server_time_is_used_without_a_clock(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 5, 1)
    before = server_micros(redis_client)
    assert limiter.allow("k", 2)
    after = server_micros(redis_client)
    bucket = stored(redis_client, "k", limiter.prefix)
    assert bucket is not None
    assert bucket[0] == 3 * MICROS
    assert before <= bucket[1] <= after


# -- bad input: the core's errors, nothing sent or changed -------------------------


@pytest.mark.parametrize(
    ("cost", "error"),
    [
        (1.0, TypeError),
        (True, TypeError),
        ("1", TypeError),
        (None, TypeError),
        (0, ValueError),
        (-1, ValueError),
        (4, ValueError),
        (2**70, ValueError),
    ],
)
def test_bad_cost(redis_client: redis.Redis, cost: Any, error: type[Exception]) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1)
    local = TokenBucketLimiter(3, 1)
    for method in ("allow", "peek", "refund"):
        with pytest.raises(error) as raised:
            getattr(limiter, method)("k", cost)
        with pytest.raises(error) as expected:
            getattr(local, method)("k", cost)
        assert type(raised.value) is error
        assert str(raised.value) == str(expected.value)
    with pytest.raises(error):
        bucketlimit.allow_all([(limiter, "k")], cost)
    assert limiter.stats()["store_calls"] == 0
    assert limiter.allow("k", Index(3))


@pytest.mark.parametrize(
    ("key", "error"),
    [(b"k", TypeError), (1, TypeError), (None, TypeError), ("", ValueError),
     ("x" * 4097, ValueError), ("\ud800", ValueError), ("é" * 2049, ValueError)],
)  # fmt: skip
def test_bad_key(redis_client: redis.Redis, key: Any, error: type[Exception]) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1)
    for call in (limiter.allow, limiter.peek, limiter.reset, lambda k: limiter.refund(k, 1)):
        with pytest.raises(error):
            call(key)
    with pytest.raises(error):
        bucketlimit.allow_all([(limiter, key)])
    assert limiter.stats()["store_calls"] == 0
    assert redis_client.dbsize() == 0


def test_bad_configuration(redis_client: redis.Redis) -> None:
    bad: list[tuple[tuple[Any, Any], type[Exception]]] = [
        ((0, 1), ValueError),
        ((1.5, 1), TypeError),
        ((True, 1), TypeError),
        ((1, -1), ValueError),
        ((1, math.nan), ValueError),
        ((1, "1"), TypeError),
    ]
    for args, error in bad:
        with pytest.raises(error):
            RedisTokenBucketLimiter(redis_client, *args)
    with pytest.raises(ValueError, match="per"):
        RedisTokenBucketLimiter(redis_client, 1, 1, per=0)
    with pytest.raises(TypeError, match="clock"):
        RedisTokenBucketLimiter(redis_client, 1, 1, clock=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hash_tag"):
        RedisTokenBucketLimiter(redis_client, 1, 1, hash_tag="tenant")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefix"):
        RedisTokenBucketLimiter(redis_client, 1, 1, prefix=b"x")  # type: ignore[arg-type]
    for prefix in ("{app}:", "a}b", "x{"):
        with pytest.raises(ValueError, match="prefix"):
            RedisTokenBucketLimiter(redis_client, 1, 1, prefix=prefix)
    async_client = redis.asyncio.Redis()
    with pytest.raises(TypeError, match="AsyncRedisTokenBucketLimiter"):
        RedisTokenBucketLimiter(async_client, 1, 1)  # type: ignore[arg-type]
    asyncio.run(async_client.aclose())
    with pytest.raises(TypeError, match="RedisTokenBucketLimiter"):
        AsyncRedisTokenBucketLimiter(redis_client, 1, 1)  # type: ignore[arg-type]


def test_beyond_lua_doubles_is_rejected_at_construction(redis_client: redis.Redis) -> None:
    """capacity * unit + p must stay below 2**53: Lua computes in doubles. How much
    a bucket may owe then depends on the configuration (``max_debt``)."""
    # Rate 1: one token is 10**6 units and one µs refills 1 unit.
    largest = (2**53 - 1 - 1) // MICROS
    with pytest.raises(ValueError, match=r"2\*\*53"):
        RedisTokenBucketLimiter(redis_client, largest + 1, 1)
    with pytest.raises(bucketlimit.ConfigurationError, match=r"exact only below 2\*\*53"):
        RedisTokenBucketLimiter(redis_client, largest + 1, 1)
    with pytest.raises(ValueError, match=r"2\*\*53"):
        RedisTokenBucketLimiter(redis_client, 1, 2**53)  # p alone
    # 0.001 tokens a second: one token is 10**9 units, so 10**7 tokens are 10**16 units.
    with pytest.raises(ValueError, match=r"2\*\*53"):
        RedisTokenBucketLimiter(redis_client, 10**7, 0.001)
    assert TokenBucketLimiter(10**7, 0.001).capacity == 10**7, "only Lua needs the bound"


@pytest.mark.parametrize(
    ("capacity", "rate", "per", "max_debt"),
    [
        # Accepted, each with the debt bound its range allows:
        (1_000_000, 1_000_000, 30 * 86400, 26 * 1_000_000),  # a monthly LLM token quota
        (10_000_000, 10_000_000, 86400, 32 * 10_000_000),
        (10**9, 1000, 1, 8 * 10**9),  # the "always allowed" quota
        (3, 0.001, 3600, 832 * 3),
        ((2**53 - 2) // MICROS, 1, 1, 0),  # the largest at 1 a second: no debt at all
        (10, 2, 1, 1000 * 10),  # where 1,000 capacities fit: all of them
    ],
)
def test_every_configuration_in_the_scripts_range_works_with_its_own_debt_bound(
    redis_client: redis.Redis, capacity: int, rate: float, per: int, max_debt: int
) -> None:
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, capacity, rate, clock, per=per)
    local = TokenBucketLimiter(capacity, rate, clock, per=per)
    assert limiter.max_debt == max_debt
    # Answering exactly as before (and as the in-process limiter) where no debt is.
    for cost in (1, capacity // 2 or 1, capacity):
        assert limiter.allow("k", cost) == local.allow("k", cost)
        clock.advance(7.25)
    # The deepest debt is the bound: a charge stops there ...
    deepest = limiter.charge("deep", 2**64 - 1)
    assert deepest.remaining == 0
    assert deepest.retry_after == pytest.approx(max_debt / (rate / per), rel=1e-9)
    # ... and a reservation beyond it is refused as one past its max_wait is, spending
    # nothing, with retry_after the time until it would fit.
    before = limiter.peek("deep")
    refused = limiter.reserve("deep", 1)
    assert not refused
    assert refused.decision.retry_after == pytest.approx(per / rate, rel=1e-6)
    assert limiter.peek("deep") == before  # nothing spent by the refusal


def test_the_largest_configuration_is_exact_to_the_last_unit(redis_client: redis.Redis) -> None:
    largest = (2**53 - 1 - 1) // MICROS
    # The largest accepted configuration is exact to the last unit.
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, largest, 1, clock)
    local = TokenBucketLimiter(largest, 1, clock)
    assert limiter.allow("k", largest) == local.allow("k", largest)
    clock.advance(0.000_001)
    assert limiter.allow("k") == local.allow("k")
    assert limiter.peek("k") == local.peek("k")
    clock.advance(1)
    assert limiter.allow("k") == local.allow("k")
    assert stored(redis_client, "k", limiter.prefix) == (1, 1_000_001)


def test_clock_errors(redis_client: redis.Redis) -> None:
    readings: list[Any] = []
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1, lambda: readings.pop(), processes=1)
    for value, error in [("1", TypeError), (math.nan, ValueError), (2**53 / MICROS, ValueError)]:
        readings.append(value)
        with pytest.raises(error):
            limiter.allow("k")
    readings.append(-((2**53 - 1) // MICROS))  # whole seconds, near the most negative reading
    assert limiter.allow("k")
    assert redis_client.dbsize() == 1


# -- stored values -----------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["nan", "inf", "1 2 -3", "1 2 3 4", "-5 0 x", "1.5 0", "", "99999999999999999999 0", "x y"],
)
def test_a_corrupt_value_is_never_an_allow(redis_client: redis.Redis, value: str) -> None:
    # "raise" shows the error; the other policies refuse (test_redis_faults.py).
    limiter = RedisTokenBucketLimiter(
        redis_client, 3, 1, on_store_error="raise", prefix="bucketlimit:"
    )
    other = RedisTokenBucketLimiter(redis_client, 3, 1, prefix="other:", on_store_error="raise")
    redis_client.set("bucketlimit:{k}:k", value)
    for call in (
        lambda: limiter.allow("k"),
        lambda: limiter.peek("k"),
        lambda: limiter.refund("k", 1),
        lambda: bucketlimit.allow_all([(other, "fine"), (limiter, "k")]),
    ):
        with pytest.raises(CorruptBucketError, match="bucketlimit:"):
            call()
    assert redis_client.get("bucketlimit:{k}:k") == value.encode()
    assert redis_client.dbsize() == 1, "nothing was written, not even the other bucket"


def test_a_value_of_another_type_is_never_an_allow(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(
        redis_client, 3, 1, on_store_error="raise", prefix="bucketlimit:"
    )
    redis_client.rpush("bucketlimit:{k}:k", "3000000 0")
    with pytest.raises(CorruptBucketError, match="WRONGTYPE"):
        limiter.allow("k")
    assert isinstance(CorruptBucketError("x"), redis.ResponseError)


def test_a_balance_above_capacity_reads_as_full(redis_client: redis.Redis) -> None:
    """A bucket written under a larger capacity holds at most this limiter's capacity."""
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 2, 0, clock, prefix="bucketlimit:")
    redis_client.set("bucketlimit:{k}:k", f"{10 * MICROS} 0")
    assert limiter.allow("k") == Decision(True, 0.0, 1, math.inf, 2)


# -- TTL: time until full, in ms rounded up, never 0; none at rate 0 ----------------


def expiry_bracket(client: redis.Redis, call: Any, key: bytes) -> tuple[int, int]:
    """The TTL (ms) the call set, bracketed by the server's clock before and after it."""
    before = server_micros(client) // 1000
    call()
    after = server_micros(client) // 1000
    expires_at = client.pexpiretime(key)  # type: ignore[arg-type]  # keys are bytes too
    assert expires_at > 0
    return expires_at - after, expires_at - before


def test_ttl_is_the_time_until_full_rounded_up(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    # The bracket is as wide as the call took; one wider than the second between the
    # TTLs compared proves nothing: another key is tried (a stalled machine, not a fault).
    for attempt in range(5):
        limiter = RedisTokenBucketLimiter(redis_client, 10, 1, clock, prefix=f"ttl-{attempt}:")
        key = limiter.redis_key("k")
        low, high = expiry_bracket(redis_client, functools.partial(limiter.allow, "k", 3), key)
        if high - low <= 1000:
            break
    else:
        pytest.fail(f"5 calls each took over a second of server time (the last {high - low} ms)")
    assert low <= 3000 <= high, f"the TTL set was {low}-{high} ms, not 3,000"
    # 7 tokens + 0.499999 refilled + 1 refunded: 1,500,001 µs to full, so 1,501 ms.
    clock.advance(0.499_999)
    low, high = expiry_bracket(redis_client, lambda: limiter.refund("k", 1), limiter.redis_key("k"))
    assert limiter.peek("k").reset_after == 2.500_001  # as if one more token were spent
    assert low <= 1501 <= high, f"the TTL set was {low}-{high} ms, not 1,501"


def test_ttl_is_never_zero(redis_client: redis.Redis) -> None:
    """One µs from full: PX 0 would be an error reply; the key expires in 1 ms."""
    clock = ManualClock()
    limiter = RedisTokenBucketLimiter(redis_client, 2, 1, clock, prefix="bucketlimit:")
    limiter.allow("k", 2)
    clock.advance(1.999_999)
    assert limiter.allow("k").reset_after == 1.000_001
    limiter.refund("k", 1)  # 1 µs to full: PX 1
    assert redis_client.pttl("bucketlimit:{k}:k") in (-2, 0, 1), "never persistent"
    # The TTL runs on the server's real clock: within that 1 ms the bucket is 1 µs
    # from full, after it gone (full). Either way a peek spends in its answer only.
    assert limiter.peek("k").reset_after in (1.000_001, 1.0)
    assert redis_client.pttl("bucketlimit:{k}:k") in (-2, 0, 1), "a peek wrote nothing"


def test_a_refund_to_full_deletes_the_bucket(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 3, 1, ManualClock(), processes=1)
    limiter.allow("k", 2)
    limiter.refund("k", 3)
    assert redis_client.dbsize() == 0
    limiter.refund("absent", 1)
    assert redis_client.dbsize() == 0, "a missing bucket is full: nothing to give back"


def test_every_key_written_has_a_ttl_when_rate_is_positive(redis_client: redis.Redis) -> None:
    users = RedisTokenBucketLimiter(redis_client, 5, 1, per=60, prefix="u:", processes=1)
    tenants = RedisTokenBucketLimiter(redis_client, 50, 0.5, per=60, prefix="t:", processes=1)
    quota = RedisTokenBucketLimiter(redis_client, 5, 0, prefix="q:", processes=1)
    for i in range(300):
        key = f"user-{i % 37}"
        if i % 3 == 0:
            bucketlimit.allow_all([(users, key), (tenants, f"tenant-{i % 5}")], 1 + i % 2)
        elif i % 7 == 0:
            users.refund(key, 1)
        else:
            users.allow(key, 1 + i % 3)
        quota.allow(key)
    keys = list(redis_client.scan_iter())
    assert sum(key.startswith(b"q:") for key in keys) == 37
    assert sum(key.startswith(b"t:") for key in keys) == 5
    assert sum(key.startswith(b"u:") for key in keys) > 30
    for key in keys:
        ttl = redis_client.pttl(key)
        if key.startswith(b"q:"):
            assert ttl == -1, key
        else:
            assert ttl > 0, key


def test_idle_buckets_expire_once_full(redis_client: redis.Redis) -> None:
    # 1,000 tokens a second and capacity 2: every bucket is full 2 ms after its last use.
    limiter = RedisTokenBucketLimiter(redis_client, 2, 1000, processes=1)  # no heartbeat key
    for i in range(200):
        limiter.allow(f"k{i}", 2)
    # Bounded polling for Redis's expiry cycle: not a timing assertion.
    deadline = time.monotonic() + 30
    while redis_client.dbsize() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert redis_client.dbsize() == 0


# -- scripts: EVALSHA, and only NOSCRIPT is answered by sending the script again ----


def test_script_flush_mid_run_costs_no_error_and_no_token(redis_client: redis.Redis) -> None:
    # Every call goes to the store, refusals too, so that the commands can be counted.
    limiter = RedisTokenBucketLimiter(redis_client, 100, 0, refusal_cache=False, processes=1)
    admitted = 0
    for i in range(300):
        if i % 50 == 0:
            redis_client.script_flush()
        admitted += limiter.allow("k").allowed
    assert admitted == 100
    bucket = stored(redis_client, "k", limiter.prefix)
    assert bucket is not None
    assert bucket[0] == 0
    assert limiter.stats()["script_loads"] == 6
    assert limiter.stats()["store_calls"] == 306


def test_script_flush_under_threads(redis_server: RedisServer, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    limiter = RedisTokenBucketLimiter(client, 1000, 0, prefix="bucketlimit:")
    admin = redis_server.client()
    results: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def worker() -> None:
        start.wait()
        try:
            results.append(sum(limiter.allow("k").allowed for _ in range(300)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    flushes = 0
    while any(thread.is_alive() for thread in threads):
        admin.script_flush()
        flushes += 1
    for thread in threads:
        thread.join()
    assert errors == []
    assert sum(results) == 1000
    assert flushes > 0
    assert admin.get("bucketlimit:{k}:k").split()[0] == b"0"  # type: ignore[union-attr]
    admin.close()
    client.close()


def test_other_errors_are_not_retried(redis_client: redis.Redis) -> None:
    """A script error other than NOSCRIPT reaches the caller after one command."""
    limiter = RedisTokenBucketLimiter(
        redis_client, 3, 1, on_store_error="raise", prefix="bucketlimit:"
    )
    limiter.allow("warm")  # the script is cached now
    redis_client.config_resetstat()
    redis_client.set("bucketlimit:{k}:k", "garbage")
    with pytest.raises(CorruptBucketError):
        limiter.allow("k")
    calls = redis_client.info("commandstats")
    assert calls["cmdstat_evalsha"]["calls"] == 1
    assert "cmdstat_eval" not in calls


# -- clients: from_url's timeouts and no retries -----------------------------------


def test_from_url_builds_a_client_with_short_timeouts_and_no_retries(redis_url: str) -> None:
    limiter = RedisTokenBucketLimiter.from_url(redis_url, 3, 1, prefix="p:")
    kwargs = limiter.client.connection_pool.connection_kwargs  # type: ignore[union-attr]
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25
    assert kwargs["retry"].get_retries() == 0
    assert limiter.allow("k")
    assert limiter.prefix == "p:"
    limiter.client.close()


def evalsha_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0))


def server_stats(admin: redis.Redis) -> tuple[int, int]:
    """(EVALSHA commands run, connections accepted) since CONFIG RESETSTAT."""
    return evalsha_calls(admin), int(admin.info("stats")["total_connections_received"])


@pytest.mark.parametrize("retries", [0, 2])
def test_a_timed_out_command_is_not_sent_again(
    redis_server_factory: ServerFactory, retries: int
) -> None:
    """The server hangs (SIGSTOP) while the script is on its way, and the call
    times out. from_url's client (retries off) gives up there: no reconnection,
    no second copy, and the one command that reached the server charges once
    when it resumes. A client with retries (redis-py 8 retries 10 times by
    default) reconnects to send the command again, which is how a retried
    timeout can charge twice (here its reconnections stall on redis-py's HELLO
    handshake, so they are counted as connections)."""
    server = redis_server_factory.start()
    if retries == 0:
        limiter = RedisTokenBucketLimiter.from_url(
            server.url, 10, 0, timeout=0.25, on_store_error="raise", prefix="bucketlimit:"
        )
    else:
        client = redis.Redis(port=server.port, socket_timeout=0.25, retry=Retry(NoBackoff(), 2))
        limiter = RedisTokenBucketLimiter(
            client, 10, 0, on_store_error="raise", prefix="bucketlimit:"
        )
    admin = server.client()
    assert limiter.allow("k")  # loads the script
    admin.config_resetstat()
    server.pause()
    with pytest.raises(redis.TimeoutError):
        limiter.allow("k")
    server.resume()
    # Bounded polling: what was sent during the pause is handled after SIGCONT.
    deadline = time.monotonic() + 10
    while server_stats(admin) < (1, retries) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server_stats(admin) == (1, retries)
    balance = int(admin.get("bucketlimit:{k}:k").split()[0])  # type: ignore[union-attr]
    assert balance == (10 - 2) * MICROS
    limiter.client.close()
    admin.close()


# -- asyncio ------------------------------------------------------------------------


def test_async_limiter_matches_in_process(redis_url: str) -> None:
    async def main(client: redis.asyncio.Redis) -> None:
        clock = ManualClock()
        limiter = AsyncRedisTokenBucketLimiter(client, 3, 2, clock, processes=1)
        users = AsyncRedisTokenBucketLimiter(client, 2, 0, clock, prefix="users:", processes=1)
        local = TokenBucketLimiter(3, 2, clock)
        local_users = TokenBucketLimiter(2, 0, clock)
        for _ in range(4):
            assert await limiter.allow("k") == local.allow("k")
        clock.advance(0.25)
        assert await limiter.peek("k") == local.peek("k")
        await limiter.refund("k", 1)
        local.refund("k", 1)
        assert await limiter.allow("k", 2) == local.allow("k", 2)
        for _ in range(3):
            assert await bucketlimit.allow_all([(users, "u"), (limiter, "k")]) == (
                bucketlimit.allow_all([(local_users, "u"), (local, "k")])
            )
        await limiter.reset("k")
        local.reset("k")
        assert await limiter.allow("k") == local.allow("k")
        await client.script_flush()
        assert await limiter.allow("k") == local.allow("k")
        assert limiter.stats()["script_loads"] == 2
        expected = local_users.stats()
        assert users.stats() == {
            "allowed": expected["allowed"],
            "refused": expected["refused"],
            # allow_all is sent through the first limiter named. Its script (the general
            # one, _redis/scripts.md) is not the one limiter.allow loaded (the limiter's
            # own), so its first call met NOSCRIPT: one EVALSHA refused, one EVAL, one load.
            "store_calls": 4,
            "script_loads": 1,
            "store_errors": 0,
            "fallback_decisions": 0,
            "breaker_openings": 0,
            "breaker_open": 0,
            "refusal_cache_hits": 0,
            "lost_refunds": 0,
            **NO_LEASES,
        }

    async def run() -> None:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            await main(client)
        finally:
            await client.aclose()

    asyncio.run(run())


def test_async_from_url(redis_url: str) -> None:
    async def main() -> None:
        limiter = AsyncRedisTokenBucketLimiter.from_url(redis_url, 3, 1)
        try:
            kwargs = limiter.client.connection_pool.connection_kwargs  # type: ignore[union-attr]
            assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.25
            assert kwargs["retry"].get_retries() == 0
            assert await limiter.allow("k")
        finally:
            await limiter.client.aclose()

    asyncio.run(main())


# -- allow_all -----------------------------------------------------------------------


def test_allow_all_spends_from_all_or_none(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    user = RedisTokenBucketLimiter(redis_client, 3, 1, clock, prefix="user:")
    world = RedisTokenBucketLimiter(redis_client, 4, 0, clock, prefix="world:")
    local_user = TokenBucketLimiter(3, 1, clock)
    local_world = TokenBucketLimiter(4, 0, clock)
    for key, cost in [("a", 2), ("a", 2), ("b", 2), ("b", 1), ("a", 1), ("c", 1)]:
        got = bucketlimit.allow_all([(user, key), (world, "all")], cost)
        assert got == bucketlimit.allow_all([(local_user, key), (local_world, "all")], cost)
        clock.advance(0.3)
    assert stored(redis_client, "all", "world:") == (0, 600_000)  # the last allowed call
    assert user.stats()["allowed"] == local_user.stats()["allowed"] == 2
    assert world.stats()["refused"] == local_world.stats()["refused"] == 4


def test_allow_all_refuses_bad_combinations(redis_client: redis.Redis, redis_url: str) -> None:
    a = RedisTokenBucketLimiter(redis_client, 3, 1, prefix="a:", processes=1)
    a_twin = RedisTokenBucketLimiter(redis_client, 3, 1, prefix="a:")
    other = RedisTokenBucketLimiter(redis.Redis.from_url(redis_url), 3, 1, prefix="o:")
    with pytest.raises(ValueError, match="twice"):
        bucketlimit.allow_all([(a, "k"), (a, "k")])
    with pytest.raises(ValueError, match="twice"):
        bucketlimit.allow_all([(a, "k"), (a_twin, "k")])  # one Redis key
    with pytest.raises(ValueError, match="same client"):
        bucketlimit.allow_all([(a, "k"), (other, "k")])
    with pytest.raises(TypeError, match="cannot mix"):
        bucketlimit.allow_all([(a, "k"), (TokenBucketLimiter(3, 1), "k")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="pairs"):
        redis_allow_all([a])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one"):
        redis_allow_all([])
    assert bucketlimit.allow_all([(a, "k"), (a, "j")])
    assert redis_client.dbsize() == 2
    other.client.close()
