"""Every key a script touches is a key it was given (python/bucketlimit/_redis/scripts.md).

Redis's scripting contract asks that a script name every key it reads or writes in
KEYS: Redis Cluster routes a script by them, Dragonfly refuses undeclared keys by
default, ElastiCache Serverless routes by them. Here MONITOR watches a real
redis-server while every operation of the token bucket and permit limiters runs
(allows, batches, reservations, charges, give-backs, reports, the ``*_all`` calls,
leases taken, renewed, expired and given back, permits granted, queued, handed on,
renewed, released, given up and abandoned), and every command a script runs (the
``lua`` lines) must name only keys of its EVAL's or EVALSHA's KEYS. Which arguments
of a command are keys is the server's own answer (``COMMAND GETKEYS``).
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import redis.asyncio

from bucketlimit import acquire_all, allow_all, reserve_all
from bucketlimit.redis import (
    AsyncRedisConcurrencyLimiter,
    LeasePolicy,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
)
from bucketlimit.testing import ManualClock
from tests.support.redis_servers import RedisServer
from tests.support.threads import wait_until

#: The end of what is watched: a command no operation sends.
END = b"declared-keys-audit-end"
#: The script that tells whether MONITOR shows a script's commands after its EVAL
#: (Redis 7.0) or before it.
PROBE = "redis.call('EXISTS', KEYS[1]) return 1"
PROBE_KEY = b"declared-keys-audit-probe"

_LINE = re.compile(rb"^[\d.]+ \[\d+ ([^\]]+)\] (.*)$", re.DOTALL)
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)
_NAMED = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def unescaped(arg: bytes) -> bytes:
    """One argument of a MONITOR line as it was sent (Redis quotes it as sdscatrepr)."""

    def one(match: re.Match[bytes]) -> bytes:
        code = match.group(1)
        if code[:1] == b"x" and len(code) == 3:
            return bytes([int(code[1:], 16)])
        return _NAMED.get(code, code)

    return _ESCAPE.sub(one, arg)


@dataclass
class Call:
    """A command MONITOR showed: who ran it (a client's address, or ``lua``) and its
    arguments."""

    source: bytes
    argv: list[bytes]

    @property
    def name(self) -> bytes:
        return self.argv[0].upper()

    def is_script(self) -> bool:
        return self.source != b"lua" and self.name in (b"EVAL", b"EVALSHA")


@dataclass
class ScriptRun:
    """An EVAL or EVALSHA and the commands its script ran."""

    call: Call
    inner: list[Call] = field(default_factory=list)

    @property
    def declared(self) -> set[bytes]:
        count = int(self.call.argv[2])
        return set(self.call.argv[3 : 3 + count])

    def describe(self) -> str:
        argv = self.call.argv
        return f"{argv[0].decode()} {argv[1][:40]!r}... KEYS {sorted(self.declared)}"


class Monitor:
    """MONITOR on its own connection, read by a thread until :data:`END`."""

    def __init__(self, server: RedisServer) -> None:
        self.client = server.client()
        self.monitor = self.client.monitor()  # type: ignore[no-untyped-call]
        self.monitor.__enter__()  # MONITOR sent and confirmed: everything from now is seen
        self.calls: list[Call] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            line = self.monitor.connection.read_response()
            assert isinstance(line, bytes), line
            matched = _LINE.match(line)
            assert matched is not None, line
            argv = [unescaped(arg) for arg in _ARG.findall(matched.group(2))]
            if argv[-1:] == [END]:
                return
            self.calls.append(Call(matched.group(1), argv))

    def stop(self, admin: redis.Redis) -> list[Call]:
        admin.echo(END)
        self.thread.join(30)
        assert not self.thread.is_alive(), "MONITOR never showed the end of the audit"
        self.monitor.__exit__()
        self.client.close()
        return self.calls


def script_runs(calls: list[Call]) -> list[ScriptRun]:
    """The scripts that ran, each with its commands. Scripts run one at a time, so a
    script's commands are the ``lua`` lines next to its EVAL: after it or before it,
    as the probe (the first script) shows."""
    probe = next(i for i, call in enumerate(calls) if call.is_script())
    after = calls[probe + 1].source == b"lua"
    runs: list[ScriptRun] = []
    waiting: list[Call] = []
    for call in calls:
        if call.is_script():
            runs.append(ScriptRun(call, [] if after else waiting))
            waiting = []
        elif call.source == b"lua":
            if after:
                runs[-1].inner.append(call)
            else:
                waiting.append(call)
    assert runs[0].inner[0].argv == [b"EXISTS", PROBE_KEY], "the probe's command"
    return runs[1:]


def keys_of(
    admin: redis.Redis, call: Call, known: dict[tuple[bytes, ...], list[bytes]]
) -> list[bytes]:
    """The keys ``call`` names, by the server's COMMAND GETKEYS (none for TIME and
    PUBLISH)."""
    argv = tuple(call.argv)
    if argv not in known:
        try:
            keys = admin.command_getkeys(*argv)
        except redis.ResponseError as error:
            # TIME alone is "wrong number of arguments" for GETKEYS.
            if "no key arguments" not in str(error) and len(argv) > 1:
                raise
            keys = []
        known[argv] = [key if isinstance(key, bytes) else key.encode() for key in keys]
    return known[argv]


def shape(key: bytes) -> str:
    """A Redis key with its tag and user key left out: its kind (``:leases``, ``:h``)."""
    return re.sub(rb"\{[^}]*\}:[^:]*", b"{tag}:key", key).decode()


# -- the operations ---------------------------------------------------------------------


class Buckets:
    """Token bucket limiters on one ManualClock: ``plain`` (every operation of its
    own), ``other`` (a second limit for the ``*_all`` calls), ``leasing`` (hot keys:
    leases on ``plain``'s buckets) and ``batching`` (group commit on them)."""

    def __init__(self, client: redis.Redis) -> None:
        self.clock = ManualClock(1000.0)
        one: dict[str, Any] = {"clock": self.clock, "processes": 1}
        self.plain = RedisTokenBucketLimiter(client, 100, 10, prefix="audit:", **one)
        self.other = RedisTokenBucketLimiter(client, 50, 5, prefix="audit-other:", **one)
        self.leasing = RedisTokenBucketLimiter(
            client, 100, 10, prefix="audit:", lease=LeasePolicy(period=1.0), **one
        )
        self.batching = RedisTokenBucketLimiter(
            client, 100, 10, prefix="audit:", batching=True, **one
        )

    def prepared(self, key: str, state: str) -> str:
        """``key``'s bucket as ``state`` says: ``plain`` (as it is), ``leased`` (a
        lease of 50 out), ``expired`` (its lease record expired: the next call reads
        the records)."""
        if state != "plain":
            self.leasing.allow(key)
            self.leasing.allow(key)  # sized from the first: a lease of 50, recorded
        if state == "expired":
            self.clock.advance(2.5)  # the record lives twice the period
        return key

    def every_operation(self, state: str) -> None:
        plain, other = self.plain, self.other
        plain.allow(self.prepared(f"allow-{state}", state))
        plain.allow(self.prepared(f"allow-3-{state}", state), 3)
        plain.peek(self.prepared(f"peek-{state}", state))
        plain.allow_many([(self.prepared(f"many-{state}", state), 1), ("many-x", 2)])
        self.batching.allow_many([(self.prepared(f"batch-{state}", state), 1), ("batch-x", 1)])
        short = self.prepared(f"reserve-{state}", state)
        plain.allow(short, 40)
        waiting = plain.reserve(short, 100, max_wait=60)
        assert waiting.delay > 0
        waiting.settle(40)  # gives 60 back, with the line it waited at
        plain.reserve(self.prepared(f"cancel-{state}", state), 5).cancel()
        plain.acquire(self.prepared(f"acquire-{state}", state), 2)
        plain.charge(self.prepared(f"charge-{state}", state), 5)
        plain.refund(self.prepared(f"refund-{state}", state), 2)
        plain.observe(self.prepared(f"observe-{state}", state), 3, limit=100)
        plain.reset(self.prepared(f"reset-{state}", state))
        allow_all([(plain, self.prepared(f"all-{state}", state), 1), (other, f"all-{state}", 1)])
        both = reserve_all(
            [(plain, self.prepared(f"rall-{state}", state), 80), (other, f"rall-{state}", 2)],
            max_wait=60,
        )
        both.settle([60, 1])

    def leases(self) -> None:
        """A lease taken, used, renewed past its period (the old one given back), then
        given back by close()."""
        leasing = self.leasing
        for _ in range(10):
            leasing.allow("hot")
        self.clock.advance(1.0)
        leasing.allow("hot")
        leasing.close()


def permits_in_one_process(client: redis.Redis) -> None:
    """Permits granted, refused, queued, handed on, picked up, renewed, checked,
    released; a waiter whose timeout ends; acquire_all, allow_all and reserve_all
    with a permit, one of them waiting for it."""
    inflight = RedisConcurrencyLimiter(client, 1, ttl=60, prefix="audit-permits:", processes=1)
    held = inflight.try_acquire("k")
    assert held
    assert not inflight.try_acquire("k")
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(inflight.acquire("k", timeout=30)))
    waiter.start()
    wait_until(lambda: inflight.stats()["waiting"] == 1, "the waiter is queued")
    held.release()  # handed on to the waiter, told by a message
    waiter.join(30)
    (handed,) = got
    assert handed
    assert handed.renew()
    assert handed.valid()
    assert inflight.in_flight("k") == 1
    handed.release()

    clock = ManualClock(1000.0)
    timed = RedisConcurrencyLimiter(
        client, 1, ttl=10, clock=clock, prefix="audit-timed:", processes=1
    )
    timed.try_acquire("k")
    assert not timed.acquire("k", timeout=3)  # queued, then its timeout ends
    clock.advance(10)  # the holder's permit expired: the next call drops it
    assert timed.try_acquire("k")

    tpm = RedisTokenBucketLimiter(client, 100, 100, prefix="audit-tpm:", processes=1)
    request = acquire_all([(tpm, "org", 50), (inflight, "org")], timeout=5)
    assert request
    request.settle([10, 1])
    both = allow_all([(tpm, "org", 5), (inflight, "org")])
    assert both
    assert not allow_all([(tpm, "org", 5), (inflight, "org")]), "the permit is busy"
    both.cancel()
    reserved = reserve_all([(tpm, "org", 5), (inflight, "org")])
    assert reserved
    later: list[Any] = []
    queued = threading.Thread(
        target=lambda: later.append(acquire_all([(tpm, "org", 5), (inflight, "org")], timeout=30))
    )
    queued.start()
    wait_until(lambda: inflight.stats()["waiting"] == 1, "acquire_all waits for the permit")
    reserved.cancel()
    queued.join(30)
    (last,) = later
    assert last
    last.cancel()
    inflight.check()
    tpm.check()


def a_waiter_abandons_its_grant(url: str) -> None:
    """A waiter handed a permit, cancelled before it picks it up: the permit goes on."""

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(url)
        limiter = AsyncRedisConcurrencyLimiter(
            client, 1, ttl=600, prefix="audit-cancel:", processes=1
        )
        held = await limiter.try_acquire("k")
        first = asyncio.create_task(limiter.acquire("k"))
        second = asyncio.create_task(limiter.acquire("k"))
        while await client.zcard(limiter.redis_key("k") + b":q") < 2:
            await asyncio.sleep(0.01)
        await held.release()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        permit = await asyncio.wait_for(second, 10)
        await permit.release()
        await client.aclose()

    asyncio.run(main())


#: The commands the operations above make their scripts run, and the kinds of key
#: those commands name: what the audit must have seen to mean anything.
EXPECTED_COMMANDS = {
    b"GET", b"SET", b"DEL", b"TIME",  # buckets
    b"HGETALL", b"HSET", b"HDEL", b"PTTL", b"PEXPIRE",  # the lease hash
    b"HMGET", b"HGET", b"ZADD", b"ZREM", b"ZCARD", b"ZRANGE", b"ZSCORE", b"ZRANK",
    b"ZREMRANGEBYSCORE", b"PUBLISH",  # permits
}  # fmt: skip
EXPECTED_KEYS = {
    "a bucket": re.compile(rb"^audit:\{allow-plain\}:allow-plain$"),
    "a lease hash": re.compile(rb"^audit:\{[^}]*\}:[^:]*:leases$"),
    "a permit hash": re.compile(rb"^audit-permits:\{k\}:k$"),
    "permits held": re.compile(rb"^audit-[a-z]+:\{[^}]*\}:[^:]*:h$"),
    "waiters queued": re.compile(rb"^audit-[a-z]+:\{[^}]*\}:[^:]*:q$"),
    "grants to pick up": re.compile(rb"^audit-[a-z]+:\{[^}]*\}:[^:]*:g$"),
    "the processes": re.compile(rb"^audit:\{bucketlimit-processes\}:$"),
}


def test_every_key_a_script_touches_is_declared_in_its_keys(
    redis_server: RedisServer, redis_client: redis.Redis, redis_url: str
) -> None:
    monitor = Monitor(redis_server)
    try:
        redis_client.eval(PROBE, 1, PROBE_KEY)
        buckets = Buckets(redis_client)
        for state in ("plain", "leased", "expired"):
            buckets.every_operation(state)
        buckets.leases()
        buckets.plain.check()
        RedisTokenBucketLimiter(redis_client, 10, 1, prefix="audit:").allow("counted")
        permits_in_one_process(redis_client)
        a_waiter_abandons_its_grant(redis_url)
    finally:
        runs = script_runs(monitor.stop(redis_client))

    known: dict[tuple[bytes, ...], list[bytes]] = {}
    undeclared: dict[str, str] = {}  # command and shape of key -> an example
    commands: set[bytes] = set()
    touched: set[bytes] = set()
    for run in runs:
        declared = run.declared
        for call in run.inner:
            commands.add(call.name)
            for key in keys_of(redis_client, call, known):
                touched.add(key)
                if key not in declared:
                    kind = f"{call.name.decode()} {shape(key)}"
                    undeclared.setdefault(kind, f"{key!r} in {run.describe()}")
    assert not undeclared, "scripts ran commands on keys not in their KEYS:\n" + "\n".join(
        f"{kind}: e.g. {example}" for kind, example in sorted(undeclared.items())
    )
    missing = EXPECTED_COMMANDS - commands
    assert not missing, f"the operations never made a script run {sorted(missing)}: audit them"
    for kind, pattern in EXPECTED_KEYS.items():
        assert any(pattern.match(key) for key in touched), f"no script touched {kind}"
