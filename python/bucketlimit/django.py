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
    BUCKETLIMIT_DEFAULT_LIMITS = "200/day;50/hour"         # per route, unless it has its own
    BUCKETLIMIT_STORAGE = "redis://localhost:6379/0"       # for limit strings (memory://)
    BUCKETLIMIT_HEADERS = "draft-11"                       # or "legacy", "openai", [...]
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

``Limit(..., concurrency=N)`` (a ``ConcurrencyLimiter`` or ``RedisConcurrencyLimiter``)
holds a permit per request until its response ends: when the view returns a plain
response, when Django closes a streaming one (after its last chunk, or when the
client went away), and whatever the view raised. A :class:`LimitThrottle` with
``concurrency=`` needs the middleware, which releases its permit.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import Resolver404, get_resolver, resolve

from bucketlimit import _config
from bucketlimit._core import Decision
from bucketlimit._web import profiles
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.buckets import qualified_name
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError
from bucketlimit._web.fields import RETRY_AFTER, Refusal, RefusalHook, retry_after_seconds
from bucketlimit._web.limiters import (
    AnyLimiter,
    ConcurrencyLimiterLike,
    SyncLimiter,
    is_async_limiter,
    is_concurrency_limiter,
)
from bucketlimit._web.limits import LimitSettings
from bucketlimit._web.procedure import run, run_async
from bucketlimit._web.request_limits import RequestLimits
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve, reserve_async
from bucketlimit._web.startup import StoreCheckError, check_stores
from bucketlimit._web.streams import AsyncStreamedBody, StreamedBody

__all__ = [
    "AsyncReservation",
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "LimitThrottle",
    "RateLimitMiddleware",
    "Reservation",
    "StoreCheckError",
    "client_address",
    "exempt",
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
_REFUSED = "_bucketlimit_refused"  # a limit of this request refused it
_RELEASES = "_bucketlimit_releases"  # the middleware releases this request's permits
_EXEMPT = "__bucketlimit_exempt__"  # a view's mark: the middleware's limits skip it
_OWN_LIMITS = "__bucketlimit_overrides_defaults__"  # a view's mark: it has limits of its own
_LIMITS = "__bucketlimit_limits__"  # a view's limits (its decorators')


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


def _enabled() -> bool:
    return bool(getattr(settings, "BUCKETLIMIT_ENABLED", True))


def _headers_setting() -> tuple[str, ...] | None:
    found = getattr(settings, "BUCKETLIMIT_HEADERS", None)
    if found is False:
        return ()
    return profiles.check_headers(found)


@functools.lru_cache(maxsize=16)
def _hook(path: str) -> RefusalHook:
    module, _, attribute = path.rpartition(".")
    return cast(RefusalHook, getattr(importlib.import_module(module), attribute))


def _on_refusal_setting() -> RefusalHook | None:
    found = getattr(settings, "BUCKETLIMIT_ON_REFUSAL", None)
    if isinstance(found, str):
        found = _hook(found)
    if found is not None and not callable(found):
        raise ConfigurationError(
            f"BUCKETLIMIT_ON_REFUSAL must be a function or its dotted path, got {found!r}"
        )
    return found


def _check_store_setting() -> bool:
    return bool(getattr(settings, "BUCKETLIMIT_CHECK_STORE", True))


def _request_limits(request: Any) -> RequestLimits:
    django_request = _django_request(request)
    limits: RequestLimits | None = getattr(django_request, _STATE, None)
    if limits is None:
        limits = RequestLimits(_headers_setting(), _on_refusal_setting(), _check_store_setting())
        setattr(django_request, _STATE, limits)
    return limits


def _hold_sync(limiter: AnyLimiter, key: str, charged: int, decision: Decision) -> Reservation:
    return Reservation(cast(SyncLimiter, limiter), key, charged, decision)


def refusal_response(refusal: Refusal) -> HttpResponse:
    """A refusal as a Django response (the problem body, status and headers)."""
    body = json.dumps(refusal.body, separators=(",", ":"))
    return HttpResponse(body, status=refusal.status, headers=refusal.headers)


def _refused(request: Any, limits: RequestLimits) -> Any:
    """The response of a refusal: ``on_refusal``'s (the limit's, else
    ``BUCKETLIMIT_ON_REFUSAL``), with ``Retry-After`` where it set none, or the
    default problem response (with no hook, or when it returned ``None``)."""
    setattr(_django_request(request), _REFUSED, True)
    refusal = limits.refusal()
    hook = limits.refusal_hook()
    if hook is None:
        return refusal_response(refusal)
    response = hook(request, refusal)
    if inspect.isawaitable(response):
        return _awaited(response, refusal)
    return _with_retry_after(response, refusal)


async def _awaited(response: Awaitable[Any], refusal: Refusal) -> Any:
    return _with_retry_after(await response, refusal)


def _with_retry_after(response: Any, refusal: Refusal) -> Any:
    if response is None:  # the hook's None: the default refusal
        return refusal_response(refusal)
    if isinstance(response, HttpResponseBase) and response.status_code == refusal.status:
        for name in (RETRY_AFTER, profiles.RETRY_AFTER_MS):
            if name in refusal.headers and name not in response:
                response[name] = refusal.headers[name]
    return response


def _write_fields(request: Any, response: HttpResponseBase) -> HttpResponseBase:
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    if limits is not None:
        limits.answered()  # every limit of the request has decided
        django_request = _django_request(request)
        refused = getattr(django_request, _THROTTLED, False) or getattr(
            django_request, _REFUSED, False
        )
        for name, value in limits.fields(refused=refused).items():
            response[name] = value  # replaces, never appends
    return response


def _release_after(request: Any, response: Any) -> Any:
    """Releases the request's permits when its response ends: now for a plain
    response (the view is done), when Django closes a streaming one (after its
    last chunk, or when the client went away); each chunk renews them."""
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    if limits is None or not limits.permits or limits.closing:
        return response
    if not getattr(response, "streaming", False):
        limits.close()
        return response
    limits.closing = True
    if response.is_async:
        response.streaming_content = AsyncStreamedBody(response.streaming_content, limits)
    else:
        response.streaming_content = StreamedBody(response.streaming_content, limits, releases=True)
    return response


def _release_now(request: Any) -> None:
    """Releases the request's permits unless a streaming response will; the request
    ran (its view failed), so the limits that admitted it count it."""
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    if limits is not None:
        limits.answered()
        if not limits.closing:
            limits.close()


def ratelimit_fields(request: HttpRequest) -> dict[str, str]:
    """The ``RateLimit-Policy`` and ``RateLimit`` fields of the limits applied so far."""
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    return {} if limits is None else limits.fields()


class Limit(LimitSettings[HttpRequest]):
    """One limit: decorate views with it, list it in ``BUCKETLIMIT_LIMITS``, or
    name it in a :class:`LimitThrottle`.

    ``limiter`` (or a plan function returning one, or ``(policy_name, limiter)``,
    or a limit string on ``storage=``, default ``BUCKETLIMIT_STORAGE``), ``key``
    (default :func:`remote_address`), ``cost`` (an int or a function of the
    request), ``name``, ``shadow``, ``exempt``, ``pk``, ``max_wait``, ``headers``,
    ``on_refusal``: as in every adapter (docs/web.md). Key, cost and exempt
    functions may be ``async def`` on async views and in the async middleware. A
    WSGI server cannot tell that a waiting client left: it keeps its tokens.
    """

    default_key = staticmethod(remote_address)
    #: Whether it decorates views (else it is an app-wide limit, or a throttle's).
    _decorates = False

    def check_limiter(self, limiter: AnyLimiter | ConcurrencyLimiterLike) -> None:
        if is_concurrency_limiter(limiter) and is_async_limiter(limiter):
            raise TypeError(
                "Django releases a permit when a response closes, which is synchronous: use "
                f"ConcurrencyLimiter or RedisConcurrencyLimiter for concurrency=, not {limiter!r}"
            )

    def default_storage(self) -> str:
        """``BUCKETLIMIT_STORAGE`` (default ``memory://``)."""
        return str(getattr(settings, "BUCKETLIMIT_STORAGE", None) or "memory://")

    def __call__(self, view: F) -> F:
        """Limits one view (a function, or ``method_decorator(limit)`` on a class's
        ``dispatch``). Stack several, each with its own ``name``. A limit string keeps
        this view's buckets (one set for every view it decorates; ``scope=`` shares
        them with other limits)."""
        self._decorates = True
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def limited_async(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
                try:
                    refusal = await self.acheck(request)
                    response = (
                        refusal if refusal is not None else await view(request, *args, **kwargs)
                    )
                except BaseException:
                    _release_now(request)  # no response will release its permits
                    raise
                return _write_fields(request, _release_after(request, response))

            setattr(limited_async, _OWN_LIMITS, True)
            setattr(limited_async, _LIMITS, (*getattr(view, _LIMITS, ()), self))
            return cast(F, limited_async)

        @functools.wraps(view)
        def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            try:
                refusal = self.check(request)
                response = refusal if refusal is not None else view(request, *args, **kwargs)
            except BaseException:
                _release_now(request)  # no response will release its permits
                raise
            return _write_fields(request, _release_after(request, response))

        setattr(limited, _OWN_LIMITS, True)
        setattr(limited, _LIMITS, (*getattr(view, _LIMITS, ()), self))
        return cast(F, limited)

    def check(self, request: HttpRequest) -> Any:
        """Applies the limit in sync code: a refusal response (``on_refusal``'s, or
        the problem), or ``None`` to go on (always, with ``BUCKETLIMIT_ENABLED``
        off)."""
        if not _enabled():
            return None
        if not self.attached:
            self.attach(_route_of(self, request))
        _, refused = run(
            self.procedure(request, lambda: _request_limits(request), _describe, _hold_sync)
        )
        return _refused(request, _request_limits(request)) if refused else None

    async def acheck(self, request: HttpRequest) -> Any:
        """Applies the limit in async code (an async limiter is awaited)."""
        if not _enabled():
            return None
        if not self.attached:
            self.attach(_route_of(self, request))
        _, refused = await run_async(
            self.procedure(request, lambda: _request_limits(request), _describe, AsyncReservation)
        )
        if not refused:
            return None
        response = _refused(request, _request_limits(request))
        return await response if inspect.isawaitable(response) else response


#: ``@limit(limiter, ...)`` on a view: the same as ``@Limit(limiter, ...)``.
limit = Limit


def _patterns(patterns: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(route, view)`` of every URL pattern, in the URLconf's order."""
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if hasattr(pattern, "url_patterns"):  # an include()
            yield from _patterns(pattern.url_patterns, route)
        else:
            yield route, pattern.callback


def _route_of(limit: Limit, request: Any) -> str | None:
    """The first URL pattern (in the URLconf's order) whose view the limit decorates;
    for a view the patterns do not show (``method_decorator`` on a class's
    ``dispatch``), the request's route; ``None`` for an app-wide limit."""
    django_request = _django_request(request)
    resolver = get_resolver(getattr(django_request, "urlconf", None))
    for route, view in _patterns(resolver.url_patterns):
        if limit in getattr(view, _LIMITS, ()):
            return route
    if not limit._decorates:
        return None
    return getattr(getattr(django_request, "resolver_match", None), "route", None)


def _view_limits() -> list[Limit]:
    """Every limit the URLconf's views apply (their ``@limit``s, their DRF throttles'),
    each attached to its first URL pattern (as :func:`_route_of` would): what the
    middleware asks the stores of at start-up."""
    if getattr(settings, "ROOT_URLCONF", None) is None:
        return []
    found: list[Limit] = []
    for route, view in _patterns(get_resolver().url_patterns):
        view_class = getattr(view, "view_class", None)
        throttles = getattr(view_class, "throttle_classes", None) or ()
        throttled = [getattr(t, "limit", None) for t in throttles]
        for limit in getattr(view, _LIMITS, ()):
            limit.attach(route)
            found.append(limit)
        found += [limit for limit in throttled if isinstance(limit, Limit)]
    return found


def exempt(view: F) -> F:
    """Marks a view (a function, or a class-based view's class) that the
    middleware's limits (``BUCKETLIMIT_LIMITS``, ``BUCKETLIMIT_DEFAULT_LIMITS``)
    skip: no charge, no fields. A view's own ``@limit`` still applies."""
    global _EXEMPTS_MARKED
    setattr(view, _EXEMPT, True)
    _EXEMPTS_MARKED = True
    return view


def _marked(view: Any, mark: str) -> bool:
    view_class = getattr(view, "view_class", None)  # a class-based view's as_view()
    return bool(getattr(view, mark, False) or getattr(view_class, mark, False))


def _configured_limits() -> Sequence[Limit]:
    names = getattr(settings, "BUCKETLIMIT_LIMITS", ())
    if isinstance(names, (str, Limit)):
        names = [names]
    return [_resolve(name) for name in names]


def _per_route(request: Any) -> str:
    """A default limit's key: the request's route and client, so each route has its
    own bucket per client."""
    match = getattr(_django_request(request), "resolver_match", None)
    route = getattr(match, "route", None) or getattr(match, "view_name", None) or "?"
    return f"{route}|{remote_address(request)}"


@functools.lru_cache(maxsize=16)
def _defaults_of(texts: tuple[str, ...], storage: str) -> tuple[Limit, ...]:
    return tuple(Limit(text, storage=storage, key=_per_route) for text in texts)


def _default_limits() -> Sequence[Limit]:
    """``BUCKETLIMIT_DEFAULT_LIMITS``: limit strings, each a bucket per client per
    route on every view without a ``@limit`` of its own (built once per value)."""
    found = getattr(settings, "BUCKETLIMIT_DEFAULT_LIMITS", None)
    if not found:
        return ()
    storage = str(getattr(settings, "BUCKETLIMIT_STORAGE", None) or "memory://")
    return _defaults_of(tuple(_config.split_limits(found)), storage)


def _view_of(request: HttpRequest) -> Any:
    """The view the request goes to (the middleware runs before Django resolves it),
    with ``request.resolver_match`` set; ``None`` for a path no URL matches."""
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        return None
    request.resolver_match = match
    return match.func


def _limits_for(request: HttpRequest) -> Sequence[Limit]:
    """The middleware's limits for this request: ``BUCKETLIMIT_LIMITS``, then the
    default limits when the view has none of its own; none for an exempt view."""
    configured = _configured_limits()
    defaults = _default_limits()
    if not (defaults or _any_exempt(configured)):
        return configured
    view = _view_of(request)
    if view is not None and _marked(view, _EXEMPT):
        return ()
    if view is None or _marked(view, _OWN_LIMITS):
        return configured
    return [*configured, *defaults]


def _any_exempt(configured: Sequence[Limit]) -> bool:
    return bool(configured) and _EXEMPTS_MARKED


#: Whether any view was marked :func:`exempt` (until then, no request is resolved
#: by the middleware for it).
_EXEMPTS_MARKED = False


@functools.lru_cache(maxsize=64)
def _import(path: str) -> Limit:
    module, _, attribute = path.rpartition(".")
    found = getattr(importlib.import_module(module), attribute)
    if not isinstance(found, Limit):
        raise ConfigurationError(f"BUCKETLIMIT_LIMITS: {path!r} is {found!r}, not a Limit")
    return found


@functools.lru_cache(maxsize=64)
def _from_string(text: str, storage: str) -> Limit:
    return Limit(text, storage=storage)


def _resolve(entry: str | Limit) -> Limit:
    if isinstance(entry, Limit):
        return entry
    if isinstance(entry, str):
        if "/" in entry or " per " in entry:  # a limit string, not a dotted path
            storage = str(getattr(settings, "BUCKETLIMIT_STORAGE", None) or "memory://")
            return _from_string(entry.strip(), storage)
        return _import(entry)
    raise ConfigurationError(
        f"BUCKETLIMIT_LIMITS holds Limit objects or their dotted paths, got {entry!r}"
    )


def _rewrite_throttled(request: HttpRequest, response: HttpResponseBase) -> Any:
    """DRF answered a :class:`LimitThrottle` refusal with its own body: send ours."""
    if getattr(request, _THROTTLED, False):
        limits = _request_limits(request)
        if response.status_code == limits.refusal().status:
            return _refused(request, limits)
    return response


class RateLimitMiddleware:
    """Applies ``BUCKETLIMIT_LIMITS`` to every request and writes the RateLimit
    fields of every limit of the request on its response (sync and async capable).

    It also answers a :class:`LimitThrottle` refusal with the problem body every
    adapter sends, in place of DRF's ``{"detail": ...}``.

    Settings, read per request (``override_settings`` applies at once):
    ``BUCKETLIMIT_LIMITS`` (app-wide ``Limit`` objects, their dotted paths, or limit
    strings), ``BUCKETLIMIT_DEFAULT_LIMITS`` (limit strings, each a bucket per
    client per route, on views without a ``@limit``), ``BUCKETLIMIT_STORAGE``,
    ``BUCKETLIMIT_ENABLED``, ``BUCKETLIMIT_HEADERS``, ``BUCKETLIMIT_ON_REFUSAL``.
    When Django builds it (at start-up: the first request of ``runserver``, a
    worker's boot under gunicorn) it asks the Redis store of each configured limit
    and of each limit the URLconf's views apply (``@limit``, DRF throttles:
    ``check()``) and raises :class:`StoreCheckError` if one does not answer,
    unless ``BUCKETLIMIT_CHECK_STORE = False``.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        if _check_store_setting() and _enabled():
            check_stores([*_configured_limits(), *_default_limits(), *_view_limits()])

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        if not _enabled():
            return self.get_response(request)
        setattr(request, _RELEASES, True)
        try:
            for each in _limits_for(request):
                refusal = each.check(request)
                if refusal is not None:
                    return _write_fields(request, refusal)
            response = _rewrite_throttled(request, self.get_response(request))
        except BaseException:
            _release_now(request)  # no response will release the request's permits
            raise
        return _write_fields(request, _release_after(request, response))

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        if not _enabled():
            return await cast(Awaitable[HttpResponseBase], self.get_response(request))
        setattr(request, _RELEASES, True)
        try:
            for each in _limits_for(request):
                refusal = await each.acheck(request)
                if refusal is not None:
                    return _write_fields(request, refusal)
            response = await cast(Awaitable[HttpResponseBase], self.get_response(request))
            rewritten = _rewrite_throttled(request, response)
            if inspect.isawaitable(rewritten):
                rewritten = await rewritten
        except BaseException:
            _release_now(request)
            raise
        return _write_fields(request, _release_after(request, rewritten))


if TYPE_CHECKING:
    # To a type checker a DRF throttle (its stubs type ``throttle_classes`` so). At
    # run time DRF only calls the methods, and importing DRF's throttling module
    # would read the settings before they exist.
    from rest_framework.throttling import BaseThrottle as _Throttle
else:
    _Throttle = object


class LimitThrottle(_Throttle):
    """A Django REST framework throttle applying a :class:`Limit`.

    ::

        class Burst(LimitThrottle):
            limit = Limit(TokenBucketLimiter(10, 1), name="burst")

        class Search(APIView):
            throttle_classes = [Burst]

    ``allow_request`` decides (atomically, in Redis too: no timestamp list in the
    cache racing between workers); ``wait()`` is the ``Retry-After`` in seconds,
    which DRF puts on its 429 (a limit with ``concurrency=`` needs
    :class:`RateLimitMiddleware`, which releases the permit when the response ends;
    without it ``allow_request`` raises ``ConfigurationError``). A refusal that can
    never pass (a spent rate-0
    quota, a cost above the capacity) has no wait: rather than DRF's 429 without
    ``Retry-After`` (which generic clients retry at once), ``allow_request`` raises
    DRF's ``Throttled`` with the status 403 or 413 and the problem body. Used alone
    it is correct; with :class:`RateLimitMiddleware` installed the response also
    carries the RateLimit fields and the body is the problem document every
    adapter sends (``application/problem+json``).
    """

    limit: Limit

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A throttle's limit string keeps the throttle's buckets, on every view that
        uses it (as DRF's throttles share their cache keys across views)."""
        super().__init_subclass__(**kwargs)
        limit = cls.__dict__.get("limit")
        if isinstance(limit, Limit):
            limit.attach(qualified_name(cls))

    def __init__(self) -> None:
        if not isinstance(getattr(type(self), "limit", None), Limit):
            raise ConfigurationError(
                f"{type(self).__name__} needs a class attribute "
                "limit = bucketlimit.django.Limit(...)"
            )
        self._decision: Decision | None = None

    def allow_request(self, request: Any, view: Any) -> bool:
        django_request = _django_request(request)
        if getattr(django_request, _THROTTLED, False) or not _enabled():
            return True  # another limit refused already: nothing more is charged
        if self.limit.concurrency is not None and not getattr(django_request, _RELEASES, False):
            raise ConfigurationError(
                f"{type(self).__name__}'s limit {self.limit.name!r} has concurrency=, whose "
                "permit is held until the response ends: add "
                "'bucketlimit.django.RateLimitMiddleware' to MIDDLEWARE, which releases it"
            )
        limits = _request_limits(request)
        held, refused = run(self.limit.procedure(request, lambda: limits, _describe, _hold_sync))
        if held is not None:
            self._decision = held.decision
        if not refused:
            if not getattr(django_request, _RELEASES, False):
                limits.answered()  # no middleware writes the response: counted now
            return True
        setattr(django_request, _THROTTLED, True)
        refusal = limits.refusal()
        if refusal.status != 429:
            raise _refused_for_good(refusal)
        return False

    def wait(self) -> float | None:
        """Seconds until the refused request passes (``Retry-After``), or ``None``."""
        if self._decision is None or self._decision.allowed:
            return None
        seconds = retry_after_seconds(self._decision)
        return None if seconds is None else float(seconds)

    def get_ident(self, request: Any) -> str:
        """The limit's key for ``request`` (what DRF's throttles call their ident)."""
        return self.limit.checked_key(self.limit.key(request), _describe(request))


def _refused_for_good(refusal: Refusal) -> Exception:
    """DRF's ``Throttled`` for a refusal that can never pass: its status (403, 413),
    no ``wait`` (no ``Retry-After``), the refusal's body."""
    from rest_framework.exceptions import Throttled  # DRF only where a throttle runs

    error = Throttled()
    error.status_code = refusal.status
    error.wait = None
    error.detail = refusal.body  # as it is: DRF would turn its numbers into strings
    return cast(Exception, error)


def reservation(request: HttpRequest, name: str | None = None) -> Reservation | AsyncReservation:
    """The reservation a limit made for ``request`` (``name`` when several apply):
    ``settle(used)`` in a sync view, ``await settle(used)`` in an async one."""
    limits: RequestLimits | None = getattr(_django_request(request), _STATE, None)
    if limits is None:
        raise LookupError("no limit applied to this request")
    return limits.reservation(name)
