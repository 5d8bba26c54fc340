"""bucketlimit.httpx's transports on a ManualClock, around httpx's MockTransport: what
each request acquires, settles and observes, holds, failures, bad configuration, the
asyncio transport, httpx2, and the openai and anthropic SDKs through ``http_client=``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from bucketlimit import TokenBucketLimiter
from bucketlimit.httpx import (
    AsyncRateLimitTransport,
    BudgetSpent,
    RateLimitTransport,
    default_key,
    estimate_tokens,
    read_usage,
)
from bucketlimit.testing import ManualClock

URL = "https://api.example/v1/chat/completions"
CHAT = {"model": "m", "max_tokens": 300, "messages": [{"role": "user", "content": "hi"}]}
KEY = default_key(httpx.Request("POST", URL))


class Provider:
    """A handler for MockTransport: answers with the headers and usage a test sets,
    and records when (on the clock) each request arrived."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.arrivals: list[float] = []
        self.status = 200
        self.headers: dict[str, str] = {}
        self.usage: dict[str, int] | None = {"prompt_tokens": 20, "completion_tokens": 80}

    def __call__(self, request: Any) -> Any:
        self.arrivals.append(self.clock.now)
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        body: dict[str, Any] = {
            "id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]
        }  # fmt: skip
        if self.usage is not None:
            body["usage"] = {**self.usage, "total_tokens": sum(self.usage.values())}
        library = httpx2 if type(request).__module__.startswith("httpx2") else httpx
        return library.Response(self.status, headers=self.headers, json=body)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(100)


def setup(
    clock: ManualClock, **kwargs: Any
) -> tuple[Provider, httpx.Client, TokenBucketLimiter, TokenBucketLimiter]:
    provider = Provider(clock)
    rpm = TokenBucketLimiter(60, 60, per=60, clock=clock)
    tpm = TokenBucketLimiter(10_000, 10_000, per=60, clock=clock)
    transport = RateLimitTransport(
        httpx.MockTransport(provider), requests=rpm, tokens=tpm, clock=clock, **kwargs
    )
    return provider, httpx.Client(transport=transport), rpm, tpm


def test_a_request_spends_its_estimate_and_settles_to_its_usage(clock: ManualClock) -> None:
    _provider, client, rpm, tpm = setup(clock)
    request = client.build_request("POST", URL, json=CHAT)
    estimate = estimate_tokens(request)
    assert estimate is not None
    assert estimate[1] == 300
    assert client.send(request).status_code == 200
    assert rpm.peek(KEY).remaining == 58  # one request (peek asks for one more)
    # 100 used of the estimate; the rest is this key's credit: the next request
    # reserves that much less, so the bucket ends as if only the usage was spent.
    assert tpm.peek(KEY).remaining == 10_000 - sum(estimate) - 1
    client.post(URL, json=CHAT)
    assert tpm.peek(KEY).remaining == 10_000 - 100 - sum(estimate) - 1


def test_the_headers_lower_the_limiters(clock: ManualClock) -> None:
    provider, client, rpm, tpm = setup(clock, margin=0)
    provider.headers = {
        "x-ratelimit-limit-tokens": "10000",
        "x-ratelimit-remaining-tokens": "1200",
        "x-ratelimit-reset-tokens": "52.8s",
        "x-ratelimit-remaining-requests": "3",
    }
    client.post(URL, json=CHAT)
    assert tpm.peek(KEY).remaining == 1199
    assert rpm.peek(KEY).remaining == 2
    # A margin keeps that fraction of the limit unspent.
    provider, client, rpm, tpm = setup(clock, margin=0.1)
    provider.headers = dict.fromkeys(["x-ratelimit-remaining-requests"], "30")
    client.post(URL, json=CHAT)
    assert rpm.peek(KEY).remaining == 30 - 6 - 1


def test_a_429_holds_every_request_until_its_retry_after(clock: ManualClock) -> None:
    provider, client, _rpm, tpm = setup(clock)
    provider.status, provider.headers = 429, {"retry-after-ms": "2500"}
    assert client.post(URL, json=CHAT).status_code == 429
    provider.status, provider.headers = 200, {}
    assert client.post(URL, json=CHAT).status_code == 200
    # Nothing before the hold's end; then the bucket, empty like the provider's,
    # waits for the request's own tokens (about 330 at 10,000 a minute: 2 s).
    first, second = provider.arrivals
    assert first == 100.0
    assert second >= 102.5
    assert second == pytest.approx(102.5 + tpm.peek(KEY).reset_after - 60, abs=0.01) or second < 105


def test_a_429s_hold_is_kept_whatever_count_the_response_carries(clock: ManualClock) -> None:
    provider, client, _rpm, _tpm = setup(clock)
    # A count of 25 digits, more than any limiter holds, beside the Retry-After.
    provider.status = 429
    provider.headers = {"retry-after": "2", "x-ratelimit-remaining-tokens": "9" * 25}
    assert client.post(URL, json=CHAT).status_code == 429
    provider.status, provider.headers = 200, {}
    client.post(URL, json=CHAT)
    first, second = provider.arrivals
    assert second - first >= 2, "a request was sent before the 429's Retry-After ended"


def test_a_bare_retry_after_delays_by_the_hold_and_no_more(clock: ManualClock) -> None:
    provider = Provider(clock)
    rph = TokenBucketLimiter(100, 100, per=3600, clock=clock)  # a token every 36 s
    transport = RateLimitTransport(httpx.MockTransport(provider), requests=rph, clock=clock)
    client = httpx.Client(transport=transport)
    provider.status, provider.headers = 429, {"retry-after": "1"}
    assert client.post(URL, json=CHAT).status_code == 429
    provider.status, provider.headers = 200, {}
    client.post(URL, json=CHAT)
    first, second = provider.arrivals
    assert second - first == 1.0, "the next request did not go at the hold's end"


class HoldingClock(ManualClock):
    """A ManualClock whose first sleep runs ``during_sleep`` first: another worker's
    429, seen while this one waits its turn."""

    during_sleep: Callable[[], None] | None = None

    def sleep(self, seconds: float) -> None:
        hook, self.during_sleep = self.during_sleep, None
        if hook is not None:
            hook()
        super().sleep(seconds)


def test_a_request_granted_before_a_hold_waits_it_out() -> None:
    clock = HoldingClock(100)
    provider = Provider(clock)
    tpm = TokenBucketLimiter(1_000, 100, clock=clock)
    transport = RateLimitTransport(httpx.MockTransport(provider), tokens=tpm, clock=clock)
    assert tpm.allow(KEY, 1_000)  # spent: the next request waits its turn (0.5 s)
    # While it waits, another worker (after its own turn) gets a 429, Retry-After: 3.
    refused = Provider(clock)
    refused.status, refused.headers = 429, {"retry-after": "3"}
    other = RateLimitTransport(httpx.MockTransport(refused), tokens=tpm, clock=clock)

    def another_worker() -> None:
        httpx.Client(transport=other).post(URL, json={"max_tokens": 1})

    clock.during_sleep = another_worker
    with httpx.Client(transport=transport) as client:
        client.post(URL, json={"max_tokens": 50})
    assert len(refused.arrivals) == 1
    assert refused.arrivals[0] < 101
    assert provider.arrivals == [refused.arrivals[0] + 3]


def test_a_limit_below_the_capacity_is_reported_once(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    provider, client, _rpm, _tpm = setup(clock)
    provider.headers = {"x-ratelimit-limit-tokens": "9000", "x-ratelimit-remaining-tokens": "8000"}
    with caplog.at_level(logging.WARNING, logger="bucketlimit"):
        for _ in range(3):
            client.post(URL, json=CHAT)
    lines = [r.getMessage() for r in caplog.records if "reports a tokens limit" in r.getMessage()]
    assert len(lines) == 1
    assert "9000" in lines[0]
    assert "10000" in lines[0]


def test_a_failure_after_the_response_is_logged_and_the_response_returned(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    _provider, client, _rpm, _tpm = setup(clock, usage=lambda response: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="bucketlimit"):
        assert client.post(URL, json=CHAT).status_code == 200
    assert any("settling or observing it failed" in r.getMessage() for r in caplog.records)


def test_a_spent_quota_is_an_error_not_a_wait(clock: ManualClock) -> None:
    quota = TokenBucketLimiter(1, 0, clock=clock)
    transport = RateLimitTransport(httpx.MockTransport(Provider(clock)), requests=quota)
    with httpx.Client(transport=transport) as client:
        client.get(URL)
        with pytest.raises(BudgetSpent, match="can never be admitted"):
            client.get(URL)


def test_requests_without_a_json_body_cost_a_request_only(clock: ManualClock) -> None:
    _provider, client, rpm, tpm = setup(clock)
    client.get("https://api.example/v1/models")
    assert rpm.peek(KEY).remaining == 58
    assert tpm.peek(KEY).remaining == 9_999
    assert estimate_tokens(httpx.Request("POST", URL, content=b"not json")) is None


def test_usage_is_read_from_openai_and_anthropic_bodies() -> None:
    def usage(body: dict[str, Any]) -> Any:
        return read_usage(httpx.Response(200, json=body))

    assert usage({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert usage({"usage": {"input_tokens": 5, "output_tokens": 6}}) == (5, 6)
    assert usage({"usage": {"input_tokens": -1, "output_tokens": 6}}) is None
    assert usage({"choices": []}) is None


def test_the_default_key_never_holds_the_secret() -> None:
    one = httpx.Request("POST", URL, headers={"authorization": "Bearer sk-secret"})
    two = httpx.Request("POST", URL, headers={"x-api-key": "sk-other"})
    assert default_key(one).startswith("api.example:")
    assert "sk-" not in default_key(one)
    assert default_key(one) != default_key(two)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({}, TypeError, "give at least one limiter"),
        ({"tokens": object()}, TypeError, "tokens= must be a token-bucket limiter"),
        ({"tokens": "lim", "key": 3}, TypeError, "tokens= must be"),
        ({"margin": 1.0}, ValueError, "margin must be >= 0 and < 1"),
        ({"margin": "0.1"}, TypeError, "margin must be a fraction"),
        ({"key": "org"}, TypeError, "key must be a function"),
        ({"usage": 5}, TypeError, "usage must be a function"),
        ({"clock": 5}, TypeError, "clock must be a zero-argument callable"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any], error: type, words: str) -> None:
    limiter = TokenBucketLimiter(10, 1)
    if "tokens" not in kwargs and kwargs:
        kwargs = {"requests": limiter, **kwargs}
    with pytest.raises(error, match=words):
        RateLimitTransport(httpx.MockTransport(lambda r: httpx.Response(200)), **kwargs)


def test_a_sync_transport_refuses_an_asyncio_limiter() -> None:
    class AsyncLimiter:
        capacity, rate = 10, 1.0

        def reserve(self) -> None: ...
        def peek(self) -> None: ...
        async def observe(self) -> None: ...

    with pytest.raises(TypeError, match="use it with AsyncRateLimitTransport"):
        RateLimitTransport(tokens=AsyncLimiter())


class GateClock(ManualClock):
    """A ManualClock whose asynchronous sleeps wait until the test lets them go."""

    waiting = False

    async def sleep_async(self, seconds: float) -> None:
        self.waiting = True
        await asyncio.Event().wait()  # until cancelled


def test_the_asyncio_transport_and_a_cancelled_wait() -> None:
    clock = GateClock(100)
    provider = Provider(clock)
    tpm = TokenBucketLimiter(1_000, 100, clock=clock)

    async def main() -> None:
        transport = AsyncRateLimitTransport(httpx.MockTransport(provider), tokens=tpm, clock=clock)
        async with httpx.AsyncClient(transport=transport) as client:
            assert (await client.post(URL, json=CHAT)).status_code == 200
            assert len(provider.arrivals) == 1
            tpm.reserve(KEY, tpm.peek(KEY).remaining + 1)  # under a token: the next waits
            before = tpm.peek(KEY)
            task = asyncio.ensure_future(client.post(URL, json={"max_tokens": 10}))
            while not clock.waiting:  # the clock stands still: only the task moves
                await asyncio.sleep(0)
            assert tpm.peek(KEY) != before  # it holds its tokens while it waits
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(provider.arrivals) == 1
            assert tpm.peek(KEY) == before  # its tokens came back

    asyncio.run(main())


def _sdk_setup(clock: ManualClock) -> tuple[Provider, TokenBucketLimiter]:
    provider = Provider(clock)
    provider.headers = {"x-ratelimit-remaining-tokens": "900", "x-ratelimit-limit-tokens": "10000"}
    return provider, TokenBucketLimiter(10_000, 10_000, per=60, clock=clock)


def test_the_openai_sdk_through_http_client(clock: ManualClock) -> None:
    provider, tpm = _sdk_setup(clock)
    transport = RateLimitTransport(httpx.MockTransport(provider), tokens=tpm, clock=clock)
    http = httpx.Client(transport=transport)
    # openai's types name httpx2's Client; it takes httpx's as well.
    base = "https://api.example/v1"
    sdk = openai.OpenAI(api_key="sk-1", base_url=base, http_client=http)  # type: ignore[arg-type]
    hello: Any = [{"role": "user", "content": "hi"}]
    made = sdk.chat.completions.create(model="m", max_tokens=300, messages=hello)
    assert made.usage is not None
    assert made.usage.total_tokens == 100
    key = default_key(httpx.Request("POST", URL, headers={"authorization": "Bearer sk-1"}))
    assert tpm.peek(key).remaining == 900 - 500 - 1  # the report, less the 10,000 * 0.05 margin


def test_the_anthropic_sdk_through_an_httpx2_client(clock: ManualClock) -> None:
    provider, _tpm = _sdk_setup(clock)
    provider.usage = {"input_tokens": 7, "output_tokens": 9}

    def anthropic_answer(request: Any) -> Any:
        provider(request)
        body = {"id": "m", "type": "message", "role": "assistant", "model": "c",
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": provider.usage}  # fmt: skip
        headers = {"anthropic-ratelimit-output-tokens-remaining": "700",
                   "anthropic-ratelimit-output-tokens-limit": "10000"}  # fmt: skip
        return httpx2.Response(200, headers=headers, json=body)

    otpm = TokenBucketLimiter(10_000, 10_000, per=60, clock=clock)
    transport = RateLimitTransport(
        httpx2.MockTransport(anthropic_answer),  # type: ignore[arg-type]
        output_tokens=otpm,
        key=lambda request: "org",
        margin=0,
        clock=clock,
    )
    sdk = anthropic.Anthropic(
        api_key="k",
        base_url="https://api.example",
        http_client=httpx2.Client(transport=transport),  # type: ignore[arg-type]
    )
    hello: Any = [{"role": "user", "content": "hi"}]
    made = sdk.messages.create(model="c", max_tokens=300, messages=hello)
    assert made.usage.output_tokens == 9
    assert otpm.peek("org").remaining == 699


def test_httpx_is_not_imported_by_the_package() -> None:
    import subprocess
    import sys

    code = "import sys, bucketlimit, bucketlimit.upstream; print('httpx' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
