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

A refused request gets ``429`` with ``Retry-After`` and an RFC 9457 problem body
(``application/problem+json``; 413 or 403 when it can never pass); every limited response carries
``RateLimit-Policy`` and ``RateLimit`` (draft-ietf-httpapi-ratelimit-headers-11),
one field each whatever the number of limits. Flask is synchronous: give it the
in-process limiter or ``RedisTokenBucketLimiter``, not the asyncio one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import flask
from flask import Flask, Request, Response, current_app

from bucketlimit._core import Decision
from bucketlimit._web.addresses import Network, client_address_key
from bucketlimit._web.limiters import AnyLimiter, SyncLimiter, is_async_limiter
from bucketlimit._web.limits import (
    ConfigurationError,
    KeyFunctionError,
    LimitSettings,
    PlanFunc,
    RequestLimits,
    run,
)
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve

if TYPE_CHECKING:
    from typing import Unpack

    from bucketlimit._web.limits import LimitOptions

__all__ = [
    "ConfigurationError",
    "KeyFunctionError",
    "Limit",
    "RateLimit",
    "Reservation",
    "client_address",
    "limit",
    "remote_address",
    "reservation",
    "reserve",
]

F = TypeVar("F", bound=Callable[..., Any])

_STATE = "bucketlimit.limits"


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


_HOOKED = "bucketlimit.hooked"  # environ: the app's RateLimit extension writes the fields


def _write_fields(limits: RequestLimits, response: Response) -> Response:
    fields = limits.fields()
    if fields:
        headers = response.headers
        for name in fields:
            if name in headers:
                del headers[name]  # replaces, never appends
        headers.extend(fields)
    return response


def _request_limits(request: Request) -> RequestLimits:
    """This request's limits (kept in its WSGI environ); the first call arranges for
    one writer of the fields, unless the app's :class:`RateLimit` hook writes them."""
    environ = request.environ
    limits: RequestLimits | None = environ.get(_STATE)
    if limits is None:
        limits = environ[_STATE] = RequestLimits()
        if not environ.get(_HOOKED):
            # Runs on the final response, error responses included, after every
            # limit of the request has decided: one RateLimit field, never two.
            flask.after_this_request(functools.partial(_write_fields, limits))
    return limits


class Limit(LimitSettings[Request]):
    """One limit: decorate views with it, or apply it to a whole app with :class:`RateLimit`.

    The arguments are those of :class:`bucketlimit._web.limits.LimitSettings`
    (docs/web.md). In Flask the limiter is ``TokenBucketLimiter`` or
    ``RedisTokenBucketLimiter`` (views are synchronous), a ``cost`` function may
    read ``request.get_json()`` (the view can read the body again), and a request
    waiting ``max_wait`` for its tokens keeps its worker asleep.
    """

    default_key = staticmethod(remote_address)

    def __init__(
        self, limiter: SyncLimiter | PlanFunc[Request], **options: Unpack[LimitOptions[Request]]
    ) -> None:
        super().__init__(limiter, **options)

    def check_limiter(self, limiter: AnyLimiter) -> None:
        if is_async_limiter(limiter):
            raise TypeError(
                "Flask views are synchronous: use TokenBucketLimiter or "
                "RedisTokenBucketLimiter, not an asyncio limiter"
            )

    def __call__(self, view: F) -> F:
        """Limits one view. Stack several, each with its own ``name``."""

        @functools.wraps(view)
        def limited(*args: Any, **kwargs: Any) -> Any:
            refusal = self.check()
            if refusal is not None:
                return refusal
            return current_app.ensure_sync(view)(*args, **kwargs)

        return cast(F, limited)

    def check(self) -> Response | None:
        """Applies the limit to the current request: a 429 response, or ``None`` to go on."""
        request: Request = flask.request._get_current_object()  # type: ignore[attr-defined]
        limits = _request_limits(request)
        _, refused = run(self.procedure(request, lambda: limits, _describe, _hold))
        if not refused:
            return None
        refusal = limits.refusal()
        return Response(
            json.dumps(refusal.body, separators=(",", ":")), refusal.status, refusal.headers
        )


#: ``@limit(limiter, ...)`` on a view: the same as ``@Limit(limiter, ...)``.
limit = Limit


class RateLimit:
    """A Flask extension applying a :class:`Limit` to every request of an app.

    ``RateLimit(limit, app)`` or ``ext = RateLimit(limit); ext.init_app(app)``.
    It runs before the view's own limits; a view decorated with the same
    ``Limit`` is charged once. Use ``exempt=`` on the limit for health checks.
    """

    def __init__(self, limit: Limit, app: Flask | None = None) -> None:
        if not isinstance(limit, Limit):
            raise TypeError(f"RateLimit takes a bucketlimit.flask.Limit, got {limit!r}")
        self.limit = limit
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        app.before_request(self._before)
        app.after_request(self._after)

    def _before(self) -> Response | None:
        flask.request.environ[_HOOKED] = True
        return self.limit.check()

    @staticmethod
    def _after(response: Response) -> Response:
        limits: RequestLimits | None = flask.request.environ.get(_STATE)
        return response if limits is None else _write_fields(limits, response)

    @property
    def shadow_refusals(self) -> int:
        return self.limit.shadow_refusals


def reservation(name: str | None = None) -> Reservation:
    """The reservation a limit made for the current request, to settle the real cost.

    ``name`` picks the limit when several apply. Reserve the largest cost up front
    (``cost=`` the request's ``max_tokens``), then refund what the view did not use::

        reservation("tokens").settle(tokens_generated)

    ``settle`` may run after the response, e.g. at the end of a streamed body or in
    ``response.call_on_close``. A reservation never settled keeps its full charge.
    """
    limits: RequestLimits | None = flask.request.environ.get(_STATE)
    if limits is None:
        raise LookupError("no limit applied to this request")
    found = limits.reservation(name)
    if isinstance(found, AsyncReservation):  # pragma: no cover - Flask never makes these
        raise TypeError("an async reservation in a Flask request")
    return found
