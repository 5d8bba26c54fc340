"""Header profiles: which rate-limit fields a response carries (docs/web.md, "Header
profiles").

- ``"draft-11"`` (the default): ``RateLimit-Policy`` and ``RateLimit`` of
  draft-ietf-httpapi-ratelimit-headers-11 (:mod:`bucketlimit._web.fields`).
- ``"legacy"``: ``X-RateLimit-Limit``, ``X-RateLimit-Remaining`` and
  ``X-RateLimit-Reset`` (UTC epoch seconds when the bucket is full again), as
  flask-limiter, slowapi and GitHub send them: one limit's, the refusing one or
  else the token bucket with the fewest tokens left (a concurrency limit only
  when it refused: it has no window that resets).
- ``"openai"``: ``x-ratelimit-limit-<name>``, ``x-ratelimit-remaining-<name>`` and
  ``x-ratelimit-reset-<name>`` (the time until the bucket is full, as OpenAI writes
  it: ``1s``, ``6m0s``, ``12ms``) for each limit, named ``requests`` or ``tokens``
  as OpenAI's are; a refusal adds ``retry-after-ms`` and its body is OpenAI's error
  (``{"error": {"message", "type", "param", "code": "rate_limit_exceeded"}}``), so
  the openai SDK reads the code and waits as told. A concurrency limit has no reset
  field (no time is known when its permits free).

``Retry-After`` is part of every refusal, whatever the profile.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence

from bucketlimit._web.fields import Applied, refusal_status, retry_after_seconds

DRAFT11 = "draft-11"
LEGACY = "legacy"
OPENAI = "openai"
#: Every profile ``headers=`` accepts.
PROFILES = (DRAFT11, LEGACY, OPENAI)
#: The profile when neither the limit nor the app names one.
DEFAULT: tuple[str, ...] = (DRAFT11,)

X_LIMIT = "X-RateLimit-Limit"
X_REMAINING = "X-RateLimit-Remaining"
X_RESET = "X-RateLimit-Reset"
RETRY_AFTER_MS = "retry-after-ms"

# A header name's characters (RFC 9110 token), for the openai suffix.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def check_headers(headers: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``headers=`` checked: a profile, a list of them (``[]``: no fields at all), or
    ``None`` (the app's). Unknown names are a ``ValueError``, other types a
    ``TypeError``."""
    if headers is None:
        return None
    names = [headers] if isinstance(headers, str) else headers
    if not isinstance(names, (list, tuple)):
        raise TypeError(f"headers must be a profile name or a list of them, got {headers!r}")
    for name in names:
        if name not in PROFILES:
            raise ValueError(f"headers: unknown profile {name!r}; the profiles are {PROFILES}")
    return tuple(dict.fromkeys(names))


def check_openai_name(name: str) -> str:
    """A limit's name is its openai headers' suffix: it must be a header token."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(
            f"under headers='openai' a limit's name is a header suffix "
            f"(x-ratelimit-limit-<name>), so it must be a token such as 'requests' or "
            f"'tokens', got {name!r}"
        )
    return name


def go_duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset fields write them (Go's ``time.Duration``):
    ``1s``, ``1.5s``, ``6m0s``, ``1h2m3s``, ``12ms``, ``0s``; rounded up to the ms."""
    ms = math.ceil(round(seconds * 1000, 6))
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0").rstrip(".") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def legacy_fields(applied: Sequence[Applied], refused: bool) -> dict[str, str]:
    """One limit's ``X-RateLimit-*``: the refusing one (the last), else the one with
    the fewest tokens left (the first on a tie).

    A concurrency limit is shown only when it refused: these fields describe a
    quota per window that resets at ``X-RateLimit-Reset``, which permits have not
    (its refusal says ``Limit`` N, ``Remaining`` 0, no ``Reset``, and
    ``Retry-After``)."""
    if refused and applied:
        chosen = applied[-1]
    else:
        rated = [a for a in applied if not a.concurrency]
        if not rated:
            return {}
        chosen = min(rated, key=lambda a: a.decision.remaining)
    decision = chosen.decision
    fields = {X_LIMIT: str(decision.limit), X_REMAINING: str(decision.remaining)}
    if not math.isinf(decision.reset_after):
        fields[X_RESET] = str(math.ceil(time.time() + decision.reset_after))
    return fields


def openai_fields(applied: Applied) -> dict[str, str]:
    """``x-ratelimit-{limit,remaining,reset}-<name>`` of one limit."""
    name = check_openai_name(applied.name)
    decision = applied.decision
    fields = {
        f"x-ratelimit-limit-{name}": str(decision.limit),
        f"x-ratelimit-remaining-{name}": str(decision.remaining),
    }
    if not math.isinf(decision.reset_after):
        fields[f"x-ratelimit-reset-{name}"] = go_duration(decision.reset_after)
    return fields


def openai_refusal_headers(applied: Applied) -> dict[str, str]:
    """``retry-after-ms`` (when the request passes later) and JSON's media type."""
    headers = {"Content-Type": "application/json"}
    if retry_after_seconds(applied.decision) is not None:
        headers[RETRY_AFTER_MS] = str(math.ceil(round(applied.decision.retry_after * 1000, 6)))
    return headers


def openai_body(applied: Applied) -> dict[str, object]:
    """The refusal as OpenAI's error object: ``code`` ``rate_limit_exceeded`` and
    ``type`` the limit's name for a 429 (as OpenAI's ``requests`` / ``tokens``);
    ``insufficient_quota`` for a spent quota (403), ``invalid_request_error`` /
    ``cost_above_capacity`` for a cost above the capacity (413)."""
    status = refusal_status(applied)
    decision = applied.decision
    if status == 413:
        message = (
            f"Request too large for {applied.name}: it costs {applied.cost}, "
            f"and the limit holds {decision.limit}."
        )
        kind, code = "invalid_request_error", "cost_above_capacity"
    elif status == 403:
        message = f"You exceeded your quota of {applied.name}: it does not refill."
        kind, code = "insufficient_quota", "insufficient_quota"
    elif applied.concurrency:
        message = (
            f"Too many requests in flight for {applied.name}: at most {decision.limit} at "
            f"once. Please try again in {go_duration(decision.retry_after)}."
        )
        kind, code = applied.name, "rate_limit_exceeded"
    else:
        message = (
            f"Rate limit reached for {applied.name}: limit {decision.limit}, remaining "
            f"{decision.remaining}, requested {applied.cost}. Please try again in "
            f"{go_duration(decision.retry_after)}."
        )
        kind, code = applied.name, "rate_limit_exceeded"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
