"""A mock LLM provider for the tests: ``POST /v1/chat/completions`` behind its own token
buckets (requests and tokens, refilled steadily, as OpenAI and Anthropic describe
theirs), answering with OpenAI's headers.

Run by uvicorn (``tests.upstream.provider:app``), configured by environment variables:
``PROVIDER_TOKENS`` and ``PROVIDER_REQUESTS`` per ``PROVIDER_WINDOW`` seconds (its true
limits), ``PROVIDER_LATENCY`` seconds of "generation" per answer, and optionally
``PROVIDER_SPEED`` tokens generated per second on top of it and ``PROVIDER_SLOTS``
generations at once (more wait for a slot, as on a provider's GPUs). A request is
charged its prompt (a quarter of its messages' characters) and its ``max_tokens`` when
it is admitted, and given back what it did not generate when it is answered
(Anthropic's rule for output tokens); a refused one gets 429 with ``Retry-After`` in
whole seconds (and the same in ``retry-after-ms``). ``"stream": true`` answers with
OpenAI's event stream, its chunks spread over the generation, the usage last when
``stream_options.include_usage`` asks for it. A request's ``metadata`` may set
``mock_completion_tokens`` (what it makes) and ``mock_seconds`` (how long it takes).
The ``x-consumer`` header names who
asked (else the body's ``user``, OpenAI's end-user id); the consumer ``other``
generates all its ``max_tokens``. ``GET /log`` returns every request: [arrival
(time.monotonic()), consumer, status, tokens used, retry-after, end of its answer];
``POST /drain`` with ``x-tokens: N`` spends N tokens at once (a burst elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
from typing import Any

WINDOW = float(os.environ.get("PROVIDER_WINDOW", "2"))
LATENCY = float(os.environ.get("PROVIDER_LATENCY", "0.01"))
SPEED = float(os.environ.get("PROVIDER_SPEED", "0"))  # tokens a second; 0: LATENCY only
SLOTS = int(os.environ.get("PROVIDER_SLOTS", "0"))  # generations at once; 0: no bound
#: Chunks of a streamed answer.
CHUNKS = 5


class Bucket:
    """A steadily refilling bucket in float tokens (the mock's own, not bucketlimit's)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rate = limit / WINDOW
        self.level = float(limit)
        self.at = time.monotonic()

    def refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.limit, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait(self, cost: float) -> float:
        return max(0.0, (cost - self.level) / self.rate)

    def headers(self, resource: str) -> list[tuple[bytes, bytes]]:
        reset = (self.limit - self.level) / self.rate
        return [
            (f"x-ratelimit-limit-{resource}".encode(), str(self.limit).encode()),
            (f"x-ratelimit-remaining-{resource}".encode(), str(int(self.level)).encode()),
            (f"x-ratelimit-reset-{resource}".encode(), go_duration(reset).encode()),
        ]


def go_duration(seconds: float) -> str:
    """As OpenAI writes resets: ``12ms`` below a second, else ``1m30.5s`` or ``6.5s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


tokens = Bucket(int(os.environ.get("PROVIDER_TOKENS", "36000")))
requests = Bucket(int(os.environ.get("PROVIDER_REQUESTS", "4000")))
log: list[tuple[float, str, int, int, float | None, float]] = []
slots = asyncio.Semaphore(SLOTS) if SLOTS else None


async def respond(send: Any, status: int, body: Any, headers: list[tuple[bytes, bytes]]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def completion(scope: Any, receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    arrival = time.monotonic()
    asked = json.loads(body)
    consumer = dict(scope["headers"]).get(b"x-consumer", b"").decode() or asked.get("user", "")
    prompt = math.ceil(sum(len(m["content"]) for m in asked["messages"]) / 4)
    most = int(asked["max_tokens"])
    tokens.refill()
    requests.refill()
    if tokens.level >= prompt + most and requests.level >= 1:
        tokens.level -= prompt + most
        requests.level -= 1
        made = most if consumer == "other" else random.randint(math.ceil(most * 0.3), most)
        seconds = LATENCY * random.uniform(0.5, 1.5) + (made / SPEED if SPEED else 0.0)
        plan = asked.get("metadata") or {}  # a test's own: what to make, how long
        made = min(most, int(plan.get("mock_completion_tokens", made)))
        seconds = float(plan.get("mock_seconds", seconds))
        async with slots if slots is not None else contextlib.nullcontext():
            if asked.get("stream"):
                await stream(send, asked, prompt, made, seconds)
            else:
                await asyncio.sleep(seconds)
        tokens.refill()
        tokens.level = min(tokens.limit, tokens.level + most - made)  # what it did not make
        log.append((arrival, consumer, 200, prompt + made, None, time.monotonic()))
        if not asked.get("stream"):
            answer = {
                "id": f"chatcmpl-{len(log)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": asked.get("model", "mock"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage(prompt, made),
            }
            await respond(
                send, 200, answer, tokens.headers("tokens") + requests.headers("requests")
            )
        return
    wait = max(tokens.wait(prompt + most), requests.wait(1))
    retry = max(1, math.ceil(wait))
    log.append((arrival, consumer, 429, 0, float(retry), arrival))
    headers = [
        (b"retry-after", str(retry).encode()),
        (b"retry-after-ms", str(retry * 1000).encode()),
    ]
    error = {
        "error": {"message": "Rate limit reached", "type": "tokens", "code": "rate_limit_exceeded"}
    }
    await respond(
        send, 429, error, headers + tokens.headers("tokens") + requests.headers("requests")
    )


def usage(prompt: int, made: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}


async def stream(send: Any, asked: dict[str, Any], prompt: int, made: int, seconds: float) -> None:
    """OpenAI's event stream: CHUNKS content chunks spread over ``seconds`` (the first
    at once), the last with ``finish_reason``, then the usage if asked, then
    ``[DONE]``. A client that
    goes away ends it (uvicorn's send raises)."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream"),
                *tokens.headers("tokens"),
                *requests.headers("requests"),
            ],
        }
    )
    base = {
        "id": f"chatcmpl-{len(log) + 1}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": asked.get("model", "mock"),
    }
    events = []
    for n in range(CHUNKS):
        last = n == CHUNKS - 1
        delta = {} if last else {"content": "ok "}
        choice = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
        events.append({**base, "choices": [choice]})
    if (asked.get("stream_options") or {}).get("include_usage"):
        events.append({**base, "choices": [], "usage": usage(prompt, made)})
    with contextlib.suppress(OSError):  # the client went away: nothing more to send
        for event in events:
            chunk = b"data: " + json.dumps(event).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(seconds / len(events))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/v1/chat/completions" and scope["method"] == "POST":
        await completion(scope, receive, send)
    elif scope["path"] == "/log":
        await respond(send, 200, log, [])
    elif scope["path"] == "/drain":  # another consumer's burst: this many tokens at once
        tokens.refill()
        tokens.level -= int(dict(scope["headers"])[b"x-tokens"])
        await respond(send, 200, {"level": tokens.level}, [])
    else:
        await respond(send, 200, {"ok": True}, [])
