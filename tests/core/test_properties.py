"""hypothesis: the limiter against the Fraction reference model (docs/design.md §4-5).

Random configurations (decimal rates such as 0.1, 2.5 or 0.3, several `per`)
and random traces (several keys, random costs, steps in whole microseconds, in
float seconds and in int seconds) go through the real limiter and through
``reference.ReferenceLimiter``; every answer must be identical.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from bucketlimit import TokenBucketLimiter, allow_all
from tests.support.reference import ReferenceLimiter, answer_of, to_micros
from tests.support.reference import allow_all as model_allow_all

KEYS = ["a", "b", "c", "d\u00e9"]


class FakeClock:
    """Returns whatever number a test put in ``value``: int or float seconds."""

    def __init__(self, value: int | float) -> None:
        self.value = value

    def __call__(self) -> int | float:
        return self.value

    def step_micros(self, micros: int) -> None:
        """Moves by whole microseconds (negative: backwards), read as float seconds."""
        self.value = (to_micros(self.value) + micros) / 1e6

    def step_seconds(self, seconds: int | float) -> None:
        self.value = self.value + seconds


# -- strategies --------------------------------------------------------------

decimal_rates = st.builds(
    lambda digits, scale: digits / 10**scale, st.integers(0, 10**5), st.integers(0, 4)
)
rates = st.one_of(
    st.sampled_from([0, 1, 2, 10, 0.1, 2.5, 0.3, 0.7, 1 / 3, 1e-3, 1000]),
    st.integers(0, 1000),
    decimal_rates,
)
pers = st.sampled_from([1, 1, 60, 3600, 0.5, 0.3, 1.5, 7, 2.5, 1e-3])
capacities = st.one_of(st.integers(1, 20), st.sampled_from([100, 10**6, 10**12]))
starts = st.one_of(st.integers(-(10**6), 10**6), st.floats(-1e6, 1e6), st.just(0))
cost_seeds = st.integers(0, 10**9)

waits = st.one_of(
    st.tuples(st.just("wait_us"), st.integers(0, 3_000_000)),
    st.tuples(st.just("wait_us"), st.integers(0, 10**11)),
    st.tuples(st.just("wait_us"), st.sampled_from([0, 1, 2, 999_999, 1_000_001])),
    st.tuples(st.just("wait_s"), st.floats(0, 100)),
    st.tuples(st.just("wait_s"), st.sampled_from([0.1, 0.3, 0.7, 5e-7, 1.5e-6, 1e-6, 0.25])),
    st.tuples(st.just("wait_s"), st.integers(0, 100)),
)
keys = st.sampled_from(KEYS)
calls = st.one_of(
    st.tuples(st.just("allow"), keys, cost_seeds),
    st.tuples(st.just("allow"), keys, st.just(0)),
    st.tuples(st.just("peek"), keys, cost_seeds),
    st.tuples(st.just("refund"), keys, cost_seeds),
    st.tuples(st.just("reset"), keys, st.just(0)),
    st.tuples(st.just("clear"), keys, st.just(0)),
)
traces = st.lists(st.one_of(calls, calls, waits), max_size=60)
backwards = st.tuples(st.just("back_us"), st.integers(1, 5_000_000))
# With a clock that steps back, what matters is a bucket created, reset or
# peeked at while the reading is behind the latest time: more keys and more
# resets make those common.
short_waits = st.one_of(
    st.tuples(st.just("wait_us"), st.integers(0, 3_000_000)),
    st.tuples(st.just("wait_s"), st.sampled_from([0.1, 0.3, 5e-7, 1.5e-6, 0.25])),
)
many_keys = st.sampled_from([*KEYS, "e", "f", "g", "h", "i", "j"])
calls_many_keys = st.one_of(
    st.tuples(st.just("allow"), many_keys, cost_seeds),
    st.tuples(st.just("peek"), many_keys, cost_seeds),
    st.tuples(st.just("refund"), many_keys, cost_seeds),
    st.tuples(st.just("reset"), many_keys, st.just(0)),
)


@dataclass
class Config:
    capacity: int
    rate: int | float
    per: int | float

    def limiter(self, clock: FakeClock, **kwargs: Any) -> TokenBucketLimiter:
        return TokenBucketLimiter(self.capacity, self.rate, clock=clock, per=self.per, **kwargs)

    def model(self) -> ReferenceLimiter:
        return ReferenceLimiter(self.capacity, self.rate, self.per)

    def cost(self, seed: int) -> int:
        return 1 + seed % self.capacity


def exact(number: int | float) -> Fraction:
    return Fraction(repr(number)) if isinstance(number, float) else Fraction(number)


def seconds_to_full(config: Config) -> Fraction:
    """How long an empty bucket takes to fill (rate > 0)."""
    return config.capacity * exact(config.per) / exact(config.rate)


def within_exact_range(config: Config) -> bool:
    """Well inside the core's documented range (capacity * units and p below 2**100)."""
    model = config.model()
    return model.full < 2**96 and model.p < 2**96


configs = st.builds(Config, capacities, rates, pers).filter(within_exact_range)
# Refilling, and full again within ~30 years, so waits stay well inside the
# clock's exact float range.
positive_rates = st.one_of(
    st.sampled_from([1, 2, 10, 0.1, 2.5, 0.3, 0.7, 1 / 3, 1e-3, 1000]),
    st.integers(1, 1000),
    st.builds(lambda digits, scale: digits / 10**scale, st.integers(1, 10**5), st.integers(0, 4)),
)
refilling_configs = (
    st.builds(
        Config, st.one_of(st.integers(1, 20), st.sampled_from([100, 10**4])), positive_rates, pers
    )
    .filter(within_exact_range)
    .filter(lambda c: seconds_to_full(c) <= 10**9)
)


@dataclass
class Run:
    """One limiter and its model on one clock, fed the same operations."""

    config: Config
    clock: FakeClock
    limiter: TokenBucketLimiter = field(init=False)
    model: ReferenceLimiter = field(init=False)
    admitted: list[tuple[str, int, int]] = field(default_factory=list)  # (key, µs, cost)

    def __post_init__(self) -> None:
        self.limiter = self.config.limiter(self.clock)
        self.model = self.config.model()

    def now(self) -> int:
        return to_micros(self.clock())

    @staticmethod
    def apply_step(clock: FakeClock, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "wait_us":
            clock.step_micros(op[1])
        elif kind == "back_us":
            clock.step_micros(-op[1])
        else:
            assert kind == "wait_s", kind
            clock.step_seconds(op[1])

    def apply(self, op: tuple[Any, ...]) -> None:
        if op[0] in ("wait_us", "back_us", "wait_s"):
            self.apply_step(self.clock, op)
        else:
            self.call(op[0], op[1], self.config.cost(op[2]))

    def call(self, kind: str, key: str, cost: int) -> None:
        limiter, model = self.limiter, self.model
        if kind == "allow":
            got, want = answer_of(limiter.allow(key, cost)), model.allow(key, cost, self.now())
            if got.allowed:
                self.admitted.append((key, self.now(), cost))
        elif kind == "peek":
            got, want = answer_of(limiter.peek(key, cost)), model.peek(key, cost, self.now())
        elif kind == "refund":
            limiter.refund(key, cost)
            model.refund(key, cost, self.now())
            return
        elif kind == "reset":
            limiter.reset(key)
            model.reset(key)
            return
        elif kind == "clear":
            limiter.clear()
            model.clear()
            return
        else:
            raise AssertionError(kind)
        assert got == want, f"{kind}({key!r}, {cost}) at {self.now()} µs"

    def assert_same_counts(self) -> None:
        stats = self.limiter.stats()
        assert (stats["allowed"], stats["refused"]) == (self.model.allowed, self.model.refused)


# -- decisions equal the model ----------------------------------------------------


@given(configs, starts, traces)
def test_decisions_equal_the_model(
    config: Config, start: int | float, trace: list[tuple[Any, ...]]
) -> None:
    run = Run(config, FakeClock(start))
    for op in trace:
        run.apply(op)
    run.assert_same_counts()


@given(
    configs,
    starts,
    # Every call comes after a clock move, forward or back.
    st.lists(st.tuples(st.one_of(short_waits, backwards), calls_many_keys), max_size=40),
)
def test_decisions_equal_the_model_when_the_clock_steps_back(
    config: Config, start: int | float, moves: list[tuple[tuple[Any, ...], tuple[Any, ...]]]
) -> None:
    run = Run(config, FakeClock(start))
    for step, call in moves:
        run.apply(step)
        run.apply(call)
    run.assert_same_counts()


@given(
    configs,
    starts,
    st.lists(
        st.tuples(st.one_of(short_waits, backwards), calls_many_keys, st.booleans()), max_size=40
    ),
)
def test_peek_changes_no_later_answer(
    config: Config,
    start: int | float,
    moves: list[tuple[tuple[Any, ...], tuple[Any, ...], bool]],
) -> None:
    """A limiter that is also peeked at (at any time, even ahead of a clock
    that later steps back) answers exactly like one that is not."""
    clock = FakeClock(start)
    peeked, plain = config.limiter(clock), config.limiter(clock)
    for step, (kind, key, seed), peek_too in moves:
        Run.apply_step(clock, step)
        cost = config.cost(seed)
        if peek_too:
            peeked.peek(key, cost)
        if kind == "allow":
            assert peeked.allow(key, cost) == plain.allow(key, cost)
        elif kind == "peek":
            assert peeked.peek(key, cost) == plain.peek(key, cost)
        elif kind == "refund":
            peeked.refund(key, cost)
            plain.refund(key, cost)
        else:
            peeked.reset(key)
            plain.reset(key)
    assert peeked.stats() == plain.stats()
    assert len(peeked) == len(plain)


@given(configs)
def test_properties_report_the_configuration(config: Config) -> None:
    limiter = config.limiter(FakeClock(0))
    assert limiter.capacity == config.capacity
    assert limiter.per == float(config.per)
    # Tokens per second, from the exact fraction (rate / per).
    assert limiter.rate == pytest.approx(float(config.model().rate), rel=1e-15, abs=0)


# -- retry_after and reset_after are exact -------------------------------------------


@given(refilling_configs, starts, st.lists(st.one_of(calls, waits), max_size=30), st.data())
def test_waiting_retry_after_passes_and_one_microsecond_less_does_not(
    config: Config, start: int | float, prefix: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    run = Run(config, FakeClock(start))
    for op in prefix:
        run.apply(op)
    key = data.draw(keys, label="key")
    probe = run.limiter.peek(key, 1)
    whole_tokens = probe.remaining + (1 if probe.allowed else 0)
    if whole_tokens == config.capacity:
        run.call("allow", key, config.capacity)
        whole_tokens = 0
    cost = data.draw(st.integers(whole_tokens + 1, config.capacity), label="cost")
    refused = run.limiter.allow(key, cost)
    assert answer_of(refused) == run.model.allow(key, cost, run.now())
    assert not refused
    wait = round(refused.retry_after * 1e6)
    note(f"refused at {run.now()} µs, retry_after {refused.retry_after} = {wait} µs")
    assert wait >= 1

    refused_at = run.now()
    run.clock.value = (refused_at + wait - 1) / 1e6
    assert run.now() == refused_at + wait - 1
    assert not run.limiter.peek(key, cost)
    too_soon = run.limiter.allow(key, cost)
    assert answer_of(too_soon) == run.model.allow(key, cost, run.now())
    assert not too_soon
    run.clock.value = (refused_at + wait) / 1e6
    assert run.limiter.peek(key, cost)
    allowed = run.limiter.allow(key, cost)
    assert answer_of(allowed) == run.model.allow(key, cost, run.now())
    assert allowed

    # reset_after of that decision: full exactly then, and not 1 µs before.
    full_in = round(allowed.reset_after * 1e6)
    allowed_at = run.now()
    if full_in > 0:
        run.clock.value = (allowed_at + full_in - 1) / 1e6
        assert not run.limiter.peek(key, config.capacity)
    run.clock.value = (allowed_at + full_in) / 1e6
    assert run.limiter.peek(key, config.capacity)


@given(st.builds(Config, capacities, st.just(0), pers), st.lists(calls, max_size=20))
def test_rate_zero_never_refills(config: Config, trace: list[tuple[Any, ...]]) -> None:
    run = Run(config, FakeClock(0))
    for op in trace:
        run.apply(op)
    run.call("allow", "z", config.capacity)
    run.clock.value = 2**61 // 10**6
    refused = run.limiter.allow("z", 1)
    assert (refused.allowed, refused.retry_after, refused.reset_after) == (
        False,
        float("inf"),
        float("inf"),
    )


# -- the sustained-rate bound ---------------------------------------------------------


def assert_within_bound(config: Config, admitted: list[tuple[int, int]]) -> None:
    """Over every window [t_i, t_j] admitted cost <= capacity + rate * T, exactly."""
    per_micro = exact(config.rate) / exact(config.per) / 1_000_000
    times = sorted({t for t, _ in admitted})
    for start, end in itertools.combinations_with_replacement(times, 2):
        spent = sum(cost for t, cost in admitted if start <= t <= end)
        assert spent <= config.capacity + per_micro * (end - start), (start, end, spent)


allows = st.tuples(st.just("allow"), keys, cost_seeds)


@given(configs, starts, st.lists(st.one_of(allows, allows, waits), max_size=80))
def test_admitted_cost_within_capacity_plus_rate_times_window(
    config: Config, start: int | float, trace: list[tuple[Any, ...]]
) -> None:
    run = Run(config, FakeClock(start))
    for op in trace:
        run.apply(op)
    for key in KEYS:
        assert_within_bound(config, [(t, cost) for k, t, cost in run.admitted if k == key])


@given(configs, starts, st.lists(st.one_of(allows, allows, waits, backwards), max_size=80))
def test_admitted_cost_bound_holds_when_the_clock_steps_back(
    config: Config, start: int | float, trace: list[tuple[Any, ...]]
) -> None:
    # One key, so every admission counts against the same bucket.
    trace = [(op[0], "k", op[2]) if op[0] == "allow" else op for op in trace]
    run = Run(config, FakeClock(start))
    first = run.now()
    latest = first
    for op in trace:
        run.apply(op)
        latest = max(latest, run.now())
    spent = sum(cost for _, _, cost in run.admitted)
    rate = Fraction(run.model.p, run.model.unit)  # tokens per µs
    assert spent <= config.capacity + rate * (latest - first)


# -- eviction never changes an answer -------------------------------------------------


@given(
    refilling_configs,
    starts,
    st.lists(st.one_of(calls, waits), max_size=25),
    st.lists(st.one_of(calls, waits), max_size=25),
    st.integers(2, 300),
    st.integers(2, 300),
)
def test_eviction_never_changes_an_answer(
    config: Config,
    start: int | float,
    before: list[tuple[Any, ...]],
    after: list[tuple[Any, ...]],
    fillers_before: int,
    fillers_after: int,
) -> None:
    """Many filler keys make the sweeper drop full buckets (tracked keys among
    them); the limiter must still answer exactly like the model, which keeps
    every bucket forever."""
    run = Run(config, FakeClock(start))
    filler = itertools.count()

    def fill(count: int) -> None:
        for _ in range(count):
            run.call("allow", f"filler-{next(filler)}", 1)

    for op in before:
        run.apply(op)
        fill(fillers_before // max(1, len(before)))
    fill(fillers_before)
    # Long enough for every bucket to be full again: the sweeper may drop them.
    run.clock.step_seconds(math.ceil(seconds_to_full(config)) + 1)
    fill(fillers_after)
    for op in after:
        run.apply(op)
        fill(fillers_after // max(1, len(after)))
    for key in KEYS:
        run.call("peek", key, config.capacity)
        run.call("allow", key, 1)
    run.assert_same_counts()
    # The test means something only if buckets were in fact dropped.
    assert run.limiter.stats()["evicted"] > 0


# -- allow_all -------------------------------------------------------------------------

PAIRS = [(limiter, key) for limiter in range(3) for key in ("a", "b")]


@given(
    # Small capacities, so that ties on `remaining` between limiters are common.
    st.lists(st.builds(Config, st.integers(1, 6), rates, pers), min_size=3, max_size=3),
    st.lists(st.integers(-1000, 1000), min_size=3, max_size=3),
    st.lists(
        st.one_of(
            st.tuples(
                st.just("all"),
                st.lists(st.sampled_from(PAIRS), min_size=1, max_size=4, unique=True),
                cost_seeds,
            ),
            st.tuples(st.just("one"), st.sampled_from(PAIRS), cost_seeds),
            waits,
        ),
        max_size=40,
    ),
)
def test_allow_all_equals_the_model(
    configs3: list[Config], offsets: list[int], trace: list[tuple[Any, ...]]
) -> None:
    base = FakeClock(0)
    # Each limiter reads its own clock: the shared time shifted by whole seconds.
    clocks = [FakeClock(0) for _ in configs3]

    def sync() -> None:
        for clock, offset in zip(clocks, offsets, strict=True):
            clock.value = base.value + offset

    sync()
    limiters = [c.limiter(clock) for c, clock in zip(configs3, clocks, strict=True)]
    models = [c.model() for c in configs3]
    for op in trace:
        if op[0] == "wait_us":
            base.step_micros(op[1])
        elif op[0] == "wait_s":
            base.step_seconds(op[1])
        elif op[0] == "one":
            (i, key), seed = op[1], op[2]
            cost = configs3[i].cost(seed)
            got = answer_of(limiters[i].allow(key, cost))
            assert got == models[i].allow(key, cost, to_micros(clocks[i]()))
        else:
            pairs, seed = op[1], op[2]
            cost = 1 + seed % min(configs3[i].capacity for i, _ in pairs)
            got = answer_of(allow_all([(limiters[i], key) for i, key in pairs], cost))
            want = model_allow_all(
                [(models[i], key, to_micros(clocks[i]())) for i, key in pairs], cost
            )
            assert got == want, (pairs, cost)
        sync()
    for limiter, model in zip(limiters, models, strict=True):
        stats = limiter.stats()
        assert (stats["allowed"], stats["refused"]) == (model.allowed, model.refused)


@given(
    configs,
    st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    st.integers(0, 10),
    cost_seeds,
)
def test_allow_all_duplicate_pair_raises_and_spends_nothing(
    config: Config, chosen: list[str], where: int, seed: int
) -> None:
    clock = FakeClock(0)
    limiter, twin = config.limiter(clock), config.limiter(clock)
    other = TokenBucketLimiter(10**12, 1, clock=clock)  # holds any cost drawn
    checks = [(limiter, key) for key in chosen] + [(other, "x")]
    checks.insert(where % (len(checks) + 1), (limiter, chosen[where % len(chosen)]))
    with pytest.raises(ValueError, match="twice"):
        allow_all(checks, config.cost(seed))
    for key in KEYS:
        assert limiter.peek(key, config.capacity) == twin.peek(key, config.capacity)
    assert other.peek("x", 10**12).allowed
    assert limiter.stats() == twin.stats()
    assert other.stats()["allowed"] == other.stats()["refused"] == 0
