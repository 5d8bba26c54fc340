"""Rate limits for Django: a view decorator (sync and async views), a middleware
(sync and async capable) and a Django REST framework throttle.

::

    # views.py
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.django import Limit

    search_limit = Limit(TokenBucketLimiter(2, 0.1), name="search")

    @search_limit                      # or @limit(limiter, ...); async views too
    def search(request): ...

    # settings.py
    MIDDLEWARE = [..., "bucketlimit.django.RateLimitMiddleware"]
    BUCKETLIMIT_LIMITS = ["myapp.limits.per_client"]       # every request (optional)
    BUCKETLIMIT_TRUSTED_PROXIES = ["10.0.0.0/8"]           # the default key behind proxies
    BUCKETLIMIT_IPV6_PREFIX = 64

The middleware applies ``BUCKETLIMIT_LIMITS`` (``Limit`` objects or their dotted
paths) to every request and writes the RateLimit fields of every limit of the
request on its response; the decorator and :class:`LimitThrottle` work without
it, but the fields of a DRF view reach the response only through it. A refusal
is the one every adapter sends (docs/design.md §7): 429 with ``Retry-After``
and an RFC 9457 problem body, 413 or 403 when it can never pass. Sync views take
``TokenBucketLimiter`` or ``RedisTokenBucketLimiter``; async views and the async
middleware also ``AsyncRedisTokenBucketLimiter`` (awaited).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from bucketlimit._core import Decision
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.fields import Refusal, retry_after_seconds
from bucketlimit._web.limiters import AnyLimiter, SyncLimiter
from bucketlimit._web.limits import (
    ConfigurationError,
    KeyFunctionError,
    LimitSettings,
    RequestLimits,
    run,
    run_async,
)
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve, reserve_async

__all__ = [
    "AsyncReservation",
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "LimitThrottle",
    "RateLimitMiddleware",
    "Reservation",
    "client_address",
    "limit",
    "ratelimit_fields",
    "remote_address",
    "reservation",
    "reserve",
    "reserve_async",
]

F = TypeVar("F", bound=Callable[..., Any])

_STATE = "_bucketlimit"
_THROTTLED = "_bucketlimit_throttled"


def _django_request(request: Any) -> HttpRequest:
    """The ``HttpRequest`` behind a DRF ``Request`` (or the request itself)."""
    return cast(HttpRequest, getattr(request, "_request", request))


def client_address(
    trusted_proxies: Iterable[str | Network] = (), *, ipv6_prefix: int = 64
) -> Callable[[HttpRequest], str]:
    """A key function: the client's IP address, an IPv6 client by its ``/64``.

    With no trusted proxies it is the direct peer, ``request.META["REMOTE_ADDR"]``,
    and ``X-Forwarded-For`` is ignored. Behind proxies, list their networks; the key
    is then the right-most ``X-Forwarded-For`` hop that is not one of them.
    """
    return client_address_key(
        trusted_proxies,
        lambda request: _django_request(request).META.get("REMOTE_ADDR") or None,
        lambda request: [
            v for v in [_django_request(request).META.get("HTTP_X_FORWARDED_FOR")] if v
        ],
        "REMOTE_ADDR is missing",
        ipv6_prefix,
    )


@functools.lru_cache(maxsize=16)
def _settings_key(proxies: tuple[str, ...], prefix: int) -> Callable[[HttpRequest], str]:
    return client_address(proxies, ipv6_prefix=prefix)


def remote_address(request: HttpRequest) -> str:
    """The default key: the client address as the settings say.

    ``BUCKETLIMIT_TRUSTED_PROXIES`` (default none: the direct peer, and
    ``X-Forwarded-For`` ignored) and ``BUCKETLIMIT_IPV6_PREFIX`` (default 64),
    read on every request, so ``override_settings`` applies at once.
    """
    proxies = getattr(settings, "BUCKETLIMIT_TRUSTED_PROXIES", ())
    if isinstance(proxies, str):
        raise TypeError(f"BUCKETLIMIT_TRUSTED_PROXIES must be a list, not one string: {proxies!r}")
    prefix = getattr(settings, "BUCKETLIMIT_IPV6_PREFIX", 64)
    return _settings_key(tuple(map(str, proxies)), prefix)(request)


def _describe(request: Any) -> str:
    django_request = _django_request(request)
    return f"{django_request.method} {django_request.path}"


def _request_limits(request: Any) -> RequestLimits:
    django_request = _django_request(request)
    limits: RequestLimits | None = getattr(django_request, _STATE, None)
    if limits is None:
        limits = RequestLimits()
        setattr(django_request, _STATE, limits)
    return limits


def _hold_sync(limiter: AnyLimiter, key: str, charged: int, decision: Decision) -> Reservation:
    return Reservation(cast(SyncLimiter, limiter), key, charged, decision)


def refusal_response(refusal: Refusal) -> HttpResponse:
    """A refusal as a Django response (the problem body, status and headers)."""
    body = json.dumps(refusal.body, separators=(",", ":"))
    return HttpResponse(body, status=refusal.status, headers=refusal.headers)


def _write_fields(request: Any, response: HttpResponseBase) -> HttpResponseBase:
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    if limits is not None:
        for name, value in limits.fields().items():
            response[name] = value  # replaces, never appends
    return response


def ratelimit_fields(request: HttpRequest) -> dict[str, str]:
    """The ``RateLimit-Policy`` and ``RateLimit`` fields of the limits applied so far."""
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    return {} if limits is None else limits.fields()


class Limit(LimitSettings[HttpRequest]):
    """One limit: decorate views with it, list it in ``BUCKETLIMIT_LIMITS``, or
    name it in a :class:`LimitThrottle`.

    ``limiter`` (or a plan function returning one, or ``(policy_name, limiter)``),
    ``key`` (default :func:`remote_address`), ``cost`` (an int or a function of
    the request), ``name``, ``shadow``, ``exempt``, ``pk``: as in every adapter
    (docs/web.md). Key, cost and exempt functions may be ``async def`` on async
    views and in the async middleware.
    """

    default_key = staticmethod(remote_address)

    def __call__(self, view: F) -> F:
        """Limits one view (a function, or ``method_decorator(limit)`` on a class's
        ``dispatch``). Stack several, each with its own ``name``."""
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def limited_async(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                refusal = await self.acheck(request)
                response = refusal or await view(request, *args, **kwargs)
                return _write_fields(request, response)

            return cast(F, limited_async)

        @functools.wraps(view)
        def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            refusal = self.check(request)
            response = refusal or view(request, *args, **kwargs)
            return _write_fields(request, response)

        return cast(F, limited)

    def check(self, request: HttpRequest) -> HttpResponse | None:
        """Applies the limit in sync code: a refusal response, or ``None`` to go on."""
        _, refused = run(
            self.procedure(request, lambda: _request_limits(request), _describe, _hold_sync)
        )
        return refusal_response(_request_limits(request).refusal()) if refused else None

    async def acheck(self, request: HttpRequest) -> HttpResponse | None:
        """Applies the limit in async code (an async limiter is awaited)."""
        _, refused = await run_async(
            self.procedure(request, lambda: _request_limits(request), _describe, AsyncReservation)
        )
        return refusal_response(_request_limits(request).refusal()) if refused else None


#: ``@limit(limiter, ...)`` on a view: the same as ``@Limit(limiter, ...)``.
limit = Limit


def _configured_limits() -> Sequence[Limit]:
    names = getattr(settings, "BUCKETLIMIT_LIMITS", ())
    if isinstance(names, (str, Limit)):
        names = [names]
    return [_resolve(name) for name in names]


@functools.lru_cache(maxsize=64)
def _import(path: str) -> Limit:
    module, _, attribute = path.rpartition(".")
    found = getattr(importlib.import_module(module), attribute)
    if not isinstance(found, Limit):
        raise ConfigurationError(f"BUCKETLIMIT_LIMITS: {path!r} is {found!r}, not a Limit")
    return found


def _resolve(entry: str | Limit) -> Limit:
    if isinstance(entry, Limit):
        return entry
    if isinstance(entry, str):
        return _import(entry)
    raise ConfigurationError(
        f"BUCKETLIMIT_LIMITS holds Limit objects or their dotted paths, got {entry!r}"
    )


def _rewrite_throttled(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    """DRF answered a :class:`LimitThrottle` refusal with its own body: send ours."""
    if getattr(request, _THROTTLED, False) and response.status_code == 429:
        return refusal_response(_request_limits(request).refusal())
    return response


class RateLimitMiddleware:
    """Applies ``BUCKETLIMIT_LIMITS`` to every request and writes the RateLimit
    fields of every limit of the request on its response (sync and async capable).

    It also answers a :class:`LimitThrottle` refusal with the problem body every
    adapter sends, in place of DRF's ``{"detail": ...}``.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        for each in _configured_limits():
            refusal = each.check(request)
            if refusal is not None:
                return _write_fields(request, refusal)
        response = self.get_response(request)
        return _write_fields(request, _rewrite_throttled(request, response))

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        for each in _configured_limits():
            refusal = await each.acheck(request)
            if refusal is not None:
                return _write_fields(request, refusal)
        response = await cast(Awaitable[HttpResponseBase], self.get_response(request))
        return _write_fields(request, _rewrite_throttled(request, response))


class LimitThrottle:
    """A Django REST framework throttle applying a :class:`Limit`.

    ::

        class Burst(LimitThrottle):
            limit = Limit(TokenBucketLimiter(10, 1), name="burst")

        class Search(APIView):
            throttle_classes = [Burst]

    ``allow_request`` decides (atomically, in Redis too: no timestamp list in the
    cache racing between workers); ``wait()`` is the ``Retry-After`` in seconds
    (``None`` when the request can never pass). With
    :class:`RateLimitMiddleware` installed the response carries the fields and the
    refusal the problem body (413/403 when it can never pass); without it, DRF's
    own 429 with ``Retry-After``.
    """

    limit: Limit

    def __init__(self) -> None:
        if not isinstance(getattr(type(self), "limit", None), Limit):
            raise ConfigurationError(
                f"{type(self).__name__} needs a class attribute "
                "limit = bucketlimit.django.Limit(...)"
            )
        self._decision: Decision | None = None

    def allow_request(self, request: Any, view: Any) -> bool:
        django_request = _django_request(request)
        if getattr(django_request, _THROTTLED, False):
            return True  # another limit refused already: nothing more is charged
        held, refused = run(
            self.limit.procedure(request, lambda: _request_limits(request), _describe, _hold_sync)
        )
        if held is not None:
            self._decision = held.decision
        if refused:
            setattr(django_request, _THROTTLED, True)
        return not refused

    def wait(self) -> float | None:
        """Seconds until the refused request passes (``Retry-After``), or ``None``."""
        if self._decision is None or self._decision.allowed:
            return None
        seconds = retry_after_seconds(self._decision)
        return None if seconds is None else float(seconds)

    def get_ident(self, request: Any) -> str:
        """The limit's key for ``request`` (what DRF's throttles call their ident)."""
        return self.limit.checked_key(self.limit.key(request), _describe(request))


def reservation(request: HttpRequest, name: str | None = None) -> Reservation | AsyncReservation:
    """The reservation a limit made for ``request`` (``name`` when several apply):
    ``settle(used)`` in a sync view, ``await settle(used)`` in an async one."""
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    if limits is None:
        raise LookupError("no limit applied to this request")
    return limits.reservation(name)
