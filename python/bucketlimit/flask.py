"""Rate limits for Flask: a view decorator and an app-wide extension.

::

    from flask import Flask
    from bucketlimit import TokenBucketLimiter
    from bucketlimit.flask import Limit, RateLimit, client_address

    app = Flask(__name__)
    per_client = Limit(TokenBucketLimiter(10, 1), name="per-client")
    RateLimit(per_client, app)                 # every request of the app

    @app.get("/search")
    @Limit(TokenBucketLimiter(2, 0.1), name="search")   # one view (several stack)
    def search(): ...

Or from strings and the app's configuration, as flask-limiter reads them::

    app.config.update(RATELIMIT_DEFAULT="200 per day;50 per hour",
                      RATELIMIT_STORAGE_URI="redis://localhost:6379/0")
    limiter = RateLimit(app=app)

    @app.get("/slow")
    @limit("1 per day")                # on the app's storage; replaces the defaults here
    def slow(): ...

    @app.get("/ping")
    @limiter.exempt                    # or @exempt
    def ping(): ...

A refusal raises :class:`RateLimitExceeded`, a werkzeug 429 ``HTTPException``
carrying the ``Decision`` (so ``@app.errorhandler(429)`` and
``errorhandler(RateLimitExceeded)`` answer it); unhandled, it is the one refusal
every adapter sends: ``429`` with ``Retry-After`` and an RFC 9457 problem body
(``application/problem+json``; 413 or 403 when it can never pass). Every limited
response carries ``RateLimit-Policy`` and ``RateLimit``
(draft-ietf-httpapi-ratelimit-headers-11), one field each whatever the number of
limits, or the fields of the header profile asked for. Flask is synchronous: give
it the in-process limiter or ``RedisTokenBucketLimiter``, not the asyncio one.

``Limit(..., concurrency=N)`` holds a permit per request until its response ends:
at once after the view for a plain body, through ``response.call_on_close`` for a
streamed one (the WSGI server closes it after the last chunk, or when the client
went away and a write failed), and whatever the view raised.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import flask
from flask import Flask, Request, Response, current_app
from werkzeug.exceptions import TooManyRequests

from bucketlimit import _config
from bucketlimit._core import Decision
from bucketlimit._web import profiles
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError
from bucketlimit._web.fields import RETRY_AFTER, Refusal, RefusalHook
from bucketlimit._web.limiters import (
    AnyLimiter,
    ConcurrencyLimiterLike,
    SyncLimiter,
    is_async_limiter,
)
from bucketlimit._web.limits import Headers, KeyFunc, LimitSettings, PlanFunc, live_limits
from bucketlimit._web.procedure import run
from bucketlimit._web.request_limits import RequestLimits
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve
from bucketlimit._web.startup import StoreCheckError, check_stores
from bucketlimit._web.streams import StreamedBody

if TYPE_CHECKING:
    from typing import Unpack

    from bucketlimit._web.limits import LimitOptions

__all__ = [
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "RateLimit",
    "RateLimitExceeded",
    "Reservation",
    "StoreCheckError",
    "client_address",
    "exempt",
    "limit",
    "remote_address",
    "reservation",
    "reserve",
    "shared_limit",
]

F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger("bucketlimit")

_STATE = "bucketlimit.limits"
_REFUSAL = "bucketlimit.refusal"  # environ: the refusal this request got
_OFF = "bucketlimit.off"  # environ: the app's limits are off (RATELIMIT_ENABLED)
_EXTENSION = "bucketlimit"  # app.extensions: the app's _AppLimits
_EXEMPT = "__bucketlimit_exempt__"  # a view's mark: the app's limits skip it
_OWN_LIMITS = "__bucketlimit_overrides_defaults__"  # a view's mark: it has limits of its own
_LIMITS = "__bucketlimit_limits__"  # a view's limits (its decorators')


def client_address(
    trusted_proxies: Iterable[str | Network] = (), *, ipv6_prefix: int = 64
) -> Callable[[Request], str]:
    """A key function: the client's IP address, an IPv6 client by its ``/64``.

    With no trusted proxies (the default) it is the direct peer,
    ``request.remote_addr``, and ``X-Forwarded-For`` is ignored: a client cannot
    pick its own key by sending one. Behind proxies, list their networks; the key
    is then the right-most ``X-Forwarded-For`` hop that is not one of them.
    ``ipv6_prefix`` (0-128) is how many bits of an IPv6 address the key keeps.
    """
    return client_address_key(
        trusted_proxies,
        lambda request: request.remote_addr,
        lambda request: request.headers.getlist("X-Forwarded-For"),
        "REMOTE_ADDR is missing",
        ipv6_prefix,
    )


#: The default key: the direct peer address (IPv6 by /64), ``X-Forwarded-For`` ignored.
remote_address = client_address()


def _describe(request: Request) -> str:
    return f"{request.method} {request.path}"


def _hold(limiter: AnyLimiter, key: str, charged: int, decision: Decision) -> Reservation:
    """A Flask request's reservation (its limiter is synchronous: see Limit)."""
    return Reservation(cast(SyncLimiter, limiter), key, charged, decision)


class RateLimitExceeded(TooManyRequests):
    """A refusal: a werkzeug ``HTTPException`` (a ``429 Too Many Requests``, or 413 /
    403 for a request that can never pass: :attr:`code` is the refusal's status).

    A limit raises it, so ``@app.errorhandler(429)`` (or ``(RateLimitExceeded)``)
    can answer instead; unhandled, :meth:`get_response` is the problem document
    every adapter sends, with ``Retry-After`` and the RateLimit fields.
    :attr:`decision` is the refusing limiter's answer, :attr:`refusal` everything
    the default response is made of.
    """

    def __init__(self, refusal: Refusal) -> None:
        # flask-limiter's description: the limit, "5 per 1 minute".
        super().__init__(description=str(refusal))
        self.code = refusal.status
        self.refusal = refusal

    @property
    def decision(self) -> Decision:
        return self.refusal.decision

    def get_response(self, environ: Any = None, scope: Any = None) -> Response:
        return _refusal_response(self.refusal)


def _refusal_response(refusal: Refusal) -> Response:
    return Response(
        json.dumps(refusal.body, separators=(",", ":")), refusal.status, refusal.headers
    )


class _AppLimits:
    """One app's configuration of its limits (``app.extensions["bucketlimit"]``)."""

    __slots__ = (
        "application",
        "check_store",
        "defaults",
        "enabled",
        "headers",
        "on_refusal",
        "storage",
    )

    def __init__(
        self,
        *,
        storage: str,
        enabled: bool,
        headers: tuple[str, ...] | None,
        on_refusal: RefusalHook | None,
        check_store: bool,
        application: list[Limit],
        defaults: list[Limit],
    ) -> None:
        self.storage = storage
        self.enabled = enabled
        self.headers = headers
        self.on_refusal = on_refusal
        self.check_store = check_store
        self.application = application
        self.defaults = defaults


def _app_limits() -> _AppLimits | None:
    found = current_app.extensions.get(_EXTENSION)
    return found if isinstance(found, _AppLimits) else None


def _release_after(limits: RequestLimits, response: Response) -> None:
    """Releases the request's permits when its response ends: now for a plain body
    (the view is done), when the WSGI server closes a streamed one (after its last
    chunk, or when the client went away)."""
    if not limits.permits or limits.closing:
        return
    if not response.is_streamed:
        limits.close()
        return
    limits.closing = True
    response.response = StreamedBody(response.response, limits, releases=False)
    response.call_on_close(limits.close)


def _release_now() -> None:
    """Releases the current request's permits unless its response will (the view
    raised, or the app's error handling never reached the fields); the request ran,
    so the limits that admitted it count it (``RequestLimits.answered``)."""
    limits: RequestLimits | None = flask.request.environ.get(_STATE)
    if limits is not None:
        limits.answered()
        if not limits.closing:
            limits.close()


def _write_fields(limits: RequestLimits, response: Response) -> Response:
    limits.answered()  # every limit of the request has decided
    _release_after(limits, response)
    refusal: Refusal | None = flask.request.environ.get(_REFUSAL)
    fields = limits.fields(refused=refusal is not None)
    headers = response.headers
    if fields:
        for name in fields:
            if name in headers:
                del headers[name]  # replaces, never appends
        headers.extend(fields)
    if refusal is not None and response.status_code == refusal.status:
        # An error handler's own answer: it still says when to come back.
        for name in (RETRY_AFTER, profiles.RETRY_AFTER_MS):
            if name in refusal.headers and name not in headers:
                headers[name] = refusal.headers[name]
    return response


def _config_headers(config: Any) -> tuple[str, ...] | None:
    """The header profile ``RATELIMIT_HEADERS_ENABLED`` asks for, as flask-limiter
    reads it: ``True`` its ``X-RateLimit-*`` fields (``legacy``), ``False`` none;
    unset, the default (draft-11's fields)."""
    enabled = config.get("RATELIMIT_HEADERS_ENABLED")
    if enabled is None:
        return None
    return (profiles.LEGACY,) if enabled else ()


def _request_limits(request: Request) -> RequestLimits | None:
    """This request's limits (kept in its WSGI environ), with the app's header
    profile and refusal hook, or ``None`` when the app's limits are off
    (``RATELIMIT_ENABLED``). The first call reads the app's settings and arranges
    for one writer of the fields: the app's :class:`RateLimit` hook, or an
    ``after_this_request`` hook."""
    environ = request.environ
    limits: RequestLimits | None = environ.get(_STATE)
    if limits is not None or environ.get(_OFF):
        return limits
    app_limits = _app_limits()
    if app_limits is None:
        if not current_app.config.get("RATELIMIT_ENABLED", True):
            environ[_OFF] = True
            return None
        limits = environ[_STATE] = RequestLimits(_config_headers(current_app.config))
        # Runs on the final response, error responses included, after every
        # limit of the request has decided: one RateLimit field, never two.
        flask.after_this_request(functools.partial(_write_fields, limits))
        return limits
    if not app_limits.enabled:
        environ[_OFF] = True
        return None
    limits = environ[_STATE] = RequestLimits(
        app_limits.headers, app_limits.on_refusal, app_limits.check_store
    )
    return limits


class Limit(LimitSettings[Request]):
    """One limit: decorate views with it, or apply it to a whole app with :class:`RateLimit`.

    The arguments are those of :class:`bucketlimit._web.limits.LimitSettings`
    (docs/web.md). In Flask the limiter is ``TokenBucketLimiter`` or
    ``RedisTokenBucketLimiter`` (views are synchronous), or a limit string such as
    ``"100/minute"`` on ``storage=`` (default: the app's ``RATELIMIT_STORAGE_URI``,
    else ``memory://``); a ``cost`` function may read ``request.get_json()`` (the
    view can read the body again), and a request waiting ``max_wait`` for its
    tokens keeps its worker asleep (a WSGI server cannot tell that the client
    left, so a waiter that disconnects keeps its tokens).
    """

    default_key = staticmethod(remote_address)

    def __init__(
        self,
        limiter: SyncLimiter | PlanFunc[Request] | str | ConcurrencyLimiterLike | None = None,
        *,
        override_defaults: bool = True,
        **options: Unpack[LimitOptions[Request]],
    ) -> None:
        super().__init__(limiter, **options)
        #: Whether a view it decorates skips the app's default limits (flask-limiter's
        #: ``override_defaults``); ``False``: they apply there too.
        self.override_defaults = bool(override_defaults)

    def check_limiter(self, limiter: AnyLimiter | ConcurrencyLimiterLike) -> None:
        if is_async_limiter(limiter):
            raise TypeError(
                "Flask views are synchronous: use TokenBucketLimiter or "
                "RedisTokenBucketLimiter (ConcurrencyLimiter or RedisConcurrencyLimiter "
                f"for concurrency=), not an asyncio limiter: {limiter!r}"
            )

    def default_storage(self) -> str:
        """The app's storage: the :class:`RateLimit` extension's, else the app's
        ``RATELIMIT_STORAGE_URI``, else ``memory://`` (outside an app context too)."""
        if not flask.has_app_context():
            return "memory://"
        app_limits = _app_limits()
        if app_limits is not None:
            return app_limits.storage
        return str(current_app.config.get("RATELIMIT_STORAGE_URI") or "memory://")

    def __call__(self, view: F) -> F:
        """Limits one view. Stack several, each with its own ``name``. The app's
        default limits (``RATELIMIT_DEFAULT``) no longer apply to it, unless
        ``override_defaults=False``. A limit string keeps this view's buckets (one
        set for every view it decorates; ``scope=`` shares them with other limits)."""

        @functools.wraps(view)
        def limited(*args: Any, **kwargs: Any) -> Any:
            refusal = self.check()
            if refusal is not None:
                return refusal
            try:
                return current_app.ensure_sync(view)(*args, **kwargs)
            except BaseException:
                _release_now()  # the view failed: no response will release its permits
                raise

        if self.override_defaults or getattr(view, _OWN_LIMITS, False):
            setattr(limited, _OWN_LIMITS, True)
        setattr(limited, _LIMITS, (*getattr(view, _LIMITS, ()), self))
        return cast(F, limited)

    def check(self) -> Any:
        """Applies the limit to the current request: ``None`` to go on; a refusal
        returns what ``on_refusal`` (the limit's, else the app's) made of it, or
        raises :class:`RateLimitExceeded` (with no hook, or when the hook returned
        ``None``)."""
        request: Request = flask.request._get_current_object()  # type: ignore[attr-defined]
        limits = _request_limits(request)
        if limits is None:  # RATELIMIT_ENABLED is off
            return None
        if not self.attached:
            self.attach(_endpoint_of(self))
        _, refused = run(self.procedure(request, lambda: limits, _describe, _hold))
        if not refused:
            return None
        refusal = limits.refusal()
        request.environ[_REFUSAL] = refusal
        hook = limits.refusal_hook()
        if hook is not None:
            response = hook(request, refusal)
            if response is not None:  # None: the default refusal (flask-limiter's on_breach)
                return response
        raise RateLimitExceeded(refusal)


#: ``@limit(limiter, ...)`` on a view: the same as ``@Limit(limiter, ...)``.
limit = Limit


def shared_limit(limit: str, scope: str, **options: Any) -> Limit:
    """flask-limiter's ``shared_limit``: a limit string whose buckets are the
    ``scope``'s, shared by every view it decorates and every limit of that scope
    (``Limit(limit, scope=scope, ...)``), in process and in Redis alike."""
    return Limit(limit, scope=scope, **options)


def exempt(view: F) -> F:
    """Marks a view that the app's limits (the :class:`RateLimit` extension's
    application and default limits) skip: no charge, no fields. A view's own
    ``@limit`` still applies."""
    setattr(view, _EXEMPT, True)
    return view


def _endpoint_of(limit: Limit) -> str | None:
    """The first endpoint of the app (in the order they were added) whose view the
    limit decorates; ``None`` for an app-wide limit."""
    for endpoint, view in current_app.view_functions.items():
        if limit in getattr(view, _LIMITS, ()):
            return str(endpoint)
    return None


def _view() -> Any:
    endpoint = flask.request.endpoint
    return None if endpoint is None else current_app.view_functions.get(endpoint)


class RateLimit:
    """A Flask extension applying limits to every request of an app.

    ``RateLimit(limit, app)`` (or ``ext = RateLimit(limit); ext.init_app(app)``)
    applies one :class:`Limit` (or a limit string) to every request, as one bucket
    per client for the whole app. The rest reads as flask-limiter's ``Limiter``:

    - ``application_limits`` (config ``RATELIMIT_APPLICATION``): limit strings,
      each one bucket per client for the whole app, like ``limit``;
    - ``default_limits`` (config ``RATELIMIT_DEFAULT``, ``;``-joined): each is a
      bucket per client *per route*, on every route that has no ``@limit`` of its
      own;
    - ``storage`` (``RATELIMIT_STORAGE_URI``): the storage URI of every limit
      string of the app (default ``memory://``);
    - ``key``: the key function of the limits it builds (default: the peer address);
    - ``enabled`` (``RATELIMIT_ENABLED``): ``False`` turns every limit of the app off;
    - ``headers``: the header profile(s) of limits that name none (default
      ``"draft-11"``); without it, ``RATELIMIT_HEADERS_ENABLED = True`` sends
      flask-limiter's ``X-RateLimit-*`` fields (``"legacy"``), ``False`` none;
    - ``on_refusal(request, refusal)``: the response of a refusal by any limit that
      has none of its own (default: raise :class:`RateLimitExceeded`);
    - ``check_store``: at ``init_app``, ask every Redis store behind the app's limits
      (``check()``): a store that does not answer raises :class:`StoreCheckError`
      there, so a wrong URL fails the start. A view's own limit made after it is
      asked before it first decides (a store that does not answer fails that
      request). ``False``: no limit of the app asks; the limiters' ``on_store_error``
      policy answers.

    Arguments win over the app's config. The app's limits run before a view's own;
    a view decorated with the same ``Limit`` is charged once; :func:`exempt` (or
    :meth:`exempt`) views skip them.
    """

    def __init__(
        self,
        limit: Limit | str | None = None,
        app: Flask | None = None,
        *,
        application_limits: str | Iterable[str] | None = None,
        default_limits: str | Iterable[str] | None = None,
        storage: str | None = None,
        key: KeyFunc[Request] | None = None,
        enabled: bool | None = None,
        headers: Headers | None = None,
        on_refusal: RefusalHook | None = None,
        check_store: bool = True,
    ) -> None:
        if limit is not None and not isinstance(limit, (Limit, str)):
            raise TypeError(
                f"RateLimit takes a bucketlimit.flask.Limit or a limit string, got {limit!r}"
            )
        if storage is not None:
            _config.storage_scheme(storage)
        if on_refusal is not None and not callable(on_refusal):
            raise TypeError(f"on_refusal must be a function (request, refusal), got {on_refusal!r}")
        self._limit = limit
        self._application = (
            None if application_limits is None else _config.split_limits(application_limits)
        )
        self._defaults = None if default_limits is None else _config.split_limits(default_limits)
        self.storage = storage
        self.key = key
        self._enabled = enabled
        self.headers = profiles.check_headers(headers)
        self.on_refusal = on_refusal
        self.check_store = bool(check_store)
        self._apps: list[_AppLimits] = []
        if app is not None:
            self.init_app(app)

    @property
    def limit(self) -> Limit | None:
        """The one app-wide :class:`Limit` given first (a limit string, once an app
        is initialised, is the :class:`Limit` built from it)."""
        if isinstance(self._limit, str):
            return self._apps[0].application[0] if self._apps else None
        return self._limit

    def init_app(self, app: Flask) -> None:
        """Reads the app's config, builds its limits, binds every limit string still
        waiting for a storage to the app's, checks the stores (``check_store``) and
        installs the hooks."""
        config = app.config
        storage = self.storage or str(config.get("RATELIMIT_STORAGE_URI") or "memory://")
        _config.storage_scheme(storage)
        enabled = self._enabled
        if enabled is None:
            enabled = bool(config.get("RATELIMIT_ENABLED", True))
        headers = self.headers if self.headers is not None else _config_headers(config)
        application_texts = self._application
        if application_texts is None:
            found = config.get("RATELIMIT_APPLICATION")
            application_texts = _config.split_limits(found) if found else []
        default_texts = self._defaults
        if default_texts is None:
            found = config.get("RATELIMIT_DEFAULT")
            default_texts = _config.split_limits(found) if found else []
        options: dict[str, Any] = {} if self.key is None else {"key": self.key}
        application: list[Limit] = []
        if isinstance(self._limit, Limit):
            application.append(self._limit)
        elif isinstance(self._limit, str):
            application.append(Limit(self._limit, storage=storage, **options))
        application += [Limit(t, storage=storage, **options) for t in application_texts]
        route_key = _per_route(self.key or remote_address)
        defaults = [Limit(t, storage=storage, key=route_key) for t in default_texts]
        app_limits = _AppLimits(
            storage=storage,
            enabled=enabled,
            headers=headers,
            on_refusal=self.on_refusal,
            check_store=self.check_store,
            application=application,
            defaults=defaults,
        )
        first = _EXTENSION not in app.extensions
        if first:  # the app's settings (storage, headers, on_refusal, enabled): the first's
            app.extensions[_EXTENSION] = app_limits
        self._apps.append(app_limits)
        waiting = [e for e in live_limits() if isinstance(e, Limit) and not e.bound]
        for each in waiting:
            each.bind(storage)  # limit strings made before the app said its storage
        if self.check_store and enabled:
            check_stores([*application, *defaults, *waiting])
        app.before_request(functools.partial(self._before, app_limits))
        if first:
            app.after_request(self._after)
            app.teardown_request(self._teardown)

    @staticmethod
    def _before(app_limits: _AppLimits) -> Any:
        if not app_limits.enabled or not (app_limits.application or app_limits.defaults):
            return None
        view = _view()
        if view is not None and getattr(view, _EXEMPT, False):
            return None
        for each in app_limits.application:
            refusal = each.check()
            if refusal is not None:
                return refusal
        if view is not None and not getattr(view, _OWN_LIMITS, False):
            for each in app_limits.defaults:
                refusal = each.check()
                if refusal is not None:
                    return refusal
        return None

    @staticmethod
    def _after(response: Response) -> Response:
        limits: RequestLimits | None = flask.request.environ.get(_STATE)
        return response if limits is None else _write_fields(limits, response)

    @staticmethod
    def _teardown(error: BaseException | None) -> None:
        """A request whose response never reached :meth:`_after` (an error that
        propagates, as under ``PROPAGATE_EXCEPTIONS``) still releases its permits."""
        _release_now()

    #: ``@ext.exempt`` on a view: :func:`exempt`.
    exempt = staticmethod(exempt)
    #: ``@ext.shared_limit("100/hour", scope="mysql")``: :func:`shared_limit`.
    shared_limit = staticmethod(shared_limit)

    @property
    def shadow_refusals(self) -> int:
        found = self.limit
        return 0 if found is None else found.shadow_refusals


def _per_route(key: Callable[[Request], Any]) -> Callable[[Request], str]:
    """A default limit's key: the request's endpoint and the key, so each route has
    its own bucket per client (flask-limiter's default limits)."""

    def route_key(request: Request) -> str:
        return f"{request.endpoint}|{key(request)}"

    return route_key


def reservation(name: str | None = None) -> Reservation:
    """The reservation a limit made for the current request, to settle the real cost.

    ``name`` picks the limit when several apply. Reserve the largest cost up front
    (``cost=`` the request's ``max_tokens``), then refund what the view did not use::

        reservation("tokens").settle(tokens_generated)

    ``settle`` may run after the response, e.g. at the end of a streamed body or in
    ``response.call_on_close``. A reservation never settled keeps its full charge.
    A limit with ``concurrency=`` puts its permit on it (``.permit``, whose
    ``token`` is the fencing token; ``.release()`` frees it before the response
    ends).
    """
    limits: RequestLimits | None = flask.request.environ.get(_STATE)
    if limits is None:
        raise LookupError("no limit applied to this request")
    found = limits.reservation(name)
    if isinstance(found, AsyncReservation):  # pragma: no cover - Flask never makes these
        raise TypeError("an async reservation in a Flask request")
    return found
