"""Every field of every response against draft-ietf-httpapi-ratelimit-headers-11:
its grammar (read with a structured-field parser, tests/web/sf.py) and its meaning
(a client that obeys r within t, and Retry-After, is never refused), on a fake clock."""

from __future__ import annotations

import base64
import math

import pytest
from flask import Flask
from hypothesis import given, settings
from hypothesis import strategies as st
from werkzeug.test import TestResponse

from bucketlimit import TokenBucketLimiter
from bucketlimit.flask import Limit, RateLimit
from bucketlimit.testing import ManualClock
from tests.web import sf
from tests.web.problem import assert_problem

PEER = "192.0.2.1"


def app_with(*limits: Limit) -> Flask:
    app = Flask(__name__)
    for limit in limits:
        RateLimit(limit, app)
    app.add_url_rule("/", "hello", lambda: "hi")
    return app


def get(app: Flask, cost: int = 1, peer: str = PEER) -> TestResponse:
    return app.test_client().get(f"/?cost={cost}", environ_base={"REMOTE_ADDR": peer})


def check_response(answer: TestResponse, limiters: dict[str, TokenBucketLimiter]) -> None:
    """The grammar and the plain meaning of every field of one response."""
    policy_lines = answer.headers.getlist("RateLimit-Policy")
    limit_lines = answer.headers.getlist("RateLimit")
    assert len(policy_lines) == len(limit_lines) == 1  # one field each, never repeated
    policies = sf.ratelimit_policy(policy_lines[0])
    limits = sf.ratelimit(limit_lines[0])
    assert list(policies) == list(limits) == list(limiters)  # every limit named in both
    for name, limiter in limiters.items():
        assert policies[name].params["q"] == limiter.capacity
        if limiter.rate > 0:
            assert policies[name].params["w"] == max(
                1, math.ceil(round(limiter.capacity / limiter.rate, 6))
            )
        else:
            assert "w" not in policies[name].params
            assert "t" not in limits[name].params
        assert limits[name].params["r"] <= limiter.capacity  # type: ignore[operator]
    if answer.status_code == 200:
        assert "Retry-After" not in answer.headers
        return
    assert answer.status_code in (429, 403, 413)
    body = answer.get_json()
    assert answer.mimetype == "application/problem+json"
    refusing = body["violated-policies"][0]
    if answer.status_code == 429:
        retry = answer.headers["Retry-After"]
        assert retry.isdigit()
        assert int(retry) >= 1
        # "SHOULD NOT reference a point in time earlier than the end of the effective window"
        t = limits[refusing].params.get("t")
        assert isinstance(t, int)
        assert int(retry) >= t
        assert_problem(body, 429, refusing, int(retry))
    else:
        assert "Retry-After" not in answer.headers
        assert_problem(body, answer.status_code, refusing, None)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 20),
    rate=st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, 50.0, 1 / 60]),
    steps=st.lists(
        st.tuples(st.floats(0, 5, allow_nan=False), st.integers(1, 25)), min_size=1, max_size=30
    ),
)
def test_every_field_of_every_response_follows_the_grammar(
    capacity: int, rate: float, steps: list[tuple[float, int]]
) -> None:
    clock = ManualClock()
    burst = TokenBucketLimiter(capacity, rate, clock)
    daily = TokenBucketLimiter(1000, 1000, clock, per=86400)
    from flask import request

    app = app_with(
        Limit(daily, name="daily"),
        Limit(burst, name="burst", cost=lambda r: int(request.args["cost"])),
    )
    for advance, cost in steps:
        clock.advance(advance)
        check_response(get(app, cost), {"daily": daily, "burst": burst})


def limit_params(answer: TestResponse, name: str = "default") -> dict[str, object]:
    return dict(sf.ratelimit(answer.headers["RateLimit"])[name].params)


@settings(max_examples=80, deadline=None)
@given(
    capacity=st.integers(1, 10),
    rate=st.sampled_from([0.1, 0.3, 1.0, 2.0, 7.0, 1 / 60]),
    wants=st.lists(st.floats(0, 3, allow_nan=False), min_size=1, max_size=60),
)
def test_a_client_that_obeys_r_within_t_is_never_refused(
    capacity: int, rate: float, wants: list[float]
) -> None:
    """The client wants to send after each pause in ``wants``; it sends only while
    the last response's ``r`` allows, or once that response's ``t`` has passed."""
    clock = ManualClock()
    app = app_with(Limit(TokenBucketLimiter(capacity, rate, clock)))
    budget, until = 1, 0.0  # nothing known yet: one request to learn the state
    for pause in wants:
        clock.advance(pause)
        if budget < 1 and clock.now < until:
            clock.set(until)  # obeying: wait out the effective window
        answer = get(app)
        assert answer.status_code == 200, (clock.now, answer.headers)
        params = limit_params(answer)
        budget = int(params["r"])  # type: ignore[call-overload]
        until = clock.now + int(params["t"])  # type: ignore[call-overload]


@settings(max_examples=80, deadline=None)
@given(
    capacity=st.integers(1, 10),
    rate=st.sampled_from([0.1, 0.3, 1.0, 2.0, 7.0, 1 / 60]),
    spent=st.integers(0, 10),
    pause=st.floats(0, 30, allow_nan=False),
)
def test_t_is_the_effective_window_to_the_second(
    capacity: int, rate: float, spent: int, pause: float
) -> None:
    """Within t - 1 seconds a greedy client gets exactly r more; by t it gets r + 1."""
    clock = ManualClock()
    limiter = TokenBucketLimiter(capacity, rate, clock)
    app = app_with(Limit(limiter))
    for _ in range(min(spent, capacity)):
        limiter.allow(PEER)
    clock.advance(pause)
    answer = get(app)
    if answer.status_code != 200:
        return  # a refusal's t is checked against Retry-After above
    params = limit_params(answer)
    r, t = int(params["r"]), int(params["t"])  # type: ignore[call-overload]
    assert t >= 1
    start = clock.now
    used = 0
    while limiter.allow(PEER):
        used += 1
    assert used == r  # r is all there is now
    # Nothing new up to t - 1 ... (less 1 µs: reset_after is rounded up to the
    # microsecond, so t may be a second long when the next token comes within 1 µs
    # of a whole second; see effective_window)
    clock.set(max(start, start + t - 1 - 1e-6))
    assert not limiter.peek(PEER).allowed
    clock.set(start + t)
    assert limiter.peek(PEER).allowed  # the next token has come by t


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(2, 20),
    rate=st.sampled_from([0.1, 0.5, 1.0, 3.0]),
    cost=st.integers(1, 20),
    pause=st.floats(0, 10, allow_nan=False),
)
def test_a_client_that_waits_retry_after_is_admitted(
    capacity: int, rate: float, cost: int, pause: float
) -> None:
    from flask import request

    clock = ManualClock()
    app = app_with(
        Limit(TokenBucketLimiter(capacity, rate, clock), cost=lambda r: int(request.args["cost"]))
    )
    get(app, capacity)  # empty the bucket
    clock.advance(pause)
    answer = get(app, cost)
    if cost > capacity:
        assert answer.status_code == 413  # never: a client must not retry
        return
    if answer.status_code == 429:
        clock.advance(int(answer.headers["Retry-After"]))
        assert get(app, cost).status_code == 200


def test_a_quota_that_never_refills_tells_clients_to_stop() -> None:
    import urllib3

    app = app_with(Limit(TokenBucketLimiter(1, 0), name="trial"))
    assert get(app).status_code == 200
    spent = get(app)
    assert spent.status_code == 403
    assert "Retry-After" not in spent.headers
    retry = urllib3.Retry(total=5, status_forcelist=[429], respect_retry_after_header=True)
    assert not retry.is_retry("GET", spent.status_code, has_retry_after=False)
    assert retry.is_retry("GET", 429, has_retry_after=True)  # a 429 is retried


def test_pk_is_an_opaque_byte_sequence_derived_from_the_key() -> None:
    limit = Limit(TokenBucketLimiter(5, 1), name="per-ip", pk=b"s" * 32)
    app = app_with(limit)
    first = get(app, peer="192.0.2.1")
    again = get(app, peer="192.0.2.1")
    other = get(app, peer="192.0.2.2")
    pks = [sf.ratelimit(a.headers["RateLimit"])["per-ip"].params["pk"] for a in (first, again)]
    policy_pk = sf.ratelimit_policy(first.headers["RateLimit-Policy"])["per-ip"].params["pk"]
    other_pk = sf.ratelimit(other.headers["RateLimit"])["per-ip"].params["pk"]
    assert pks[0] == pks[1] == policy_pk  # one partition, one pk
    assert other_pk != pks[0]
    assert isinstance(pks[0], bytes)
    assert len(pks[0]) == 12
    assert b"192.0.2.1" not in pks[0]
    assert "192.0.2.1" not in first.headers["RateLimit"]
    assert base64.b64encode(pks[0]).decode() in first.headers["RateLimit"]
    # Another secret: another pk for the same key (nobody can hash addresses to find it).
    other_secret = app_with(Limit(TokenBucketLimiter(5, 1), name="per-ip", pk=True))
    answer = get(other_secret, peer="192.0.2.1")
    assert sf.ratelimit(answer.headers["RateLimit"])["per-ip"].params["pk"] != pks[0]
    assert (
        "pk"
        not in sf.ratelimit(get(app_with(Limit(TokenBucketLimiter(5, 1)))).headers["RateLimit"])[
            "default"
        ].params
    )


@pytest.mark.parametrize(("pk", "error"), [(b"short", ValueError), ("text", TypeError)])
def test_pk_takes_true_or_a_secret(pk: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="pk must be"):
        Limit(TokenBucketLimiter(5, 1), pk=pk)  # type: ignore[arg-type]


def test_the_parser_rejects_what_is_not_a_structured_list() -> None:
    for bad in ('"a";r=1,', '"a";r=x y', '"a";R=1', '"a', '"a";r=1;;', '"a";pk=:@@:'):
        with pytest.raises(sf.ParseError):
            sf.parse_list(bad)
    with pytest.raises(AssertionError):
        sf.ratelimit('"a";r=-1')
    with pytest.raises(AssertionError):
        sf.ratelimit_policy('"a";w=5')  # q is required
