"""The framework-free helpers behind every adapter, for aiohttp and any other
framework: the fields, the refusal, the client address, reservations.

::

    from bucketlimit.web import Applied, ratelimit_fields, refusal_body, refusal_headers

    decision = limiter.allow(key)
    applied = Applied.of(limiter, decision, "api")
    headers = ratelimit_fields([applied])              # RateLimit-Policy and RateLimit
    if not decision.allowed:
        headers |= refusal_headers(decision)           # Retry-After, Content-Type
        status, body = refusal_status(applied), refusal_body(applied)

Everything here is what the Flask, FastAPI, ASGI, Litestar and Django adapters
use themselves (docs/web.md, "Other frameworks"); the names are public and stable.
"""

from __future__ import annotations

from bucketlimit._web.addresses import (
    TrustedProxies,
    check_ipv6_prefix,
    client_address_key,
    forwarded_client,
    subnet_key,
)
from bucketlimit._web.fields import (
    COST_ABOVE_CAPACITY,
    PROBLEM_JSON,
    QUOTA_EXCEEDED,
    QUOTA_SPENT,
    RATELIMIT,
    RATELIMIT_POLICY,
    RETRY_AFTER,
    Applied,
    Refusal,
    effective_window,
    partition_key,
    ratelimit_fields,
    refusal_body,
    refusal_headers,
    refusal_status,
    retry_after_seconds,
    window_seconds,
)
from bucketlimit._web.limiters import AsyncLimiter, Limiter, SyncLimiter
from bucketlimit._web.limits import (
    ConfigurationError,
    CostFunc,
    ExemptFunc,
    KeyFunc,
    KeyFunctionError,
    LimitSettings,
    Plan,
    PlanFunc,
    RequestLimits,
    run,
    run_async,
)
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve, reserve_async

__all__ = [
    "COST_ABOVE_CAPACITY",
    "PROBLEM_JSON",
    "QUOTA_EXCEEDED",
    "QUOTA_SPENT",
    "RATELIMIT",
    "RATELIMIT_POLICY",
    "RETRY_AFTER",
    "Applied",
    "AsyncLimiter",
    "AsyncReservation",
    "ConfigurationError",
    "CostFunc",
    "ExemptFunc",
    "KeyFunc",
    "KeyFunctionError",
    "LimitSettings",
    "Limiter",
    "Plan",
    "PlanFunc",
    "Refusal",
    "RequestLimits",
    "Reservation",
    "SyncLimiter",
    "TrustedProxies",
    "check_ipv6_prefix",
    "client_address_key",
    "effective_window",
    "forwarded_client",
    "partition_key",
    "ratelimit_fields",
    "refusal_body",
    "refusal_headers",
    "refusal_status",
    "reserve",
    "reserve_async",
    "retry_after_seconds",
    "run",
    "run_async",
    "subnet_key",
    "window_seconds",
]
