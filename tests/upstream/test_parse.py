"""bucketlimit.upstream.parse on header sets recorded from the providers' documentation
(each sample says where it comes from), every header form, and bad values: ignored
with a log line, never raised."""

from __future__ import annotations

import email.utils
import logging
from typing import Any

import httpx
import pytest

from bucketlimit import upstream
from bucketlimit.upstream import Observation, parse

# OpenAI, "Rate limits" guide, the table of header fields and their sample values
# (https://developers.openai.com/api/docs/guides/rate-limits.md).
OPENAI_DOCS = {
    "x-ratelimit-limit-requests": "60",
    "x-ratelimit-limit-tokens": "150000",
    "x-ratelimit-remaining-requests": "59",
    "x-ratelimit-remaining-tokens": "149984",
    "x-ratelimit-reset-requests": "1s",
    "x-ratelimit-reset-tokens": "6m0s",
}
# OpenAI, headers of a chat completion quoted on the OpenAI developer forum ("How to
# get rate limit reset time for response API?",
# https://community.openai.com/t/how-to-get-rate-limit-reset-time-for-response-api/1268905):
# millisecond resets, and a field parse does not know (ignored).
OPENAI_FORUM = {
    "x-ratelimit-limit-requests": "5000",
    "x-ratelimit-limit-tokens": "160000",
    "x-ratelimit-limit-tokens_usage_based": "160000",
    "x-ratelimit-remaining-requests": "4999",
    "x-ratelimit-remaining-tokens": "159976",
    "x-ratelimit-remaining-tokens_usage_based": "159976",
    "x-ratelimit-reset-requests": "12ms",
    "x-ratelimit-reset-tokens": "9ms",
    "x-ratelimit-reset-tokens_usage_based": "9ms",
}
# An OpenAI-compatible provider's documented sample with fractional seconds and a
# 429's retry-after (Groq, "Rate Limits", https://console.groq.com/docs/rate-limits).
GROQ_DOCS = {
    "retry-after": "2",
    "x-ratelimit-limit-requests": "14400",
    "x-ratelimit-limit-tokens": "18000",
    "x-ratelimit-remaining-requests": "14370",
    "x-ratelimit-remaining-tokens": "17997",
    "x-ratelimit-reset-requests": "2m59.56s",
    "x-ratelimit-reset-tokens": "7.66s",
}
# Anthropic: a response of api.anthropic.com/v1/messages recorded on 2025-08-21 (the
# tidyllm package's test fixture, https://rdrr.io/cran/tidyllm/src/tests/testthat/
# claude/api.anthropic.com/v1/messages-e050b5-POST.R); the fields are those of
# Anthropic's rate-limit docs, as listed in "Rate limits and quotas - Claude Platform
# on AWS" (https://docs.aws.amazon.com/claude-platform/latest/userguide/rate-limits.html).
ANTHROPIC_RECORDED = {
    "date": "Thu, 21 Aug 2025 12:41:00 GMT",
    "anthropic-ratelimit-input-tokens-limit": "80000",
    "anthropic-ratelimit-input-tokens-remaining": "80000",
    "anthropic-ratelimit-input-tokens-reset": "2025-08-21T12:40:59Z",
    "anthropic-ratelimit-output-tokens-limit": "16000",
    "anthropic-ratelimit-output-tokens-remaining": "16000",
    "anthropic-ratelimit-output-tokens-reset": "2025-08-21T12:41:00Z",
    "anthropic-ratelimit-requests-limit": "1000",
    "anthropic-ratelimit-requests-remaining": "999",
    "anthropic-ratelimit-requests-reset": "2025-08-21T12:40:59Z",
    "anthropic-ratelimit-tokens-limit": "96000",
    "anthropic-ratelimit-tokens-remaining": "96000",
    "anthropic-ratelimit-tokens-reset": "2025-08-21T12:40:59Z",
    "request-id": "req_011CSLsW7mFqvHHnzrKdKjAE",
}


def test_openai_documented_sample() -> None:
    assert parse(OPENAI_DOCS) == [
        Observation("requests", 59, limit=60, reset_after=1.0),
        Observation("tokens", 149984, limit=150000, reset_after=360.0),
    ]


def test_openai_millisecond_resets_and_unknown_fields() -> None:
    found = parse(OPENAI_FORUM)
    assert [(o.resource, o.remaining, o.limit) for o in found] == [
        ("requests", 4999, 5000),
        ("tokens", 159976, 160000),
    ]
    assert found[0].reset_after == pytest.approx(0.012)
    assert found[1].reset_after == pytest.approx(0.009)


def test_fractional_seconds_and_retry_after_on_every_observation() -> None:
    found = parse(GROQ_DOCS)
    assert [o.retry_after for o in found] == [2.0, 2.0]
    assert found[0].reset_after == pytest.approx(179.56)
    assert found[1].reset_after == pytest.approx(7.66)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("6m0s", 360),
        ("1s", 1),
        ("12ms", 0.012),
        ("1m30.5s", 90.5),
        ("2h0m0s", 7200),
        ("0s", 0),
        ("500us", 0.0005),
        ("250µs", 0.00025),
        ("7ns", 7e-9),
        ("1h1m1.5s", 3661.5),
    ],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert upstream.duration(text) == pytest.approx(seconds)


def test_anthropic_recorded_response_reads_resets_against_its_date() -> None:
    found = parse(ANTHROPIC_RECORDED)
    assert [(o.resource, o.remaining, o.limit) for o in found] == [
        ("requests", 999, 1000),
        ("tokens", 96000, 96000),
        ("input-tokens", 80000, 80000),
        ("output-tokens", 16000, 16000),
    ]
    # The resets are at or before the response's Date: nothing to wait for.
    assert {o.reset_after for o in found} == {0.0}


def test_anthropic_resets_in_the_future_and_with_offsets() -> None:
    headers = {
        "Date": "Thu, 21 Aug 2025 12:41:00 GMT",
        "anthropic-ratelimit-tokens-remaining": "1000",
        "anthropic-ratelimit-tokens-reset": "2025-08-21T12:41:30.5Z",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2025-08-21T14:42:00+02:00",
    }
    found = {o.resource: o for o in parse(headers)}
    assert found["tokens"].reset_after == 30.5
    assert found["requests"].reset_after == 60.0


def test_draft11_fields_with_a_real_structured_field_parser() -> None:
    headers = {
        "RateLimit-Policy": '"burst";q=100;w=60, "daily";q=1000;w=86400;qu="tokens"',
        "RateLimit": '"burst";r=50;t=30, "daily";r=500;t=3600, "other";t=5',
    }
    assert parse(headers) == [
        Observation("requests", 50, limit=100, reset_after=30.0),
        Observation("tokens", 500, limit=1000, reset_after=3600.0),
    ]
    # Our own web adapters' fields read back (docs/web.md): no policy, no t.
    assert parse({"RateLimit": '"requests";r=9'}) == [Observation("requests", 9)]


def test_retry_after_in_seconds_as_a_date_and_in_milliseconds() -> None:
    assert parse({"Retry-After": "120"}) == [Observation("requests", 0, retry_after=120.0)]
    date = "Thu, 21 Aug 2025 12:41:00 GMT"
    later = "Thu, 21 Aug 2025 12:42:30 GMT"
    assert parse({"date": date, "retry-after": later})[0].retry_after == 90.0
    # retry-after-ms is the more precise: it wins.
    found = parse({"retry-after-ms": "1500.5", "retry-after": "2", **OPENAI_DOCS})
    assert {o.retry_after for o in found} == {1.5005}
    # Without a Date field, against this machine's clock.
    soon = email.utils.formatdate(usegmt=True)
    assert 0 <= parse({"Retry-After": soon})[0].retry_after <= 1  # type: ignore[operator]


def test_header_names_are_case_insensitive_in_a_mapping_and_in_httpx_headers() -> None:
    shouted: dict[str, str] = {name.upper(): value for name, value in OPENAI_DOCS.items()}
    assert parse(shouted) == parse(OPENAI_DOCS) == parse(httpx.Headers(OPENAI_DOCS))
    response = httpx.Response(429, headers={**OPENAI_DOCS, "Retry-After": "3"})
    assert {o.retry_after for o in parse(response.headers)} == {3.0}


def test_nothing_said_is_nothing_found() -> None:
    assert parse({}) == []
    assert parse({"content-type": "application/json"}) == []


@pytest.mark.parametrize(
    ("headers", "kept"),
    [
        ({"x-ratelimit-remaining-tokens": "-5"}, []),  # negative
        ({"x-ratelimit-remaining-tokens": "lots"}, []),  # garbage
        ({"x-ratelimit-remaining-tokens": "1.5"}, []),  # not whole
        (
            {"x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "5"},
            [Observation("tokens", 10)],  # a reset without units
        ),
        (
            {"x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "-1s"},
            [Observation("tokens", 10)],
        ),
        (
            {"x-ratelimit-remaining-tokens": "10", "x-ratelimit-limit-tokens": "ten"},
            [Observation("tokens", 10)],
        ),
        (
            {
                "anthropic-ratelimit-tokens-remaining": "7",
                "anthropic-ratelimit-tokens-reset": "soon",
            },
            [Observation("tokens", 7)],
        ),
        ({"retry-after": "-3"}, []),
        ({"retry-after": "Funday, 99 Nope"}, []),
        ({"retry-after-ms": "1e3"}, []),
        ({"RateLimit": '"burst";r=-1;t=30'}, []),
        ({"RateLimit": "not a structured field ("}, []),
        ({"RateLimit": '"burst";r=5;t=?1'}, [Observation("requests", 5)]),
        ({"date": "yesterday", "x-ratelimit-remaining-tokens": "3"}, [Observation("tokens", 3)]),
    ],
)
def test_bad_values_are_ignored_with_a_log_line(
    headers: dict[str, str], kept: list[Observation], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="bucketlimit"):
        assert parse(headers) == kept
    assert [r for r in caplog.records if r.name == "bucketlimit" and "ignoring" in r.getMessage()]


# Every field parse reads but one: test_a_bad_field_warns_once_then_quietly needs a
# field bad in no other test (a field warns once per process).
WARNED_ONCE = "anthropic-ratelimit-output-tokens-remaining"
EVERY_FIELD = [
    name
    for profile in upstream.PROFILES
    for resource in profile.resources
    for field in ("limit", "remaining", "reset")
    if (name := profile.pattern.format(resource=resource, field=field)) != WARNED_ONCE
] + ["retry-after", "retry-after-ms", "date", "ratelimit", "ratelimit-policy"]
MOST = 2**64 - 1
OPENAI = ("requests", "tokens")  # the first observations: OpenAI's fields


# A hang guard only: a reset of 16 KB of digits took seconds, a megabyte would not
# end; one pass over a megabyte takes milliseconds.
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("value", "kept"),
    [
        ("1" * 2**20, [Observation(r, MOST, limit=MOST) for r in OPENAI]),
        ("1h" * 2**19 + "x", []),
        (" " * 2**20 + "1", [Observation(r, 1, limit=1, retry_after=0.001) for r in OPENAI]),
    ],
    ids=["digits", "units", "spaces"],
)
def test_a_megabyte_in_every_field_is_read_in_one_pass_and_logged_short(
    value: str, kept: list[Observation], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="bucketlimit"):
        found = parse(dict.fromkeys(EVERY_FIELD, value))
    assert found[:2] == kept
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert lines, "no field was refused: the values tested nothing"
    assert max(map(len, lines)) < 1_000, "a refused value is copied into its log line whole"


@pytest.mark.timeout(10)  # a hang guard, as above
def test_a_duration_longer_than_any_go_writes_is_refused_unread() -> None:
    headers = {"x-ratelimit-remaining-tokens": "5", "x-ratelimit-reset-tokens": "1" * 2**20}
    assert parse(headers) == [Observation("tokens", 5)]
    assert upstream.duration("2562047h47m16.854775807s") == pytest.approx(2**63 / 1e9)
    for text in ("1" * 65, "1" * 2**20, "1s" * 2**19):
        with pytest.raises(ValueError, match=f"{len(text)} characters, more than 64"):
            upstream.duration(text)


def test_a_count_beyond_what_any_limiter_holds_is_read_as_the_most_it_takes() -> None:
    headers = {"x-ratelimit-remaining-tokens": "9" * 25, "x-ratelimit-limit-tokens": "0" * 30 + "7"}
    assert parse(headers) == [Observation("tokens", MOST, limit=7)]
    assert parse({"x-ratelimit-remaining-tokens": str(MOST + 1)})[0].remaining == MOST
    assert parse({"x-ratelimit-remaining-tokens": str(MOST)})[0].remaining == MOST


def test_a_bad_field_warns_once_then_quietly(caplog: pytest.LogCaptureFixture) -> None:
    name = WARNED_ONCE  # bad in no other test
    with caplog.at_level(logging.DEBUG, logger="bucketlimit"):
        for _ in range(3):
            parse({name: "nan"})
    levels = [r.levelno for r in caplog.records if name in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_without_http_sf_draft11_is_skipped_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_http_sf(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "http_sf":
            raise ImportError("No module named 'http_sf'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_http_sf)
    with caplog.at_level(logging.WARNING, logger="bucketlimit"):
        assert parse({"RateLimit": '"burst";r=5', **OPENAI_DOCS}) == parse(OPENAI_DOCS)
    assert any("http-sf" in r.getMessage() for r in caplog.records)
