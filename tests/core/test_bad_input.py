"""docs/design.md §3: every bad input gets a clear TypeError/ValueError and changes nothing.

Each row is checked twice over: the exception is exactly the promised type
(never a subclass such as OverflowError or UnicodeEncodeError, never a
PanicException), and a twin limiter that never saw the bad call answers
exactly like the one that did, on the same clock trace, afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any, cast

import pytest

from bucketlimit import MAX_KEY_BYTES, Decision, TokenBucketLimiter, allow_all
from bucketlimit.testing import ManualClock
from tests.support.reference import ReferenceLimiter, answer_of, to_micros

pytestmark = pytest.mark.interpreters


class Index:
    """An integer-like object, as a numpy integer is: only ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Index({self.value})"


class ClockFailure(Exception):
    """Raised by a test clock; must reach the caller unchanged."""


_UNSET = object()


class SwitchClock:
    """Reads a ManualClock, except for one reading that returns or raises
    whatever a test puts in ``next_value`` / ``next_error``."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.next_value: object = _UNSET
        self.next_error: BaseException | None = None

    def __call__(self) -> Any:  # a float, except when a test says otherwise
        if self.next_error is not None:
            error, self.next_error = self.next_error, None
            raise error
        if self.next_value is not _UNSET:
            value, self.next_value = self.next_value, _UNSET
            return value
        return self.clock()


@dataclass
class Side:
    """One side of the comparison: a per-user limiter and a global cap on one clock."""

    clock: ManualClock
    switch: SwitchClock
    user: TokenBucketLimiter
    cap: TokenBucketLimiter


def make_side() -> Side:
    clock = ManualClock()
    switch = SwitchClock(clock)
    side = Side(
        clock,
        switch,
        TokenBucketLimiter(3, 1, clock=switch),
        TokenBucketLimiter(5, 2, clock=switch),
    )
    # Leave buckets partly spent, with fractional balances, and a key or two
    # never seen, so that any stray change would show in later answers.
    side.user.allow("a", 2)
    clock.advance(0.2)
    side.user.allow("b", 3)
    allow_all([(side.user, "a"), (side.cap, "all")], cost=1)
    side.user.refund("b", 1)
    clock.advance(0.15)
    return side


Answers = tuple[list[Decision], list[dict[str, int]], list[int]]


class Twins:
    """A subject that receives the bad call and a twin that does not."""

    def __init__(self) -> None:
        self.subject = make_side()
        self.twin = make_side()

    def advance(self, seconds: float) -> None:
        self.subject.clock.advance(seconds)
        self.twin.clock.advance(seconds)

    def assert_same_afterwards(self) -> None:
        """Both sides answer identically to the same valid calls."""
        subject: list[Decision] = []
        twin: list[Decision] = []
        for step in range(8):
            for out, side in ((subject, self.subject), (twin, self.twin)):
                for key in ("a", "b", "c", "\u00e9" * 10):
                    out.append(side.user.peek(key, 2))
                    out.append(side.user.allow(key, 1 + step % 3))
                    out.append(allow_all([(side.user, key), (side.cap, "all")], cost=1))
                out.append(side.cap.peek("all", 5))
            assert subject == twin, f"answers differ at step {step}"
            self.advance(0.35)
        for name in ("user", "cap"):
            s, t = getattr(self.subject, name), getattr(self.twin, name)
            assert s.stats() == t.stats(), name
            assert len(s) == len(t), name


def assert_raises_exactly(
    exc_type: type[Exception], call: Callable[[], object], *fragments: str
) -> Exception:
    """``call`` raises exactly ``exc_type`` with every fragment in its message."""
    with pytest.raises(BaseException) as info:  # noqa: PT011 - the type is checked below
        call()
    error = info.value
    assert type(error) is exc_type, f"expected exactly {exc_type.__name__}, got {error!r}"
    message = normalize(str(error))
    for fragment in fragments:
        assert normalize(fragment) in message, f"{fragment!r} not named in {str(error)!r}"
    return error


def normalize(text: str) -> str:
    # Rust prints 1e300 and NaN where Python prints 1e+300 and nan.
    return text.lower().replace("e+", "e")


def text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# -- construction -------------------------------------------------------------

NOT_INTEGERS: list[Any] = [2.0, 2.5, "3", None, True, False, Decimal(3), Fraction(3)]
NOT_NUMBERS: list[Any] = ["1", None, True, False, Decimal("0.5"), Fraction(1, 2), 1j, [1]]


def construction_rows() -> list[Any]:
    rows: list[Any] = []

    def row(kwargs: dict[str, Any], exc: type[Exception], *fragments: str) -> None:
        rows.append(pytest.param(kwargs, exc, fragments, id=repr(kwargs)))

    for bad in NOT_INTEGERS:
        row({"capacity": bad, "rate": 1}, TypeError, "capacity")
    for bad in (0, -1, -(10**40)):
        row({"capacity": bad, "rate": 1}, ValueError, "capacity", str(bad))
    for bad in (10**40, 2**64, 10**20):
        row({"capacity": bad, "rate": 1}, ValueError, "capacity", str(bad))
    # capacity * units per token beyond the exact range.
    row({"capacity": 10**18, "rate": 1e-7}, ValueError, "capacity", str(10**18))
    for bad in NOT_NUMBERS:
        row({"capacity": 1, "rate": bad}, TypeError, "rate")
        row({"capacity": 1, "rate": 1, "per": bad}, TypeError, "per")
    for bad in (-1, -0.5, -(10**40), math.nan, math.inf, -math.inf):
        row({"capacity": 1, "rate": bad}, ValueError, "rate", text(bad))
    for bad in (0, 0.0, -0.0, -1, -2.5, math.nan, math.inf, -math.inf):
        row({"capacity": 1, "rate": 1, "per": bad}, ValueError, "per", text(bad))
    for bad in (1e-300, 1e300, 5e-324, 10**40):
        row({"capacity": 1, "rate": bad}, ValueError, "rate", text(bad))
        row({"capacity": 1, "rate": 1, "per": bad}, ValueError, "per", text(bad))
    row({"capacity": 1, "rate": 1e20, "per": 1e-20}, ValueError, "rate")
    for bad in (0, -1):
        row({"capacity": 1, "rate": 1, "max_keys": bad}, ValueError, "max_keys", str(bad))
    for bad in (1.5, True, "2"):
        row({"capacity": 1, "rate": 1, "max_keys": bad}, TypeError, "max_keys")
    row({"capacity": 1, "rate": 1, "clock": 5}, TypeError, "clock")
    return rows


@pytest.mark.parametrize(("kwargs", "exc", "fragments"), construction_rows())
def test_bad_configuration(
    kwargs: dict[str, Any], exc: type[Exception], fragments: tuple[str, ...]
) -> None:
    twins = Twins()
    assert_raises_exactly(exc, lambda: TokenBucketLimiter(**kwargs), *fragments)
    # A failed construction leaves no trace on limiters that exist.
    twins.assert_same_afterwards()


@pytest.mark.parametrize(
    ("capacity", "rate", "per"),
    [
        (10**12, 1, 1),  # large but exact
        (3, 1e-7, 1),
        (3, 1e20, 1),
        (3, 2.5, 1e-3),
        (2**63, 0, 1),
    ],
)
def test_configurations_within_the_exact_range_are_accepted(
    capacity: int, rate: float, per: float
) -> None:
    limiter = TokenBucketLimiter(capacity, rate, per=per, clock=ManualClock())
    assert limiter.allow("k", capacity)
    assert not limiter.allow("k")


EDGE_SECONDS = 2**62 // 10**6  # the clock's range is ±2**62 µs


@pytest.mark.parametrize(
    ("capacity", "rate"),
    [(2**64 - 1, 1e20), (2**64 - 1, 0), (1, 1e-7), (10**6, 10**20), (3, 1e-9)],
)
def test_edges_of_the_exact_range_answer_exactly(capacity: int, rate: float) -> None:
    """No overflow, panic or error at the extremes: the answers equal the model's."""
    readings = [-EDGE_SECONDS, -EDGE_SECONDS, 0, 0.000001, EDGE_SECONDS, EDGE_SECONDS]
    now: list[int | float] = [readings[0]]
    limiter = TokenBucketLimiter(capacity, rate, clock=lambda: now[0])
    model = ReferenceLimiter(capacity, rate)
    for reading in readings:
        now[0] = reading
        for cost in (capacity, 1, capacity):
            want = model.peek("k", cost, to_micros(reading))
            assert answer_of(limiter.peek("k", cost)) == want
            assert answer_of(limiter.allow("k", cost)) == model.allow("k", cost, to_micros(reading))


def test_negative_zero_rate_is_rate_zero() -> None:
    # docs/design.md §3 rejects rate < 0; -0.0 is not below 0 (it equals 0.0).
    clock = ManualClock()
    limiter = TokenBucketLimiter(2, -0.0, clock=clock)
    twin = TokenBucketLimiter(2, 0.0, clock=clock)
    assert limiter.rate == 0.0
    for _ in range(3):
        assert limiter.allow("k") == twin.allow("k")
        clock.advance(100)


def test_index_objects_count_as_integers() -> None:
    clock = ManualClock()
    subject = TokenBucketLimiter(Index(5), 2, clock=clock, max_keys=Index(10))
    twin = TokenBucketLimiter(5, 2, clock=clock, max_keys=10)
    assert subject.capacity == 5
    for step in range(20):
        cost = 1 + step % 5
        assert subject.peek("k", Index(cost)) == twin.peek("k", cost)
        assert subject.allow("k", Index(cost)) == twin.allow("k", cost)
        subject.refund("k", Index(1))
        twin.refund("k", 1)
        assert allow_all([(subject, "j")], cost=Index(cost)) == allow_all([(twin, "j")], cost)
        clock.advance(0.3)
    assert subject.stats() == twin.stats()
    big = TokenBucketLimiter(3, 1, clock=clock)
    assert_raises_exactly(ValueError, lambda: big.allow("k", Index(10**40)), str(10**40))
    assert_raises_exactly(ValueError, lambda: TokenBucketLimiter(Index(0), 1), "capacity", "0")


# -- calls: cost, key, clock --------------------------------------------------

Call = Callable[[Side], object]


def clock_methods(key: str = "a", cost: Any = 1) -> list[tuple[str, Call]]:
    """Every method that reads the clock, called on the per-user limiter."""
    return [
        ("allow", lambda s: s.user.allow(key, cost)),
        ("peek", lambda s: s.user.peek(key, cost)),
        ("refund", lambda s: s.user.refund(key, cost)),
        ("allow_all", lambda s: allow_all([(s.user, key), (s.cap, "all")], cost)),
    ]


def key_methods(key: Any) -> list[tuple[str, Call]]:
    """Every method that takes a key, including ``reset`` and a key in second place."""

    def reset(side: Side) -> None:
        side.user.reset(key)

    def allow_all_second(side: Side) -> Decision:
        # `key` is typed Any: typed as a str, the call is the token buckets' overload.
        return allow_all([(side.cap, "all"), (side.user, cast(str, key))])

    return [*clock_methods(key=key), ("reset", reset), ("allow_all-second", allow_all_second)]


def call_rows() -> list[Any]:
    rows: list[Any] = []

    def add(name: str, call: Call, exc: type[Exception], *fragments: str) -> None:
        rows.append(pytest.param(call, exc, fragments, id=name))

    for bad in (*NOT_INTEGERS, b"1"):
        for method, call in clock_methods(cost=bad):
            add(f"{method}-cost={bad!r}", call, TypeError, "cost")
    for bad in (0, -1, -(10**40)):
        for method, call in clock_methods(cost=bad):
            add(f"{method}-cost={bad}", call, ValueError, "cost", str(bad))
    for bad in (4, 10**40):
        for method, call in clock_methods(cost=bad):
            add(f"{method}-cost={bad}", call, ValueError, "cost", str(bad))
    for method, call in clock_methods(cost=4)[:3]:
        add(f"{method}-cost-above-capacity-names-both", call, ValueError, "4", "3")
    # Above the second limiter's capacity only: the first must not be charged.
    add(
        "allow_all-cost-above-one-capacity",
        lambda s: allow_all([(s.cap, "all"), (s.user, "a")], cost=4),
        ValueError,
        "4",
        "3",
    )

    bad_keys: list[tuple[Any, type[Exception]]] = [
        (b"a", TypeError),
        (None, TypeError),
        (1, TypeError),
        (("a",), TypeError),
        ("", ValueError),
        ("x" * (MAX_KEY_BYTES + 1), ValueError),
        ("\u00e9" * (MAX_KEY_BYTES // 2) + "x", ValueError),  # 4,097 bytes, 2,049 chars
        ("\U0001f600" * (MAX_KEY_BYTES // 4 + 1), ValueError),
        ("\ud800", ValueError),
        ("user-\udfff", ValueError),
    ]
    for key, exc in bad_keys:
        label = f"{type(key).__name__}{len(key) if isinstance(key, str) else ''}"
        for method, call in key_methods(key):
            add(f"{method}-key-{label}", call, exc, "key")

    add(
        "allow_all-duplicate",
        lambda s: allow_all([(s.user, "a"), (s.cap, "all"), (s.user, "a")]),
        ValueError,
        "a",
    )
    add("allow_all-not-a-limiter", lambda s: allow_all([(s.user, "a"), (1, "b")]), TypeError)  # type: ignore[list-item]
    add("allow_all-not-a-pair", lambda s: allow_all([(s.user, "a"), (s.cap,)]), TypeError)  # type: ignore[list-item]
    add("allow_all-empty", lambda s: allow_all([]), ValueError)
    return rows


@pytest.mark.parametrize(("call", "exc", "fragments"), call_rows())
def test_bad_call_changes_nothing(
    call: Call, exc: type[Exception], fragments: tuple[str, ...]
) -> None:
    twins = Twins()
    assert_raises_exactly(exc, lambda: call(twins.subject), *fragments)
    twins.assert_same_afterwards()


@pytest.mark.parametrize(
    "key",
    [
        "x" * MAX_KEY_BYTES,
        "\u00e9" * (MAX_KEY_BYTES // 2),
        "\U0001f600" * (MAX_KEY_BYTES // 4),
        "k",
        " ",
        "\x00",
    ],
    ids=["ascii-4096", "2-byte-4096", "4-byte-4096", "one-char", "space", "nul"],
)
def test_keys_up_to_the_maximum_are_accepted(key: str) -> None:
    assert MAX_KEY_BYTES == 4096
    limiter = TokenBucketLimiter(2, 0, clock=ManualClock())
    assert limiter.allow(key, 2)
    assert not limiter.allow(key)
    assert limiter.allow("other", 2)
    limiter.reset(key)
    assert limiter.peek(key, 2).allowed


# -- the clock ------------------------------------------------------------------

BAD_READINGS: list[tuple[Any, type[Exception]]] = [
    ("1", TypeError),
    (None, TypeError),
    (b"1", TypeError),
    ([1.0], TypeError),
    (1j, TypeError),
    (Decimal(1), TypeError),
    (True, TypeError),
    (math.nan, ValueError),
    (math.inf, ValueError),
    (-math.inf, ValueError),
    (1e300, ValueError),
    (-1e300, ValueError),
    (2**62, ValueError),  # seconds: 2**62 * 10**6 µs is far beyond ±2**62 µs
    (-(2**62), ValueError),
    (10**40, ValueError),
    (2**62 / 1e6 * 1.001, ValueError),
]


@pytest.mark.parametrize(
    ("reading", "exc", "method"),
    [
        pytest.param(reading, exc, method, id=f"{method}-{reading!r}")
        for reading, exc in BAD_READINGS
        for method, _ in clock_methods()
    ],
)
def test_bad_clock_reading_changes_nothing(reading: Any, exc: type[Exception], method: str) -> None:
    twins = Twins()
    twins.advance(1.0)
    twins.subject.switch.next_value = reading
    call = dict(clock_methods())[method]
    assert_raises_exactly(exc, lambda: call(twins.subject), "clock")
    assert twins.subject.switch.next_value is _UNSET, "the clock was not read"
    twins.assert_same_afterwards()


@pytest.mark.parametrize("method", [m for m, _ in clock_methods()])
def test_clock_exception_propagates(method: str) -> None:
    twins = Twins()
    failure = ClockFailure("clock is broken")
    twins.subject.switch.next_error = failure
    call = dict(clock_methods())[method]
    with pytest.raises(ClockFailure) as info:
        call(twins.subject)
    assert info.value is failure
    twins.assert_same_afterwards()


@pytest.mark.parametrize(
    "reading", [-0.0, -5, 0.0000005, 2**62 // 10**6, -(2**62 // 10**6), Index(7)]
)
def test_odd_but_valid_clock_readings_are_accepted(reading: Any) -> None:
    limiter = TokenBucketLimiter(1, 1, clock=lambda: reading)
    assert limiter.allow("k")
    refused = limiter.allow("k")
    assert (refused.allowed, refused.retry_after) == (False, 1.0)


@pytest.mark.parametrize("method", [m for m, _ in clock_methods()])
def test_clock_stepping_back_acts_as_the_latest_time(method: str) -> None:
    """A backwards reading adds nothing, raises nothing, and moves no bucket back.

    The subject reads 0.5 s where the twin reads the latest time seen (2.0 s):
    they must answer alike, then and afterwards.
    """
    twins = Twins()
    twins.advance(2.0 - twins.subject.clock.now)
    for side in (twins.subject, twins.twin):
        side.user.allow("a", 3)  # drained at 2.0 s; "b" was last touched at 0.2 s
        side.cap.allow("all", 1)
    for key in ("a", "b", "new"):
        twins.subject.switch.next_value = 0.5
        got = dict(clock_methods(key=key))[method](twins.subject)
        want = dict(clock_methods(key=key))[method](twins.twin)
        assert got == want
        assert twins.subject.switch.next_value is _UNSET
    # Had the bucket moved back to 0.5 s, 1.5 s of refill would appear at 2.0 s.
    refused = twins.subject.user.peek("a", 1)
    assert refused == twins.twin.user.peek("a", 1)
    twins.assert_same_afterwards()


def test_backwards_clock_gives_no_refill() -> None:
    readings = iter([10.0, 10.0, 4.0, 4.0, 10.5, 10.5])
    limiter = TokenBucketLimiter(5, 1, clock=lambda: next(readings))
    assert limiter.allow("k", 5)
    drained = limiter.allow("k")
    assert (drained.allowed, drained.retry_after) == (False, 1.0)
    # Six seconds back: still refused, the same wait, no error.
    assert limiter.allow("k") == drained
    assert limiter.peek("k") == drained
    # Half a second after the latest time: half a token, not 6.5 tokens.
    later = limiter.allow("k")
    assert (later.allowed, later.retry_after, later.remaining) == (False, 0.5, 0)
    assert limiter.peek("k", 1).retry_after == 0.5


# -- Decision built by hand -------------------------------------------------------
#
# Decision(True, 0.0, -1, 0.0, 10) must not surface as PyO3's OverflowError:
# every field is checked like any other input.

GOOD_DECISION = (True, 0.0, 3, 1.5, 10, False)


@pytest.mark.parametrize(
    ("position", "value", "exc", "fragment"),
    [
        (0, 1, TypeError, "allowed must be a bool"),
        (0, None, TypeError, "allowed must be a bool"),
        (1, -1.0, ValueError, "retry_after must be >= 0"),
        (1, math.nan, ValueError, "retry_after must be >= 0"),
        (1, "1", TypeError, "retry_after must be an int or float"),
        (1, True, TypeError, "retry_after must be an int or float"),
        (1, 10**400, ValueError, "retry_after"),
        (2, -1, ValueError, "remaining must be an int from 0 to 2**64 - 1"),
        (2, 2**64, ValueError, "remaining must be an int from 0 to 2**64 - 1"),
        (2, 1.0, TypeError, "remaining must be an int"),
        (2, False, TypeError, "remaining must be an int"),
        (3, -0.5, ValueError, "reset_after must be >= 0"),
        (4, -1, ValueError, "limit must be an int from 0 to 2**64 - 1"),
        (4, 2**70, ValueError, "limit must be an int from 0 to 2**64 - 1"),
        (5, 0, TypeError, "degraded must be a bool"),
    ],
)
def test_bad_decision_fields_are_type_or_value_errors(
    position: int, value: Any, exc: type[Exception], fragment: str
) -> None:
    args: list[Any] = list(GOOD_DECISION)
    args[position] = value
    with pytest.raises(exc) as raised:
        Decision(*args)
    assert type(raised.value) is exc  # exactly: never PyO3's OverflowError
    assert fragment in str(raised.value)


def test_decision_fields_at_their_edges_are_accepted() -> None:
    d = Decision(False, math.inf, 2**64 - 1, math.inf, 2**64 - 1)
    assert (d.retry_after, d.remaining, d.reset_after, d.limit) == (
        math.inf,
        2**64 - 1,
        math.inf,
        2**64 - 1,
    )
    assert Decision(True, 0, Index(4), 2, 5) == Decision(True, 0.0, 4, 2.0, 5)
    assert Decision(*GOOD_DECISION) == Decision(True, 0.0, 3, 1.5, 10)
