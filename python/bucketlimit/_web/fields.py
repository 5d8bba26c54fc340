"""A ``Decision`` as HTTP: ``Retry-After``, the ``RateLimit-Policy`` and ``RateLimit``
fields of draft-ietf-httpapi-ratelimit-headers-11, and the 429 body."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bucketlimit._core import Decision

RATELIMIT = "RateLimit"
RATELIMIT_POLICY = "RateLimit-Policy"
RETRY_AFTER = "Retry-After"

# RFC 9651 (structured fields): an Integer has at most 15 digits.
_SF_INT_MAX = 999_999_999_999_999


def retry_after_seconds(decision: Decision) -> int | None:
    """``Retry-After`` for a refusal: whole seconds, rounded up, at least 1.

    ``None`` when the request can never pass (``retry_after`` is infinite: a rate-0
    quota, or a cost above the capacity). No value would be true then, and a huge
    one makes well-behaved clients sleep for ever, so the field is left out and the
    body says ``"retry_after": null``.
    """
    if math.isinf(decision.retry_after):
        return None
    return max(1, math.ceil(decision.retry_after))


def window_seconds(capacity: int, rate: float) -> int | None:
    """The ``w`` of a token bucket: seconds for an empty bucket to fill again.

    A token bucket is not a fixed window, so this is the honest reading of it:
    ``q`` (the capacity) per ``w`` seconds is the bucket's sustained rate, and a
    full bucket admits a burst of ``q`` at once. A client that keeps to ``q``
    per ``w`` is never refused. ``capacity / rate`` is rounded to the limiter's
    own microsecond resolution first, so float noise in the rate (100 per 60 s
    is 1.6666666666666667/s) cannot add a second, then up to whole seconds
    (rounding up keeps the advertised rate at or below the real one). ``None``
    (``w`` omitted) when the bucket never refills: a rate-0 quota has no window.
    """
    if rate <= 0:
        return None
    return max(1, math.ceil(round(capacity / rate, 6)))


def _reset_seconds(decision: Decision) -> int | None:
    """The ``t`` of the ``RateLimit`` field, or ``None`` to leave it out.

    Refused: the same value as ``Retry-After`` (the draft asks that Retry-After
    not point before the end of ``t``; equal values keep the two in step).
    Allowed: ``ceil(reset_after)``, the seconds until the bucket is full, i.e.
    until ``r`` is back to ``q``. Infinite (rate 0): no such time, ``t`` is omitted.
    """
    if not decision.allowed:
        return retry_after_seconds(decision)
    if math.isinf(decision.reset_after):
        return None
    return math.ceil(decision.reset_after)


def _sf_string(text: str) -> str:
    """``text`` as an RFC 9651 String: quoted, with ``"`` and ``\\`` escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _sf_int(value: int) -> int:
    return min(max(value, 0), _SF_INT_MAX)


@dataclass(frozen=True)
class Applied:
    """One limit's answer for one request, as the RateLimit fields report it."""

    name: str
    decision: Decision
    window: int | None

    def policy_item(self) -> str:
        item = f"{_sf_string(self.name)};q={_sf_int(self.decision.limit)}"
        return item if self.window is None else f"{item};w={_sf_int(self.window)}"

    def limit_item(self) -> str:
        item = f"{_sf_string(self.name)};r={_sf_int(self.decision.remaining)}"
        reset = _reset_seconds(self.decision)
        return item if reset is None else f"{item};t={_sf_int(reset)}"


def ratelimit_fields(applied: Sequence[Applied]) -> dict[str, str]:
    """``RateLimit-Policy`` and ``RateLimit``: one field each, one list member per limit.

    >>> d = Decision(True, 0.0, 7, 1.5, 10)
    >>> ratelimit_fields([Applied("per-ip", d, 5)])
    {'RateLimit-Policy': '"per-ip";q=10;w=5', 'RateLimit': '"per-ip";r=7;t=2'}
    """
    if not applied:
        return {}
    return {
        RATELIMIT_POLICY: ", ".join(a.policy_item() for a in applied),
        RATELIMIT: ", ".join(a.limit_item() for a in applied),
    }


def refusal_body(decision: Decision) -> dict[str, object]:
    """The JSON body of a 429: ``{"error": "rate limited", "retry_after": 2}``.

    ``retry_after`` is the ``Retry-After`` value, or ``null`` when the request can
    never pass.
    """
    return {"error": "rate limited", "retry_after": retry_after_seconds(decision)}


def refusal_headers(decision: Decision) -> dict[str, str]:
    seconds = retry_after_seconds(decision)
    return {} if seconds is None else {RETRY_AFTER: str(seconds)}
