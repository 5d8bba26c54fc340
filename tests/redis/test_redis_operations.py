"""Redis limiters under what an operator does to a store (docs/design.md §6).

Real servers built by the tests: a whole Redis Cluster stopped or hung, one of its
nodes killed, a primary demoted to a replica (READONLY), a connection pool too
small for a burst, a key of a ``str`` subclass. Each test names the defect it
reproduces. Assertions are counts, never durations; waits are bounded polling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from bucketlimit import Decision, RedisLimiterStats, TokenBucketLimiter
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    ConfigurationError,
    RedisTokenBucketLimiter,
    StoreUnavailableError,
    client_from_url,
)
from tests.support.redis_servers import RedisClusterNodes, ServerFactory, free_port

# Short timeouts keep an outage's timed-out calls cheap; the counts do not depend on them.
TIMEOUT = 0.1
# The slots the test clusters give each node (as redis-cli --cluster create does).
NODE_SLOTS = [(0, 5460), (5461, 10922), (10923, 16383)]


def url_of(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def key_on_node(node: int, prefix: str = "bucketlimit:", skip: int = 0) -> str:
    """A plain key whose bucket lives on the ``node``-th node of a test cluster."""
    low, high = NODE_SLOTS[node]
    found = (
        f"k{i}"
        for i in range(100_000)
        if low <= key_slot(f"{prefix}{{k{i}}}:k{i}".encode()) <= high
    )
    for _ in range(skip):
        next(found)
    return next(found)


def charged(cluster: RedisClusterNodes, key: str, capacity: int) -> int:
    """Tokens taken from a rate-0 bucket, as the cluster holds it."""
    client = cluster.client()
    try:
        value = client.get(f"bucketlimit:{{{key}}}:{key}")
    finally:
        client.close()
    return 0 if value is None else capacity - int(value.split()[0]) // 1_000_000


def wait_for(condition: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    """Bounded polling for something that must happen: not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout} s waiting for {what}")
        time.sleep(0.02)


@contextmanager
def closing(limiter: RedisTokenBucketLimiter) -> Iterator[RedisTokenBucketLimiter]:
    try:
        yield limiter
    finally:
        limiter.close()  # from_url's client, when a call built it


class Tally:
    """What a run of calls got: answers from the store, degraded answers, errors."""

    def __init__(self) -> None:
        self.answers = self.store_admitted = self.degraded = 0
        self.errors: list[BaseException] = []

    def add(self, answer: Decision) -> None:
        self.answers += 1
        if answer.degraded:
            self.degraded += 1
        elif answer.allowed:
            self.store_admitted += 1

    @property
    def calls(self) -> int:
        return self.store_admitted + self.degraded + len(self.errors)


# -- a whole cluster unreachable is an outage, not a mistake --------

CAPACITY = 100_000  # rate 0: every admission stays charged in Redis, to be counted
OUTAGE = 0.6  # seconds: longer than retry_interval, so that probes fail too
RETRY = 0.2


def run_sync(limiter: RedisTokenBucketLimiter, key: str, seconds: float, tally: Tally) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            tally.add(limiter.allow(key))
        except Exception as e:
            tally.errors.append(e)
        time.sleep(0.005)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["stop", "pause"])
def test_a_whole_cluster_down_or_hung_goes_to_the_policy(
    redis_server_factory: ServerFactory, fault: str
) -> None:
    # No call may raise ConfigurationError: RedisClusterException ("Redis Cluster
    # cannot be connected") is an outage, not a configuration error.
    cluster = redis_server_factory.cluster()
    key = key_on_node(1)
    with closing(
        RedisTokenBucketLimiter.from_url(
            cluster.url,
            CAPACITY,
            0,
            cluster=True,
            timeout=TIMEOUT,
            retry_interval=RETRY,
            prefix="bucketlimit:",
        )
    ) as limiter:
        before, during, after = Tally(), Tally(), Tally()
        run_sync(limiter, key, 0.2, before)
        down = time.monotonic()
        if fault == "stop":
            cluster.stop()
        else:
            cluster.pause()
        # A limiter built during the outage starts (nothing is sent at construction)
        # and answers too.
        late = RedisTokenBucketLimiter.from_url(
            cluster.url,
            CAPACITY,
            0,
            cluster=True,
            timeout=TIMEOUT,
            on_store_error="open",
            prefix="bucketlimit:",
        )
        assert late.allow(key).degraded
        assert_raise_policy(cluster.url, key)
        run_sync(limiter, key, OUTAGE, during)
        if fault == "stop":
            for server in cluster.servers:
                server.restart()  # empty, but nodes.conf brings the cluster back
        else:
            cluster.resume()
        wait_for(lambda: not limiter.allow(key).degraded, "answers from the cluster again")
        up = time.monotonic()
        run_sync(limiter, key, 0.2, after)
        stats = limiter.stats()

    assert_outage_answers(before, during, after, stats, up - down)
    if fault == "pause":
        # Nothing was lost: Redis charged every store-backed admission, plus the
        # commands that timed out and ran when the nodes woke up (docs/redis.md,
        # "What a degraded answer may have charged").
        assert_charged_once(charged(cluster, key, CAPACITY), before, after, stats)


def assert_outage_answers(
    before: Tally, during: Tally, after: Tally, stats: RedisLimiterStats, outage: float
) -> None:
    """Answers from the store before and after, by the policy during the outage (of
    ``outage`` seconds, from the fault to the first answer from the store again: a
    restarted node serves 2 s after it starts), with the breaker skipping the store."""
    assert before.errors == during.errors == after.errors == [], "a call raised"
    assert before.degraded == after.degraded == 0, "degraded while the cluster was up"
    assert during.degraded == during.calls > 0, (
        f"{during.calls} calls during the outage, {during.degraded} degraded"
    )
    assert during.store_admitted == 0, "admitted by the store while it was down"
    # The breaker opened and skipped the store: a few commands per interval, not one
    # per call (a breaker per node, and the shared one, each probe once per interval).
    assert stats["breaker_openings"] >= 1, "the breaker never opened"
    errors, bound = stats["store_errors"], 4 * (outage / RETRY + 2)
    assert errors <= bound, f"{errors} store errors in a {outage:.2f} s outage, over {bound:.0f}"


def assert_charged_once(spent: int, before: Tally, after: Tally, stats: RedisLimiterStats) -> None:
    """Redis charged every store-backed admission, and at most the commands that timed
    out (and ran when the nodes woke up) besides."""
    store_backed = before.store_admitted + after.store_admitted
    most = store_backed + stats["store_errors"] + 1
    assert store_backed <= spent <= most, (
        f"Redis charged {spent}: {store_backed} admitted by it, at most {most} with timeouts"
    )


def assert_raise_policy(url: str, key: str) -> None:
    """Under "raise": the client's error first (never ConfigurationError), then
    StoreUnavailableError while the breaker skips the store."""
    limiter = RedisTokenBucketLimiter.from_url(
        url,
        10,
        0,
        cluster=True,
        timeout=TIMEOUT,
        on_store_error="raise",
        retry_interval=60,
        prefix="bucketlimit:",
    )
    with pytest.raises((redis.RedisError, redis.exceptions.RedisClusterException)) as first:
        limiter.allow(key)
    assert not isinstance(first.value, (StoreUnavailableError, ConfigurationError))
    with pytest.raises(StoreUnavailableError):
        limiter.allow(key)


async def run_async(
    limiter: AsyncRedisTokenBucketLimiter, key: str, seconds: float, tally: Tally
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            tally.add(await limiter.allow(key))
        except Exception as e:
            tally.errors.append(e)
        await asyncio.sleep(0.005)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault", ["stop", "pause"])
def test_an_async_limiter_with_a_whole_cluster_down_or_hung(
    redis_server_factory: ServerFactory, fault: str
) -> None:
    # Every answer comes from the policy, probes included: not 19 degraded answers
    # and then ConfigurationError on every probe.
    cluster = redis_server_factory.cluster()
    key = key_on_node(2)
    before, during, after = Tally(), Tally(), Tally()
    outage = [0.0]  # when the fault began, then how long until the store answered again

    async def main() -> RedisLimiterStats:
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            cluster.url,
            CAPACITY,
            0,
            cluster=True,
            timeout=TIMEOUT,
            retry_interval=RETRY,
            prefix="bucketlimit:",
        )
        try:
            await run_async(limiter, key, 0.2, before)
            outage[0] = time.monotonic()
            if fault == "stop":
                cluster.stop()
            else:
                cluster.pause()
            await run_async(limiter, key, OUTAGE, during)
            if fault == "stop":
                for server in cluster.servers:
                    server.restart()
            else:
                cluster.resume()
            deadline = time.monotonic() + 20
            while (await limiter.allow(key)).degraded:
                assert time.monotonic() < deadline, "the cluster never answered again"
                await asyncio.sleep(0.02)
            outage[0] = time.monotonic() - outage[0]
            await run_async(limiter, key, 0.2, after)
            return limiter.stats()
        finally:
            await limiter.client.aclose()

    stats = asyncio.run(main())
    assert_outage_answers(before, during, after, stats, outage[0])
    if fault == "pause":
        assert_charged_once(charged(cluster, key, CAPACITY), before, after, stats)


# -- from_url(cluster=True) sends nothing at construction -------------


def test_from_url_cluster_connects_on_first_use() -> None:
    # redis-py's RedisCluster asks for CLUSTER SLOTS when built: if from_url built it
    # at once, an app building its limiters at import would fail during an outage.
    url = url_of(free_port())  # nothing listens there
    lazy = client_from_url(url, cluster=True)  # what from_url builds its limiter on
    limiter = RedisTokenBucketLimiter(lazy, 5, 1, on_store_error="open")
    assert not lazy.built, "nothing built, nothing sent"
    answer = limiter.allow("k")
    assert answer.allowed
    assert answer.degraded
    assert limiter.stats()["breaker_openings"] == 1, "not one outage"
    # Reading `client` builds it now, and says why it cannot.
    with pytest.raises(redis.exceptions.RedisClusterException, match="cannot be connected"):
        _ = limiter.client
    asynchronous = client_from_url(url, cluster=True, asyncio=True)
    AsyncRedisTokenBucketLimiter(asynchronous, 5, 1)
    assert not asynchronous.built


def test_from_url_builds_its_client_once(redis_url: str) -> None:
    limiter = RedisTokenBucketLimiter.from_url(redis_url, 5, 1, prefix="bucketlimit:")
    assert limiter.allow("k")
    client = limiter.client
    assert limiter.client is client
    assert limiter.allow("k").remaining == 3, "not the second call on one bucket"
    assert isinstance(client, redis.Redis)
    assert isinstance(client.connection_pool, redis.BlockingConnectionPool)
    client.close()


# -- the operator limit: one breaker per limiter covered a whole cluster --------------

#: A killed node refuses at once: a long timeout costs nothing there, and on a loaded
#: machine a healthy node's reply may take more than TIMEOUT.
KILLED_TIMEOUT = 5.0


@pytest.mark.timeout(60)
def test_one_nodes_outage_degrades_only_its_keys(redis_server_factory: ServerFactory) -> None:
    # With one breaker per limiter, one master of three down would degrade the keys
    # on the two healthy masters too.
    cluster = redis_server_factory.cluster()
    keys = [key_on_node(node) for node in range(3)]
    with closing(
        RedisTokenBucketLimiter.from_url(
            cluster.url,
            1_000,
            0,
            cluster=True,
            timeout=KILLED_TIMEOUT,
            retry_interval=30,
            prefix="bucketlimit:",
            processes=1,  # "local" answers from the whole capacity, counted or not
        )
    ) as limiter:
        assert [limiter.allow(key).degraded for key in keys] == [False] * 3
        cluster.servers[2].kill()
        answers = [limiter.allow(key) for key in keys * 5]
        assert [a.degraded for a in answers] == [False, False, True] * 5
        assert all(a.allowed for a in answers)
        stats = limiter.stats()
        assert stats["breaker_openings"] == 1, "not one outage, of one node"
        assert stats["store_errors"] == 1, "the dead node's breaker skipped it"
        # Other keys of the healthy nodes are unaffected as well.
        assert not limiter.allow(key_on_node(0, skip=3)).degraded


def test_one_nodes_outage_degrades_only_its_keys_async(
    redis_server_factory: ServerFactory,
) -> None:
    cluster = redis_server_factory.cluster()
    keys = [key_on_node(node) for node in range(3)]

    async def main() -> tuple[list[bool], RedisLimiterStats]:
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            cluster.url,
            1_000,
            0,
            cluster=True,
            timeout=KILLED_TIMEOUT,
            retry_interval=30,
            prefix="bucketlimit:",
        )
        try:
            assert [(await limiter.allow(key)).degraded for key in keys] == [False] * 3
            cluster.servers[0].kill()
            degraded = [(await limiter.allow(key)).degraded for key in keys * 5]
            return degraded, limiter.stats()
        finally:
            await limiter.client.aclose()

    degraded, stats = asyncio.run(main())
    assert degraded == [True, False, False] * 5, "degraded answers for another node's keys"
    assert stats["breaker_openings"] == 1, "not one outage, of one node"


# -- a full connection pool is not an outage ----------------------------

BURST = 150  # tasks at once: more than redis-py's pool of 100


def test_a_burst_larger_than_the_pool_waits_for_a_connection(redis_url: str) -> None:
    # A pool of 100 that raised when full would give the other 50 MaxConnectionsError,
    # answered degraded, and open the breaker (under "closed": 50 refusals).
    async def main() -> tuple[list[Decision], RedisLimiterStats]:
        # timeout=2: the 100 connections open at once, and on a loaded machine
        # some take longer than the default 0.25 s to connect; waiting for a free
        # connection is what is tested, not the connect time.
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            redis_url,
            1_000,
            0,
            on_store_error="closed",
            retry_interval=30,
            timeout=2,
            prefix="bucketlimit:",
        )
        try:
            answers = await asyncio.gather(*(limiter.allow("k") for _ in range(BURST)))
            return list(answers), limiter.stats()
        finally:
            await limiter.client.aclose()

    answers, stats = asyncio.run(main())
    assert [a.degraded for a in answers] == [False] * BURST
    assert all(a.allowed for a in answers)
    assert stats["breaker_openings"] == stats["store_errors"] == 0, f"an outage: {stats}"
    client = redis.Redis.from_url(redis_url)
    value = client.get("bucketlimit:{k}:k")
    client.close()
    assert value is not None
    assert int(value.split()[0]) // 1_000_000 == 1_000 - BURST, "charged once per admission"


def test_an_exhausted_pool_of_your_own_is_waited_for_then_answered_by_the_policy(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A client you built with a small pool that raises when full: a call that finds it
    # full waits for a connection (nothing was sent); one still without a connection
    # after drivers.POOL_WAIT is answered by the policy, marked degraded. The store is
    # not down, so the breaker stays closed and nothing is logged as an outage.
    caplog.set_level(logging.INFO, logger="bucketlimit")

    async def main() -> tuple[list[Decision], list[Decision], Decision, RedisLimiterStats]:
        client = redis.asyncio.Redis.from_url(
            redis_url, max_connections=5, retry=redis.asyncio.retry.Retry(NoBackoff(), 0)
        )
        # Unbatched: 40 allows at once are 40 round trips wanting 40 connections
        # (shared round trips would send them in two, on one connection).
        limiter = AsyncRedisTokenBucketLimiter(
            client, 1_000, 0, on_store_error="closed", batching=False, prefix="bucketlimit:"
        )
        try:
            burst = await asyncio.gather(*(limiter.allow("k") for _ in range(40)))
            # Every connection held by a command that blocks past the pool wait.
            held = [asyncio.ensure_future(client.blpop(["nothing"], timeout=3)) for _ in range(5)]
            admin = redis.Redis.from_url(redis_url)
            while admin.info("clients")["blocked_clients"] < 5:  # every connection is held
                await asyncio.sleep(0.01)
            admin.close()
            starved = await asyncio.gather(*(limiter.allow("k") for _ in range(5)))
            await asyncio.gather(*held)
            return list(burst), list(starved), await limiter.allow("k"), limiter.stats()
        finally:
            await client.aclose()

    burst, starved, later, stats = asyncio.run(main())
    assert not any(a.degraded for a in burst), "a burst waits for its pool's connections"
    assert all(a.degraded and not a.allowed for a in starved), '"closed": refused, degraded'
    assert not later.degraded, "the next call asks the store"
    assert stats["breaker_openings"] == stats["store_errors"] == 0, f"an outage: {stats}"
    assert stats["fallback_decisions"] == len(starved), f"{len(starved)} degraded: {stats}"
    # No outage, so no breaker's lines; but the first answer without the store says
    # why, once (a degraded answer is never silent).
    [record] = [r for r in caplog.records if r.name == "bucketlimit"]
    assert record.levelno == logging.WARNING
    assert "answered without its store for the first time (MaxConnectionsError" in (
        record.getMessage()
    )


def test_an_exhausted_blocking_pool_of_your_own_is_not_an_outage(redis_url: str) -> None:
    # The sync twin, with a blocking pool whose wait runs out: redis-py raises
    # ConnectionError("No connection available."), which is not the store's failure.
    pool = redis.BlockingConnectionPool.from_url(
        redis_url, max_connections=1, timeout=0.05, retry=Retry(NoBackoff(), 0)
    )
    client = redis.Redis.from_pool(pool)
    limiter = RedisTokenBucketLimiter(client, 10, 0, on_store_error="open", prefix="bucketlimit:")
    held = pool.get_connection()  # type: ignore[no-untyped-call]  # its one connection, busy
    try:
        answer = limiter.allow("k")
    finally:
        pool.release(held)  # type: ignore[no-untyped-call]
    assert answer.allowed
    assert answer.degraded
    assert not limiter.allow("k").degraded
    stats = limiter.stats()
    assert stats["breaker_openings"] == stats["store_errors"] == 0, f"an outage: {stats}"
    client.close()


# -- READONLY keeps the store failing until a write succeeds -----------


def test_a_demoted_primary_is_one_outage_not_a_flapping_breaker(
    redis_server_factory: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # A refusal (which writes nothing) succeeds on the demoted primary. If it closed
    # the breaker, the next allow would reopen it: one outage, many openings.
    caplog.set_level(logging.INFO, logger="bucketlimit")
    primary = redis_server_factory.start(extra_args=["--repl-diskless-sync-delay", "0"])
    demoted = redis_server_factory.start()
    with closing(
        RedisTokenBucketLimiter.from_url(primary.url, 1, 0, prefix="bucketlimit:")
    ) as on_primary:
        assert on_primary.allow("spent")  # a bucket with nothing left
    admin = demoted.client()
    admin.replicaof("127.0.0.1", primary.port)
    wait_for(lambda: admin.exists("bucketlimit:{spent}:spent"), "the replica to sync")
    with closing(
        RedisTokenBucketLimiter.from_url(
            demoted.url,
            1,
            0,
            retry_interval=0,
            refusal_cache=False,
            on_store_error="open",
            prefix="bucketlimit:",
        )
    ) as limiter:
        answers = [limiter.allow(key) for key in ["fresh", "spent"] * 5]
        # Each allow of "fresh" needs a write: READONLY, answered by the policy; each
        # refusal of "spent" is the replica's answer, and closes nothing.
        assert [a.degraded for a in answers] == [True, False] * 5
        assert limiter.stats()["breaker_openings"] == 1, "not one outage"
        admin.replicaof("NO", "ONE")  # promoted: writes succeed again
        assert not limiter.allow("fresh-2").degraded
        assert not limiter.allow("fresh").degraded
        assert limiter.stats()["breaker_openings"] == 1, "the breaker flapped"
    admin.close()
    ours = [r for r in caplog.records if r.name == "bucketlimit"]
    assert [r.levelno for r in ours] == [logging.WARNING, logging.INFO]


# -- a key is its content ------------------------------------------------


class TenantId(str):
    """A str subclass overriding what a key's encoding might call."""

    def translate(self, table: Any) -> str:
        return "mallory"

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"mallory"

    def __str__(self) -> str:
        return "mallory"

    def __len__(self) -> int:
        return 0


def test_a_str_subclass_is_charged_by_its_content(redis_client: redis.Redis) -> None:
    # If Keys called the key's own translate(), TenantId("alice") would charge
    # mallory's bucket in Redis while the in-process limiter charges alice's.
    limiter = RedisTokenBucketLimiter(redis_client, 3, 0, prefix="bucketlimit:", processes=1)
    local = TokenBucketLimiter(3, 0)
    assert limiter.allow(TenantId("alice")).remaining == local.allow(TenantId("alice")).remaining
    assert limiter.peek("alice").remaining == local.peek("alice").remaining == 1
    assert redis_client.keys("*") == [b"bucketlimit:{alice}:alice"]


def test_a_hash_tag_of_a_str_subclass_is_its_content(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(
        redis_client,
        3,
        0,
        prefix="t:",
        hash_tag=lambda key: TenantId(key.split("/")[0]),
        processes=1,  # no heartbeat key
    )
    assert limiter.allow(TenantId("acme/alice"))
    assert redis_client.keys("*") == [b"t:{acme}:acme/alice"]


# -- the asyncio degraded path yields to the loop -----------


@pytest.mark.parametrize("path", ["breaker open", "refusal cache"])
def test_an_async_answer_without_io_still_lets_the_loop_run(redis_url: str, path: str) -> None:
    # A task looping on a degraded (or cached) answer must still await something that
    # suspends: otherwise no other task runs until it is done.
    calls = 200

    async def main() -> int:
        if path == "breaker open":
            limiter = AsyncRedisTokenBucketLimiter.from_url(
                url_of(free_port()),
                5,
                1,
                on_store_error="open",
                retry_interval=60,
                prefix="bucketlimit:",
            )
        else:
            limiter = AsyncRedisTokenBucketLimiter.from_url(
                redis_url, 1, 0.001, prefix="bucketlimit:"
            )
        try:
            # The failure that opens the breaker; or the admission and the refusal to cache.
            warm_up = 1 if path == "breaker open" else 2
            for _ in range(warm_up):
                await limiter.allow("k")
            sent = limiter.stats()["store_calls"]
            ticks = 0
            stop = False

            async def ticker() -> None:
                nonlocal ticks
                while not stop:
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.ensure_future(ticker())
            await asyncio.sleep(0)
            start = ticks
            for _ in range(calls):
                answer = await limiter.allow("k")
                assert answer.degraded if path == "breaker open" else not answer.allowed
            seen = ticks - start
            stop = True
            await task
            assert limiter.stats()["store_calls"] == sent, "every answer came without I/O"
            return seen
        finally:
            await limiter.client.aclose()

    ticks = asyncio.run(main())
    assert ticks >= calls // 2, f"another task ran {ticks} times during {calls} answers"


# -- the asyncio cluster client during a slot migration ------------------

MIGRATIONS = 4  # back and forth, of one slot under load


@pytest.mark.timeout(90)
def test_an_async_cluster_limiter_through_slot_migrations(
    redis_server_factory: ServerFactory,
) -> None:
    # With 8 tasks, a limiter that mishandles the migrations would degrade 97 % of
    # answers, open the breaker 20 times, let AttributeError reach callers, and charge
    # 13 calls in Redis *and* answer them from the fallback. from_url's client keeps
    # its connections on MOVED (reinitialize_steps=0); a redirect storm is sent once more.
    cluster = redis_server_factory.cluster()
    tag = "tenant"
    slot = key_slot(f"bucketlimit:{{{tag}}}:x".encode())
    keys = [f"user-{i}" for i in range(32)]
    seed = cluster.owner(slot).client()
    for i in range(300):  # keys to move, so that each migration takes a while
        seed.set(f"seed{{{tag}}}{i}", "x")
    seed.close()
    tally, migrations, finished = Tally(), [0], asyncio.Event()

    def migrate(loop: asyncio.AbstractEventLoop) -> None:
        try:
            for _ in range(MIGRATIONS):
                source = cluster.owner(slot)
                target = next(s for s in cluster.servers if s is not source)
                cluster.move_slot(slot, target, batch=1)  # ASK for each moved key meanwhile
                migrations[0] += 1
        finally:
            loop.call_soon_threadsafe(finished.set)

    async def worker(limiter: AsyncRedisTokenBucketLimiter, offset: int) -> None:
        i = offset
        while not finished.is_set():
            try:
                tally.add(await limiter.allow(keys[i % len(keys)]))
            except Exception as e:
                tally.errors.append(e)
            i += 1
            await asyncio.sleep(0)

    async def main() -> RedisLimiterStats:
        # A timeout far above a reply's time: what is tested is the redirections, and
        # on a loaded machine (CI runs three interpreters' suites) the migrating thread
        # of this process can hold the loop past 0.25 s, which is a slow reply, not an
        # outage (a CI run on CPython 3.13 saw one TimeoutError open the breaker).
        limiter = AsyncRedisTokenBucketLimiter.from_url(
            cluster.url,
            CAPACITY,
            0,
            cluster=True,
            hash_tag=lambda key: tag,
            prefix="bucketlimit:",
            timeout=5.0,
        )
        try:
            await limiter.check()
            loop = asyncio.get_running_loop()
            mover = loop.run_in_executor(None, migrate, loop)
            await asyncio.gather(*(worker(limiter, i) for i in range(8)))
            await mover
            return limiter.stats()
        finally:
            await limiter.client.aclose()

    stats = asyncio.run(main())
    client = cluster.client()
    values = [client.get(f"bucketlimit:{{{tag}}}:{key}") for key in keys]
    client.close()
    spent = sum(CAPACITY - int(v.split()[0]) // 1_000_000 for v in values if v is not None)
    print(  # the figures docs/redis.md's resharding table quotes
        f"\n{migrations[0]} migrations: {tally.answers} calls, {tally.degraded} degraded, "
        f"{len(tally.errors)} exceptions, {tally.store_admitted} admitted, {spent} charged"
    )
    assert migrations[0] == MIGRATIONS, f"{migrations[0]} migrations of {MIGRATIONS}"
    assert tally.errors == [], "a call raised"
    assert tally.store_admitted > 0, "nothing admitted by the store"
    assert stats["breaker_openings"] == 0, "a migration is not an outage"
    assert tally.degraded == stats["fallback_decisions"], f"{tally.degraded} degraded: {stats}"
    assert spent == tally.store_admitted, (
        f"{spent} charged, {tally.store_admitted} admitted: every admission charged once"
    )
