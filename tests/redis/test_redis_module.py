"""The Redis/Valkey module (docs/redis.md, "The module"): one arithmetic with the Lua
scripts, on the same stored values, shipped with the package and found by the limiters.

- Parity: the same random operations on two servers, one serving them by the module
  and one by the scripts, on one ManualClock: every field of every answer equal.
- One key, both engines: a module limiter and a Lua limiter alternate on the same
  keys (a fleet switching during a rolling restart) and answer exactly as the
  in-process limiter does.
- The exact range: configurations the script refuses work with the module, and a
  value it wrote beyond 2**53 is a corrupt bucket to the script.
- Detection: ``engine="auto"`` uses the module where it is loaded and the script
  elsewhere; ``engine="module"`` without it is a configuration error.
- Cluster: a call over keys of two slots is refused (``CROSSSLOT``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

import bucketlimit
from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._redis.module import EngineName
from bucketlimit.redis import (
    ConfigurationError,
    CorruptBucketError,
    ExactRangeError,
    RedisConcurrencyLimiter,
    RedisTokenBucketLimiter,
    module_path,
)
from bucketlimit.testing import ManualClock
from tests.redis.test_redis_parity import PinnedScript
from tests.support.redis_servers import (
    RedisServer,
    ServerFactory,
    command,
    pin_min_ttl,
)

MICROS = 1_000_000


class Pinned(RedisTokenBucketLimiter):
    """Keys live ten minutes at least, on either engine (the ManualClock stands still
    while the server's TTLs run: see test_redis_parity.py)."""

    _script = PinnedScript

    def __init__(self, client: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(client, *args, **kwargs)
        pin_min_ttl(client)


@pytest.fixture
def servers(redis_server_factory: ServerFactory) -> tuple[RedisServer, RedisServer]:
    """A server with the module loaded, and one without."""
    return redis_server_factory.start(module=True), redis_server_factory.start(module=False)


def stats(client: redis.Redis) -> dict[str, int]:
    """Calls per command, from INFO commandstats."""
    info = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in info.items()}


# -- parity ----------------------------------------------------------------------------


def fields(answer: Any) -> tuple[Any, ...]:
    """Every field of an answer: a Decision's, a reservation's (its decision and
    delay), a permit's (granted, remaining, reset, retry; not its token, which the
    servers start from their own clocks for a new key)."""
    if isinstance(answer, Decision):
        return (
            answer.allowed,
            answer.retry_after,
            answer.remaining,
            answer.reset_after,
            answer.limit,
        )
    if isinstance(answer, (tuple, list)):
        return tuple(fields(item) for item in answer)
    return (answer,)


@dataclass
class Side:
    """One server's limiters for a parity run: two token buckets of different
    configurations (one prefix each) and a concurrency limiter, on one clock."""

    engine: EngineName
    client: redis.Redis
    clock: ManualClock
    limiters: list[RedisTokenBucketLimiter] = field(default_factory=list)
    permits: RedisConcurrencyLimiter | None = None
    held: dict[int, Any] = field(default_factory=dict)
    reservations: dict[int, Any] = field(default_factory=dict)


def side(server: RedisServer, engine: EngineName, configs: list[tuple[int, float, float]]) -> Side:
    client = server.client()
    clock = ManualClock()
    s = Side(engine, client, clock)
    for i, (capacity, rate, per) in enumerate(configs):
        s.limiters.append(
            Pinned(client, capacity, rate, clock, per=per, prefix=f"p{i}:", engine=engine)
        )
    s.permits = RedisConcurrencyLimiter(client, 2, ttl=3, clock=clock, engine=engine)
    return s


def step(s: Side, rng: random.Random, n: int) -> Any:
    """Operation ``n`` of a trace on one side; ``rng`` is a copy shared by both."""
    op = rng.choice(
        ["allow"] * 4
        + ["peek", "reserve", "reserve", "cancel", "settle", "charge"]
        + ["refund", "reset", "all", "reserve_all", "many", "take", "release", "renew"]
        + ["in_flight", "valid", "observe"]
    )
    i = rng.randrange(len(s.limiters))
    limiter = s.limiters[i]
    key = rng.choice(["a", "b", "c"])
    cost = rng.randint(1, limiter.capacity)
    s.clock.advance(rng.choice([0, 0, 1, 999, 100_000, 700_000, 3 * MICROS]) / MICROS)
    if op == "allow":
        return limiter.allow(key, cost)
    if op == "peek":
        return limiter.peek(key, cost)
    if op == "reserve":
        wait = rng.choice([None, 0, 0.5, 5.0])
        reservation = limiter.reserve(key, cost, max_wait=wait)
        s.reservations[n] = reservation
        return (reservation.decision, reservation.delay)
    if op in ("cancel", "settle"):
        if not s.reservations:
            return None
        reservation = s.reservations.pop(sorted(s.reservations)[rng.randrange(len(s.reservations))])
        if op == "cancel":
            reservation.cancel()
        else:
            reservation.settle(rng.randint(0, reservation.cost))
        return limiter.peek(key)
    if op == "charge":
        return limiter.charge(key, rng.randint(1, 3 * limiter.capacity))
    if op == "refund":
        limiter.refund(key, cost)
        return limiter.peek(key)
    if op == "reset":
        limiter.reset(key)
        return limiter.peek(key)
    if op == "observe":
        return limiter.observe(
            key, rng.randint(0, limiter.capacity), reset_after=rng.choice([None, 2.0])
        )
    if op == "all":
        return bucketlimit.redis.allow_all([(s.limiters[0], key), (s.limiters[1], key)], 1)
    if op == "reserve_all":
        reservation = bucketlimit.redis.reserve_all(
            [(s.limiters[0], key), (s.limiters[1], key)], 1, max_wait=rng.choice([None, 1.0])
        )
        s.reservations[n] = reservation
        return (reservation.decision, reservation.delay)
    if op == "many":
        pairs = [(rng.choice("abc"), rng.randint(1, limiter.capacity)) for _ in range(3)]
        return limiter.allow_many(pairs)
    permits = s.permits
    assert permits is not None
    if op == "take":
        permit = permits.try_acquire(key)
        if permit:
            s.held[n] = permit
        return (bool(permit), *fields(permit.decision))
    if op == "in_flight":
        return permits.in_flight(key)
    if not s.held:
        return None
    held = s.held[sorted(s.held)[rng.randrange(len(s.held))]]
    if op == "release":
        held.release()
        return permits.in_flight(held.key)
    if op == "renew":
        return held.renew()
    return held.valid()


def test_the_module_and_the_scripts_answer_alike(
    servers: tuple[RedisServer, RedisServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """Random operations of every kind (allow, peek, reservations and their cancel and
    settle, charge, refund, reset, observe, allow_all, reserve_all, batches, permits),
    on configurations with decimals and ``per``, on two servers and one clock each,
    started alike: every field of every answer is equal."""
    with_module, without = servers
    compared = differences = 0
    for seed in range(6):
        rng = random.Random(seed)
        configs = [
            (rng.randint(1, 30), rng.choice([1, 2.5, 0.1, 7, 1000]), rng.choice([1, 60, 0.5]))
            for _ in range(2)
        ]
        module_side = side(with_module, "module", configs)
        lua_side = side(without, "lua", configs)
        for n in range(150):
            state = rng.getstate()
            left = fields(step(module_side, rng, n))
            rng.setstate(state)
            right = fields(step(lua_side, rng, n))
            compared += 1
            if left != right:
                differences += 1
                print(f"seed {seed} step {n}: module {left} != lua {right}")
        assert stats(module_side.client).get("bucketlimit.allow", 0) > 0, "the module served"
        assert not any(name.startswith("bucketlimit.") for name in stats(lua_side.client))
    with capsys.disabled():
        print(f"\nmodule vs Lua: {compared} operations compared, {differences} differences")
    assert differences == 0, f"{differences} of {compared} answers differ between the engines"


# -- one key, both engines ------------------------------------------------------------


def test_a_fleet_may_switch_engines_on_the_same_keys(redis_server_factory: ServerFactory) -> None:
    """A module limiter and a Lua limiter on the same prefix, alternating at random on
    the same keys (reservations made by one are cancelled by the other): every answer
    is the in-process limiter's, so each reads what the other wrote."""
    server = redis_server_factory.start(module=True)
    client = server.client()
    clock = ManualClock()
    local = TokenBucketLimiter(10, 2.5, clock)
    engines = {
        name: Pinned(client, 10, 2.5, clock, prefix="fleet:", engine=name)
        for name in ("module", "lua")
    }
    rng = random.Random(7)
    waiting: list[tuple[Any, Any]] = []
    compared = 0
    for _ in range(400):
        clock.advance(rng.choice([0, 1, 400, 250_000, 1_300_000]) / MICROS)
        remote = engines[rng.choice(["module", "lua"])]
        key = rng.choice("xy")
        cost = rng.randint(1, 4)
        op = rng.choice(["allow", "allow", "reserve", "cancel", "charge", "refund"])
        if op == "allow":
            assert remote.allow(key, cost) == local.allow(key, cost)
        elif op == "reserve":
            mine, theirs = local.reserve(key, cost), remote.reserve(key, cost)
            assert (theirs.decision, theirs.delay) == (mine.decision, mine.delay)
            waiting.append((mine, theirs))
        elif op == "cancel" and waiting:
            mine, theirs = waiting.pop(rng.randrange(len(waiting)))
            mine.cancel()
            theirs.cancel()
        elif op == "charge":
            assert remote.charge(key, cost) == local.charge(key, cost)
        else:
            local.refund(key, cost)
            remote.refund(key, cost)
        assert remote.peek(key) == local.peek(key)
        compared += 1
    counts = stats(client)
    assert counts.get("bucketlimit.allow", 0) > 0, "the module served some calls"
    assert counts.get("evalsha", 0) > 0, "the scripts served the others"
    assert compared == 400


# -- the exact range ------------------------------------------------------------------


def test_the_module_computes_beyond_the_scripts_range(redis_server_factory: ServerFactory) -> None:
    """A capacity the script refuses (capacity * units per token past 2**53) works
    with the module, as the in-process limiter answers; the value it stores is then
    a corrupt bucket to the script, which refuses rather than guesses."""
    server = redis_server_factory.start(module=True)
    client = server.client()
    clock = ManualClock()
    capacity = 10**13  # 10**13 tokens of 10**6 units: 10**19 units
    with pytest.raises(ExactRangeError):
        RedisTokenBucketLimiter(client, capacity, 3, clock, prefix="big:")
    big = RedisTokenBucketLimiter(client, capacity, 3, clock, prefix="big:", engine="module")
    local = TokenBucketLimiter(capacity, 3, clock)
    for cost in (1, capacity // 3, capacity // 3, capacity // 2):
        clock.advance(0.25)
        assert_same(big.allow("k", cost), local.allow("k", cost))
    reservation, mine = big.reserve("k", capacity), local.reserve("k", capacity)
    assert_same(reservation.decision, mine.decision)
    assert reservation.delay == pytest.approx(mine.delay, rel=1e-15)
    stored = client.get(big.redis_key("k"))
    assert isinstance(stored, bytes)
    balance = int(stored.split()[0])
    assert abs(balance) >= 2**53, f"the stored balance {balance} is beyond Lua's doubles"
    lua = RedisTokenBucketLimiter(
        client, 10, 1, clock, prefix="big:", engine="lua", on_store_error="raise"
    )
    with pytest.raises(CorruptBucketError):
        lua.allow("k")


def assert_same(remote: Decision, local: Decision) -> None:
    """Equal decisions; waits past 2**53 µs as seconds may differ in their last bit
    (the store's whole µs divided in Python, the core's converted in Rust)."""
    assert (remote.allowed, remote.remaining, remote.limit) == (
        local.allowed,
        local.remaining,
        local.limit,
    )
    assert remote.retry_after == pytest.approx(local.retry_after, rel=1e-15)
    assert remote.reset_after == pytest.approx(local.reset_after, rel=1e-15)


# -- detection ------------------------------------------------------------------------


def test_auto_uses_the_module_where_it_is_loaded_and_the_script_elsewhere(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    for server, expected in zip(servers, ("bucketlimit.allow", "evalsha"), strict=True):
        client = server.client()
        limiter = RedisTokenBucketLimiter(client, 5, 1)
        assert limiter.engine == "auto"
        limiter.check()
        assert [limiter.allow("k").remaining for _ in range(3)] == [4, 3, 2]
        assert stats(client).get(expected, 0) >= 3, f"{expected} served the allows"


def test_engine_module_without_the_module_is_a_configuration_error(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    _, without = servers
    limiter = RedisTokenBucketLimiter(without.client(), 5, 1, engine="module")
    with pytest.raises(ConfigurationError, match="unknown command"):
        limiter.allow("k")
    with pytest.raises(ValueError, match="engine must be one of"):
        RedisTokenBucketLimiter(without.client(), 5, 1, engine="native")  # type: ignore[arg-type]


def test_the_module_file_is_shipped_and_loads(redis_server_factory: ServerFactory) -> None:
    server = redis_server_factory.start(extra_args=["--loadmodule", module_path()], module=False)
    modules = server.client().module_list()
    assert [module[b"name"] for module in modules] == [b"bucketlimit"]


# -- cluster --------------------------------------------------------------------------


def test_a_call_over_two_slots_is_refused(redis_server_factory: ServerFactory) -> None:
    """The keys are in the commands' key specs: a cluster node refuses keys of two
    slots (CROSSSLOT) before the command runs, and serves one slot's keys."""
    node = redis_server_factory.start(cluster=True, module=True)
    client = node.client()
    command(client, "CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    group = ("", 10, MICROS, 1, 1)
    with pytest.raises(redis.ResponseError, match="same slot"):  # the CROSSSLOT error
        command(client, "BUCKETLIMIT.ALLOW", "{a}:x", *group, "{b}:y", *group)
    deadline = time.monotonic() + 20  # a hang guard: the node serves its slots soon
    while b"cluster_state:ok" not in command(client, "CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "the one-node cluster never became ok"
        time.sleep(0.05)
    reply = command(client, "BUCKETLIMIT.ALLOW", "{a}:x", *group, "{a}:y", *group)
    assert reply[0] == 0, "allowed: one slot"


def test_keys_of_any_bytes_reach_the_module(redis_server_factory: ServerFactory) -> None:
    """A key with NUL bytes is a key like any other (a module that built its name as a
    C string would abort the server)."""
    server = redis_server_factory.start(module=True)
    client = server.client()
    limiter = RedisTokenBucketLimiter(client, 2, 1, ManualClock(), engine="module")
    for key in ["a\x00b", "\x00", "{\x00}:\x00"]:
        assert limiter.allow(key).remaining == 1, repr(key)
        assert limiter.reserve(key, 2).delay == 1.0, repr(key)
    assert client.ping(), "the server is alive"


def test_a_lease_that_leaves_tokens_in_the_bucket_is_ready_now(
    redis_server_factory: ServerFactory,
) -> None:
    """A lease asked for 10 of a bucket holding 3.5 tokens, waiting at most 0 µs: it
    gets the 3 whole tokens at once (delay 0, its call allowed), not a delay below
    zero (what the script answers: ceil(-0.5 token / p))."""
    server = redis_server_factory.start(module=True)
    client = server.client()
    client.set("{k}:k", f"{3 * MICROS + MICROS // 2} 0")
    reply = command(
        client, "BUCKETLIMIT.LEASE", "{k}:k", 0, 10, MICROS, 1, 1, 10, "me", MICROS, 0, 0
    )
    retry_after, remaining, _, granted, delay, returned, holders = reply
    assert (retry_after, granted, delay) == (0, 3, 0), reply
    assert (remaining, returned, holders) == (0, 0, 1), reply
