"""httpx transports that keep every worker within a rate-limited API's budget
(docs/upstream.md).

    import httpx, openai
    from bucketlimit.httpx import RateLimitTransport

    transport = RateLimitTransport(httpx.HTTPTransport(), requests=rpm, tokens=tpm)
    client = openai.OpenAI(http_client=httpx.Client(transport=transport))

Each request, through one procedure (:func:`RateLimitTransport._flow`, driven by the
sync and the asyncio transport alike):

1. **Estimate**: its cost in each limiter: 1 request, and the tokens ``estimate``
   says (default :func:`estimate_tokens`: the JSON body's ``max_tokens`` for the
   output, a quarter of the body's bytes for the input).
2. **Acquire** them all at once from the shared limiters, waiting in their queue:
   a reservation is taken only when it would be served within the time its own
   tokens take to refill, else the worker sleeps until it would and asks again, so
   no deep queue is ever promised tokens that a report or a hold could no longer
   give. A hold (below) is waited out even by a request already granted.
3. **Send** it through the wrapped transport.
4. **Observe**: what the headers say (:func:`bucketlimit.upstream.parse`) lowers
   the limiter of each resource, keeping ``margin`` of the provider's limit
   unspent; a 429's ``Retry-After`` holds the key for every worker until then.
   Then the response is returned, its body passed on as it comes.
5. **Settle**: once the body has all come (read whole, or a stream read to its
   end), the tokens its ``usage`` reports replace the estimate (default
   :func:`read_usage`, for JSON responses); a stream closed before its end, a
   failed or unreadable response, or a body over 4 MiB keeps the estimate.

What fails: admission follows the limiters' own ``on_store_error`` (a Redis
outage answers from each process's share, degraded); a failure to settle or to
observe after the response is logged, and the response is returned all the same.
The package never imports httpx unless this module is imported.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import inspect
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final, TypeGuard, TypeVar

try:
    import httpx
except ImportError:  # openai >= 3 and anthropic >= 2 bring httpx2 only: the same API
    import httpx2 as httpx  # type: ignore[no-redef]

from bucketlimit import _checks, reserve_all
from bucketlimit.upstream import Observation, parse

logger = logging.getLogger("bucketlimit")

__all__ = [
    "AsyncRateLimitTransport",
    "BudgetSpent",
    "RateLimitTransport",
    "default_key",
    "estimate_tokens",
    "read_usage",
]

#: Input and output tokens of one request: an estimate before it, its use after it.
Tokens = tuple[int, int]
#: The resources a transport takes a limiter for, as parse names them.
RESOURCES: Final = ("requests", "tokens", "input-tokens", "output-tokens")


class BudgetSpent(RuntimeError):
    """A request can never be admitted: a limiter refuses it for ever (a spent
    quota, rate 0)."""


def default_key(request: httpx.Request) -> str:
    """The request's host and a digest of its credentials (``Authorization`` or
    ``x-api-key``; never the secret itself): providers count per API key. Give a key
    function of your own to count per model or per organisation."""
    credentials = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
    digest = hashlib.blake2b(credentials.encode("utf-8"), digest_size=8).hexdigest()
    return f"{request.url.host}:{digest}"


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return None


def estimate_tokens(request: httpx.Request) -> Tokens | None:
    """The usual estimate of a chat request: its JSON body's ``max_tokens`` (or
    ``max_completion_tokens``, ``max_output_tokens``) as the output, and a quarter of
    the body's bytes as the input (about four bytes a token; the JSON around the
    text makes it an overestimate). ``None`` for a request without a JSON object
    body (it costs a request and no tokens)."""
    try:
        content = request.content
    except Exception:  # a streamed body, not read: nothing to estimate from
        return None
    body = _json(content) if content else None
    if not isinstance(body, dict):
        return None
    output = 0
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            output = value
            break
    return math.ceil(len(content) / 4), output


def read_usage(response: httpx.Response) -> Tokens | None:
    """The input and output tokens a JSON response's ``usage`` reports:
    ``prompt_tokens``/``completion_tokens`` (OpenAI's chat completions) or
    ``input_tokens``/``output_tokens`` (Anthropic, OpenAI's responses); ``None``
    when it reports none. Called only on a successful JSON response, once read."""
    body = _json(response.content)
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    for names in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
        tokens_in, tokens_out = (usage.get(name) for name in names)
        if _count(tokens_in) and _count(tokens_out):
            return tokens_in, tokens_out
    return None


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# -- the steps the procedure yields, which a transport carries out -------------------


@dataclass(frozen=True)
class Call:
    """Call ``function`` (awaiting what it returns when it is awaitable)."""

    function: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Sleep:
    """Wait ``seconds`` on the transport's clock."""

    seconds: float


@dataclass(frozen=True)
class Wait:
    """Wait until a reservation's tokens are the caller's (its own ``wait``)."""

    reservation: Any


@dataclass(frozen=True)
class Send:
    """Send the request through the wrapped transport; the answer is its response."""

    request: httpx.Request


@dataclass(frozen=True)
class Stream:
    """Pass the response's body on as it comes, and once it has all come run the
    flow ``settle`` gives for the response read (nothing for a body closed before
    its end, or longer than 4 MiB)."""

    request: httpx.Request
    response: httpx.Response
    settle: Callable[[httpx.Response], Generator[Step, Any, None]]


Step = Call | Sleep | Wait | Send | Stream
Flow = Generator[Step, Any, httpx.Response]
T = TypeVar("T")

# The longest body whose usage is read (a chat completion's is far shorter): a
# longer one keeps its estimate, and no more of it is kept.
_MOST_KEPT: Final = 4 * 1024 * 1024


class _Settings:
    """What both transports share: the limiters by resource, the functions, the
    margin, the clock; and the procedure of one request (:meth:`flow`)."""

    def __init__(
        self,
        *,
        requests: Any,
        tokens: Any,
        input_tokens: Any,
        output_tokens: Any,
        key: Callable[[httpx.Request], str],
        estimate: Callable[[httpx.Request], Tokens | None],
        usage: Callable[[httpx.Response], Tokens | None] | None,
        margin: float,
        clock: Callable[[], float] | None,
        asynchronous: bool,
    ) -> None:
        given = dict(zip(RESOURCES, (requests, tokens, input_tokens, output_tokens), strict=True))
        self.limiters: dict[str, Any] = {r: lim for r, lim in given.items() if lim is not None}
        if not self.limiters:
            raise TypeError(
                "give at least one limiter: requests=, tokens=, input_tokens= or output_tokens="
            )
        for resource, limiter in self.limiters.items():
            for method in ("reserve", "peek", "observe"):
                if not callable(getattr(limiter, method, None)):
                    raise TypeError(
                        f"{resource.replace('-', '_')}= must be a token-bucket limiter "
                        f"(with {method}), got {type(limiter).__name__}"
                    )
            if inspect.iscoroutinefunction(limiter.observe) and not asynchronous:
                raise TypeError(
                    f"{resource.replace('-', '_')}= is an asyncio limiter: use it with "
                    "AsyncRateLimitTransport"
                )
        # One kind of limiter (in-process, Redis, asyncio Redis): one reserve_all.
        _checks.route([(limiter, "k") for limiter in self.limiters.values()], "the transport")
        for name, function in (("key", key), ("estimate", estimate)):
            if not callable(function):
                raise TypeError(f"{name} must be a function of the request, got {function!r}")
        if usage is not None and not callable(usage):
            raise TypeError(f"usage must be a function of the response or None, got {usage!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise TypeError(f"margin must be a fraction (a float), got {margin!r}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be >= 0 and < 1, got {margin!r}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a zero-argument callable, got {clock!r}")
        self.key = key
        self.estimate = estimate
        self.usage = usage
        self.margin = float(margin)
        self.clock = clock
        # The limiter that keeps each key's hold, for requests already granted.
        self.holder = next(iter(self.limiters.values()))
        self._reported: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        # Tokens estimated and not used, by (limiter, key): the next request of the key
        # reserves that much less (see _settle).
        self._credit: dict[tuple[int, str], int] = {}

    # -- costs ------------------------------------------------------------------

    def costs(self, request: httpx.Request) -> list[tuple[Any, int]]:
        """(limiter, cost) of each limiter the request spends from; a cost above a
        limiter's capacity is taken at its capacity (the rest is charged when the
        request settles)."""
        estimate = self.estimate(request)
        tokens_in, tokens_out = estimate if estimate is not None else (0, 0)
        wanted = {
            "requests": 1,
            "tokens": tokens_in + tokens_out,
            "input-tokens": tokens_in,
            "output-tokens": tokens_out,
        }
        return [
            (limiter, min(wanted[resource], limiter.capacity))
            for resource, limiter in self.limiters.items()
            if wanted[resource] > 0
        ]

    # -- the procedure of one request ---------------------------------------------

    def flow(self, request: httpx.Request) -> Flow:
        """One request: acquire its costs, wait out a hold, send it, settle, observe."""
        key = self.key(request)
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must return a non-empty str, got {key!r}")
        costs = self.costs(request)
        taken = self._take_credit(key, costs)
        checks = [
            (limiter, key, cost - take) for (limiter, cost), take in zip(costs, taken, strict=True)
        ]
        try:
            reservation = yield from self._acquire(checks)
        except BaseException:
            self._add_credit(key, costs, taken)
            raise
        response: httpx.Response = yield Send(request)
        try:
            yield from self._after(key, costs, taken, reservation, request, response)
        except Exception:
            logger.warning(
                "a response of %s was returned, but settling or observing it failed",
                request.url.host,
                exc_info=True,
            )
        return response

    def _acquire(self, checks: list[tuple[Any, str, int]]) -> Generator[Step, Any, Any]:
        """A reservation of every check, taken only when it would be served within
        the time its own tokens take to refill (so no deep queue is promised tokens
        a report could take back); else a sleep until it would, and again. A
        reservation that waited then waits out a hold that began meanwhile (one
        that began before it already pushed its wait past the hold)."""
        horizon = max((cost / limiter.rate if limiter.rate else 0.0) for limiter, _, cost in checks)
        while True:
            reservation = yield Call(reserve_all, (checks,), (("max_wait", horizon),))
            if reservation:
                break
            wait = reservation.decision.retry_after
            if math.isinf(wait):
                raise BudgetSpent(
                    f"a request for key {checks[0][1]!r} can never be admitted: "
                    f"{reservation.decision!r} (a spent quota?)"
                )
            yield Sleep(wait)
        if reservation.delay > 0:
            hold = _hold_key(checks[0][1])
            try:
                yield Wait(reservation)
                held = yield Call(self.holder.peek, (hold,))
                while not held:
                    yield Sleep(held.retry_after)
                    held = yield Call(self.holder.peek, (hold,))
            except BaseException:
                yield Call(reservation.cancel)
                raise
        return reservation

    def _after(
        self,
        key: str,
        costs: list[tuple[Any, int]],
        taken: list[int],
        reservation: Any,
        request: httpx.Request,
        response: httpx.Response,
    ) -> Generator[Step, Any, None]:
        """Observes the response's headers; then, once its body has all come (it
        reaches the caller as it comes), settles the estimate to the usage it says."""
        yield from self._observe(key, parse(response.headers))
        content_type = response.headers.get("content-type", "")
        if self.usage is None or not response.is_success or "json" not in content_type:
            return
        usage = self.usage

        def settle(read: httpx.Response) -> Generator[Step, Any, None]:
            used = usage(read)
            if used is not None:
                yield from self._settle(key, costs, taken, reservation, self._used(costs, used))

        if response.is_stream_consumed:  # built from its body (a mock): read already
            yield from settle(response)
        else:
            yield Stream(request, response, settle)

    def _observe(self, key: str, observations: list[Observation]) -> Generator[Step, Any, None]:
        """Applies a response's reports, the hold first, each on its own: one that
        fails (a store error) is logged and loses only itself, so nothing is sent
        before a hold ends whatever else the response said."""
        reports: list[Call] = []
        holds = [seen.retry_after for seen in observations if seen.retry_after]
        if holds:
            # Every limiter holds the key (so nothing is granted before its end),
            # and so does the hold key (so nothing granted before waits less).
            hold = (("retry_after", max(holds)),)
            for limiter in self.limiters.values():
                reports.append(Call(limiter.observe, (key, limiter.capacity), hold))
            reports.append(Call(self.holder.observe, (_hold_key(key), self.holder.capacity), hold))
        for seen in observations:
            limiter = self.limiters.get(seen.resource)
            if limiter is not None:
                remaining, words = self._words(seen, limiter)
                reports.append(Call(limiter.observe, (key, remaining), words))
        for report in reports:
            try:
                yield report
            except Exception:
                logger.warning(
                    "a report of the upstream for key %r was not applied", key, exc_info=True
                )

    def _used(self, costs: list[tuple[Any, int]], used: Tokens) -> list[int]:
        tokens_in, tokens_out = used
        actual = {
            "requests": 1,
            "tokens": tokens_in + tokens_out,
            "input-tokens": tokens_in,
            "output-tokens": tokens_out,
        }
        by_limiter = {id(limiter): resource for resource, limiter in self.limiters.items()}
        return [actual[by_limiter[id(limiter)]] for limiter, _ in costs]

    def _settle(
        self,
        key: str,
        costs: list[tuple[Any, int]],
        taken: list[int],
        reservation: Any,
        used: list[int],
    ) -> Generator[Step, Any, None]:
        """The estimate becomes the use: more is charged (``settle``); less is kept
        as this key's credit, which its next request reserves less by. Given back
        instead, it would come back to nobody while another request waits in the
        bucket (docs/design.md §4, "Giving back"), and at saturation one always
        does; the provider's reports still bound what the credit lets through."""
        reserved = [cost - take for (_, cost), take in zip(costs, taken, strict=True)]
        settled = [
            r + max(0, u - cost) for r, u, (_, cost) in zip(reserved, used, costs, strict=True)
        ]
        if settled != reserved:
            yield Call(reservation.settle, (settled,))
        left = [max(0, cost - u) for (_, cost), u in zip(costs, used, strict=True)]
        self._add_credit(key, costs, left)

    def _take_credit(self, key: str, costs: list[tuple[Any, int]]) -> list[int]:
        """What each cost is paid from the key's credit (all but one token of it)."""
        with self._lock:
            taken = []
            for limiter, cost in costs:
                held = self._credit.get((id(limiter), key), 0)
                take = min(held, cost - 1)
                if take:
                    self._credit[(id(limiter), key)] = held - take
                taken.append(take)
            return taken

    def _add_credit(self, key: str, costs: list[tuple[Any, int]], amounts: list[int]) -> None:
        """Keeps ``amounts`` as the key's credit, at most a capacity in each limiter."""
        with self._lock:
            for (limiter, _), amount in zip(costs, amounts, strict=True):
                if amount:
                    place = (id(limiter), key)
                    held = self._credit.get(place, 0) + amount
                    self._credit[place] = min(held, limiter.capacity)

    def _words(self, seen: Observation, limiter: Any) -> tuple[int, tuple[tuple[str, Any], ...]]:
        """observe's remaining and words for one observation, keeping ``margin`` of the
        provider's limit unspent: a limit that much lower, and as much less remaining
        (the limiter's capacity stands for a limit not said). Its hold goes with it:
        a hold's end makes a token, whatever remains (docs/design.md §4)."""
        capacity = limiter.capacity
        if seen.limit is not None and seen.limit < capacity:
            self._report(seen, capacity)
        limit = capacity if seen.limit is None else seen.limit
        kept = math.ceil(limit * self.margin)
        words = (
            ("limit", limit - kept),
            ("reset_after", seen.reset_after),
            ("retry_after", seen.retry_after),
        )
        return max(0, seen.remaining - kept), words

    def _report(self, seen: Observation, capacity: int) -> None:
        """A provider's limit below the limiter's capacity: said once per value."""
        with self._lock:
            if (seen.resource, seen.limit or 0) in self._reported:
                return
            self._reported.add((seen.resource, seen.limit or 0))
        logger.warning(
            "the upstream reports a %s limit of %d where the limiter's capacity is %d: "
            "its reports keep the bucket within that limit while they come, but an idle "
            "bucket refills to its capacity; configure a capacity of at most %d",
            seen.resource,
            seen.limit,
            capacity,
            seen.limit,
        )


def _hold_key(key: str) -> str:
    """The key a 429's hold is kept under, beside ``key``'s buckets (a digest, so it
    fits in any key's length)."""
    return "\x00hold:" + hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()


# -- a body passed on as it comes, settled once it has all come ----------------------


class _Body:
    """What a response's body has brought so far (up to 4 MiB), and the
    response read from it once it has all come."""

    def __init__(self, step: Stream) -> None:
        self.step = step
        self.chunks: list[bytes] | None = []
        self.size = 0

    def keep(self, chunk: bytes) -> None:
        if self.chunks is None:
            return
        self.size += len(chunk)
        if self.size > _MOST_KEPT:
            self.chunks = None  # too long to read its usage: none of it is kept
        else:
            self.chunks.append(chunk)

    def read(self) -> httpx.Response | None:
        """The response as read (its raw body decoded as its headers say), once;
        ``None`` when the body was too long to keep."""
        chunks, self.chunks = self.chunks, None
        if chunks is None:
            return None
        response = self.step.response
        return type(response)(
            response.status_code,
            headers=response.headers,
            content=b"".join(chunks),
            request=self.step.request,
        )

    def failed(self) -> None:
        logger.warning(
            "a response of %s was returned, but settling it failed",
            self.step.request.url.host,
            exc_info=True,
        )


class _SettlingStream:
    """A sync body passed on as it comes; at its end, ``settle`` runs with the
    response read. Closed before its end, it settles nothing (the estimate stays)."""

    def __init__(self, body: _Body, settle: Callable[[httpx.Response], None]) -> None:
        self._body = body
        self._stream: Any = body.step.response.stream
        self._settle = settle

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._stream:
            self._body.keep(chunk)
            yield chunk
        read = self._body.read()
        if read is not None:
            try:
                self._settle(read)
            except Exception:
                self._body.failed()

    def close(self) -> None:
        self._stream.close()


class _AsyncSettlingStream:
    """:class:`_SettlingStream` for an asyncio body."""

    def __init__(self, body: _Body, settle: Callable[[httpx.Response], Awaitable[None]]) -> None:
        self._body = body
        self._stream: Any = body.step.response.stream
        self._settle = settle

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            self._body.keep(chunk)
            yield chunk
        read = self._body.read()
        if read is not None:
            try:
                await self._settle(read)
            except Exception:
                self._body.failed()

    async def aclose(self) -> None:
        await self._stream.aclose()


@functools.cache
def _stream_class(library: ModuleType, asynchronous: bool) -> type[Any]:
    """The settling stream for ``library``'s responses: httpx and httpx2 each read
    only a stream of their own base class."""
    if asynchronous:
        return type("AsyncSettlingStream", (_AsyncSettlingStream, library.AsyncByteStream), {})
    return type("SettlingStream", (_SettlingStream, library.SyncByteStream), {})


def _library(thing: object) -> ModuleType:
    """httpx or httpx2, whichever made ``thing`` (a request, a response)."""
    return importlib.import_module(type(thing).__module__.partition(".")[0])


# -- the two transports: each carries out the procedure's steps, and only that ------


class RateLimitTransport(httpx.BaseTransport):
    """An httpx transport that keeps its requests within shared limiters, wrapping
    ``transport`` (default: the client library's ``HTTPTransport()``): give it to
    ``httpx.Client(transport=...)``, and that client to ``openai.OpenAI(http_client=...)``
    or ``anthropic.Anthropic(http_client=...)``. It works the same in an
    ``httpx2.Client`` (which the openai >= 3 and anthropic >= 2 SDKs use) around an
    ``httpx2`` transport: both libraries have one transport API.

    - ``requests``, ``tokens``, ``input_tokens``, ``output_tokens``: a limiter per
      resource the provider limits (in-process or ``RedisTokenBucketLimiter``, one
      kind for all; at least one), configured with the provider's limits (capacity
      per window: ``TokenBucketLimiter(90_000, 90_000, per=60)`` for 90,000 tokens a
      minute). Each request costs 1 request and its estimated tokens.
    - ``key``: a function of the request naming its buckets (default
      :func:`default_key`: host and a digest of the API key).
    - ``estimate``: a function of the request returning its (input, output) tokens,
      or ``None`` for none (default :func:`estimate_tokens`).
    - ``usage``: a function of a successful JSON response, once its body has all
      come, returning the (input, output) tokens it used, which settle the
      estimate, or ``None`` to keep every estimate (default :func:`read_usage`).
    - ``margin``: the fraction of each provider limit left unspent, for other
      consumers and requests in flight (default 0.05).
    - ``clock``: what the transport sleeps on while it waits its turn: give the
      limiters' clock (a ``ManualClock`` in tests); default real time.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        requests: Any = None,
        tokens: Any = None,
        input_tokens: Any = None,
        output_tokens: Any = None,
        key: Callable[[httpx.Request], str] = default_key,
        estimate: Callable[[httpx.Request], Tokens | None] = estimate_tokens,
        usage: Callable[[httpx.Response], Tokens | None] | None = read_usage,
        margin: float = 0.05,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if transport is not None and not callable(getattr(transport, "handle_request", None)):
            raise TypeError(f"transport must be an httpx transport, got {transport!r}")
        self._transport = transport
        self._settings = _Settings(
            requests=requests,
            tokens=tokens,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            key=key,
            estimate=estimate,
            usage=usage,
            margin=margin,
            clock=clock,
            asynchronous=False,
        )

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._run(self._settings.flow(request))

    def _run(self, flow: Generator[Step, Any, T]) -> T:
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.send(answer) if error is None else flow.throw(error)
            except StopIteration as done:
                result: T = done.value
                return result
            answer, error = None, None
            try:
                answer = self._carry_out(step)
            except BaseException as failed:  # the procedure decides what it means
                error = failed

    def _carry_out(self, step: Step) -> Any:
        if isinstance(step, Call):
            return step.function(*step.args, **dict(step.kwargs))
        if isinstance(step, Sleep):
            sleep = getattr(self._settings.clock, "sleep", None)
            return (sleep if callable(sleep) else time.sleep)(max(0.0, step.seconds))
        if isinstance(step, Wait):
            return step.reservation.wait()
        if isinstance(step, Send):
            if self._transport is None:
                self._transport = _library(step.request).HTTPTransport()
            return self._transport.handle_request(step.request)
        settle = step.settle
        stream = _stream_class(_library(step.response), False)
        step.response.stream = stream(_Body(step), lambda read: self._run(settle(read)))
        return None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class AsyncRateLimitTransport(httpx.AsyncBaseTransport):
    """:class:`RateLimitTransport` for ``httpx.AsyncClient`` (``openai.AsyncOpenAI``,
    ``anthropic.AsyncAnthropic``) or ``httpx2.AsyncClient``, wrapping an async
    transport (default: the client library's ``AsyncHTTPTransport()``). The limiters
    may be in-process, ``AsyncRedisTokenBucketLimiter`` (awaited) or the sync Redis
    ones (blocking round trips); it waits with the clock's ``sleep_async`` when it has one, else
    ``asyncio.sleep``. A request cancelled while it waits gives its tokens back."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        requests: Any = None,
        tokens: Any = None,
        input_tokens: Any = None,
        output_tokens: Any = None,
        key: Callable[[httpx.Request], str] = default_key,
        estimate: Callable[[httpx.Request], Tokens | None] = estimate_tokens,
        usage: Callable[[httpx.Response], Tokens | None] | None = read_usage,
        margin: float = 0.05,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if transport is not None and not callable(getattr(transport, "handle_async_request", None)):
            raise TypeError(f"transport must be an httpx async transport, got {transport!r}")
        self._transport = transport
        self._settings = _Settings(
            requests=requests,
            tokens=tokens,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            key=key,
            estimate=estimate,
            usage=usage,
            margin=margin,
            clock=clock,
            asynchronous=True,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._run(self._settings.flow(request))

    async def _run(self, flow: Generator[Step, Any, T]) -> T:
        answer: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = flow.send(answer) if error is None else flow.throw(error)
            except StopIteration as done:
                result: T = done.value
                return result
            answer, error = None, None
            try:
                answer = await self._carry_out(step)
            except BaseException as failed:  # the procedure decides what it means
                error = failed

    async def _carry_out(self, step: Step) -> Any:
        if isinstance(step, Call):
            answer = step.function(*step.args, **dict(step.kwargs))
            return await answer if inspect.isawaitable(answer) else answer
        if isinstance(step, Sleep):
            sleep = getattr(self._settings.clock, "sleep_async", None)
            return await (sleep if callable(sleep) else asyncio.sleep)(max(0.0, step.seconds))
        if isinstance(step, Wait):
            waiting = getattr(step.reservation, "wait_async", None) or step.reservation.wait
            return await waiting()
        if isinstance(step, Send):
            if self._transport is None:
                self._transport = _library(step.request).AsyncHTTPTransport()
            return await self._transport.handle_async_request(step.request)
        settle = step.settle
        stream = _stream_class(_library(step.response), True)
        step.response.stream = stream(_Body(step), lambda read: self._run(settle(read)))
        return None

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()
