"""One Redis limiter's configuration and state, free of I/O (docs/design.md §6).

:class:`LimiterState` is what every operation (``bucketlimit._redis.flows``) reads
and updates: the exact units of the bucket, its keys and its scripts, the
breakers (one per cluster node), the refusal cache, the failure policy's
fallback, the live processes sharing the limit, and the counters ``stats()``
reports. The public classes (``bucketlimit.redis``) hold one and drive the flows
over it; nothing here sends a command.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Final, Protocol

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._histogram import ROUND_TRIP_BUCKETS, Histogram, fork_safe
from bucketlimit._redis.clients import LazyClient
from bucketlimit._redis.keys import Keys, key_slot
from bucketlimit._redis.module import Engine
from bucketlimit._redis.resilience import (
    CLOSED,
    LOCAL,
    Breaker,
    Fallback,
    Policy,
    Processes,
    RefusalCache,
)
from bucketlimit._redis.script import (
    HEARTBEAT,
    MAX_DEBT_CAPACITIES,
    SERVER_TIME,
    Script,
    general_script,
    lease_hash,
    limiter_script,
    max_debt_capacities,
)
from bucketlimit._redis.timing import StoreTime

logger = logging.getLogger("bucketlimit")


class Counters:
    """The numbers ``stats()`` reports, for every kind of limiter: one lock, since
    many threads may share a limiter. A limiter reports the ones it counts
    (:meth:`snapshot` with its names): a token bucket ``allowed`` and ``refused``, a
    concurrency limiter the same two as ``granted`` and ``refused``, and each the
    events of its own (a permit's ``released``, a lease's tokens, ...)."""

    __slots__ = (
        "__weakref__",
        "_lock",
        "abandoned",
        "allowed",
        "fallback_decisions",
        "lease_round_trips",
        "lease_tokens",
        "lease_tokens_expired",
        "lease_tokens_returned",
        "lost_refunds",
        "lost_releases",
        "refusal_cache_hits",
        "refused",
        "released",
        "script_loads",
        "store_calls",
        "store_errors",
    )

    abandoned: int
    allowed: int
    fallback_decisions: int
    lease_round_trips: int
    lease_tokens: int
    lease_tokens_expired: int
    lease_tokens_returned: int
    lost_refunds: int
    lost_releases: int
    refusal_cache_hits: int
    refused: int
    released: int
    script_loads: int
    store_calls: int
    store_errors: int

    def __init__(self) -> None:
        self._lock = threading.Lock()
        for name in self.__slots__:
            if name[0] != "_":
                setattr(self, name, 0)
        fork_safe(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def add(self, sent: int, allowed: bool | None = None) -> None:
        """A call that ended: the commands it sent and, for a decision (a permit
        granted or refused), whether it allowed. One lock per call: the flows call
        this once, at their end."""
        lock = self._lock
        lock.acquire()  # cheaper than `with` on every call, and nothing here raises
        self.store_calls += sent
        if allowed is not None:
            if allowed:
                self.allowed += 1
            else:
                self.refused += 1
        lock.release()

    def event(self, name: str, count: int = 1) -> None:
        """``count`` of one of the rarer things a call meets (``script_loads``,
        ``store_errors``, ``fallback_decisions``, ``lease_tokens``, ...)."""
        with self._lock:
            setattr(self, name, getattr(self, name) + count)

    def leased(
        self, round_trips: int, tokens: int = 0, returned: int = 0, expired: int = 0
    ) -> None:
        """A lease's round trips and tokens: leased, given back, expired unused."""
        with self._lock:
            self.lease_round_trips += round_trips
            self.lease_tokens += tokens
            self.lease_tokens_returned += returned
            self.lease_tokens_expired += expired

    def snapshot(self, names: tuple[str, ...]) -> dict[str, int]:
        """The counters ``names``, read at one moment."""
        with self._lock:
            return {name: getattr(self, name) for name in names}


class Breakers:
    """The breakers of one limiter: one for a standalone store; on a cluster one per
    primary (named by the client's slot map, ``host:port``), so that one shard's
    outage degrades only its keys, and the shared one until the map is known."""

    __slots__ = ("__weakref__", "_describe", "_lock", "_name", "_nodes", "_retry", "shared")

    def __init__(self, retry_interval: float, name: str, describe: Callable[[], str]) -> None:
        self._retry = retry_interval
        self._name = name
        self._describe = describe
        self.shared = Breaker(retry_interval, name, describe)
        self._nodes: dict[str, Breaker] = {}
        self._lock = threading.Lock()
        fork_safe(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def of(self, client: Any, bucket: bytes) -> Breaker:
        """The breaker of the node holding ``bucket`` in ``client``'s slot map."""
        try:
            node = client.nodes_manager.slots_cache[key_slot(bucket)][0].name
        except (LookupError, AttributeError, TypeError):
            return self.shared  # not known yet (or a client without the map)
        breaker = self._nodes.get(node)
        if breaker is None:
            with self._lock:
                breaker = self._nodes.get(node)
                if breaker is None:
                    breaker = Breaker(self._retry, f"{self._name} node {node}", self._describe)
                    self._nodes[node] = breaker
        return breaker

    def all(self) -> list[Breaker]:
        return [self.shared, *list(self._nodes.values())]


class Answering(Protocol):
    """What a limiter's state says of its fallback (a token bucket's ``Fallback``, a
    concurrency limiter's ``PermitFallback``): the policy answering, in words."""

    @property
    def description(self) -> str: ...


class Store(Protocol):
    """What the shared steps of every flow (``flows.ask``, its heartbeat, the failure
    policy's ``unanswered``) need of a limiter's state: a token bucket's
    :class:`LimiterState`, or a concurrency limiter's
    (``bucketlimit._redis.permits.PermitState``)."""

    @property
    def client(self) -> Any: ...
    @property
    def cluster(self) -> bool: ...
    @property
    def name(self) -> str: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def keys(self) -> Keys: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def round_trips(self) -> Histogram: ...
    @property
    def processes(self) -> Processes: ...
    @property
    def breakers(self) -> Breakers: ...
    @property
    def flying(self) -> set[object]: ...
    @property
    def time(self) -> StoreTime: ...

    def layout(self, script: object) -> str: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def closed(self) -> bool: ...

    def closing(self) -> str: ...
    def connect(self) -> Any: ...
    def learned(self, processes: int) -> None: ...
    def degraded(self, why: BaseException | None, *, logged: bool) -> None: ...


def default_prefix(capacity: int, p: int, unit: int) -> str:
    """The prefix of a limiter given none: its limit in the script's units
    (capacity, then the rate as p/q tokens a second), so that two different limits
    never read each other's buckets and a changed limit starts from full buckets
    (docs/design.md §6, "Keys")."""
    return f"bucketlimit:{capacity}:{p}/{unit // 1_000_000}:"


class StoreState:
    """What a token bucket's state (:class:`LimiterState`) and a concurrency
    limiter's (``bucketlimit._redis.permits.PermitState``) do alike: the client
    built on first use, a breaker per node, the script's ``now``, the first
    degraded answer logged. The subclass sets the attributes named here."""

    #: Readings of an injected clock stay within +/-2**clock_bits µs, so that what
    #: the script adds to them stays exact in Lua doubles.
    clock_bits: ClassVar[int] = 53

    source: Any  # the client or a LazyClient
    client: Any
    #: The module's commands or the scripts (``bucketlimit._redis.module``).
    engine: Engine
    cluster: bool
    clock: Callable[[], float] | None
    breakers: Breakers
    counters: Counters
    #: Seconds each command took to answer (``drivers.send``): the limiter's
    #: ``histograms()``, which bucketlimit.metrics exports.
    round_trips: Histogram
    name: str
    _warned: bool
    #: The commands on their way to the store now (each sent is its own token), and
    #: whether the limiter is closed: ``close()`` lets the first land before it closes
    #: the client, and after it nothing is sent (``drivers.send``).
    flying: set[object]
    closed: bool
    #: Where its calls take their time from (``timing``).
    time: StoreTime
    #: The scripts it runs (its own, where it has one; the general one).
    own: Script | None = None
    script: Script

    def layout(self, script: object) -> str:
        """Which script ``script`` (an EVALSHA's SHA1 or an EVAL's source) is, as
        ``timing.with_time`` reads its arguments."""
        own = self.own
        if own is not None and script in (own.sha, own.source):
            return "limiter"
        if script in (HEARTBEAT.sha, HEARTBEAT.source):
            return "heartbeat"
        return "general"

    def connect(self) -> Any:
        """The client, built now (once) if it is a ``LazyClient`` not built yet."""
        client = self.client
        if client is None:
            client = self.client = self.source.get()
        return client

    def same_client(self) -> object:
        """What allow_all compares: the client, or the LazyClient that will build it."""
        source = self.source
        if isinstance(source, LazyClient) and source.built:
            return source.get()
        return source

    def closing(self) -> str:
        """The error of a command sent once the limiter is closed."""
        return f"{self.name} is closed: close() ended it (build another limiter)"

    def land(self) -> None:
        """Closes the limiter (no command is sent from now on) and waits for the
        commands on their way to land, so that closing the client cuts none. Each is
        bounded by the client's timeout."""
        self.closed = True
        while self.flying:
            time.sleep(LANDING_STEP)

    async def land_async(self) -> None:
        """:meth:`land`, awaited."""
        self.closed = True
        while self.flying:
            await asyncio.sleep(LANDING_STEP)

    def breaker(self, key: bytes) -> Breaker:
        """The breaker of the node that holds ``key``."""
        if not self.cluster or self.client is None:
            return self.breakers.shared
        return self.breakers.of(self.client, key)

    def now(self) -> int | bytes:
        """The script's ``now``: the injected clock in µs, or "read the server's TIME"."""
        if self.clock is None:
            return SERVER_TIME
        seconds = self.clock()
        micros = _core.clock_to_micros(seconds)
        if not -(2**self.clock_bits) < micros < 2**self.clock_bits:
            raise ValueError(
                f"clock returned {seconds!r}: the Redis script computes in Lua doubles, "
                f"so readings must stay within +/-2**{self.clock_bits} microseconds"
            )
        return micros

    policy: Policy
    processes: Processes
    fallback: Answering

    def without_store(self) -> str:
        """What answers without the store, for the logs."""
        raise NotImplementedError

    def answering_policy(self) -> Policy:
        """The policy that answers without the store: ``"local"`` only once the
        processes sharing the limit are counted (or fixed); until then ``"closed"``,
        since no share can be told (docs/design.md §6, "How many processes")."""
        if self.policy == LOCAL and not self.processes.known:
            return CLOSED
        return self.policy

    def described(self) -> str:
        """The log line's part for a policy other than a counted ``"local"``."""
        if self.policy == LOCAL:
            return f"calls are refused: {self.processes.describe()}"
        return self.fallback.description

    def degraded(self, why: BaseException | None, *, logged: bool, refused: bool = False) -> None:
        """An answer given without the store (``degraded=True``): counted. Never
        silent: an outage's start is logged by its breaker, with this
        process's share (``logged``); the first degraded answer for another reason
        (a full pool, a redirection storm, a corrupt key) is logged here, once per
        limiter, with what calls get (``refused``: a refusal whatever the policy,
        as on a corrupt key)."""
        self.counters.event("fallback_decisions")
        if logged or self._warned:
            return
        self._warned = True
        logger.warning(
            "%s answered without its store for the first time (%s: %s); %s",
            self.name,
            type(why).__name__,
            why,
            "this call is refused" if refused else self.without_store(),
        )


class LimiterState(StoreState):
    """Everything one Redis limiter decides with (see the module docstring).

    ``client`` is the client, or a ``LazyClient`` building it on first use.
    """

    fallback: Fallback
    own: Script

    def __init__(
        self,
        client: Any,
        *,
        cluster: bool,
        capacity: int,
        p: int,
        unit: int,
        per: float,
        clock: Callable[[], float] | None,
        keys: Keys,
        script: Script,
        policy: Policy,
        processes: int | None,
        retry_interval: float,
        refusal_cache: bool,
        name: str,
        engine: Engine,
        timing: StoreTime,
        leasing: bool = False,
    ) -> None:
        self.source = client  # the client or a LazyClient
        self.time = timing
        self.engine = engine
        self.client: Any = None if isinstance(client, LazyClient) else client
        self.cluster = cluster
        self.capacity = capacity
        self.p = p
        self.unit = unit
        self.per = per
        self.full = capacity * unit
        #: Capacities a bucket may owe here: the core's bound with the module alone,
        #: else the scripts' D (docs/design.md §4), which the module may serve too.
        self.debt_capacities = (
            MAX_DEBT_CAPACITIES if engine.name == "module" else max_debt_capacities(self.full, p)
        )
        self.clock = clock
        self.keys = keys
        #: The scripts assembled from ``script`` (scripts.lua): the general one, and
        #: this limiter's own.
        self.script = general_script(script.source)
        self.own = limiter_script(script.source, capacity, unit, p)
        #: The start of the common allow's command: its own script by EVALSHA, one key.
        self.evalsha = ("EVALSHA", self.own.sha, 1)
        #: The values after `now` that the general script takes for each bucket.
        self.config_args = (capacity, unit, p)
        #: Whether this limiter leases: its calls on a bucket name the lease hash.
        self.leasing = leasing
        self.name = name
        self.counters = Counters()
        self.round_trips = Histogram(ROUND_TRIP_BUCKETS, wanted=False)
        self.policy: Policy = policy
        self.retry_interval = retry_interval
        # Counted only where the count is used: the "local" share.
        self.processes = Processes(processes if processes is not None or policy == LOCAL else 1)
        self.fallback = self._fallback()
        self.breakers = Breakers(retry_interval, name, self.without_store)
        # Only on the store's clock: an injected clock (a ManualClock) may jump ahead
        # of time.monotonic(), which the cache measures waits with.
        self.refusals = RefusalCache() if refusal_cache and clock is None else None
        self._client_lock = threading.Lock()
        self._warned = False  # the first degraded answer is logged
        self.flying = set()
        self.closed = False
        fork_safe(self)

    def _after_fork(self) -> None:
        self._client_lock = threading.Lock()
        self.processes.forked()
        self.fallback = self._fallback()

    def _fallback(self) -> Fallback:
        return Fallback(
            self.answering_policy(),
            self.capacity,
            self.p,
            self.unit,
            processes=self.processes.count,
            retry_interval=self.retry_interval,
            clock=self.clock,
        )

    # -- values sent to the script ---------------------------------------------------

    def bucket_keys(self, bucket: bytes) -> tuple[bytes, ...]:
        """The keys of a call on one bucket (but the common allow and its batches):
        with its lease hash when this limiter leases, else the bucket alone (one on
        which another limiter holds leases is sent again with it: flows.resent)."""
        return (bucket, lease_hash(bucket)) if self.leasing else (bucket,)

    def cost(self, cost: object) -> int:
        """A cost checked as the core checks it (1 <= cost <= capacity)."""
        if type(cost) is not int or not 0 < cost <= self.capacity:
            return _core.check_cost(cost, self.capacity)
        return cost

    def charged(self, cost: int) -> int:
        """The cost a charge sends: beyond 1 + D capacities any charge ends at the debt
        bound, so the script never multiplies past 2**53."""
        return min(cost, (1 + self.debt_capacities) * self.capacity)

    def decision(self, reply: Any) -> Decision:
        """A script's reply ``{retry_after_us, remaining, reset_after_us[, limit]}`` as a
        Decision: waits in whole µs, -1 for never; the limit of the tightest bucket
        follows when the script decided several."""
        retry_after, reset_after = reply[0], reply[2]
        return Decision(
            retry_after == 0,
            retry_after / 1_000_000 if retry_after >= 0 else INF,
            reply[1],
            reset_after / 1_000_000 if reset_after >= 0 else INF,
            reply[3] if len(reply) > 3 else self.capacity,
        )

    # -- without the store -----------------------------------------------------------

    def without_store(self) -> str:
        """What answers without the store, for the logs: the policy, and under
        ``"local"`` this process's share and how the processes are counted."""
        if self.policy != LOCAL or not self.processes.known:
            return self.described()
        return (
            f"{self.fallback.description}: {self.fallback.share} of {self.capacity} tokens, "
            f"{self.processes.describe()}"
        )

    def learned(self, processes: int) -> None:
        """A heartbeat read ``processes`` live processes sharing this limiter: the
        local share follows (the fallback is rebuilt when the share changes)."""
        if self.processes.learned(processes):
            self.fallback = self._fallback()


INF: Final = float("inf")
#: Seconds between two looks at the commands still on their way while closing.
LANDING_STEP: Final = 0.001
