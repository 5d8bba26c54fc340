"""RedisConcurrencyLimiter and AsyncRedisConcurrencyLimiter against real servers that
fail (the token buckets' own are in test_redis_faults.py).

Each policy with the server stopped, the breaker and its probe, replies lost after
the script ran (tests/support/tcp_proxy.py drops them) and a restart without
persistence. A lost grant holds its slot until its ttl on the server's clock,
which no test can fake: the ttl is 0.5 s and "never earlier" is checked on the
server's TIME, never on a duration of the test's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from bucketlimit import Decision
from bucketlimit.redis import (
    AsyncRedisConcurrencyLimiter,
    Policy,
    RedisConcurrencyLimiter,
    StoreUnavailableError,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import RedisServer, ServerFactory
from tests.support.tcp_proxy import TcpProxy
from tests.support.threads import wait_until

POLICIES: tuple[Policy, ...] = ("local", "open", "closed", "raise")
TTL = 0.5  # seconds on the server's clock, where a lost grant must expire by itself


def url_of(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def script_calls(admin: redis.Redis) -> int:
    """EVALSHA and EVAL commands the server ran since it started."""
    stats = admin.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


def server_micros(admin: redis.Redis) -> int:
    seconds, micros = admin.time()
    return int(seconds) * 1_000_000 + int(micros)


def outcome(call: Callable[[], Any]) -> object:
    """What ``call()`` answered (a permit's decision), or its ConnectionError's name."""
    try:
        got = call()
    except redis.ConnectionError as error:
        return type(error).__name__
    return getattr(got, "decision", got)


def degraded(allowed: bool, retry: float, remaining: int, reset: float, limit: int) -> Decision:
    return Decision(allowed, retry, remaining, reset, limit, True)


def stopped(factory: ServerFactory, policy: Policy, clock: ManualClock) -> Any:
    """A limiter of limit 8 shared by 4 processes (a local share of 2), holding one
    permit from the store, whose server is then stopped; the breaker skips the store
    for the whole test once the first call failed."""
    server = factory.start()
    limiter = RedisConcurrencyLimiter.from_url(
        server.url, 8, ttl=10, clock=clock, processes=4, on_store_error=policy, retry_interval=60
    )
    stored = limiter.try_acquire("k")
    assert stored.decision == Decision(True, 0.0, 7, 10.0, 8)  # from the store
    assert limiter.in_flight("k") == 1
    server.stop()
    return limiter, stored


# -- each policy with the server stopped ---------------------------------------------------


def test_local_takes_this_process_share_in_process(redis_server_factory: ServerFactory) -> None:
    clock = ManualClock()
    limiter, stored = stopped(redis_server_factory, "local", clock)
    with limiter:
        first, second, third = (limiter.try_acquire("k") for _ in range(3))
        assert [p.decision for p in (first, second, third)] == [
            degraded(True, 0.0, 1, 10.0, 2),
            degraded(True, 0.0, 0, 10.0, 2),
            degraded(False, 10.0, 0, 10.0, 2),  # the share is 8 // 4: the third is refused
        ]
        assert (third.token, 0 < first.token < second.token) == (0, True)  # local tokens
        assert not limiter.acquire("k", timeout=0.5)  # queued until its timeout, then refused
        assert clock.now == 0.5  # waited on the limiter's clock
        assert limiter.in_flight("k") == 2  # the local ones: the store's is not known
        # The store's permit: the store cannot say, and its release is lost (counted):
        # it expires by its ttl.
        assert (stored.valid(), stored.renew()) == (False, False)
        stored.release()
        assert limiter.stats()["lost_releases"] == 1
        # The local permits release and expire as in process, on the limiter's clock.
        assert (first.valid(), first.renew()) == (True, True)
        first.release()
        assert limiter.in_flight("k") == 1
        fourth = limiter.try_acquire("k")
        assert fourth.decision == degraded(True, 0.0, 0, 10.0, 2)
        assert fourth.token > second.token
        waited = limiter.acquire("k", timeout=20)  # on the clock, until `second` expires
        assert (waited.decision, clock.now) == (degraded(True, 0.0, 0, 10.0, 2), 10.0)
        assert (second.valid(), second.renew()) == (False, False)
        assert (fourth.valid(), limiter.in_flight("k")) == (True, 2)
        stats = limiter.stats()
    # The first failure opened the breaker; every later call skipped the store.
    assert (stats["breaker_open"], stats["breaker_openings"], stats["store_errors"]) == (1, 1, 1)
    assert (stats["fallback_decisions"], stats["granted"], stats["refused"]) == (6, 5, 2)


NOTHING_HELD = {
    "open": [degraded(True, 0.0, 0, 0.0, 8)] * 10 + [0, False, False, None],
    "closed": [degraded(False, 60.0, 0, 60.0, 8)] * 10 + [0, False, False, None],
    "raise": ["ConnectionError"] + ["StoreUnavailableError"] * 13,
}


@pytest.mark.parametrize("policy", ["open", "closed", "raise"])
def test_open_closed_and_raise_hold_nothing(
    redis_server_factory: ServerFactory, policy: Policy
) -> None:
    """ "open" grants past the limit, "closed" refuses, at once, holding nothing;
    "raise" raises the client's error, then the breaker's StoreUnavailableError (a
    ConnectionError too). The store's permit cannot be checked; its release is lost,
    counted, and raised only under "raise", as permit_flows.release documents (the slot
    frees by its ttl), and it counts as released for its holder all the same."""
    clock = ManualClock()
    limiter, stored = stopped(redis_server_factory, policy, clock)
    with limiter:
        calls: list[Callable[[], Any]] = [lambda: limiter.try_acquire("k")] * 9
        calls += [lambda: limiter.acquire("k", timeout=5), lambda: limiter.in_flight("k")]
        calls += [stored.valid, stored.renew, stored.release]
        assert [outcome(call) for call in calls] == NOTHING_HELD[policy]
        assert clock.now == 0.0, "answered at once: nothing to wait for"
        if policy == "open":  # no token, nothing to check with the store
            permit = limiter.try_acquire("k")
            assert (permit.token, permit.valid(), permit.renew()) == (0, True, True)
            permit.release()
        stored.release()  # released already: nothing sent, nothing raised
        assert (stored.valid(), stored.renew()) == (False, False)
        stats = limiter.stats()
    names = ("fallback_decisions", "granted", "released", "lost_releases", "store_errors")
    counts = {"open": [11, 12, 0, 1, 1], "closed": [10, 1, 0, 1, 1], "raise": [0, 1, 0, 1, 1]}
    assert [stats[name] for name in names] == counts[policy]


def test_the_asyncio_limiter_under_a_stopped_server(redis_server_factory: ServerFactory) -> None:
    async def main(policy: Policy) -> list[object]:
        server = redis_server_factory.start()
        clock = ManualClock()
        limiter = AsyncRedisConcurrencyLimiter.from_url(
            server.url, 8, ttl=10, clock=clock, processes=4, on_store_error=policy
        )
        async with limiter:
            stored = await limiter.try_acquire("k")
            server.stop()
            seen: list[object] = []
            for call in (
                lambda: limiter.try_acquire("k"),
                lambda: limiter.acquire("k", timeout=0.5),
                lambda: limiter.acquire("k", timeout=0.5),
                lambda: limiter.in_flight("k"),
                stored.valid,
                stored.release,
            ):
                try:
                    got = await call()
                except redis.ConnectionError as error:
                    seen.append(type(error).__name__)
                else:
                    seen.append(getattr(got, "decision", got))
            seen.append(limiter.stats()["lost_releases"])
        return seen

    granted, refused = degraded(True, 0.0, 1, 10.0, 2), degraded(False, 9.5, 0, 9.5, 2)
    local = asyncio.run(main("local"))
    assert local == [granted, degraded(True, 0.0, 0, 10.0, 2), refused, 2, False, None, 1]
    unavailable = ["StoreUnavailableError"] * 5
    assert asyncio.run(main("raise")) == ["ConnectionError", *unavailable, 1]


# -- the breaker ---------------------------------------------------------------------------


def open_the_breaker(
    factory: ServerFactory, policy: Policy, retry: float
) -> tuple[RedisConcurrencyLimiter, RedisServer, object, float]:
    """A limiter of limit 1 whose store failed once (stopped), which opened its breaker
    (``retry``: its retry_interval), then restarted empty on the same port: the
    limiter, the server, the failed call's outcome and when it was made."""
    server = factory.start()
    limiter = RedisConcurrencyLimiter.from_url(
        server.url, 1, ttl=10, on_store_error=policy, retry_interval=retry
    )
    assert limiter.try_acquire("warm"), "the store did not answer at first"
    server.stop()
    opened = time.monotonic()
    first = outcome(lambda: limiter.try_acquire("k"))  # fails: the breaker opens
    server.restart()  # empty, on the same port
    return limiter, server, first, opened


@pytest.mark.parametrize("policy", ["closed", "raise"])
def test_the_breaker_skips_the_store_until_its_retry_interval(
    redis_server_factory: ServerFactory, policy: Policy
) -> None:
    """After the failure that opens it, every call answers by the policy with no
    command sent (INFO commandstats of the restarted server, the limiter's
    store_calls); the retry interval (60 s) outlasts the test."""
    retry = 60.0
    limiter, server, first, _ = open_the_breaker(redis_server_factory, policy, retry)
    with limiter, server.client() as admin:
        asked = limiter.stats()["store_calls"]
        calls: list[Callable[[], Any]] = [
            lambda: limiter.try_acquire("k"),
            lambda: limiter.acquire("k", timeout=5),
            lambda: limiter.in_flight("k"),
        ]
        skipped = [outcome(call) for call in calls]
        sent = (script_calls(admin), limiter.stats()["store_calls"] - asked)
        assert sent == (0, 0), f"(scripts run, store calls) while the breaker was open: {sent}"
        refusal = degraded(False, retry, 0, retry, 1)
        if policy == "raise":
            assert [first, *skipped] == ["ConnectionError"] + ["StoreUnavailableError"] * 3
        else:
            assert [first, *skipped] == [refusal, refusal, refusal, 0]
        assert limiter.stats()["breaker_open"] == 1, "the breaker is not open"


@pytest.mark.parametrize("policy", ["closed", "raise"])
def test_a_probe_after_the_retry_interval_closes_the_breaker(
    redis_server_factory: ServerFactory, policy: Policy
) -> None:
    """Once the retry interval (0.3 s) has passed, one call probes the store, which
    answers, and permits come from the store again."""
    retry = 0.3
    limiter, server, _, opened = open_the_breaker(redis_server_factory, policy, retry)
    with limiter, server.client() as admin:
        stored = Decision(True, 0.0, 0, 10.0, 1)
        wait_until(lambda: outcome(lambda: limiter.try_acquire("k")) == stored, "the probe", 30)
        waited = time.monotonic() - opened
        assert waited >= retry, f"a probe {waited:.3f} s after the failure, before {retry} s"
        stats = limiter.stats()
        assert (stats["breaker_open"], stats["breaker_openings"]) == (0, 1), f"not closed: {stats}"
        assert script_calls(admin) >= 1, "the probe ran no script"
        assert (limiter.in_flight("k"), bool(limiter.try_acquire("k"))) == (1, False)


# -- replies lost after the script ran ----------------------------------------------------------


def through_proxy(proxy: TcpProxy, policy: Policy) -> RedisConcurrencyLimiter:
    """Limit 1, ttl 0.5 s on the server's clock; a reply not heard within 0.5 s is lost."""
    limiter = RedisConcurrencyLimiter.from_url(
        url_of(proxy.port),
        1,
        ttl=TTL,
        timeout=0.5,
        on_store_error=policy,
        retry_interval=0.1,
        processes=1,  # "local" holds a permit of its own, counted or not
    )
    connected(limiter)
    return limiter


def connected(limiter: RedisConcurrencyLimiter) -> None:
    """Waits until a call is answered by the store (the breaker closed, a connection
    open, the script loaded): a reply dropped next is a script's, not a handshake's."""

    def from_the_store() -> bool:
        try:
            permit = limiter.try_acquire("warm")
        except StoreUnavailableError:
            return False
        permit.release()
        return not permit.decision.degraded

    wait_until(from_the_store, "the store to answer", 30)


def lose_next_reply(proxy: TcpProxy, policy: Policy, call: Any) -> Any:
    """``call()`` with its reply dropped (on a live connection: :func:`connected`):
    its answer, or None once it raised the client's timeout (under "raise")."""
    proxy.drop_next_reply()
    if policy == "raise":
        with pytest.raises(redis.TimeoutError):
            call()
        return None
    return call()


@contextmanager
def losing_the_reply(
    proxy: TcpProxy, policy: Policy, call: Any, admin: redis.Redis
) -> Iterator[Future[Any]]:
    """``call()`` with its reply dropped, in another thread, entered once the store
    ran its script (so that the test sees what it did within the ttl, while the
    call waits out its timeout): the future of :func:`lose_next_reply`'s answer,
    awaited on exit, and checked to have sent one script, never again (counted by
    the proxy: the test's own calls go to the server directly)."""
    ran, sent = script_calls(admin), proxy.commands("EVALSHA", "EVAL")
    with ThreadPoolExecutor(1) as pool:
        lost = pool.submit(lose_next_reply, proxy, policy, call)
        wait_until(lambda: script_calls(admin) > ran or lost.done(), "the script to run", 30)
        yield lost
        lost.result(timeout=30)
    assert proxy.commands("EVALSHA", "EVAL") - sent == 1, "not sent once, never again"


def held_by_nobody(direct: RedisConcurrencyLimiter, key: str) -> None:
    """The key's one slot is held, by a grant nobody heard of."""
    held = (direct.in_flight(key), bool(direct.try_acquire(key)))
    assert held == (1, False), f"(in flight, another granted): {held}, not (1, False)"


def frees_by_its_ttl(
    direct: RedisConcurrencyLimiter, admin: redis.Redis, key: str, at: int
) -> None:
    """The key's slot, held by nobody, frees when its ttl has passed on the server's
    clock (``at``: the server's µs before the grant), never earlier; then it is
    granted again."""
    wait_until(lambda: direct.in_flight(key) == 0, "the lost grant to expire", TTL + 30)
    freed = server_micros(admin) - at
    assert freed >= TTL * 1_000_000, f"freed {freed} µs after the grant, before its ttl {TTL} s"
    assert direct.try_acquire(key), "not granted again once freed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_grant_whose_reply_is_lost_expires_by_its_ttl(
    redis_server_factory: ServerFactory, policy: Policy
) -> None:
    server = redis_server_factory.start()
    admin = server.client()
    direct = RedisConcurrencyLimiter(admin, 1, ttl=TTL)  # the same keys, no proxy
    with TcpProxy(server.port) as proxy, through_proxy(proxy, policy) as limiter:
        for key, call in (
            ("k", lambda: limiter.try_acquire("k")),
            ("q", lambda: limiter.acquire("q", timeout=2)),
        ):
            connected(limiter)
            start = server_micros(admin)
            with losing_the_reply(proxy, policy, call, admin) as lost:
                held_by_nobody(direct, key)
            answer = lost.result()
            if answer is not None:  # answered by the policy, holding nothing on the store
                got = (answer.decision.degraded, answer.decision.allowed)
                assert got == (True, policy != "closed"), f"(degraded, allowed): {got}"
                answer.release()
            frees_by_its_ttl(direct, admin, key, start)
        stats = limiter.stats()
    lost_counts = (stats["store_errors"], stats["lost_releases"])
    assert lost_counts == (2, 0), f"(store errors, lost releases): {lost_counts}"
    admin.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["local", "raise"])
def test_a_queued_waiter_whose_reply_is_lost_is_handed_a_slot_that_expires(
    redis_server_factory: ServerFactory, policy: Policy
) -> None:
    """The store queued the waiter and nobody heard: a release hands its slot to
    that waiter's name, held by nobody, which frees by its ttl (or the place lapses
    by its lease first); never two holders on the store."""
    server = redis_server_factory.start()
    admin = server.client()
    direct = RedisConcurrencyLimiter(admin, 1, ttl=TTL)  # the holder
    with TcpProxy(server.port) as proxy, through_proxy(proxy, policy) as limiter:
        held = direct.try_acquire("q")
        call = lambda: limiter.acquire("q", timeout=2)  # noqa: E731
        with losing_the_reply(proxy, policy, call, admin) as lost:
            assert held.renew(), "still held: the slot goes by the release below"
            queued = int(admin.zcard(direct.redis_key("q") + b":q"))
            assert queued == 1, f"{queued} waiters queued on the store, not the one"
            start = server_micros(admin)
            held.release()  # handed to the waiter nobody hears
            held_by_nobody(direct, "q")
        answer = lost.result()
        if answer is not None:
            assert answer.decision.degraded, "the policy's answer is not degraded"
            answer.release()  # this process's share, in process
        frees_by_its_ttl(direct, admin, "q", start)
    admin.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["local", "raise"])
def test_a_release_whose_reply_is_lost_frees_once(
    redis_server_factory: ServerFactory, policy: Policy
) -> None:
    """The release ran on the store and its reply was lost: the slot is free (for
    another process), the release is counted lost, not released, and never sent
    again; the old permit frees nothing of the next holder's."""
    server = redis_server_factory.start()
    admin = server.client()
    direct = RedisConcurrencyLimiter(admin, 1, ttl=TTL)
    with TcpProxy(server.port) as proxy, through_proxy(proxy, policy) as limiter:
        permit = limiter.try_acquire("k")
        assert (permit.decision.allowed, permit.decision.degraded) == (True, False)
        before = limiter.stats()
        with losing_the_reply(proxy, policy, permit.release, admin) as lost:
            # Read within the permit's ttl: freed by the release, not by its expiry.
            assert direct.in_flight("k") == 0, "not freed on the store"
        assert lost.result() is None, "a release answers nothing, and raises only under raise"
        successor = direct.try_acquire("k")
        assert successor.token > permit.token > 0, "the successor's token is not larger"
        sent = proxy.commands()
        permit.release()  # once: nothing sent, nothing of the successor's freed
        assert proxy.commands() == sent, "the release was sent again"
        assert (direct.in_flight("k"), successor.valid()) == (1, True), "the successor's freed"
        stats = limiter.stats()
    assert stats["released"] == before["released"], "counted released"
    assert stats["lost_releases"] == before["lost_releases"] + 1, "not counted lost"
    admin.close()


# -- a restart without persistence ------------------------------------------------------------


def test_a_restart_loses_the_permits_and_their_holders_are_told(
    redis_server_factory: ServerFactory,
) -> None:
    """Every permit is gone with the store (the tokens' growth across it is in
    test_redis_permits.py): the old holder's valid() and renew() say so (a renewal
    never brings it back), its release frees nothing of the next holder's, and the
    next grant, after the reconnection and the script's reload, has a larger token."""
    server = redis_server_factory.start()
    limiter = RedisConcurrencyLimiter.from_url(server.url, 1, ttl=60, on_store_error="raise")
    with limiter:
        old = limiter.try_acquire("k")
        assert (bool(old), bool(limiter.try_acquire("k"))) == (True, False)
        server.restart()
        assert (old.valid(), old.renew(), limiter.in_flight("k")) == (False, False, 0)
        new = limiter.try_acquire("k")
        assert (new.decision.allowed, new.decision.degraded) == (True, False)
        assert new.token > old.token
        old.release()
        assert (limiter.in_flight("k"), new.valid()) == (1, True)
        stats = limiter.stats()
    assert (stats["script_loads"] >= 1, stats["fallback_decisions"]) == (True, 0)
