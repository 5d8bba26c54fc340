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
from bucketlimit._web.counting import ABANDONED, ALLOWED, GIVEN_BACK, REFUSED, LimitCounters
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
    counters: LimitCounters | None = None  # where its outcome is counted, once

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
        "_holders",
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
        # Per permit: its limit's counters, its ttl and when it was last renewed.
        self._holders: list[_Holder] = []
        #: Whether an adapter has arranged for :meth:`close` at the end of a streamed
        #: response (so that nothing else closes it sooner).
        self.closing = False
        self._ttl = math.inf  # the shortest ttl of the permits held
        self._renew_at = math.inf  # time.monotonic() of their next renewal

    def hold(self, permit: Any, ttl: float | None, counters: LimitCounters | None = None) -> None:
        """Keeps ``permit`` (granted) until :meth:`close`; ``ttl`` (its limiter's, or
        ``None``) paces :meth:`keep_alive`; ``counters`` (its limit's) count it in
        flight until then, and expired when it outlives its ttl."""
        now = time.monotonic()
        self.permits.append(permit)
        self._holders.append(_Holder(counters, math.inf if ttl is None else ttl, now))
        if counters is not None:
            counters.add("permits_in_flight")
        if ttl is not None and ttl < self._ttl:
            self._ttl = ttl
            self._renew_at = min(self._renew_at, now + ttl * RENEW_AFTER)

    def close(self) -> Awaitable[None] | None:
        """Releases every permit the request holds, each once (a permit's ``release``
        frees nothing the second time, so an early ``reservation.release()`` is
        safe). Returns an awaitable to await when a release was a coroutine (an
        asyncio Redis limiter's), else ``None``. A release that fails is logged: the
        permit then frees at its expiry. A permit held longer than its ttl since it
        was taken or last renewed is counted expired (its slot went to another)."""
        if not self.permits:
            return None
        self._check_expiry(time.monotonic())
        permits, self.permits = self.permits, []
        holders, self._holders = self._holders, []
        for holder in holders:
            if holder.counters is not None:
                holder.counters.add("permits_in_flight", -1)
        self._renew_at = math.inf
        return _each(permits, "release")

    def keep_alive(self) -> Awaitable[None] | None:
        """Renews the permits once a third of their ttl has passed since they were
        taken or last renewed (cheap to call at every chunk of a streamed body).
        Returns an awaitable to await when a renewal was a coroutine."""
        now = time.monotonic()
        if not self.permits or now < self._renew_at:
            return None
        self._renew_at = now + self._ttl * RENEW_AFTER
        self._check_expiry(now)
        return _each(self.permits, "renew")

    def _check_expiry(self, now: float) -> None:
        """Counts expired each permit that went its ttl without a renewal (its slot
        went to another request): what a renewal or the release finds."""
        for holder in self._holders:
            if not holder.expired and now - holder.renewed >= holder.ttl:
                holder.expired = True
                if holder.counters is not None:
                    holder.counters.add("permits_expired")
            holder.renewed = now

    def answered(self) -> None:
        """The request goes on to run (or ran): every limit that admitted it and was
        not counted yet counts it ``allowed``. Each adapter calls it once the
        request's limits have all decided (its response starts, or ends); again, it
        counts nothing."""
        self._count(self.entries, ALLOWED)

    def refused_by(self, owner: object) -> list[Reservation | AsyncReservation]:
        """``owner`` (the last limit applied) refused the request: counts it
        ``refused`` there and ``given_back`` by the limits before it; returns their
        reservations, to cancel (the request did not run)."""
        self._count([e for e in self.entries if e.owner is owner], REFUSED)
        return self._others_counted(owner, GIVEN_BACK)

    def abandoned(self, owner: Any) -> list[Reservation | AsyncReservation]:
        """The client went away while ``owner`` (a limit) made the request wait:
        counts it ``abandoned`` there and by the limits before it; returns their
        reservations, to cancel."""
        owner.counters.add(ABANDONED)
        return self._others_counted(owner, ABANDONED)

    def _others_counted(self, owner: object, outcome: str) -> list[Reservation | AsyncReservation]:
        others = [e for e in self.entries if e.owner is not owner]
        self._count(others, outcome)
        return [e.reservation for e in others]

    @staticmethod
    def _count(entries: list[_Entry], outcome: str) -> None:
        for entry in entries:
            counters, entry.counters = entry.counters, None  # each entry once
            if counters is not None:
                counters.add(outcome)

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
        *,
        counters: LimitCounters | None = None,
    ) -> None:
        """Records ``owner``'s answer: ``applied`` is the member that decided,
        ``before`` the limit's other members (its concurrency policy's); its
        outcome is counted in ``counters`` (the limit's) once it is known."""
        names = {a.name for e in self.entries for a in e.members}
        for member in (*before, applied):
            if member.name in names:
                raise ConfigurationError(
                    f"two limits named {member.name!r} apply to one request; each limit on "
                    "a route needs its own name= (they are reported as one RateLimit "
                    "field with one member per name)"
                )
        self.entries.append(_Entry(owner, applied, reservation, headers, before, counters))

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


@dataclass
class _Holder:
    """What a request knows of a permit it holds: for its limit's counters."""

    counters: LimitCounters | None
    ttl: float
    renewed: float  # time.monotonic() when granted or last renewed (or asked to be)
    expired: bool = False  # counted expired already


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
