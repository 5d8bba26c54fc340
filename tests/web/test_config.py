"""Limit strings (bucketlimit.parse_limit / parse_limits) against a reference reading
of the grammar, the limiter factory (bucketlimit.limiter) in memory, and a Limit
built from a string in every adapter."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import bucketlimit
from bucketlimit import TokenBucketLimiter, parse_limit, parse_limits
from bucketlimit import django as bl_django
from bucketlimit import fastapi as bl_fastapi
from bucketlimit import flask as bl_flask
from bucketlimit import litestar as bl_litestar
from bucketlimit.testing import ManualClock
from bucketlimit.web import LimitStringError

SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "month": 2592000}
SECONDS["year"] = 360 * 86400


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100/minute", (100, 100, 60)),
        ("100 per minute", (100, 100, 60)),
        ("10/second", (10, 10, 1)),
        ("5/2 seconds", (5, 5, 2)),
        ("5 per 2 seconds", (5, 5, 2)),
        ("1000/day", (1000, 1000, 86400)),
        ("3/hour", (3, 3, 3600)),
        ("1 per DAY", (1, 1, 86400)),
        ("  50 / hours ", (50, 50, 3600)),
        ("2/month", (2, 2, 2592000)),
        ("1/year", (1, 1, 31104000)),
    ],
)
def test_the_forms_the_peers_accept(text: str, expected: tuple[int, int, int]) -> None:
    assert parse_limit(text) == expected


@pytest.mark.parametrize(
    "bad",
    ["", "100", "minute", "100/", "100/fortnight", "-1/second", "0/second", "1/0 seconds",
     "1.5/second", "100/minute/extra", "ten/second"],
)  # fmt: skip
def test_a_bad_string_is_a_value_error_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_limit(bad)


# A hang guard only: a refusal that backtracks over every way to split a run of
# spaces between the pattern's parts does not end on a megabyte (800 spaces took
# seconds); one pass over it takes milliseconds.
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad",
    ["1 per" + " " * 2**20 + "!", "1" + " " * 2**20 + "/ 5" + " " * 2**20],
    ids=["after per", "around the multiple"],
)
def test_a_megabyte_of_spaces_is_refused_in_one_pass(bad: str) -> None:
    with pytest.raises(ValueError, match="not a limit"):
        parse_limit(bad)
    with pytest.raises(ValueError, match="not a limit"):
        parse_limits([bad, "1/second"])


def test_several_limits_are_for_parse_limits() -> None:
    assert parse_limits("10/second;1000/day") == [(10, 10, 1), (1000, 1000, 86400)]
    assert parse_limits("10/second, 1000/day | 5 per minute") == [
        (10, 10, 1),
        (1000, 1000, 86400),
        (5, 5, 60),
    ]
    assert parse_limits(["200 per day", "50 per hour"]) == [(200, 200, 86400), (50, 50, 3600)]
    with pytest.raises(ValueError, match="parse_limits"):
        parse_limit("10/second;1000/day")
    with pytest.raises(ValueError, match="no limit"):
        parse_limits(" ; ")
    with pytest.raises(ValueError, match="'bad'"):
        parse_limits("10/second;bad")
    with pytest.raises(TypeError):
        parse_limit(100)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_limits([100])  # type: ignore[list-item]


@given(
    count=st.integers(1, 10**9),
    multiple=st.one_of(st.none(), st.integers(1, 1000)),
    period=st.sampled_from(sorted(SECONDS)),
    plural=st.booleans(),
    per=st.sampled_from(["/", " / ", " per ", "per"]),
)
def test_any_written_limit_reads_as_the_reference_says(
    count: int, multiple: int | None, period: str, plural: bool, per: str
) -> None:
    text = f"{count}{per}{'' if multiple is None else f'{multiple} '}{period}{'s' * plural}"
    seconds = SECONDS[period] * (1 if multiple is None else multiple)
    assert parse_limit(text) == (count, count, seconds)
    assert parse_limits(f"{text};{text}") == [(count, count, seconds)] * 2


def test_the_bucket_of_n_per_period_admits_n_at_once_and_n_per_period_after() -> None:
    clock = ManualClock()
    limiter = bucketlimit.limiter("10/minute", clock=clock)
    assert isinstance(limiter, TokenBucketLimiter)
    assert [limiter.allow("k").allowed for _ in range(11)] == [True] * 10 + [False]
    clock.advance(6)  # a minute refills 10: one every 6 s
    assert limiter.allow("k")
    assert not limiter.allow("k")
    # Within one minute at most N + N * 59/60: a full bucket, then what refills (a
    # fixed window admits 2N in an instant at its edge).
    clock.advance(60)
    admitted = 0
    for _ in range(60):
        admitted += sum(limiter.allow("k").allowed for _ in range(20))
        clock.advance(1)
    assert admitted == 10 + 9  # t = 0 .. 59 s: the full 10, then one every 6 s


def test_the_factory_in_memory() -> None:
    assert bucketlimit.limiter("100/minute") is not bucketlimit.limiter("100/minute")
    built = bucketlimit.limiter((5, 2), max_keys=10)
    assert isinstance(built, TokenBucketLimiter)
    assert (built.capacity, built.rate, built.max_keys) == (5, 2.0, 10)
    assert bucketlimit.limiter((60, 60, 60)).rate == 1.0
    with pytest.raises(ValueError, match="storage must be a URI"):
        bucketlimit.limiter("1/second", storage="memcached://localhost")
    with pytest.raises(ValueError, match="async_=True needs a Redis"):
        bucketlimit.limiter("1/second", async_=True)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="storage must be a URI"):
        bucketlimit.limiter("1/second", storage="async+memory://")
    with pytest.raises(TypeError, match="limit must be"):
        bucketlimit.limiter(5)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="storage must be"):
        bucketlimit.limiter("1/second", storage=None)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="'5/eon'"):
        bucketlimit.limiter("5/eon")


@pytest.mark.parametrize("module", [bl_flask, bl_fastapi, bl_litestar, bl_django])
def test_every_adapters_limit_takes_a_limit_string(module: object) -> None:
    limit_class = module.Limit  # type: ignore[attr-defined]
    limit = limit_class("5 per 2 seconds", storage="memory://")
    limiter = limit.limiter
    assert isinstance(limiter, TokenBucketLimiter)
    assert (limiter.capacity, limiter.rate) == (5, 2.5)
    assert limit.name == "5 per 2 seconds"  # distinct per limit string
    assert limit_class("1/second", name="requests").name == "requests"
    with pytest.raises(LimitStringError, match="'not a limit'") as raised:
        limit_class("not a limit")
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value, TypeError)
    with pytest.raises(TypeError, match="storage= and scope= are for a limit string"):
        limit_class(TokenBucketLimiter(1, 1), storage="memory://")
    with pytest.raises(TypeError, match="storage= and scope= are for a limit string"):
        limit_class(TokenBucketLimiter(1, 1), scope="auth")
    with pytest.raises(ValueError, match="scope must be non-empty"):
        limit_class("1/second", scope="")
    with pytest.raises(ValueError, match="storage must be a URI"):
        limit_class("1/second", storage="nowhere://")


def test_a_limit_string_without_storage_is_built_when_first_read() -> None:
    limit = bl_fastapi.Limit("3/minute")
    assert not limit.bound
    assert isinstance(limit.limiter, TokenBucketLimiter)  # no app storage: memory://
    assert limit.bound
    first = limit.limiter
    assert limit.limiter is first  # built once
