"""What a rate-limited API says about its limits, read from a response's headers.

    from bucketlimit.upstream import parse

    for seen in parse(response.headers):
        limiters[seen.resource].observe(key, seen.remaining, limit=seen.limit,
                                        reset_after=seen.reset_after,
                                        retry_after=seen.retry_after)

:func:`parse` reads the header families below into :class:`Observation` values, one
per resource; each provider is a row of data (:data:`PROFILES`), not code:

- OpenAI: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, resets as
  durations (``6m0s``, ``1s``, ``12ms``, ``1m30.5s``);
- Anthropic: ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
  {limit,remaining,reset}``, resets as RFC 3339 times;
- draft-ietf-httpapi-ratelimit-headers-11: ``RateLimit`` (``r``, ``t``) and
  ``RateLimit-Policy`` (``q``, ``w``, ``qu``), RFC 9651 structured fields read with
  the ``http-sf`` package (``pip install 'bucketlimit[upstream]'``; without it these
  two fields are skipped, with a log line);
- ``Retry-After`` (seconds or an HTTP date) and ``retry-after-ms``, which every
  observation of the response carries; alone, they are one observation of
  ``"requests"`` with nothing remaining.

Times given as dates (Anthropic's resets, an HTTP-date ``Retry-After``) are read
against the response's ``Date`` field when it has one (the server's clock, so a
skewed local clock does not matter), else against ``time.time()``. A count above
2**64 - 1 (more than any limiter holds) is read as 2**64 - 1, what every ``observe``
takes. A value that is not what its field should hold (negative, without units,
garbage, a duration of more than 64 characters) is ignored, with one log line on the
``bucketlimit`` logger (a WARNING the first time a field is bad, DEBUG after, the
value shortened): never an exception, so a quirky header cannot fail a request, and
no value costs more than a pass over it.
"""

from __future__ import annotations

import email.utils
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

logger = logging.getLogger("bucketlimit")

__all__ = ["PROFILES", "Observation", "Profile", "parse"]


@dataclass(frozen=True)
class Observation:
    """Where one of the upstream's limits stands, as a response said it.

    ``resource``: what is counted (``"requests"``, ``"tokens"``, ``"input-tokens"``,
    ``"output-tokens"``; a draft-11 policy's quota unit); ``remaining``: how many
    are left; ``limit``: the most there can be (``None`` when not said);
    ``reset_after``: seconds until it is full again (``None`` when not said);
    ``retry_after``: seconds before the upstream takes another request (a 429's
    ``Retry-After``), or ``None``. Give it to a limiter's ``observe``.
    """

    resource: str
    remaining: int
    limit: int | None = None
    reset_after: float | None = None
    retry_after: float | None = None


class Headers(Protocol):
    """A mapping of header names to values, or httpx's ``Headers``."""

    def items(self) -> Iterable[tuple[str, str]]: ...


#: How a provider writes a reset: seconds from the response's time.
ResetReader = Callable[[str, float], float]


@dataclass(frozen=True)
class Profile:
    """One provider's header family: ``pattern`` with ``{resource}`` and ``{field}``
    (``limit``, ``remaining``, ``reset``) names each header; ``read_reset`` turns a
    reset's text into seconds (given the response's time, Unix seconds)."""

    name: str
    pattern: str
    resources: tuple[str, ...]
    read_reset: ResetReader


# -- values ----------------------------------------------------------------------

_PART = r"(\d+(?:\.\d+)?)(h|ms|m|s|us|µs|μs|ns)"
_DURATION: Final = re.compile(f"(?:{_PART})+")
_PARTS: Final = re.compile(_PART)
# Go's units; µ is written as the micro sign or as the Greek mu.
_UNITS: Final = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}
_UNITS.update({"μs": 1e-6, "ns": 1e-9})
# The longest duration read, in characters (Go's longest is 24:
# 2562047h47m16.854775807s): a longer value is refused unread, so a hostile one
# costs no more than a short one. The pattern is linear besides: fullmatch tries one
# start, and a number's digits can only end at a unit.
_LONGEST_DURATION: Final = 64


def duration(text: str, now: float = 0.0) -> float:
    """A Go duration as OpenAI writes resets: ``6m0s``, ``1s``, ``12ms``,
    ``1m30.5s``, ``2h0m0s`` (every number with its unit; at most 64 characters).
    ``ValueError`` otherwise."""
    text = text.strip()
    if len(text) > _LONGEST_DURATION:
        raise ValueError(f"not a duration: {len(text)} characters, more than {_LONGEST_DURATION}")
    if not _DURATION.fullmatch(text):
        raise ValueError(f"not a duration with units: {text!r}")
    return sum(float(number) * _UNITS[unit] for number, unit in _PARTS.findall(text))


def rfc3339(text: str, now: float) -> float:
    """An RFC 3339 time as Anthropic writes resets (``2025-08-21T12:40:59Z``): the
    seconds from ``now`` until then (0 when it is past). ``ValueError`` otherwise."""
    text = text.strip()
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", text, re.I):
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    moment = datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    return max(0.0, moment.timestamp() - now)


# The largest count an observation carries, 2**64 - 1: the most a limiter's observe
# takes, and more than any bucket holds, so a larger count says no more.
_MOST: Final = 2**64 - 1


def _count(text: str) -> int:
    text = text.strip()
    if not text.isdigit() or not text.isascii():
        raise ValueError(f"not a count (a whole number >= 0): {text!r}")
    digits = text.lstrip("0")
    # Over 20 digits is over _MOST: not converted (int() of a long text is slow).
    return _MOST if len(digits) > 20 else min(int(digits or "0"), _MOST)


def _http_date(text: str) -> float:
    moment = email.utils.parsedate_to_datetime(text)
    if moment.tzinfo is None:
        raise ValueError(f"not an HTTP date: {text!r}")
    return moment.timestamp()


#: The providers parse knows, in order: data, one row each.
PROFILES: Final = (
    Profile("openai", "x-ratelimit-{field}-{resource}", ("requests", "tokens"), duration),
    Profile(
        "anthropic",
        "anthropic-ratelimit-{resource}-{field}",
        ("requests", "tokens", "input-tokens", "output-tokens"),
        rfc3339,
    ),
)

# Header names already reported bad once (a WARNING), so a provider sending one
# bad field on every response is not a log line per request.
_REPORTED: set[str] = set()


def _ignore(name: str, value: str, why: object) -> None:
    level = logging.DEBUG if name in _REPORTED else logging.WARNING
    _REPORTED.add(name)
    logger.log(level, "ignoring the %s header %s: %s", name, _clip(repr(value)), _clip(str(why)))


def _clip(text: str, most: int = 200) -> str:
    """At most ``most`` characters of ``text``, then its length: a hostile header of
    a megabyte is not copied into a log line whole."""
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


# -- parse ----------------------------------------------------------------------


def parse(headers: Mapping[str, str] | Headers) -> list[Observation]:
    """The observations a response's headers hold, in the order of :data:`PROFILES`,
    then draft-11's policies; ``[]`` when it says nothing of its limits. Header names
    are read case-insensitively (a plain mapping or httpx's ``Headers``); a bad value
    is ignored with a log line, never raised."""
    fields: dict[str, str] = {}
    for name, value in headers.items():
        name = name.lower()
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    now = _response_time(fields)
    retry_after = _retry_after(fields, now)
    found: list[Observation] = []
    for profile in PROFILES:
        for resource in profile.resources:
            seen = _profile_observation(fields, profile, resource, now, retry_after)
            if seen is not None:
                found.append(seen)
    found += _draft11(fields, retry_after)
    if not found and retry_after is not None:
        found.append(Observation("requests", 0, retry_after=retry_after))
    return found


def _read(fields: dict[str, str], name: str, reader: Callable[[str], Any]) -> Any:
    """The header's value read by ``reader``, ``None`` when absent or bad (logged)."""
    value = fields.get(name)
    if value is None:
        return None
    try:
        result = reader(value)
    except (ValueError, OverflowError) as why:
        _ignore(name, value, why)
        return None
    if isinstance(result, float) and not (math.isfinite(result) and result >= 0):
        _ignore(name, value, "not a finite number of seconds >= 0")
        return None
    return result


def _response_time(fields: dict[str, str]) -> float:
    """The response's time (Unix seconds): its Date field, else this machine's clock."""
    if "date" in fields:
        date = _read(fields, "date", _http_date)
        if date is not None:
            return float(date)
    return time.time()


def _retry_after(fields: dict[str, str], now: float) -> float | None:
    """``retry-after-ms`` (milliseconds, the more precise) else ``Retry-After``
    (seconds, or an HTTP date), in seconds."""
    millis = _read(fields, "retry-after-ms", lambda v: _seconds(v) / 1000)
    if millis is not None:
        return float(millis)

    def seconds_or_date(value: str) -> float:
        if value.strip().isdigit():
            return float(value.strip())
        return max(0.0, _http_date(value) - now)

    seconds = _read(fields, "retry-after", seconds_or_date)
    return None if seconds is None else float(seconds)


def _seconds(text: str) -> float:
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*", text):
        raise ValueError(f"not a number >= 0: {text!r}")
    return float(text)


def _profile_observation(
    fields: dict[str, str], profile: Profile, resource: str, now: float, retry: float | None
) -> Observation | None:
    def name(field: str) -> str:
        return profile.pattern.format(resource=resource, field=field)

    remaining = _read(fields, name("remaining"), _count)
    if remaining is None:
        return None  # nothing to observe without it
    reset = _read(fields, name("reset"), lambda v: profile.read_reset(v, now))
    return Observation(
        resource,
        remaining,
        limit=_read(fields, name("limit"), _count),
        reset_after=None if reset is None else float(reset),
        retry_after=retry,
    )


# -- draft-11 ---------------------------------------------------------------------

_WARNED_NO_SF: list[bool] = []


def _draft11(fields: dict[str, str], retry: float | None) -> list[Observation]:
    """``RateLimit`` with ``RateLimit-Policy``: one observation per policy named in
    ``RateLimit`` with an ``r``; its ``t`` is read as the seconds until it is full
    again, the policy's ``q`` as its limit, its ``qu`` (default ``"requests"``) as
    the resource."""
    if "ratelimit" not in fields:
        return []
    try:
        import http_sf  # optional: bucketlimit[upstream]
    except ImportError:
        if not _WARNED_NO_SF:
            _WARNED_NO_SF.append(True)
            logger.warning(
                "ignoring the RateLimit and RateLimit-Policy headers: reading them needs "
                "the http-sf package (pip install 'bucketlimit[upstream]')"
            )
        return []

    def members(name: str) -> dict[str, dict[str, Any]]:
        value = fields.get(name)
        if value is None:
            return {}
        try:
            parsed = http_sf.parse(value.encode("latin-1"), tltype="list")
        except (http_sf.StructuredFieldError, UnicodeEncodeError, ValueError) as why:
            _ignore(name, value, why)
            return {}
        found: dict[str, dict[str, Any]] = {}
        assert isinstance(parsed, list)
        for member in parsed:
            if isinstance(member, tuple) and isinstance(member[0], str):
                found[str(member[0])] = dict(member[1])
            else:
                _ignore(name, value, f"a member that is not a named policy: {member!r}")
        return found

    def whole(params: dict[str, Any], key: str, name: str, value: str) -> int | None:
        number = params.get(key)
        if number is None:
            return None
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            _ignore(name, value, f"{key}={number!r} is not a whole number >= 0")
            return None
        return number

    policies = members("ratelimit-policy")
    found = []
    for policy, params in members("ratelimit").items():
        value = fields["ratelimit"]
        remaining = whole(params, "r", "ratelimit", value)
        if remaining is None:
            continue
        reset = whole(params, "t", "ratelimit", value)
        declared = policies.get(policy, {})
        unit = declared.get("qu", "requests")
        limit = whole(declared, "q", "ratelimit-policy", fields.get("ratelimit-policy", ""))
        found.append(
            Observation(
                str(unit),
                remaining,
                limit=limit,
                reset_after=None if reset is None else float(reset),
                retry_after=retry,
            )
        )
    return found
