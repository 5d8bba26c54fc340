"""Streamed bodies that hold a request's permits (``concurrency=``) to their end.

A WSGI server, and Django's handlers, iterate a streamed body chunk by chunk and
call its ``close()`` when they are done with it: after the last chunk, or when
the client went away and a write failed. :class:`StreamedBody` and
:class:`AsyncStreamedBody` wrap such a body: each chunk renews the permits
(:meth:`RequestLimits.keep_alive`, so a response longer than their ``ttl`` keeps
its slot), and with ``releases=True`` the end of the body or its ``close()``
releases them (:meth:`RequestLimits.close`). Flask releases through
``response.call_on_close`` instead and wraps with ``releases=False``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

from bucketlimit._web.request_limits import RequestLimits


class StreamedBody:
    """A body that renews ``limits``' permits at each chunk; with ``releases`` its
    end (or ``close()``) releases them. Closing it closes the body it wraps."""

    __slots__ = ("_body", "_chunks", "_limits", "_releases")

    def __init__(self, body: Iterable[Any], limits: RequestLimits, *, releases: bool) -> None:
        self._body = body
        self._chunks = iter(body)
        self._limits = limits
        self._releases = releases

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            chunk = next(self._chunks)
        except StopIteration:
            if self._releases:
                self._limits.close()
            raise
        self._limits.keep_alive()
        return chunk

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if callable(close):
                close()
        finally:
            if self._releases:
                self._limits.close()


class AsyncStreamedBody:
    """:class:`StreamedBody` for an asynchronous body (Django's async streaming): its
    permits' releases and renewals are synchronous ones (the adapter refuses an
    asyncio concurrency limiter there)."""

    __slots__ = ("_chunks", "_limits")

    def __init__(self, body: AsyncIterable[Any], limits: RequestLimits) -> None:
        self._chunks = aiter(body)
        self._limits = limits

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            self._limits.close()
            raise
        self._limits.keep_alive()
        return chunk

    def close(self) -> None:
        self._limits.close()
