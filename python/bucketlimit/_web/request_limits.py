"""The limits applied to one request (``RequestLimits``): the one writer of its
rate-limit fields (several limits on one route become one field with several
members, never repeated fields), its refusal, and the holder of its permits until
the response ends."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, cast

from bucketlimit._web import profiles
from bucketlimit._web.errors import ConfigurationError
from bucketlimit._web.fields import (
    Applied,
    Refusal,
    RefusalHook,
    describe_limit,
    ratelimit_fields,
    refusal_body,
    refusal_headers,
    refusal_status,
)
from bucketlimit._web.reservations import AsyncReservation, Reservation

logger = logging.getLogger("bucketlimit")


@dataclass
class _Entry:
    owner: object
    applied: Applied  # the member that decided (the refusing one of a refusal)
    reservation: Reservation | AsyncReservation
    headers: tuple[str, ...] | None = None
    before: tuple[Applied, ...] = ()  # the limit's other members (its concurrency)

    @property
    def members(self) -> tuple[Applied, ...]:
        return (*self.before, self.applied)


#: A permit is renewed after this share of its ttl while its response goes on.
RENEW_AFTER = 1 / 3


class RequestLimits:
    """The limits applied to one request, in order; the one writer of its fields;
    the holder of its permits until the response ends.

    ``headers`` (the header profiles of limits that name none), ``on_refusal``
    (the refusal hook of limits that have none), ``check_store`` (``False``: no
    limit asks its store before it first decides) and ``storage`` (where a limit
    string that names none keeps its buckets) are the app's, set by the adapter
    (Flask's extension, the ASGI middleware, Django's settings).

    The permits of its limits (``concurrency=``) are released by :meth:`close`,
    which each adapter calls once the response has ended (its last body chunk sent,
    the client gone, or the handler failed); :meth:`keep_alive`, called as a
    streamed body goes out, renews them so that a response longer than their
    ``ttl`` keeps its slot.
    """

    __slots__ = (
        "_renew_at",
        "_ttl",
        "checks_store",
        "closing",
        "entries",
        "headers",
        "on_refusal",
        "permits",
        "storage",
    )

    def __init__(
        self,
        headers: tuple[str, ...] | None = None,
        on_refusal: RefusalHook | None = None,
        check_store: bool = True,
        storage: str | None = None,
    ) -> None:
        self.entries: list[_Entry] = []
        self.headers = profiles.DEFAULT if headers is None else headers
        self.on_refusal = on_refusal
        self.checks_store = check_store
        self.storage = storage
        #: The permits the request holds, until :meth:`close`.
        self.permits: list[Any] = []
        #: Whether an adapter has arranged for :meth:`close` at the end of a streamed
        #: response (so that nothing else closes it sooner).
        self.closing = False
        self._ttl = math.inf  # the shortest ttl of the permits held
        self._renew_at = math.inf  # time.monotonic() of their next renewal

    def hold(self, permit: Any, ttl: float | None) -> None:
        """Keeps ``permit`` (granted) until :meth:`close`; ``ttl`` (its limiter's, or
        ``None``) paces :meth:`keep_alive`."""
        self.permits.append(permit)
        if ttl is not None and ttl < self._ttl:
            self._ttl = ttl
            self._renew_at = min(self._renew_at, time.monotonic() + ttl * RENEW_AFTER)

    def close(self) -> Awaitable[None] | None:
        """Releases every permit the request holds, each once (a permit's ``release``
        frees nothing the second time, so an early ``reservation.release()`` is
        safe). Returns an awaitable to await when a release was a coroutine (an
        asyncio Redis limiter's), else ``None``. A release that fails is logged: the
        permit then frees at its expiry."""
        if not self.permits:
            return None
        permits, self.permits = self.permits, []
        self._renew_at = math.inf
        return _each(permits, "release")

    def keep_alive(self) -> Awaitable[None] | None:
        """Renews the permits once a third of their ttl has passed since they were
        taken or last renewed (cheap to call at every chunk of a streamed body).
        Returns an awaitable to await when a renewal was a coroutine."""
        if not self.permits or time.monotonic() < self._renew_at:
            return None
        self._renew_at = time.monotonic() + self._ttl * RENEW_AFTER
        return _each(self.permits, "renew")

    def find(self, owner: object) -> Reservation | AsyncReservation | None:
        """The reservation ``owner`` already made for this request (a limit applies once)."""
        for entry in self.entries:
            if entry.owner is owner:
                return entry.reservation
        return None

    def add(
        self,
        owner: object,
        applied: Applied,
        reservation: Reservation | AsyncReservation,
        headers: tuple[str, ...] | None = None,
        before: tuple[Applied, ...] = (),
    ) -> None:
        """Records ``owner``'s answer: ``applied`` is the member that decided,
        ``before`` the limit's other members (its concurrency policy's)."""
        names = {a.name for e in self.entries for a in e.members}
        for member in (*before, applied):
            if member.name in names:
                raise ConfigurationError(
                    f"two limits named {member.name!r} apply to one request; each limit on "
                    "a route needs its own name= (they are reported as one RateLimit "
                    "field with one member per name)"
                )
        self.entries.append(_Entry(owner, applied, reservation, headers, before))

    def others(self, owner: object) -> list[Reservation | AsyncReservation]:
        """Every reservation but ``owner``'s: refunded when ``owner`` refuses."""
        return [e.reservation for e in self.entries if e.owner is not owner]

    def _profile(self, entry: _Entry) -> tuple[str, ...]:
        return self.headers if entry.headers is None else entry.headers

    def fields(self, refused: bool = False) -> dict[str, str]:
        """The rate-limit fields of every limit, by each one's header profile:
        draft-11's two fields (one member per limit), one limit's ``X-RateLimit-*``
        (legacy), each limit's ``x-ratelimit-*-<name>`` (openai)."""
        entries = self.entries
        if all(e.headers is None for e in entries) and self.headers is profiles.DEFAULT:
            return ratelimit_fields([a for e in entries for a in e.members])  # the common case
        draft: list[Applied] = []
        legacy: list[Applied] = []
        openai: dict[str, str] = {}
        for entry in entries:
            profile = self._profile(entry)
            members = entry.members
            if profiles.DRAFT11 in profile:
                draft += members
            if profiles.LEGACY in profile:
                legacy += members
            if profiles.OPENAI in profile:
                for member in members:
                    openai.update(profiles.openai_fields(member))
        return {
            **ratelimit_fields(draft),
            **profiles.legacy_fields(
                legacy, refused and bool(legacy) and legacy[-1] is entries[-1].applied
            ),
            **openai,
        }

    def refusal(self) -> Refusal:
        """How to answer the refusal of the last limit applied (the one that refused):
        its status (429, or 413/403 when it can never pass), the fields of every
        limit with ``Retry-After`` and ``Content-Type``, and the body: the problem
        document, or OpenAI's error object under the ``openai`` profile."""
        entry = self.entries[-1]
        applied = entry.applied
        headers = {**self.fields(refused=True), **refusal_headers(applied.decision)}
        if profiles.OPENAI in self._profile(entry):
            headers.update(profiles.openai_refusal_headers(applied))
            body = profiles.openai_body(applied)
        else:
            body = refusal_body(applied)
        status = refusal_status(applied)
        return Refusal(status, headers, body, applied.decision, describe_limit(applied))

    def refusal_hook(self) -> RefusalHook | None:
        """The ``on_refusal`` of the refusing limit, else the app's, else ``None``."""
        owner = self.entries[-1].owner
        hook = getattr(owner, "on_refusal", None)
        return self.on_refusal if hook is None else cast(RefusalHook, hook)

    def reservation(self, name: str | None) -> Reservation | AsyncReservation:
        """The reservation of the limit called ``name`` (``None``: the only one)."""
        if name is not None:
            for entry in self.entries:
                if any(member.name == name for member in entry.members):
                    return entry.reservation
            raise LookupError(f"no limit named {name!r} applied to this request")
        if len(self.entries) == 1:
            return self.entries[0].reservation
        if not self.entries:
            raise LookupError("no limit applied to this request")
        names = [e.applied.name for e in self.entries]
        raise LookupError(f"several limits apply to this request; name one of {names!r}")


def _each(permits: list[Any], method: str) -> Awaitable[None] | None:
    """Calls ``release`` or ``renew`` on every permit; an awaitable of the answers
    that are coroutines (``None`` when there are none). A failure is logged, not
    raised: a response that ends must not fail because a store did not answer."""
    pending: list[Awaitable[Any]] = []
    for permit in permits:
        try:
            answer = getattr(permit, method)()
        except Exception:
            failed = "%s() of %r failed; it frees at its expiry"
            logger.warning(failed, method, permit, exc_info=True)
            continue
        if answer is not None and answer.__class__ is not bool and inspect.isawaitable(answer):
            pending.append(answer)
    return _awaiting(pending, method) if pending else None


async def _awaiting(pending: list[Awaitable[Any]], method: str) -> None:
    for answer in pending:
        try:
            await answer
        except Exception:
            logger.warning("%s() of a permit failed; it frees at its expiry", method, exc_info=True)
