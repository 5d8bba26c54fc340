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

A concurrency limit's answer (a ``Permit``'s decision) is ``Applied.concurrent(
permit.decision, name)``: its policy says ``qu="concurrent-requests"``.

Everything here is what the Flask, FastAPI, ASGI, Litestar and Django adapters
use themselves (docs/web.md, "Other frameworks"); the names are public and stable.
:func:`live_limits` and :func:`watch_limits` are the seam for tools that manage
every limit of an app: the start-up store checks (:func:`check_stores`) and
``bucketlimit.testing``.
"""

from __future__ import annotations

from bucketlimit._web.addresses import (
    TrustedProxies,
    check_ipv6_prefix,
    client_address_key,
    forwarded_client,
    subnet_key,
)
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError, LimitStringError
from bucketlimit._web.fields import (
    CONCURRENT_REQUESTS,
    COST_ABOVE_CAPACITY,
    PROBLEM_JSON,
    QUOTA_EXCEEDED,
    QUOTA_SPENT,
    RATELIMIT,
    RATELIMIT_POLICY,
    RETRY_AFTER,
    Applied,
    Refusal,
    RefusalHook,
    concurrency_decision,
    describe_limit,
    effective_window,
    partition_key,
    ratelimit_fields,
    refusal_body,
    refusal_headers,
    refusal_status,
    retry_after_seconds,
    window_seconds,
)
from bucketlimit._web.limiters import (
    AsyncLimiter,
    ConcurrencyLimiterLike,
    Limiter,
    SyncLimiter,
    is_concurrency_limiter,
    is_limiter,
)
from bucketlimit._web.limits import (
    Concurrency,
    CostFunc,
    ExemptFunc,
    Headers,
    KeyFunc,
    LimitSettings,
    Plan,
    PlanFunc,
    live_limits,
    watch_limits,
)
from bucketlimit._web.procedure import run, run_async
from bucketlimit._web.profiles import (
    PROFILES,
    go_duration,
    legacy_fields,
    openai_body,
    openai_fields,
    openai_refusal_headers,
)
from bucketlimit._web.request_limits import RequestLimits
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve, reserve_async
from bucketlimit._web.startup import StoreCheckError, check_stores, check_stores_async
from bucketlimit._web.waiting import ClientDisconnected

__all__ = [
    "CONCURRENT_REQUESTS",
    "COST_ABOVE_CAPACITY",
    "PROBLEM_JSON",
    "PROFILES",
    "QUOTA_EXCEEDED",
    "QUOTA_SPENT",
    "RATELIMIT",
    "RATELIMIT_POLICY",
    "RETRY_AFTER",
    "Applied",
    "AsyncLimiter",
    "AsyncReservation",
    "ClientDisconnected",
    "Concurrency",
    "ConcurrencyLimiterLike",
    "ConfigurationError",
    "CostFunc",
    "ExemptFunc",
    "Headers",
    "KeyFunc",
    "KeyFunctionError",
    "LimitSettings",
    "LimitStringError",
    "Limiter",
    "Plan",
    "PlanFunc",
    "Refusal",
    "RefusalHook",
    "RequestLimits",
    "Reservation",
    "StoreCheckError",
    "SyncLimiter",
    "TrustedProxies",
    "check_ipv6_prefix",
    "check_stores",
    "check_stores_async",
    "client_address_key",
    "concurrency_decision",
    "describe_limit",
    "effective_window",
    "forwarded_client",
    "go_duration",
    "is_concurrency_limiter",
    "is_limiter",
    "legacy_fields",
    "live_limits",
    "openai_body",
    "openai_fields",
    "openai_refusal_headers",
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
    "watch_limits",
    "window_seconds",
]
