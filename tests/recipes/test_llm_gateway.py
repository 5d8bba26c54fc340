"""The LLM gateway recipe (docs/recipes/llm-gateway.md), run whole: its example
(examples/llm_gateway/gateway.py) under ``uvicorn --workers 2`` on a real
redis-server, in front of the mock provider (tests/upstream/provider.py), called
by the real openai SDK. A few seconds of traffic at a small scale (limits per 10 s):

- the SDK succeeds: every call of the batch user's threads and of the interactive
  users, streamed or not, ends well (the batch threads wait their turn at the
  gateway instead of failing after the SDK's retries);
- exactness: by every arrival at the provider, no user has used more than its
  token and request buckets allowed since the start, nor the organisation more
  than its cap; the provider never answered 429; no user ever had more than 2
  generations at the provider at once;
- one outcome per request: each limit's ``requests`` outcomes add up to the HTTP
  answers that reached it;
- a client that drops a stream frees its generation slot at once (before the
  provider's generation ends), and a request's tokens are settled with the usage.

The gateway and the run are the package's (tests/recipes/conftest.py), which
tests/recipes/test_dashboard.py scrapes with a real Prometheus. No speed is
asserted: benches/gateway.py measures it.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import httpx
import pytest
import redis

from bucketlimit.redis import RedisConcurrencyLimiter, RedisTokenBucketLimiter
from tests.recipes.gateway import Run, Stack, estimate, requests_total, sdk

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

LIMITS = ("generations", "requests", "tokens", "org-tokens")  # in the order they decide
DEADLINE = 30.0  # seconds for a state the gateway reaches at once (a hang guard)


def test_the_sdk_succeeds_and_batch_callers_wait_rather_than_fail(run: Run) -> None:
    assert run.total(batch=True) > 0, "the batch user's threads made no call"
    assert run.total(batch=False) > 0, "the interactive users made no call"
    errors = Counter(call.error for call in run.calls if call.error is not None)
    assert run.failed(batch=True) == 0, f"batch calls failed: {errors}"
    assert run.failed(batch=False) == 0, f"interactive calls failed: {errors}"
    waited = [c.end - c.start for c in run.calls if c.batch]
    statuses = Counter(status for _, status in run.responses)
    print(
        f"\n{run.total(batch=True)} batch calls, {run.total(batch=False)} interactive, "
        f"{len(run.responses)} HTTP answers ({statuses}), the longest batch call "
        f"{max(waited):.2f} s"
    )


def test_no_user_and_not_the_org_ever_went_over_its_bound(stack: Stack, run: Run) -> None:
    shape = run.shape
    # What follows holds while the store answers: a limit that cannot reach it answers
    # from each worker's share of the limit (docs/redis.md, "When the store fails").
    degraded = [
        line
        for line in stack.scrape().splitlines()
        if line.startswith("bucketlimit_degraded_decisions_total") and not line.endswith(" 0.0")
    ]
    assert not degraded, f"the store did not answer in time: {degraded}"
    assert run.provider_429s() == 0, "the provider refused a request"
    for user in run.users():
        rows = run.admitted(user)
        assert rows, f"{user}: nothing reached the provider"
        tokens = run.margin(rows, shape.tpm, shape.window)
        requests = run.margin(rows, shape.rpm, shape.window, cost=1)
        assert tokens >= 0, f"{user}: {-tokens} tokens over its bucket's bound"
        assert requests >= 0, f"{user}: {-requests} requests over its bucket's bound"
        in_flight = run.most_in_flight(user)
        assert in_flight <= shape.generations, f"{user}: {in_flight} generations at once"
    org = run.margin(run.admitted(), shape.org_tpm, shape.window)
    assert org >= 0, f"the organisation: {-org} tokens over its cap's bound"


def test_each_limit_counts_one_outcome_per_answer_that_reached_it(stack: Stack, run: Run) -> None:
    answered = len(stack.answers)  # every HTTP answer so far, the SDK's retries' included
    deadline = time.monotonic() + DEADLINE
    while True:  # each worker publishes its numbers every second
        found = requests_total(stack.scrape())
        first = sum(found.get((LIMITS[0], o), 0) for o in ("allowed", "refused", "given_back"))
        if first >= answered or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # polling interval, not a timing assumption
    reached = answered  # every request reaches the first limit (no unknown key here)
    for policy in LIMITS:
        outcomes = {o: found.get((policy, o), 0) for o in ("allowed", "refused", "given_back")}
        print(f"\n{policy}: {outcomes}")
        assert sum(outcomes.values()) == reached, f"{policy}: {outcomes}, {reached} reached it"
        assert found.get((policy, "abandoned"), 0) == 0
        reached -= int(outcomes["refused"])  # the next limit never saw those
    ran = found[LIMITS[-1], "allowed"]
    assert ran == stack.answers.count(200), "every limit's allowed is the requests that ran"


def test_a_dropped_stream_frees_its_slot_and_tokens_are_settled_with_the_usage(
    stack: Stack, run: Run
) -> None:
    shape = stack.shape
    client = redis.Redis.from_url(stack.redis_url)
    generations = RedisConcurrencyLimiter(
        client, shape.generations, ttl=120, prefix=f"{shape.prefix}generations:"
    )
    body = {
        "model": "mock",
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": "a long story"}],
        "metadata": {"mock_seconds": "120"},  # the provider generates for two minutes
    }
    headers = {"authorization": "Bearer sk-dropper"}
    with (
        httpx.Client(base_url=stack.gateway, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer,
    ):
        stack.answers.append(answer.status_code)
        assert answer.status_code == 200
        assert generations.in_flight("dropper") == 1, "the stream holds its generation slot"
    # The client has hung up: the slot is free, long before the provider ends.
    deadline = time.monotonic() + DEADLINE
    while generations.in_flight("dropper"):
        assert time.monotonic() < deadline, "the dropped stream still holds its slot"
        time.sleep(0.05)  # polling interval, not a timing assumption
    assert not [r for r in stack.provider_log() if r[1] == "dropper"], "the generation ended"

    # Settled: the tokens bucket keeps what the provider reported used, not the estimate.
    settler = sdk(stack, "settler")
    questions: list[dict[str, Any]] = [
        {
            "model": "mock",
            "max_tokens": 650,
            "messages": [{"role": "user", "content": "hello " * 10}],
            "metadata": {"mock_completion_tokens": "30"},
        }
        for _ in range(2)
    ]
    began = time.monotonic()
    plain = settler.chat.completions.create(**questions[0])
    streamed = settler.chat.completions.create(**questions[1], stream=True)
    usages = [plain.usage] + [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert all(usage is not None for usage in usages)
    used = sum(usage.total_tokens for usage in usages if usage is not None)
    tokens = RedisTokenBucketLimiter(
        client, shape.tpm, shape.tpm, per=shape.window, prefix=f"{shape.prefix}tokens:"
    )
    peeked = tokens.peek("settler")
    remaining = peeked.remaining + peeked.allowed  # in the bucket (peek counts its own)
    refilled = shape.tpm / shape.window * (time.monotonic() - began)
    estimated = sum(estimate(q) for q in questions)
    # Had the estimates stood, the bucket could hold no more than this:
    assert shape.tpm - estimated + refilled < shape.tpm - used, "the run was too slow to tell"
    assert remaining >= shape.tpm - used, f"{remaining} left: not settled with {used} used"
    settler.close()
    client.close()
