"""The Redis layer's flows fed scripted replies and errors, without a server (h11's
way): resending, redirections, the breaker, every failure policy, a changed time
source, corrupt keys, and cancellation with shared round trips.

A scripted client is a redis-py client whose ``execute_command`` answers from a
list the test wrote (a reply, or an exception raised as the client would) and
records what the limiter sent. Nothing is connected: every test here runs in
milliseconds; tests/redis proves the same promises against real servers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from redis.exceptions import (
    ClusterError,
    ConnectionError,
    NoScriptError,
    ResponseError,
    TimeoutError,
)

import bucketlimit
from bucketlimit import ConcurrencyLimiter, Decision, TokenBucketLimiter
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    CorruptBucketError,
    Policy,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
    StoreUnavailableError,
)

#: The limiter script's reply to an allow of 1 from a bucket of 10 that was full.
ALLOWED = [0, 9, 100_000]
KEY = b"bucketlimit:10:10/1:{k}:k"
POLICIES: tuple[Policy, ...] = ("raise", "open", "closed", "local")


class Scripted(redis.Redis):
    """A blocking client answering each command with the next of ``answers``."""

    def __init__(self, *answers: Any) -> None:
        super().__init__(host="127.0.0.1", port=9)  # never connected
        self.answers = list(answers)
        self.sent: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent.append(args)
        assert self.answers, f"no answer scripted for {args[0]}"
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    @property
    def names(self) -> list[str]:
        return [str(args[0]) for args in self.sent]


class AsyncScripted(aredis.Redis):
    """An asyncio client whose commands wait until the test answers them, in order."""

    def __init__(self) -> None:
        super().__init__(host="127.0.0.1", port=9)  # never connected
        self.sent: list[tuple[Any, ...]] = []
        self.pending: asyncio.Queue[tuple[tuple[Any, ...], asyncio.Future[Any]]] = asyncio.Queue()

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append(args)
        await self.pending.put((args, answer))
        return await answer

    async def next_command(self) -> tuple[tuple[Any, ...], asyncio.Future[Any]]:
        return await asyncio.wait_for(self.pending.get(), 10)


def limiter(
    client: redis.Redis, policy: Policy = "raise", **options: Any
) -> RedisTokenBucketLimiter:
    """10 tokens refilled 10 a second, on the Lua scripts, one process."""
    return RedisTokenBucketLimiter(
        client, 10, 10, engine="lua", processes=1, on_store_error=policy, **options
    )


def breaker(limiter: Any) -> tuple[int, int]:
    stats = limiter.stats()
    return stats["breaker_open"], stats["breaker_openings"]


def stored(decision: Decision) -> bool:
    return decision.allowed and not decision.degraded


# Resending ----------------------------------------------------------------------------


def test_a_lost_script_goes_whole_once_then_by_its_sha_again() -> None:
    client = Scripted(NoScriptError("No matching script"), ALLOWED, ALLOWED)
    bucket = limiter(client)
    assert stored(bucket.allow("k"))
    assert stored(bucket.allow("k"))
    assert client.names == ["EVALSHA", "EVAL", "EVALSHA"]
    assert client.sent[1][3] == KEY, "the whole script names the same bucket"
    assert bucket.stats()["script_loads"] == 1
    assert breaker(bucket) == (0, 0)


def test_a_script_lost_again_after_going_whole_is_not_sent_a_third_time() -> None:
    client = Scripted(NoScriptError("No matching script"), NoScriptError("No matching script"))
    with pytest.raises(NoScriptError):  # under "raise", the client's own error
        limiter(client).allow("k")
    assert client.names == ["EVALSHA", "EVAL"]


def test_a_redirection_storm_goes_once_more_and_is_not_an_outage() -> None:
    client = Scripted(ClusterError("TTL exhausted."), ALLOWED)
    bucket = limiter(client)
    assert stored(bucket.allow("k"))
    assert client.names == ["EVALSHA", "EVALSHA"]
    assert breaker(bucket) == (0, 0)


def test_a_second_redirection_storm_is_the_policys_answer_and_goes_no_further() -> None:
    client = Scripted(ClusterError("TTL exhausted."), ClusterError("TTL exhausted."))
    bucket = limiter(client, "closed")
    decision = bucket.allow("k")
    assert (decision.allowed, decision.degraded) == (False, True)
    assert client.names == ["EVALSHA", "EVALSHA"]
    assert breaker(bucket) == (0, 0), "a storm is no outage: the next call asks the store"


def test_a_timed_out_command_is_never_sent_again() -> None:
    """It may have run: sent again, it could charge twice."""
    client = Scripted(TimeoutError("Timeout reading from socket"))
    bucket = limiter(client, "open")
    decision = bucket.allow("k")
    assert (decision.allowed, decision.degraded) == (True, True)
    assert client.names == ["EVALSHA"]
    assert breaker(bucket) == (1, 1)


# Failure policies and the breaker -----------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_answers_a_store_that_is_down(policy: Policy) -> None:
    client = Scripted(ConnectionError("Connection refused"))
    bucket = limiter(client, policy, retry_interval=30)
    if policy == "raise":
        with pytest.raises(ConnectionError):  # the client's own error
            bucket.allow("k")
        with pytest.raises(StoreUnavailableError):  # then the breaker's, nothing sent
            bucket.allow("k")
        assert client.names == ["EVALSHA"]
        return
    decision = bucket.allow("k")
    expected = {
        "open": Decision(True, 0.0, 0, 0.0, 10, True),
        "closed": Decision(False, 30.0, 0, 30.0, 10, True),
        "local": Decision(True, 0.0, 9, 0.1, 10, True),  # the one process's share: all 10
    }[policy]
    assert decision == expected
    assert breaker(bucket) == (1, 1)
    assert bucket.stats()["fallback_decisions"] == 1


def test_local_without_a_count_of_the_processes_refuses() -> None:
    """No share can be told before the store has counted the processes: closed."""
    client = Scripted(ConnectionError("Connection refused"))
    bucket = RedisTokenBucketLimiter(client, 10, 10, engine="lua", on_store_error="local")
    decision = bucket.allow("k")
    assert (decision.allowed, decision.degraded) == (False, True)


@pytest.mark.parametrize("policy", ["open", "closed", "local"])
def test_an_open_breaker_sends_nothing_until_its_interval(policy: Policy) -> None:
    client = Scripted(ConnectionError("Connection refused"))
    bucket = limiter(client, policy, retry_interval=3600)
    answers = [bucket.allow("k") for _ in range(5)]
    assert all(answer.degraded for answer in answers)
    assert client.names == ["EVALSHA"], "the open breaker asked the store again"
    assert breaker(bucket) == (1, 1)


def test_an_answered_probe_closes_the_breaker() -> None:
    client = Scripted(ConnectionError("Connection refused"), ALLOWED)
    bucket = limiter(client, "closed", retry_interval=0.001)
    assert bucket.allow("k").degraded
    for _ in range(1_000_000):  # until the interval has passed and one call probes
        decision = bucket.allow("k")
        if len(client.sent) == 2:
            break
    assert stored(decision), "the probe's answer is the store's"
    assert breaker(bucket) == (0, 1)


def test_a_probe_that_fails_keeps_the_breaker_open() -> None:
    client = Scripted(ConnectionError("Connection refused"), ConnectionError("again"))
    bucket = limiter(client, "closed", retry_interval=0.001)
    assert bucket.allow("k").degraded
    for _ in range(1_000_000):
        decision = bucket.allow("k")
        if len(client.sent) == 2:
            break
    assert decision.degraded
    assert breaker(bucket) == (1, 1), "one outage, still open"


# What the store answered ----------------------------------------------------------------


def test_time_refused_to_scripts_is_sent_by_the_client_from_then_on() -> None:
    refused = ResponseError("ERR This Redis command is not allowed from script script: f1")
    client = Scripted(refused, [1_700_000_000, 5], ALLOWED, ALLOWED)
    bucket = limiter(client)
    assert stored(bucket.allow("k"))
    assert stored(bucket.allow("k"))
    assert client.names == ["EVALSHA", "TIME", "EVALSHA", "EVALSHA"]
    first, second = (int(client.sent[i][-1]) for i in (2, 3))
    assert first >= 1_700_000_000_000_005, "the now sent is the store's TIME, in µs"
    assert second >= first, "a clock sent never goes back"
    assert breaker(bucket) == (0, 0)


@pytest.mark.parametrize("policy", ["open", "closed", "local"])
def test_a_corrupt_bucket_is_refused_whatever_the_policy_and_said_so(
    policy: Policy, caplog: pytest.LogCaptureFixture
) -> None:
    client = Scripted(ResponseError("BUCKETLIMIT corrupt bucket value in key 1 of 1"))
    bucket = limiter(client, policy)
    with caplog.at_level(logging.WARNING, "bucketlimit"):
        decision = bucket.allow("k")
    assert (decision.allowed, decision.degraded) == (False, True)
    assert breaker(bucket) == (0, 0), "the store answered"
    assert "CorruptBucketError" in caplog.text
    assert "this call is refused" in caplog.text


def test_a_corrupt_bucket_raises_under_raise() -> None:
    client = Scripted(ResponseError("BUCKETLIMIT corrupt bucket value in key 1 of 1"))
    with pytest.raises(CorruptBucketError):
        limiter(client).allow("k")


def test_commands_are_timed_once_the_round_trip_histogram_is_asked_for() -> None:
    """A limiter nobody measures spends nothing on timing its commands; from the
    first ``histograms()`` call (``bucketlimit.metrics`` makes it when it adds the
    limiter) each command is one observation."""
    client = Scripted(ALLOWED, ALLOWED, ALLOWED)
    bucket = limiter(client)
    bucket.allow("k")
    [(name, _, round_trips)] = bucket.histograms()
    assert name == "store_round_trip_seconds"
    assert round_trips.snapshot().count == 0, "timed before anyone asked"
    bucket.allow("k")
    bucket.allow("k")
    assert round_trips.snapshot().count == 2, "not one observation per command"


# Permits ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["lua", "module"])
@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_answers_a_permit_the_store_could_not_give(policy: Policy, engine: Any) -> None:
    client = Scripted(ConnectionError("Connection refused"))
    permits = RedisConcurrencyLimiter(
        client, 2, on_store_error=policy, processes=1, retry_interval=30, engine=engine
    )
    if policy == "raise":
        with pytest.raises(ConnectionError):
            permits.try_acquire("k")
        with pytest.raises(StoreUnavailableError):
            permits.try_acquire("k")
        assert len(client.sent) == 1
        return
    permit = permits.try_acquire("k")
    allowed, remaining = {"open": (True, 0), "closed": (False, 0), "local": (True, 1)}[policy]
    assert (permit.decision.allowed, permit.decision.remaining) == (allowed, remaining)
    assert permit.decision.degraded
    assert len(client.sent) == 1
    permit.release()
    assert len(client.sent) == 1, "a permit given without the store is given back in process"


# allow_all over several limiters ----------------------------------------------------------


def buckets_then(client: redis.Redis, policy: Policy, *, permit: bool) -> list[Any]:
    """allow_all's checks: a bucket, then another bucket or a permit, all on ``policy``."""
    first = limiter(client, policy, retry_interval=30, prefix="a:")
    if permit:
        second: Any = RedisConcurrencyLimiter(
            client, 2, on_store_error=policy, processes=1, retry_interval=30, engine="lua"
        )
    else:
        second = limiter(client, policy, retry_interval=30, prefix="b:")
    return [(first, "k"), (second, "k")]


@pytest.mark.parametrize("policy", POLICIES)
def test_allow_all_with_or_without_a_permit_is_one_script_and_one_policy(policy: Policy) -> None:
    """Over two buckets, or a bucket and a permit, allow_all sends the general script
    the same way (the permits' keys and arguments after the buckets'), and the
    store down, answers by the policy the same way."""
    sent, answers = [], []
    for permit in (False, True):
        client = Scripted(ConnectionError("Connection refused"))
        checks = buckets_then(client, policy, permit=permit)
        if policy == "raise":
            with pytest.raises(ConnectionError):  # the client's own error
                bucketlimit.allow_all(checks)
        else:
            got = bucketlimit.allow_all(checks)
            answers.append(got if isinstance(got, Decision) else got.decision)
        assert len(client.sent) == 1, "one script, not resent"
        sent.append(client.sent[0])
    buckets, with_permit = sent
    assert buckets[:2] == with_permit[:2], "not EVALSHA of one script"
    assert (buckets[2], with_permit[2]) == (4, 2 + 4), "not 2 keys a bucket, 4 a permit"
    assert buckets[3:5] == with_permit[3:5], "not the first bucket's keys first"
    bucket_args, permit_args = buckets[3 + 4 :], with_permit[3 + 6 :]
    assert (bucket_args[0], permit_args[0]) == (b"", 1), "not the count of permits first"
    assert bucket_args[1] == permit_args[1] == b"allow", "not the mode next"
    assert bucket_args[2:11] == permit_args[2:11], "not the first bucket's 9 values next"
    if policy == "raise":
        return
    alone, mixed = answers
    assert (alone.degraded, mixed.degraded) == (True, True), "a policy's answer is degraded"
    assert alone.allowed == mixed.allowed == (policy != "closed"), f"{policy} answered otherwise"
    if policy != "local":  # "open" and "closed" answer as the first limiter
        assert alone == mixed, f"{policy}: the first limiter's answer differs with a permit"


def test_allow_all_counts_its_decision_once_per_check_as_in_process() -> None:
    client = Scripted(ConnectionError("Connection refused"))
    bucket = limiter(client, "open")
    permits = RedisConcurrencyLimiter(client, 2, on_store_error="open", processes=1, engine="lua")
    local_bucket, local_permits = TokenBucketLimiter(10, 10), ConcurrencyLimiter(2)
    checks: list[Any] = [(bucket, "k"), (permits, "a"), (permits, "b")]
    assert bucketlimit.allow_all(checks).decision.allowed
    assert bucketlimit.allow_all([(local_bucket, "k"), (local_permits, "a"), (local_permits, "b")])
    assert bucket.stats()["allowed"] == local_bucket.stats()["allowed"] == 1, "one bucket check"
    assert permits.stats()["granted"] == local_permits.stats()["granted"] == 2, (
        "two permit checks of one limiter: counted twice, as in process"
    )
    assert bucket.stats()["store_calls"] == 1, "the script counted once, on the first limiter"
    assert permits.stats()["store_calls"] == 0, "the script counted on another limiter"


def test_allow_all_with_a_permit_without_the_store_never_grants_what_would_wait() -> None:
    """Under "local", a bucket of 2 (1 a second) and a permit: the share's 2 tokens
    are granted now, the third call is refused, not granted with a delay."""
    client = Scripted(ConnectionError("Connection refused"))
    options: dict[str, Any] = {"engine": "lua", "processes": 1, "retry_interval": 3600}
    bucket = RedisTokenBucketLimiter(client, 2, 1, on_store_error="local", **options)
    permits = RedisConcurrencyLimiter(client, 10, on_store_error="local", **options)
    checks: list[Any] = [(bucket, "k"), (permits, "k")]
    answers = [bucketlimit.allow_all(checks) for _ in range(3)]
    assert [a.decision.allowed for a in answers] == [True, True, False]
    assert [a.delay for a in answers[:2]] == [0.0, 0.0], "an allow granted with a wait"
    assert answers[2].decision.degraded


# Cancellation and shared round trips (asyncio) ----------------------------------------------


def run(test: Any) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def answer(future: asyncio.Future[Any], reply: Any) -> None:
    if isinstance(reply, BaseException):
        future.set_exception(reply)
    else:
        future.set_result(reply)


def test_a_call_cancelled_in_flight_is_no_store_failure() -> None:
    async def test() -> None:
        client = AsyncScripted()
        bucket = AsyncRedisTokenBucketLimiter(client, 10, 10, engine="lua", processes=1)
        call = asyncio.create_task(bucket.allow("k"))
        await client.next_command()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert breaker(bucket) == (0, 0)
        again = asyncio.create_task(bucket.allow("k"))
        _, reply = await client.next_command()
        answer(reply, ALLOWED)
        assert stored(await again)

    run(test)


def test_allows_waiting_for_a_round_trip_go_together_and_a_cancelled_one_is_left_out() -> None:
    async def test() -> None:
        client = AsyncScripted()
        bucket = AsyncRedisTokenBucketLimiter(client, 10, 10, engine="lua", processes=1)
        first = asyncio.create_task(bucket.allow("a"))
        _, reply = await client.next_command()
        waiting = [asyncio.create_task(bucket.allow(key)) for key in ("b", "c", "d")]
        await asyncio.sleep(0)  # each joins the next round trip
        waiting[1].cancel()
        answer(reply, ALLOWED)
        assert stored(await first)
        batch, reply = await client.next_command()
        keys = [arg for arg in batch if isinstance(arg, bytes) and b"{" in arg]
        assert keys == [b"bucketlimit:10:10/1:{b}:b", b"bucketlimit:10:10/1:{d}:d"]
        answer(reply, [0, 9, 100_000, 0, 8, 200_000])
        b, d = waiting[0], waiting[2]
        assert (await b).remaining == 9
        assert (await d).remaining == 8
        assert waiting[1].cancelled()
        assert client.pending.empty()
        assert len(client.sent) == 2

    run(test)


def test_a_shared_round_trip_that_fails_is_each_calls_policy_answer_and_not_resent() -> None:
    async def test() -> None:
        client = AsyncScripted()
        bucket = AsyncRedisTokenBucketLimiter(
            client, 10, 10, engine="lua", processes=1, on_store_error="open", retry_interval=3600
        )
        first = asyncio.create_task(bucket.allow("a"))
        _, reply = await client.next_command()
        waiting = [asyncio.create_task(bucket.allow(key)) for key in ("b", "c")]
        await asyncio.sleep(0)
        answer(reply, ALLOWED)
        await first
        _, reply = await client.next_command()
        answer(reply, TimeoutError("Timeout reading from socket"))
        decisions = await asyncio.gather(*waiting)
        assert all(d.allowed and d.degraded for d in decisions)
        assert len(client.sent) == 2, "a batch that may have run is never sent again"
        assert breaker(bucket) == (1, 1)

    run(test)
