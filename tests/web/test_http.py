"""The framework-free half of the web adapters: fields, keys, reservations, settings."""

from __future__ import annotations

import ipaddress
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bucketlimit import Decision, TokenBucketLimiter
from bucketlimit._web.addresses import TrustedProxies, forwarded_client
from bucketlimit._web.errors import ConfigurationError, KeyFunctionError
from bucketlimit._web.fields import (
    Applied,
    ratelimit_fields,
    refusal_body,
    refusal_headers,
    retry_after_seconds,
    window_seconds,
)
from bucketlimit._web.limits import LimitSettings
from bucketlimit._web.request_limits import RequestLimits
from bucketlimit._web.reservations import AsyncReservation, Reservation, reserve, reserve_async
from bucketlimit.testing import ManualClock
from tests.web.problem import assert_problem

# The subset of RFC 9651 the two fields use: a list of String items with Integer
# parameters, members separated by "," and optional spaces.
SF_ITEM = r'"(?:[ !#-\[\]-~]|\\["\\])*"(?:;[a-z][a-z0-9_.*-]*=\d{1,15})*'
SF_LIST = re.compile(rf"{SF_ITEM}(?:\s*,\s*{SF_ITEM})*")


def tokens(limiter: TokenBucketLimiter, key: str) -> int:
    """Whole tokens in the bucket (peek answers for a cost of 1, spent or not)."""
    decision = limiter.peek(key)
    return decision.remaining + decision.allowed


class AsyncWrapper:
    """An in-process limiter behind coroutine methods: the async code path, no Redis."""

    def __init__(self, inner: TokenBucketLimiter) -> None:
        self.inner = inner

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def rate(self) -> float:
        return self.inner.rate

    async def allow(self, key: str, cost: int = 1) -> Decision:
        return self.inner.allow(key, cost)

    async def peek(self, key: str, cost: int = 1) -> Decision:
        return self.inner.peek(key, cost)

    async def refund(self, key: str, cost: int) -> None:
        self.inner.refund(key, cost)


# -- Retry-After and the RateLimit fields ---------------------------------------------------


@pytest.mark.parametrize(
    ("retry_after", "seconds"),
    [(1e-6, 1), (0.5, 1), (1.0, 1), (1.000001, 2), (2.5, 3), (59.999999, 60), (math.inf, None)],
)
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(
    retry_after: float, seconds: int | None
) -> None:
    assert retry_after_seconds(Decision(False, retry_after, 0, 1.0, 1)) == seconds


@given(st.integers(min_value=1, max_value=10**12))
def test_retry_after_is_the_ceiling_of_the_microsecond_wait(micros: int) -> None:
    retry_after = micros / 1e6  # how the limiter reports it
    assert retry_after_seconds(Decision(False, retry_after, 0, retry_after, 5)) == max(
        1, math.ceil(retry_after)
    )


def test_a_refusal_that_can_never_pass_has_no_retry_after_and_says_null() -> None:
    never = Decision(False, math.inf, 0, math.inf, 3)
    assert refusal_headers(never) == {"Content-Type": "application/problem+json"}
    assert_problem(refusal_body(Applied("q", never, None)), 403, "q", None)
    too_big = Decision(False, math.inf, 3, 0.0, 3)
    assert_problem(refusal_body(Applied("q", too_big, 3, 1.0, cost=4)), 413, "q", None)
    later = Decision(False, 1.2, 0, 4.0, 3)
    assert refusal_headers(later) == {
        "Content-Type": "application/problem+json",
        "Retry-After": "2",
    }
    assert_problem(refusal_body(Applied("q", later, 4, 0.75)), 429, "q", 2)


@pytest.mark.parametrize(
    ("capacity", "rate", "window"),
    [
        (10, 2.0, 5),
        (10, 100 / 60, 6),  # 100 a minute: float noise must not make it 7
        (2, 2 / 3, 3),  # 2 every 3 s: 3.0000000000000004 must not make it 4
        (3, 0.7, 5),  # 4.29 s rounds up: the advertised rate stays at or below the real one
        (10, 100.0, 1),  # under a second: the draft's w is at least 1
        (1, 1e-4, 10_000),
        (5, 0.0, None),  # never refills: no window
    ],
)
def test_window_is_the_time_to_refill_an_empty_bucket(
    capacity: int, rate: float, window: int | None
) -> None:
    assert window_seconds(capacity, rate) == window


def test_fields_for_an_allowed_request() -> None:
    # 7 of 10 tokens and 0.5 of the 8th, 2 a second: full in 1.5 s, the 8th in 0.25 s.
    decision = Decision(True, 0.0, 7, 1.5, 10)
    assert ratelimit_fields([Applied("per-ip", decision, 5, 2.0)]) == {
        "RateLimit-Policy": '"per-ip";q=10;w=5',
        "RateLimit": '"per-ip";r=7;t=1',
    }
    # 1 token a minute, 3.5 of 10 left, full in 6.5 minutes: the 4th comes in 30 s.
    slow = Decision(True, 0.0, 3, 390.0, 10)
    assert ratelimit_fields([Applied("slow", slow, 600, 1 / 60)])["RateLimit"] == (
        '"slow";r=3;t=30'
    )
    full = Decision(True, 0.0, 10, 0.0, 10)  # full: a spent token is back in 1 / rate
    assert ratelimit_fields([Applied("slow", full, 600, 1 / 60)])["RateLimit"] == (
        '"slow";r=10;t=60'
    )


def test_a_refusal_reports_t_equal_to_retry_after() -> None:
    decision = Decision(False, 0.25, 0, 9.75, 10)
    fields = ratelimit_fields([Applied("default", decision, 10, 1.0)])
    assert fields["RateLimit"] == '"default";r=0;t=1'
    assert refusal_headers(decision)["Retry-After"] == "1"


def test_a_refusal_for_a_larger_cost_reports_the_tokens_still_there() -> None:
    # 3 tokens left, the request wanted 5: r says 3 smaller requests would pass.
    decision = Decision(False, 2.0, 3, 7.0, 10)
    # t is when a 4th token comes (1 s), before the Retry-After of the 5 asked for.
    assert ratelimit_fields([Applied("x", decision, 10, 1.0)])["RateLimit"] == '"x";r=3;t=1'


def test_a_quota_that_never_refills_has_neither_w_nor_t() -> None:
    allowed = Decision(True, 0.0, 4, math.inf, 5)
    refused = Decision(False, math.inf, 0, math.inf, 5)
    assert ratelimit_fields([Applied("quota", allowed, None)]) == {
        "RateLimit-Policy": '"quota";q=5',
        "RateLimit": '"quota";r=4',
    }
    assert ratelimit_fields([Applied("quota", refused, None)])["RateLimit"] == '"quota";r=0'


def test_several_limits_are_one_field_with_one_member_each() -> None:
    fields = ratelimit_fields(
        [
            Applied("burst", Decision(True, 0.0, 9, 0.5, 10), 5, 2.0),
            Applied("daily", Decision(True, 0.0, 999, 86.4, 1000), 86400, 1000 / 86400),
        ]
    )
    assert fields == {
        "RateLimit-Policy": '"burst";q=10;w=5, "daily";q=1000;w=86400',
        "RateLimit": '"burst";r=9;t=1, "daily";r=999;t=87',
    }
    assert ratelimit_fields([]) == {}


def test_names_are_escaped_as_structured_field_strings() -> None:
    fields = ratelimit_fields([Applied('a"b\\c', Decision(True, 0.0, 1, 1.0, 2), 2)])
    assert fields["RateLimit-Policy"] == '"a\\"b\\\\c";q=2;w=2'
    assert SF_LIST.fullmatch(fields["RateLimit-Policy"])


@given(
    remaining=st.integers(min_value=0, max_value=10**18),
    limit=st.integers(min_value=1, max_value=10**18),
    reset=st.floats(min_value=0, max_value=1e12),
    allowed=st.booleans(),
    window=st.one_of(st.none(), st.integers(min_value=1, max_value=10**18)),
    name=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1),
)
def test_fields_are_always_valid_structured_field_lists(
    remaining: int, limit: int, reset: float, allowed: bool, window: int | None, name: str
) -> None:
    decision = Decision(allowed, 0.0 if allowed else reset, remaining, reset, limit)
    fields = ratelimit_fields([Applied(name, decision, window), Applied("b", decision, window)])
    for value in fields.values():
        assert SF_LIST.fullmatch(value), value  # integers clamp to the 15 digits SF allows


# -- the client address --------------------------------------------------------------------

PROXIES = TrustedProxies(["10.0.0.0/8", "fd00::/8", "192.0.2.7"])


@pytest.mark.parametrize(
    ("peer", "xff", "client"),
    [
        # The peer is not a proxy we trust: whatever it writes is ignored.
        ("203.0.113.9", ["1.2.3.4"], "203.0.113.9"),
        ("203.0.113.9", [], "203.0.113.9"),
        # A trusted proxy: the right-most hop it did not write itself.
        ("10.0.0.1", ["1.2.3.4"], "1.2.3.4"),
        ("10.0.0.1", ["6.6.6.6, 1.2.3.4"], "1.2.3.4"),  # the left one is the client's forgery
        ("10.0.0.1", ["6.6.6.6, 1.2.3.4, 10.0.0.2"], "1.2.3.4"),  # two proxies deep
        ("10.0.0.1", ["6.6.6.6", "1.2.3.4, 10.0.0.2"], "1.2.3.4"),  # several header lines
        ("192.0.2.7", ["1.2.3.4"], "1.2.3.4"),  # a single trusted address
        ("10.0.0.1", ["10.0.0.3, 10.0.0.2"], "10.0.0.3"),  # every hop trusted: the left-most
        ("10.0.0.1", [], "10.0.0.1"),  # a trusted proxy that forwarded nothing
        ("10.0.0.1", [" , "], "10.0.0.1"),
        ("10.0.0.1", ["1.2.3.4:5678"], "1.2.3.4"),  # ports some proxies add
        ("10.0.0.1", ["[2001:db8::1]:443"], "2001:db8::1"),
        ("10.0.0.1", ["unknown"], "unknown"),  # a proxy's opaque token, kept
        ("fd00::5", ["2001:db8::1"], "2001:db8::1"),
        ("::ffff:10.0.0.1", ["1.2.3.4"], "1.2.3.4"),  # IPv4-mapped peer
        ("10.0.0.1", ["::ffff:1.2.3.4"], "1.2.3.4"),
        ("2001:DB8::0:1", [], "2001:db8::1"),  # one spelling per address
        ("testclient", ["1.2.3.4"], "testclient"),  # not an address: untrusted
        (None, ["1.2.3.4"], None),
    ],
)
def test_forwarded_client(peer: str | None, xff: list[str], client: str | None) -> None:
    assert forwarded_client(peer, xff, PROXIES) == client


def test_without_trusted_proxies_the_header_is_never_read() -> None:
    assert forwarded_client("10.0.0.1", ["1.2.3.4"], TrustedProxies()) == "10.0.0.1"


@given(
    forged=st.lists(st.text(max_size=40), max_size=5),
    client=st.ip_addresses(v=4).filter(lambda a: a not in ipaddress.ip_network("10.0.0.0/8")),
)
def test_a_client_cannot_choose_its_key_behind_a_trusted_proxy(
    forged: list[str], client: ipaddress.IPv4Address
) -> None:
    # Whatever the client writes, the trusted proxy appends the address it saw.
    header = ", ".join([*forged, str(client)])
    assert forwarded_client("10.1.2.3", [header], PROXIES) == str(client)


@given(forged=st.lists(st.text(max_size=40), max_size=5))
def test_a_client_cannot_choose_its_key_without_a_proxy(forged: list[str]) -> None:
    assert forwarded_client("198.51.100.4", forged, PROXIES) == "198.51.100.4"


def test_an_opaque_hop_is_cut_to_a_valid_key_length() -> None:
    assert forwarded_client("10.0.0.1", ["x" * 10_000], PROXIES) == "x" * 256


def test_trusted_proxies_reject_a_bare_string_and_host_bits() -> None:
    with pytest.raises(TypeError, match="list of networks"):
        TrustedProxies("10.0.0.0/8")
    with pytest.raises(ValueError, match="host bits"):
        TrustedProxies(["10.0.0.1/8"])
    assert TrustedProxies([ipaddress.ip_network("10.0.0.0/8")]).networks == (
        ipaddress.ip_network("10.0.0.0/8"),
    )


# -- reservations ---------------------------------------------------------------------------


def test_reserve_then_settle_refunds_the_unused_part_once() -> None:
    limiter = TokenBucketLimiter(1000, 0)
    held = reserve(limiter, "u", 500)
    assert held.allowed
    assert held.charged == 500
    assert tokens(limiter, "u") == 500
    assert held.settle(120) == 380
    assert tokens(limiter, "u") == 880
    assert held.charged == 120
    assert held.settle(0) == 0  # settled already: nothing more comes back
    assert tokens(limiter, "u") == 880


def test_settle_charges_the_overage() -> None:
    """The use happened, so settle charges what ran over the estimate."""
    limiter = TokenBucketLimiter(100, 0)
    held = reserve(limiter, "u", 10)
    assert held.settle(25) == 0
    assert held.charged == 25
    assert tokens(limiter, "u") == 75
    assert held.settle(90) == 0  # settled already: nothing more is charged
    assert tokens(limiter, "u") == 75


def test_settle_overage_puts_the_bucket_in_debt_and_later_callers_wait() -> None:
    clock = ManualClock()
    limiter = TokenBucketLimiter(100, 10, clock=clock)
    held = reserve(limiter, "u", 100)
    held.settle(150)
    assert not limiter.allow("u")
    assert limiter.reserve("u", 10).delay == 6.0


def test_cancel_refunds_everything() -> None:
    limiter = TokenBucketLimiter(100, 0)
    held = reserve(limiter, "u", 10)
    assert held.cancel() == 10
    assert tokens(limiter, "u") == 100


def test_a_refused_reservation_holds_nothing() -> None:
    limiter = TokenBucketLimiter(10, 0)
    limiter.allow("u", 8)
    held = reserve(limiter, "u", 5)
    assert not held.allowed
    assert held.charged == 0
    assert held.settle(0) == 0
    assert tokens(limiter, "u") == 2


@pytest.mark.parametrize(("used", "error"), [(-1, ValueError), (True, TypeError), (1.5, TypeError)])
def test_settle_checks_used(used: object, error: type[Exception]) -> None:
    limiter = TokenBucketLimiter(10, 0)
    held = reserve(limiter, "u", 5)
    with pytest.raises(error):
        held.settle(used)  # type: ignore[arg-type]
    assert held.settle(2) == 3  # the bad call changed nothing


@pytest.mark.anyio
@pytest.mark.parametrize("wrap", [False, True], ids=["sync-limiter", "async-limiter"])
async def test_reserve_async_with_either_kind_of_limiter(wrap: bool) -> None:
    inner = TokenBucketLimiter(100, 0)
    limiter = AsyncWrapper(inner) if wrap else inner
    held = await reserve_async(limiter, "u", 40)
    assert isinstance(held, AsyncReservation)
    assert held.allowed
    assert tokens(inner, "u") == 60
    assert await held.settle(15) == 25
    assert await held.settle(0) == 0
    assert tokens(inner, "u") == 85
    refused = await reserve_async(limiter, "u", 90)
    assert not refused.allowed
    assert await refused.cancel() == 0


# -- settings and the limits of one request --------------------------------------------------


def key_of(request: object) -> str:
    return "k"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cost": 0}, ValueError, "cost must be >= 1"),
        ({"cost": True}, TypeError, "cost must be an int"),
        ({"cost": "1"}, TypeError, "cost must be an int"),
        ({"key": "user"}, TypeError, "key must be a function"),
        ({"name": ""}, ValueError, "printable ASCII"),
        ({"name": "caf\u00e9"}, ValueError, "printable ASCII"),
        ({"name": "a\nb"}, ValueError, "printable ASCII"),
        ({"name": 3}, TypeError, "name must be a str"),
        ({"exempt": True}, TypeError, "exempt must be a predicate"),
    ],
)
def test_settings_are_checked_at_construction(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    settings: dict[str, object] = {"key": key_of, **kwargs}
    with pytest.raises(error, match=match):
        LimitSettings(TokenBucketLimiter(5, 1), **settings)  # type: ignore[arg-type]


def test_a_limiter_without_the_methods_is_refused() -> None:
    with pytest.raises(TypeError, match="no allow"):
        LimitSettings(object(), key=key_of)  # type: ignore[arg-type]


def test_a_missing_key_is_a_configuration_error_naming_the_function() -> None:
    settings: LimitSettings[object] = LimitSettings(
        TokenBucketLimiter(5, 1), key=key_of, name="per-user"
    )
    assert settings.checked_key("u1", "GET /") == "u1"
    for missing in (None, "", 42):
        with pytest.raises(KeyFunctionError, match=r"key_of.*'per-user'.*GET /x"):
            settings.checked_key(missing, "GET /x")
    assert issubclass(KeyFunctionError, ConfigurationError)
    assert issubclass(ConfigurationError, RuntimeError)


def test_the_window_comes_from_the_limiter() -> None:
    assert LimitSettings(TokenBucketLimiter(10, 100, per=60), key=key_of).window == 6
    assert LimitSettings(TokenBucketLimiter(10, 0), key=key_of).window is None


def test_request_limits_refuse_two_limits_with_one_name() -> None:
    limiter = TokenBucketLimiter(5, 1, clock=ManualClock())
    limits = RequestLimits()
    first, second = object(), object()
    held = reserve(limiter, "k", 1)
    assert held.decision is not None
    limits.add(first, Applied("default", held.decision, 5), held)
    assert limits.find(first) is held
    assert limits.find(second) is None
    with pytest.raises(ConfigurationError, match="two limits named 'default'"):
        limits.add(second, Applied("default", held.decision, 5), held)
    assert limits.reservation(None) is held
    assert limits.reservation("default") is held
    with pytest.raises(LookupError, match="no limit named 'other'"):
        limits.reservation("other")
    limits.add(second, Applied("other", held.decision, 5), held)
    with pytest.raises(LookupError, match="several limits"):
        limits.reservation(None)
    with pytest.raises(LookupError, match="no limit applied"):
        RequestLimits().reservation(None)


def test_reservation_repr_is_readable() -> None:
    held = Reservation(None, "k", 0, None)
    assert repr(held) == "Reservation(key='k', charged=0, settled=False, decision=None)"
    assert held.allowed  # an exempt request goes on
