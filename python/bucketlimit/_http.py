"""What the Flask and FastAPI adapters share, with no web framework imported.

- a ``Decision`` as HTTP: ``Retry-After``, the ``RateLimit-Policy`` and
  ``RateLimit`` fields of draft-ietf-httpapi-ratelimit-headers-11, the 429 body;
- the client address behind trusted proxies (``X-Forwarded-For``);
- reservations: reserve the largest cost up front, give back the unused part;
- ``LimitSettings``: one limit's configuration, counters and shadow logging;
- ``RequestLimits``: the limits applied to one request, so that several limits
  on one route become one field with several members, never repeated fields.

Only ``bucketlimit.flask`` and ``bucketlimit.fastapi`` import this module.
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from bucketlimit._core import Decision

__all__ = [
    "RATELIMIT",
    "RATELIMIT_POLICY",
    "RETRY_AFTER",
    "AnyLimiter",
    "Applied",
    "AsyncLimiter",
    "AsyncReservation",
    "ConfigurationError",
    "KeyFunctionError",
    "LimitSettings",
    "Network",
    "RequestLimits",
    "Reservation",
    "SyncLimiter",
    "TrustedProxies",
    "forwarded_client",
    "is_async_limiter",
    "ratelimit_fields",
    "refusal_body",
    "refusal_headers",
    "reserve",
    "reserve_async",
    "retry_after_seconds",
    "window_seconds",
]

logger = logging.getLogger("bucketlimit")

RATELIMIT = "RateLimit"
RATELIMIT_POLICY = "RateLimit-Policy"
RETRY_AFTER = "Retry-After"

# RFC 9651 (structured fields): an Integer has at most 15 digits.
_SF_INT_MAX = 999_999_999_999_999


class SyncLimiter(Protocol):
    """What the adapters need from a limiter whose methods answer at once."""

    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float: ...
    def allow(self, key: str, cost: int = 1) -> Decision: ...
    def peek(self, key: str, cost: int = 1) -> Decision: ...
    def refund(self, key: str, cost: int) -> None: ...


class AsyncLimiter(Protocol):
    """The same, with coroutine methods (``AsyncRedisTokenBucketLimiter``)."""

    @property
    def capacity(self) -> int: ...
    @property
    def rate(self) -> float: ...
    async def allow(self, key: str, cost: int = 1) -> Decision: ...
    async def peek(self, key: str, cost: int = 1) -> Decision: ...
    async def refund(self, key: str, cost: int) -> None: ...


AnyLimiter = SyncLimiter | AsyncLimiter


def is_async_limiter(limiter: object) -> bool:
    """True when ``limiter.allow`` is a coroutine function (the asyncio Redis limiter)."""
    return inspect.iscoroutinefunction(getattr(limiter, "allow", None))


class ConfigurationError(RuntimeError):
    """The app configured a limit in a way that cannot work (raised while serving)."""


class KeyFunctionError(ConfigurationError):
    """A key function returned no key: that would put every such request in one bucket."""


# -- a Decision as HTTP ---------------------------------------------------------------------


def retry_after_seconds(decision: Decision) -> int | None:
    """``Retry-After`` for a refusal: whole seconds, rounded up, at least 1.

    ``None`` when the request can never pass (``retry_after`` is infinite: a rate-0
    quota, or a cost above the capacity). No value would be true then, and a huge
    one makes well-behaved clients sleep for ever, so the field is left out and the
    body says ``"retry_after": null``.
    """
    if math.isinf(decision.retry_after):
        return None
    return max(1, math.ceil(decision.retry_after))


def window_seconds(capacity: int, rate: float) -> int | None:
    """The ``w`` of a token bucket: seconds for an empty bucket to fill again.

    A token bucket is not a fixed window, so this is the honest reading of it:
    ``q`` (the capacity) per ``w`` seconds is the bucket's sustained rate, and a
    full bucket admits a burst of ``q`` at once. A client that keeps to ``q``
    per ``w`` is never refused. ``capacity / rate`` is rounded to the limiter's
    own microsecond resolution first, so float noise in the rate (100 per 60 s
    is 1.6666666666666667/s) cannot add a second, then up to whole seconds
    (rounding up keeps the advertised rate at or below the real one). ``None``
    (``w`` omitted) when the bucket never refills: a rate-0 quota has no window.
    """
    if rate <= 0:
        return None
    return max(1, math.ceil(round(capacity / rate, 6)))


def _reset_seconds(decision: Decision) -> int | None:
    """The ``t`` of the ``RateLimit`` field, or ``None`` to leave it out.

    Refused: the same value as ``Retry-After`` (the draft asks that Retry-After
    not point before the end of ``t``; equal values keep the two in step).
    Allowed: ``ceil(reset_after)``, the seconds until the bucket is full, i.e.
    until ``r`` is back to ``q``. Infinite (rate 0): no such time, ``t`` is omitted.
    """
    if not decision.allowed:
        return retry_after_seconds(decision)
    if math.isinf(decision.reset_after):
        return None
    return math.ceil(decision.reset_after)


def _sf_string(text: str) -> str:
    """``text`` as an RFC 9651 String: quoted, with ``"`` and ``\\`` escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _sf_int(value: int) -> int:
    return min(max(value, 0), _SF_INT_MAX)


@dataclass(frozen=True)
class Applied:
    """One limit's answer for one request, as the RateLimit fields report it."""

    name: str
    decision: Decision
    window: int | None

    def policy_item(self) -> str:
        item = f"{_sf_string(self.name)};q={_sf_int(self.decision.limit)}"
        return item if self.window is None else f"{item};w={_sf_int(self.window)}"

    def limit_item(self) -> str:
        item = f"{_sf_string(self.name)};r={_sf_int(self.decision.remaining)}"
        reset = _reset_seconds(self.decision)
        return item if reset is None else f"{item};t={_sf_int(reset)}"


def ratelimit_fields(applied: Sequence[Applied]) -> dict[str, str]:
    """``RateLimit-Policy`` and ``RateLimit``: one field each, one list member per limit.

    >>> d = Decision(True, 0.0, 7, 1.5, 10)
    >>> ratelimit_fields([Applied("per-ip", d, 5)])
    {'RateLimit-Policy': '"per-ip";q=10;w=5', 'RateLimit': '"per-ip";r=7;t=2'}
    """
    if not applied:
        return {}
    return {
        RATELIMIT_POLICY: ", ".join(a.policy_item() for a in applied),
        RATELIMIT: ", ".join(a.limit_item() for a in applied),
    }


def refusal_body(decision: Decision) -> dict[str, object]:
    """The JSON body of a 429: ``{"error": "rate limited", "retry_after": 2}``.

    ``retry_after`` is the ``Retry-After`` value, or ``null`` when the request can
    never pass.
    """
    return {"error": "rate limited", "retry_after": retry_after_seconds(decision)}


def refusal_headers(decision: Decision) -> dict[str, str]:
    seconds = retry_after_seconds(decision)
    return {} if seconds is None else {RETRY_AFTER: str(seconds)}


# -- the client address behind trusted proxies -------------------------------------------

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# A hop that is not an address is kept as it is (the proxy wrote it: "unknown",
# an obfuscated RFC 7239 identifier); cut so that it stays a valid limiter key.
_MAX_OPAQUE_HOP = 256


def _parse_address(text: str) -> Address | None:
    """An IP address from a peer or an X-Forwarded-For hop, or ``None``.

    Accepts ``1.2.3.4``, ``1.2.3.4:5678``, ``::1``, ``[::1]`` and ``[::1]:5678``
    (some proxies write the port). IPv4-mapped IPv6 becomes the IPv4 address, so
    ``::ffff:10.0.0.1`` matches ``10.0.0.0/8``.
    """
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class TrustedProxies:
    """The proxy networks whose ``X-Forwarded-For`` entries the app believes.

    ``TrustedProxies(["10.0.0.0/8", "fd00::/8", "192.0.2.7"])``. A bare address is
    a one-address network; host bits set (``"10.0.0.1/8"``) is a ``ValueError``,
    as a typo there would silently trust the wrong machines.
    """

    __slots__ = ("networks",)

    def __init__(self, networks: Iterable[str | Network] = ()) -> None:
        if isinstance(networks, str):
            raise TypeError(
                f"trusted_proxies must be a list of networks, not one string: [{networks!r}]"
            )
        self.networks: tuple[Network, ...] = tuple(
            n
            if isinstance(n, (ipaddress.IPv4Network, ipaddress.IPv6Network))
            else ipaddress.ip_network(n)
            for n in networks
        )

    def __contains__(self, address: Address | None) -> bool:
        if address is None:
            return False
        return any(address.version == n.version and address in n for n in self.networks)

    def __repr__(self) -> str:
        return f"TrustedProxies({[str(n) for n in self.networks]!r})"


def forwarded_client(
    peer: str | None, forwarded_for: Iterable[str], trusted: TrustedProxies
) -> str | None:
    """The client's address: the peer, or the right-most untrusted X-Forwarded-For hop.

    ``forwarded_for`` holds the values of every ``X-Forwarded-For`` line in order.
    If the peer is not a trusted proxy its header is ignored entirely: anyone can
    write one. Otherwise the hops are read from the right (each trusted proxy
    appends the address it saw) and the first one that is not a trusted proxy is
    the client. If every hop is trusted, the left-most one is the best we know.
    Returns ``None`` only when there is no peer at all.
    """
    if peer is None:
        return None
    peer_address = _parse_address(peer)
    if peer_address is None or peer_address not in trusted:
        return str(peer_address) if peer_address is not None else peer
    hops = [hop.strip() for value in forwarded_for for hop in value.split(",")]
    hops = [hop for hop in hops if hop]
    if not hops:
        return str(peer_address)
    for hop in reversed(hops):
        address = _parse_address(hop)
        if address is None:
            return hop[:_MAX_OPAQUE_HOP]
        if address not in trusted:
            return str(address)
    leftmost = _parse_address(hops[0])
    return str(leftmost)


# -- reservations -------------------------------------------------------------------------


def _check_used(used: int) -> int:
    if isinstance(used, bool) or not isinstance(used, int):
        raise TypeError(f"used must be an int, got {type(used).__name__}")
    if used < 0:
        raise ValueError(f"used must be >= 0, got {used}")
    return used


L = TypeVar("L")


class _ReservationBase(Generic[L]):
    __slots__ = ("_limiter", "_lock", "_settled", "charged", "decision", "key")

    def __init__(self, limiter: L | None, key: str, charged: int, decision: Decision | None):
        self._limiter = limiter
        self.key = key
        #: Tokens this reservation holds (0 when refused, exempt, or settled).
        self.charged = charged
        #: The limiter's answer; ``None`` when the request was exempt.
        self.decision = decision
        self._settled = False
        self._lock = threading.Lock()

    @property
    def allowed(self) -> bool:
        """True when the request may go on (exempt requests included)."""
        return self.decision is None or self.decision.allowed

    def _take_refund(self, used: int) -> int:
        """How many tokens to give back now; marks the reservation settled."""
        _check_used(used)
        with self._lock:
            if self._settled:
                return 0
            self._settled = True
            refund = max(0, self.charged - used)
            self.charged = min(self.charged, used)
            return refund

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key={self.key!r}, charged={self.charged}, "
            f"settled={self._settled}, decision={self.decision!r})"
        )


class Reservation(_ReservationBase[SyncLimiter]):
    """Tokens taken before a handler runs; ``settle`` gives back what it did not use.

    Made by :func:`reserve` and by the adapters. ``settle(used)`` refunds
    ``charged - used`` once; later calls do nothing and return 0, so it is safe
    in a ``finally`` or a callback that may run twice. It never charges more than
    was reserved: ``used`` above the reservation refunds nothing. A refused or
    exempt reservation holds nothing to give back.
    """

    __slots__ = ()

    def settle(self, used: int) -> int:
        """Keeps ``used`` tokens, refunds the rest; returns how many were refunded."""
        refund = self._take_refund(used)
        if refund and self._limiter is not None:
            self._limiter.refund(self.key, refund)
        return refund

    def cancel(self) -> int:
        """Refunds everything (the request did not run); same as ``settle(0)``."""
        return self.settle(0)


class AsyncReservation(_ReservationBase[AnyLimiter]):
    """:class:`Reservation` for async code: ``await settle(used)``.

    Works with both kinds of limiter: a coroutine ``refund`` is awaited, the
    in-process one is called directly.
    """

    __slots__ = ()

    async def settle(self, used: int) -> int:
        """Keeps ``used`` tokens, refunds the rest; returns how many were refunded."""
        refund = self._take_refund(used)
        if refund and self._limiter is not None:
            result = self._limiter.refund(self.key, refund)
            if inspect.isawaitable(result):
                await result
        return refund

    async def cancel(self) -> int:
        """Refunds everything (the request did not run); same as ``settle(0)``."""
        return await self.settle(0)


def reserve(limiter: SyncLimiter, key: str, max_cost: int) -> Reservation:
    """Spends ``max_cost`` now, if the bucket holds it; settle the real cost later.

    >>> from bucketlimit import TokenBucketLimiter
    >>> limiter = TokenBucketLimiter(1000, 0)
    >>> r = reserve(limiter, "user-1", 500)   # the request may generate 500 tokens
    >>> r.allowed, r.decision.remaining
    (True, 500)
    >>> r.settle(120)                         # it generated 120: 380 come back
    380
    >>> limiter.allow("user-1", 880).remaining   # 1000 - 120 were left
    0
    """
    decision = limiter.allow(key, max_cost)
    return Reservation(limiter, key, max_cost if decision.allowed else 0, decision)


async def reserve_async(limiter: AnyLimiter, key: str, max_cost: int) -> AsyncReservation:
    """:func:`reserve` for async code and either kind of limiter."""
    answer = limiter.allow(key, max_cost)
    decision: Decision = await answer if inspect.isawaitable(answer) else answer
    return AsyncReservation(limiter, key, max_cost if decision.allowed else 0, decision)


# -- one limit's settings, and the limits of one request ---------------------------------

R = TypeVar("R")  # the framework's request type

KeyFunc = Callable[[R], Any]
CostSpec = int | Callable[[R], Any]


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    # An RFC 9651 String holds printable ASCII only.
    if not name or not all(" " <= ch <= "~" for ch in name):
        raise ValueError(f"name must be non-empty printable ASCII, got {name!r}")
    return name


class LimitSettings(Generic[R]):
    """One limit: limiter, key function, cost, policy name, shadow mode, exemption.

    The adapters subclass it; everything here is framework-free.
    """

    def __init__(
        self,
        limiter: AnyLimiter,
        *,
        key: KeyFunc[R],
        cost: CostSpec[R] = 1,
        name: str = "default",
        shadow: bool = False,
        exempt: Callable[[R], Any] | None = None,
    ) -> None:
        for method in ("allow", "peek", "refund"):
            if not callable(getattr(limiter, method, None)):
                raise TypeError(f"limiter has no {method}() method: {limiter!r}")
        if not callable(key):
            raise TypeError(f"key must be a function of the request, got {key!r}")
        if not callable(cost):
            if isinstance(cost, bool) or not isinstance(cost, int):
                raise TypeError(f"cost must be an int or a function of the request, got {cost!r}")
            if cost < 1:
                raise ValueError(f"cost must be >= 1, got {cost}")
        if exempt is not None and not callable(exempt):
            raise TypeError(f"exempt must be a predicate of the request, got {exempt!r}")
        self.limiter = limiter
        self.key = key
        self.cost = cost
        self.name = _check_name(name)
        self.shadow = bool(shadow)
        self.exempt = exempt
        self.window = window_seconds(limiter.capacity, limiter.rate)
        self._is_async = is_async_limiter(limiter)
        self._lock = threading.Lock()
        self._shadow_refusals = 0

    @property
    def shadow_refusals(self) -> int:
        """Requests a shadow limit would have refused (always 0 when not shadow)."""
        return self._shadow_refusals

    def checked_key(self, key: object, where: str) -> str:
        """The key function's answer, or a :class:`KeyFunctionError` if there is none."""
        if isinstance(key, str) and key:
            return key
        raise KeyFunctionError(
            f"the key function {getattr(self.key, '__qualname__', self.key)!r} of limit "
            f"{self.name!r} returned {key!r} for {where}; it must return a non-empty str "
            "(a missing key would put all such requests in one shared bucket)"
        )

    def can_never_pass(self, cost: int) -> bool:
        """A cost above the capacity: refused with no retry time, not a server error.

        The cost often comes from the client (the tokens it asks for), so a request
        larger than the whole bucket is the client's problem: a 429 that says it will
        never pass, rather than the ``ValueError`` the limiter raises.
        """
        return isinstance(cost, int) and not isinstance(cost, bool) and cost > self.limiter.capacity

    @staticmethod
    def never(full: Decision) -> Decision:
        """A refusal for a cost above the capacity, built on the bucket's real state.

        ``full`` is ``peek(key, capacity)``: refused unless the bucket is full, and a
        refusal reports the balance and time to full as they are (nothing spent).
        """
        if full.allowed:
            return Decision(False, math.inf, full.limit, 0.0, full.limit)
        return Decision(False, math.inf, full.remaining, full.reset_after, full.limit)

    def applied(self, decision: Decision) -> Applied:
        return Applied(self.name, decision, self.window)

    def refuses(self, decision: Decision, key: str, cost: int, where: str) -> bool:
        """Whether to answer 429: counts and logs a shadow limit's would-be refusal."""
        if decision.allowed:
            return False
        if not self.shadow:
            return True
        with self._lock:
            self._shadow_refusals += 1
        logger.info(
            "shadow limit %r would refuse %s (key %r, cost %d, retry after %s s)",
            self.name,
            where,
            key,
            cost,
            retry_after_seconds(decision),
        )
        return False


@dataclass
class _Entry:
    owner: object
    applied: Applied
    reservation: Reservation | AsyncReservation


class RequestLimits:
    """The limits applied to one request, in order; the one writer of its fields."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[_Entry] = []

    def find(self, owner: object) -> Reservation | AsyncReservation | None:
        """The reservation ``owner`` already made for this request (a limit applies once)."""
        for entry in self.entries:
            if entry.owner is owner:
                return entry.reservation
        return None

    def add(
        self, owner: object, applied: Applied, reservation: Reservation | AsyncReservation
    ) -> None:
        for entry in self.entries:
            if entry.applied.name == applied.name:
                raise ConfigurationError(
                    f"two limits named {applied.name!r} apply to one request; each limit on "
                    "a route needs its own name= (they are reported as one RateLimit "
                    "field with one member per name)"
                )
        self.entries.append(_Entry(owner, applied, reservation))

    def others(self, owner: object) -> list[Reservation | AsyncReservation]:
        """Every reservation but ``owner``'s: refunded when ``owner`` refuses."""
        return [e.reservation for e in self.entries if e.owner is not owner]

    def fields(self) -> dict[str, str]:
        return ratelimit_fields([e.applied for e in self.entries])

    def reservation(self, name: str | None) -> Reservation | AsyncReservation:
        """The reservation of the limit called ``name`` (``None``: the only one)."""
        if name is not None:
            for entry in self.entries:
                if entry.applied.name == name:
                    return entry.reservation
            raise LookupError(f"no limit named {name!r} applied to this request")
        if len(self.entries) == 1:
            return self.entries[0].reservation
        if not self.entries:
            raise LookupError("no limit applied to this request")
        names = [e.applied.name for e in self.entries]
        raise LookupError(f"several limits apply to this request; name one of {names!r}")
