"""Parity for permits: the scripts' permit part held to the in-process
``ConcurrencyLimiter`` (src/concurrency.rs) on random traces (docs/design.md §4,
"Permits").

Each side has its own ManualClock, advanced alike; a waiting ``acquire`` sleeps on
its side's clock (``ManualClock.sleep``), so after every step the two clocks must
read the same, and every answer must be equal: grants, decisions (``remaining``,
``reset_after``, ``retry_after``), releases, renewals, validity, the permits held.
Fencing tokens come from different counters (one per limiter in process, one per
key and at least the clock's µs on Redis), so what is compared is their order: a
key's tokens grow with every grant on both sides.

The same for the calls over a token bucket and a concurrency limiter
(``allow_all``, ``reserve_all``, ``acquire_all``, their ``settle`` / ``cancel``):
one script on Redis, the core's locks in process.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bucketlimit
from bucketlimit import ConcurrencyLimiter, TokenBucketLimiter
from bucketlimit.redis import RedisConcurrencyLimiter, RedisTokenBucketLimiter
from bucketlimit.testing import ManualClock

MICROS = 1_000_000


@dataclass(frozen=True)
class Step:
    """Advance both clocks by ``micros``, then ``op`` on ``key``; ``pick`` chooses a
    permit (release, renew, valid) or a reservation (settle, cancel); ``timeout`` an
    acquire's."""

    micros: int
    op: str
    key: str
    pick: int
    timeout: float | None


steps = st.lists(
    st.builds(
        Step,
        micros=st.one_of(st.just(0), st.integers(0, 10), st.integers(0, 4 * MICROS)),
        op=st.sampled_from(
            ["take", "take", "acquire", "release", "release", "renew", "valid", "in_flight"]
        ),
        key=st.sampled_from(["a", "b"]),
        pick=st.integers(0, 30),
        timeout=st.sampled_from([None, 0, 0.5, 1.5, 3.0]),
    ),
    max_size=30,
)


class Sides:
    """The in-process limiter and the Redis one, each on its own clock."""

    def __init__(self, client: redis.Redis, limit: int, ttl: float) -> None:
        self.local_clock, self.redis_clock = ManualClock(), ManualClock()
        prefix = f"parity-{uuid.uuid4().hex}:"
        self.local = ConcurrencyLimiter(limit, ttl=ttl, clock=self.local_clock)
        self.redis = RedisConcurrencyLimiter(
            client, limit, ttl=ttl, clock=self.redis_clock, prefix=prefix
        )
        self.held: list[tuple[Any, Any]] = []  # (in-process permit, Redis permit)
        self.tokens: dict[str, list[tuple[int, int]]] = {}

    def advance(self, micros: int) -> None:
        self.local_clock.advance(micros / MICROS)
        self.redis_clock.advance(micros / MICROS)

    def granted(self, key: str, local: Any, remote: Any) -> None:
        assert bool(local) == bool(remote)
        if local:
            self.held.append((local, remote))
            self.tokens.setdefault(key, []).append((local.token, remote.token))

    def step(self, step: Step) -> None:
        self.advance(step.micros)
        key = step.key
        if step.op == "take":
            local, remote = self.local.try_acquire(key), self.redis.try_acquire(key)
            assert local.decision == remote.decision
            self.granted(key, local, remote)
        elif step.op == "acquire":
            local = self.local.acquire(key, timeout=step.timeout)
            remote = self.redis.acquire(key, timeout=step.timeout)
            assert local.decision == remote.decision
            self.granted(key, local, remote)
        elif step.op == "in_flight":
            assert self.local.in_flight(key) == self.redis.in_flight(key)
        elif self.held:
            local, remote = self.held[step.pick % len(self.held)]
            if step.op == "release":
                local.release()
                remote.release()
            elif step.op == "renew":
                assert local.renew() == remote.renew()
            else:
                assert local.valid() == remote.valid()
        assert self.local_clock.now == self.redis_clock.now

    def check_tokens(self) -> None:
        for grants in self.tokens.values():
            local = [a for a, _ in grants]
            remote = [b for _, b in grants]
            assert local == sorted(set(local))
            assert remote == sorted(set(remote))
        for key in ("a", "b"):
            assert self.local.in_flight(key) == self.redis.in_flight(key)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit=st.integers(1, 3), ttl=st.sampled_from([1, 2.5, 10]), trace=steps)
def test_random_traces_answer_as_in_process(
    redis_client: redis.Redis, limit: int, ttl: float, trace: list[Step]
) -> None:
    sides = Sides(redis_client, limit, ttl)
    for step in trace:
        sides.step(step)
    sides.check_tokens()


# -- with a token bucket: the *_all calls ------------------------------------------------


@dataclass(frozen=True)
class Combined:
    """Advance by ``micros``, then ``op`` over the bucket (``cost`` tokens) and the
    permit of ``key``; ``pick`` a reservation to settle (``used``) or cancel."""

    micros: int
    op: str
    key: str
    cost: int
    pick: int
    used: int
    wait: float | None


combined_steps = st.lists(
    st.builds(
        Combined,
        micros=st.one_of(st.just(0), st.integers(0, 2 * MICROS)),
        op=st.sampled_from(["allow", "reserve", "acquire", "settle", "cancel", "take"]),
        key=st.sampled_from(["a", "b"]),
        cost=st.integers(1, 6),
        pick=st.integers(0, 30),
        used=st.integers(0, 8),
        wait=st.sampled_from([None, 0, 1.0, 2.5]),
    ),
    max_size=25,
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit=st.integers(1, 2), trace=combined_steps)
def test_calls_with_tokens_answer_as_in_process(
    redis_client: redis.Redis, limit: int, trace: list[Combined]
) -> None:
    clocks = (ManualClock(), ManualClock())
    prefix = uuid.uuid4().hex
    local_bucket = TokenBucketLimiter(6, 2, clock=clocks[0])
    local_conc = ConcurrencyLimiter(limit, ttl=3, clock=clocks[0])
    remote_bucket = RedisTokenBucketLimiter(
        redis_client, 6, 2, clock=clocks[1], prefix=f"b{prefix}:"
    )
    remote_conc = RedisConcurrencyLimiter(
        redis_client, limit, ttl=3, clock=clocks[1], prefix=f"c{prefix}:"
    )
    reservations: list[tuple[Any, Any]] = []
    for step in trace:
        for clock in clocks:
            clock.advance(step.micros / MICROS)
        if step.op in ("settle", "cancel"):
            if reservations:
                local, remote = reservations[step.pick % len(reservations)]
                if step.op == "settle":
                    local.settle([step.used, 1])
                    remote.settle([step.used, 1])
                else:
                    local.cancel()
                    remote.cancel()
        elif step.op == "take":
            assert (
                local_conc.try_acquire(step.key).decision
                == remote_conc.try_acquire(step.key).decision
            )
        else:
            # Typed as the checks' union (a list literal of two tuple shapes is not).
            local_checks: list[
                tuple[TokenBucketLimiter, str, int] | tuple[ConcurrencyLimiter, str]
            ] = [(local_bucket, step.key, step.cost), (local_conc, step.key)]
            remote_checks: list[
                tuple[RedisTokenBucketLimiter, str, int] | tuple[RedisConcurrencyLimiter, str]
            ] = [(remote_bucket, step.key, step.cost), (remote_conc, step.key)]
            if step.op == "allow":
                local = bucketlimit.allow_all(local_checks)
                remote = bucketlimit.allow_all(remote_checks)
            elif step.op == "reserve":
                local = bucketlimit.reserve_all(local_checks, max_wait=step.wait)
                remote = bucketlimit.reserve_all(remote_checks, max_wait=step.wait)
            else:
                local = bucketlimit.acquire_all(local_checks, timeout=step.wait)
                remote = bucketlimit.acquire_all(remote_checks, timeout=step.wait)
            assert local.decision == remote.decision
            assert local.delay == remote.delay
            assert len(local.permits) == len(remote.permits)
            reservations.append((local, remote))
        assert clocks[0].now == clocks[1].now
        for key in ("a", "b"):
            assert local_conc.in_flight(key) == remote_conc.in_flight(key)
            assert local_bucket.peek(key) == remote_bucket.peek(key)
