"""hypothesis: reservations against the Fraction reference model (docs/design.md §2, §4).

Random traces mix ``allow``, ``peek``, ``reserve`` (with and without
``max_wait``), ``charge``, ``cancel`` and ``settle`` on several keys; the real
limiter and ``reference.ReferenceLimiter`` must give identical decisions and
delays. On the model, waiting exactly a reservation's delay makes its tokens
there and one microsecond less does not; at the times the tokens are used,
every window obeys ``capacity + rate * T``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from bucketlimit import Reservation, TokenBucketLimiter, reserve_all
from tests.core.test_properties import (
    KEYS,
    Config,
    FakeClock,
    configs,
    exact,
    refilling_configs,
    starts,
    waits,
)
from tests.support.reference import Line, ReferenceLimiter, answer_of, seconds, to_micros
from tests.support.reference import reserve_all as model_reserve_all

keys = st.sampled_from(KEYS)
seeds = st.integers(0, 10**9)
max_waits = st.one_of(
    st.none(),
    st.sampled_from([0, 0.5, 1, 2.5, 10, 1e-6, math.inf]),
    st.integers(0, 100),
    st.floats(0, 1000),
)
calls = st.one_of(
    st.tuples(st.just("allow"), keys, seeds),
    st.tuples(st.just("peek"), keys, seeds),
    st.tuples(st.just("reserve"), keys, seeds, max_waits),
    st.tuples(st.just("reserve"), keys, seeds, st.none()),
    st.tuples(st.just("charge"), keys, st.integers(1, 10**6)),
    st.tuples(st.just("cancel"), seeds),
    st.tuples(st.just("settle"), seeds, seeds),
)
traces = st.lists(st.one_of(calls, calls, waits), max_size=60)


def wait_micros(max_wait: float | None) -> int | None:
    """``max_wait`` in µs as the limiter reads it (None or inf: no limit)."""
    if max_wait is None or max_wait == math.inf:
        return None
    return to_micros(max_wait)


@dataclass
class Held:
    reservation: Reservation
    key: str
    cost: int
    ready: int  # µs
    line: Line | None  # the model's line, where it waited
    made: int  # the model's write count after it
    used: int | None = None  # tokens used at ``ready``; None while not settled
    cancelled: bool = False


@dataclass
class Run:
    config: Config
    clock: FakeClock
    limiter: TokenBucketLimiter = field(init=False)
    model: ReferenceLimiter = field(init=False)
    held: list[Held] = field(default_factory=list)
    allowed_uses: list[tuple[str, int, int]] = field(default_factory=list)  # (key, µs, cost)

    def __post_init__(self) -> None:
        self.limiter = self.config.limiter(self.clock)
        self.model = self.config.model()

    def now(self) -> int:
        return to_micros(self.clock())

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "wait_us":
            self.clock.step_micros(op[1])
        elif kind == "wait_s":
            self.clock.step_seconds(op[1])
        elif kind in ("allow", "peek"):
            cost = self.config.cost(op[2])
            got = answer_of(getattr(self.limiter, kind)(op[1], cost))
            want = getattr(self.model, kind)(op[1], cost, self.now())
            assert got == want, (kind, op)
            if kind == "allow" and got.allowed:
                self.allowed_uses.append((op[1], self.now(), cost))
        elif kind == "reserve":
            self.reserve(op[1], self.config.cost(op[2]), op[3])
        elif kind == "charge":
            got = answer_of(self.limiter.charge(op[1], op[2]))
            assert got == self.model.charge(op[1], op[2], self.now()), op
        elif kind == "cancel":
            self.cancel(op[1])
        else:
            self.settle(op[1], op[2])

    def reserve(self, key: str, cost: int, max_wait: float | None) -> None:
        now = self.now()
        reservation = self.limiter.reserve(key, cost, max_wait=max_wait)
        answer, delay, line = self.model.reserve_with_line(key, cost, now, wait_micros(max_wait))
        assert answer_of(reservation.decision) == answer, (key, cost, max_wait)
        assert reservation.delay == seconds(delay), (key, cost, max_wait)
        assert bool(reservation) is answer.allowed
        assert (reservation.key, reservation.cost) == (key, cost)
        if reservation:
            assert delay is not None
            self.held.append(Held(reservation, key, cost, now + delay, line, self.model.writes))

    def open_reservations(self) -> list[Held]:
        return [h for h in self.held if h.used is None and not h.cancelled]

    def cancel(self, seed: int) -> None:
        """Cancels a reservation still waiting (a cancel after the use would be a lie)."""
        waiting = [h for h in self.open_reservations() if h.ready > self.now()]
        if not waiting:
            return
        held = waiting[seed % len(waiting)]
        held.reservation.cancel()
        held.reservation.cancel()  # the second changes nothing
        self.model.refund(held.key, held.cost, self.now(), held.line)
        held.cancelled = True

    def settleable(self, *, fresh_only: bool = False) -> list[Held]:
        """Reservations whose tokens were used; ``fresh_only``: and whose bucket has not
        been full since they were made (docs/design.md §4, "Giving back": a give-back
        after that may take headroom others left, which the bound does not cover)."""
        ready = [h for h in self.open_reservations() if h.ready <= self.now()]
        if fresh_only:
            ready = [h for h in ready if self.model.filled.get(h.key, -1) < h.made]
        return ready

    def settle(self, seed: int, used_seed: int, *, fresh_only: bool = False) -> None:
        """Settles a reservation whose tokens were used: refund or charge the difference."""
        ready = self.settleable(fresh_only=fresh_only)
        if not ready:
            return
        held = ready[seed % len(ready)]
        used = used_seed % (2 * held.cost + 2)
        held.reservation.settle(used)
        held.reservation.settle(0)  # settling twice changes nothing
        if used < held.cost:
            self.model.refund(held.key, held.cost - used, self.now(), held.line)
        elif used > held.cost:
            self.model.charge(held.key, used - held.cost, self.now())
        held.used = used

    def uses(self, key: str) -> list[tuple[int, int]]:
        """(µs, tokens) used for ``key``: a reservation's at its ready time."""
        found = [(t, cost) for k, t, cost in self.allowed_uses if k == key]
        for h in self.held:
            if h.key == key and not h.cancelled:
                found.append((h.ready, h.cost if h.used is None else min(h.used, h.cost)))
        return found

    def assert_same_state(self) -> None:
        for key in KEYS:
            got = answer_of(self.limiter.peek(key, 1))
            assert got == self.model.peek(key, 1, self.now()), key
        stats = self.limiter.stats()
        assert (stats["allowed"], stats["refused"]) == (self.model.allowed, self.model.refused)


@given(configs, starts, traces)
def test_reservations_equal_the_model(
    config: Config, start: int | float, trace: list[tuple[Any, ...]]
) -> None:
    run = Run(config, FakeClock(start))
    for op in trace:
        run.apply(op)
    run.assert_same_state()


@given(refilling_configs, st.lists(st.tuples(keys, seeds), min_size=1, max_size=30))
def test_waiting_the_delay_makes_the_tokens_there_and_one_microsecond_less_does_not(
    config: Config, reservations: list[tuple[str, int]]
) -> None:
    model = config.model()
    limiter = config.limiter(FakeClock(0))
    for key, seed in reservations:
        cost = config.cost(seed)
        answer, delay = model.reserve(key, cost, 0, None)
        reservation = limiter.reserve(key, cost)
        assert reservation.delay == seconds(delay)
        if not answer.allowed:
            continue  # past the debt bound: refused, nothing taken
        assert delay is not None
        # The balance right after this reservation, refilled: covered exactly at delay.
        assert model.balance_at(key, delay) >= 0
        if delay > 0:
            assert model.balance_at(key, delay - 1) < 0


def assert_within_bound(config: Config, uses: list[tuple[int, int]]) -> None:
    """Over every window [t_i, t_j] the cost used is <= capacity + rate * (T + 1 µs).

    The microsecond is the clock's granularity (docs/design.md §4): each ready time is the
    exact one rounded up to a whole microsecond, so two of them can be up to 1 µs
    closer than exactly; the rounding never accumulates over a window.
    """
    per_micro = exact(config.rate) / exact(config.per) / 1_000_000
    times = sorted({t for t, _ in uses})
    for first, last in itertools.combinations_with_replacement(times, 2):
        spent = sum(cost for t, cost in uses if first <= t <= last)
        assert spent <= config.capacity + per_micro * (last - first + 1), (first, last, spent)


no_charges = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), keys, seeds, max_waits),
        st.tuples(st.just("reserve"), keys, seeds, st.none()),
        st.tuples(st.just("allow"), keys, seeds),
        st.tuples(st.just("cancel"), seeds),
        st.tuples(st.just("settle"), seeds, seeds),
        waits,
    ),
    max_size=50,
)


@given(configs, starts, no_charges)
def test_tokens_used_at_their_ready_times_obey_the_bound(
    config: Config, start: int | float, trace: list[tuple[Any, ...]]
) -> None:
    """Charges are left out: they record use that happened beyond the limit. Any
    waiting reservation may be cancelled, also with others waiting behind it (their
    times do not move, and what they would share is not given back). A settle gives
    back only while its bucket has not been full since the reservation was made
    (docs/design.md §4, "Giving back")."""
    run = Run(config, FakeClock(start))
    for op in trace:
        if op[0] == "settle":
            # Within the estimate only: an overage is use beyond the limit.
            seed, used_seed = op[1], op[2]
            ready = run.settleable(fresh_only=True)
            if ready:
                held = ready[seed % len(ready)]
                run.settle(seed, used_seed % (held.cost + 1), fresh_only=True)
            continue
        run.apply(op)
    for key in KEYS:
        assert_within_bound(config, run.uses(key))


@given(
    st.lists(st.tuples(configs, keys, seeds), min_size=1, max_size=4),
    st.lists(st.one_of(max_waits, st.none()), min_size=1, max_size=6),
    starts,
    st.lists(st.integers(0, 3_000_000), max_size=6),
)
def test_reserve_all_equals_the_model(
    buckets: list[tuple[Config, str, int]],
    max_wait_list: list[float | None],
    start: int | float,
    steps: list[int],
) -> None:
    clock = FakeClock(start)
    limiters = [(c.limiter(clock), c.model(), key, c.cost(seed)) for c, key, seed in buckets]
    steps = [0, *steps]
    for step, max_wait in zip(steps, itertools.cycle(max_wait_list), strict=False):
        clock.step_micros(step)
        now = to_micros(clock())
        reservation = reserve_all(
            [(limiter, key, cost) for limiter, _, key, cost in limiters], max_wait=max_wait
        )
        answer, delay = model_reserve_all(
            [(model, key, cost, now) for _, model, key, cost in limiters], wait_micros(max_wait)
        )
        assert answer_of(reservation.decision) == answer
        assert reservation.delay == seconds(delay)
        assert [c for _, _, c in reservation.checks] == [cost for *_, cost in limiters]
    for limiter, model, key, _ in limiters:
        assert answer_of(limiter.peek(key)) == model.peek(key, 1, to_micros(clock()))


def test_fraction_rates_stay_exact() -> None:
    """0.1 tokens a second: ten reservations of 1 on an empty bucket wait 10 s each."""
    limiter = TokenBucketLimiter(1, 0.1, clock=FakeClock(0))
    delays = [limiter.reserve("k").delay for _ in range(11)]
    assert delays == [10.0 * k for k in range(11)]
    assert Fraction(delays[-1]) == 100
