"""A ``Decision`` as HTTP: ``Retry-After``, the ``RateLimit-Policy`` and ``RateLimit``
fields of draft-ietf-httpapi-ratelimit-headers-11, and the refusal as an RFC 9457
problem (docs/design.md §7; docs/web.md says why each value is what it is)."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from bucketlimit._core import Decision

RATELIMIT = "RateLimit"
RATELIMIT_POLICY = "RateLimit-Policy"
RETRY_AFTER = "Retry-After"
CONTENT_TYPE = "Content-Type"

#: RFC 9457's media type: every refusal body is a problem document.
PROBLEM_JSON = "application/problem+json"
#: draft-11's problem type: the quota is used up for now; retry after ``Retry-After``.
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
#: The quota is spent and never refills (rate 0): retrying cannot help (403).
QUOTA_SPENT = "tag:bucketlimit,2026:quota-spent"
#: The request costs more than the whole bucket holds: it can never pass (413).
COST_ABOVE_CAPACITY = "tag:bucketlimit,2026:cost-above-capacity"
#: draft-11's quota unit of a concurrency limit (``qu``): requests in flight at once.
CONCURRENT_REQUESTS = "concurrent-requests"

# RFC 9651 (structured fields): an Integer has at most 15 digits.
_SF_INT_MAX = 999_999_999_999_999
# pk: this many bytes of the HMAC-SHA256 of the key.
_PK_BYTES = 12


def retry_after_seconds(decision: Decision) -> int | None:
    """``Retry-After`` for a refusal: whole seconds, rounded up, at least 1.

    ``None`` when the request can never pass (``retry_after`` is infinite: a rate-0
    quota, or a cost above the capacity). No value would be true then, and a huge
    one makes well-behaved clients sleep for ever, so the field is left out, the
    body says ``"retry_after": null`` and the status is not 429 (:func:`refusal_status`).
    """
    if math.isinf(decision.retry_after):
        return None
    return max(1, math.ceil(decision.retry_after))


@functools.lru_cache(maxsize=1024)
def window_seconds(capacity: int, rate: float) -> int | None:
    """The ``w`` of a token bucket: seconds for an empty bucket to fill again.

    ``q`` (the capacity) per ``w`` seconds is the bucket's sustained rate, and a
    full bucket admits a burst of ``q`` at once. ``capacity / rate`` is rounded
    to the limiter's own microsecond resolution first, so float noise in the rate
    (100 per 60 s is 1.6666666666666667/s) cannot add a second, then up to whole
    seconds (rounding up keeps the advertised rate at or below the real one).
    ``None`` (``w`` omitted) when the bucket never refills: a rate-0 quota has no
    window.
    """
    if rate <= 0:
        return None
    return max(1, math.ceil(round(capacity / rate, 6)))


def effective_window(decision: Decision, rate: float) -> int | None:
    """The ``t`` of the ``RateLimit`` field: draft-11's *effective window*.

    "The number of seconds within which the client can use no more than the
    available quota": for a token bucket, the time until the bucket holds one
    whole token more than ``r`` (before then, ``r`` is all there is). It is
    ``reset_after`` (the time to full) less the time the other missing tokens
    take, rounded to the limiter's microsecond, then up to whole seconds, at least
    1: a client that waits ``t`` has the next token. A refusal's ``t`` is never
    after its ``Retry-After`` (the draft asks that Retry-After not point before the
    end of ``t``). ``None`` (``t`` omitted) when the bucket never refills.

    ``reset_after`` is rounded up to the microsecond, so the difference can exceed
    the exact window by up to 1 µs: when the next token comes less than 1 µs after
    a whole second (or exactly on it), ``t`` may be that second plus one. It is
    never short: waiting ``t`` always finds the next token.
    """
    if rate <= 0 or math.isinf(decision.reset_after):
        return None
    missing = decision.limit - decision.remaining - 1  # -1 when full: the next token after one
    seconds = max(1, math.ceil(round(decision.reset_after - missing / rate, 6)))
    if not decision.allowed:
        retry = retry_after_seconds(decision)
        if retry is not None:
            seconds = min(seconds, retry)
    return seconds


def _sf_string(text: str) -> str:
    """``text`` as an RFC 9651 String: quoted, with ``"`` and ``\\`` escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _sf_int(value: int) -> int:
    return value if 0 <= value <= _SF_INT_MAX else min(max(value, 0), _SF_INT_MAX)


def partition_key(secret: bytes, name: str, key: str) -> bytes:
    """The ``pk`` of a limit's key: opaque and not reversible without ``secret``.

    An HMAC, not a plain hash: the key is often an IP address, and the hash of a
    32-bit address is reversed by trying all of them.
    """
    message = f"{name}\x00{key}".encode("utf-8", "surrogatepass")
    return hmac.new(secret, message, hashlib.sha256).digest()[:_PK_BYTES]


@functools.lru_cache(maxsize=1024)
def _quoted(name: str) -> str:
    return _sf_string(name)


@functools.lru_cache(maxsize=1024)
def _policy_item(name: str, limit: int, window: int | None, unit: str | None) -> str:
    item = f"{_sf_string(name)};q={_sf_int(limit)}"
    if unit is not None:
        item = f"{item};qu={_sf_string(unit)}"
    return item if window is None else f"{item};w={_sf_int(window)}"


def concurrency_decision(decision: Decision) -> Decision:
    """A permit's ``Decision`` as HTTP reports it (docs/web.md, "Concurrency").

    ``limit`` and ``remaining`` are the permits (``q`` and ``r``); ``reset_after`` is
    ``inf``, since no time is known when every permit is free (a request ends when it
    ends), so no ``t``, no ``X-RateLimit-Reset`` and no OpenAI reset field are sent;
    a refusal's ``retry_after`` is at most 1 s: a slot frees the moment any request
    of the key ends, and the permit's own bound (the holders' expiry, up to the
    ``ttl``) would send well-behaved clients away for a whole ``ttl``.
    """
    retry = 0.0 if decision.allowed else min(decision.retry_after, 1.0)
    return Decision(decision.allowed, retry, decision.remaining, math.inf, decision.limit)


class Applied(NamedTuple):
    """One limit's answer for one request, as the RateLimit fields report it.

    ``rate`` is the limiter's tokens per second (``t``); ``pk`` the partition key
    (a Byte Sequence parameter on both fields) or ``None``; ``cost`` what the
    request asked for (a cost above ``q`` is refused with 413); ``unit`` draft-11's
    quota unit (``qu``), ``None`` for a token bucket (whose unit draft-11 cannot
    name) and :data:`CONCURRENT_REQUESTS` for a concurrency limit
    (:meth:`concurrent`).
    """

    name: str
    decision: Decision
    window: int | None
    rate: float = 0.0
    pk: bytes | None = None
    cost: int = 1
    unit: str | None = None

    @classmethod
    def of(
        cls,
        limiter: Any,
        decision: Decision,
        name: str = "default",
        *,
        cost: int = 1,
        pk: bytes | None = None,
    ) -> Applied:
        """The answer ``decision`` of ``limiter`` (anything with ``capacity`` and
        ``rate``) under the policy ``name``."""
        rate = limiter.rate
        return cls(name, decision, window_seconds(limiter.capacity, rate), rate, pk, cost)

    @classmethod
    def concurrent(
        cls, decision: Decision, name: str = "default", *, pk: bytes | None = None
    ) -> Applied:
        """A concurrency limit's answer under the policy ``name``: ``decision`` is the
        permit's (``Permit.decision``), reported as :func:`concurrency_decision` says;
        the policy has ``qu="concurrent-requests"`` and no window."""
        return cls(name, concurrency_decision(decision), None, 0.0, pk, 1, CONCURRENT_REQUESTS)

    @property
    def concurrency(self) -> bool:
        """Whether this is a concurrency limit's member (``qu="concurrent-requests"``)."""
        return self.unit == CONCURRENT_REQUESTS

    def _pk(self) -> str:
        return "" if self.pk is None else f";pk=:{base64.b64encode(self.pk).decode('ascii')}:"

    def policy_item(self) -> str:
        return _policy_item(self.name, self.decision.limit, self.window, self.unit) + self._pk()

    def limit_item(self) -> str:
        item = f"{_quoted(self.name)};r={_sf_int(self.decision.remaining)}"
        window = effective_window(self.decision, self.rate)
        if window is not None:
            item = f"{item};t={_sf_int(window)}"
        return item if self.pk is None else item + self._pk()


def ratelimit_fields(applied: Sequence[Applied]) -> dict[str, str]:
    """``RateLimit-Policy`` and ``RateLimit``: one field each, one list member per limit.

    >>> d = Decision(True, 0.0, 7, 1.5, 10)
    >>> ratelimit_fields([Applied("per-ip", d, 5, rate=2.0)])
    {'RateLimit-Policy': '"per-ip";q=10;w=5', 'RateLimit': '"per-ip";r=7;t=1'}
    """
    if not applied:
        return {}
    if len(applied) == 1:
        return {RATELIMIT_POLICY: applied[0].policy_item(), RATELIMIT: applied[0].limit_item()}
    return {
        RATELIMIT_POLICY: ", ".join(a.policy_item() for a in applied),
        RATELIMIT: ", ".join(a.limit_item() for a in applied),
    }


def refusal_status(applied: Applied) -> int:
    """429 for a refusal that passes later; one that never can is answered so that
    clients stop retrying: 413 (Content Too Large) for a cost above the capacity,
    403 for a quota that never refills and is spent."""
    if applied.cost > applied.decision.limit:
        return 413
    if math.isinf(applied.decision.retry_after):
        return 403
    return 429


_PROBLEMS = {
    429: (QUOTA_EXCEEDED, "Too many requests: the quota is used up for now"),
    403: (QUOTA_SPENT, "The quota is spent and does not refill"),
    413: (COST_ABOVE_CAPACITY, "The request costs more than the quota can ever hold"),
}


def refusal_body(applied: Applied) -> dict[str, object]:
    """The refusal as an RFC 9457 problem (``application/problem+json``).

    ``type`` is draft-11's ``quota-exceeded`` for a 429, a bucketlimit type for a
    request that can never pass; ``violated-policies`` names the refusing limit;
    ``retry_after`` (an extension member) is the ``Retry-After`` value or ``null``.
    """
    status = refusal_status(applied)
    kind, title = _PROBLEMS[status]
    retry = retry_after_seconds(applied.decision)
    if status == 413:
        detail = f"costs {applied.cost}, and policy {applied.name!r} holds {applied.decision.limit}"
    elif applied.concurrency:
        detail = (
            f"policy {applied.name!r} allows {applied.decision.limit} requests at once; "
            f"retry in {retry} s"
        )
    elif retry is None:
        detail = f"policy {applied.name!r} is spent"
    else:
        detail = f"policy {applied.name!r} admits this request in {retry} s"
    return {
        "type": kind,
        "title": title,
        "status": status,
        "detail": detail,
        "violated-policies": [applied.name],
        "retry_after": retry,
    }


def refusal_headers(decision: Decision) -> dict[str, str]:
    """``Retry-After`` when the request passes later, and the problem's media type."""
    seconds = retry_after_seconds(decision)
    headers = {CONTENT_TYPE: PROBLEM_JSON}
    if seconds is not None:
        headers[RETRY_AFTER] = str(seconds)
    return headers


_UNITS = ((86_400, "day"), (3_600, "hour"), (60, "minute"), (1, "second"))


def describe_limit(applied: Applied) -> str:
    """A limit as people read it, in the words of ``limits`` (flask-limiter, slowapi):
    ``"5 per 1 minute"`` (a bucket of 5 that fills again in a minute), ``"3 at once"``
    (a concurrency limit), ``"100 in all"`` (a quota that never refills)."""
    quota = applied.decision.limit
    if applied.concurrency:
        return f"{quota} at once"
    if applied.window is None:
        return f"{quota} in all"
    seconds, unit = next((s, u) for s, u in _UNITS if applied.window % s == 0)
    count = applied.window // seconds
    return f"{quota} per {count} {unit}{'' if count == 1 else 's'}"


@dataclass(frozen=True)
class Refusal:
    """Everything an adapter writes for a refusal: status, headers (the RateLimit
    fields, ``Retry-After``, ``Content-Type``) and the JSON body; ``limit`` is the
    refusing limit as people read it (``"5 per 1 minute"``, :func:`describe_limit`),
    which is also what ``str(refusal)`` shows."""

    status: int
    headers: dict[str, str]
    body: dict[str, object]
    decision: Decision
    limit: str = ""

    def __str__(self) -> str:
        return self.limit or f"refused with {self.status}"


#: ``on_refusal(request, refusal)``: the response to send for a refusal instead of the
#: default one (the framework's response; in async adapters it may be ``async def``).
RefusalHook = Callable[[Any, Refusal], Any]
