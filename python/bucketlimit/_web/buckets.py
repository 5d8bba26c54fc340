"""Which buckets a limit string's limiter keeps (docs/design.md §7, "One set of
buckets per (route or name, limit)").

A ``Limit("5/minute")`` builds its limiter when first needed, on its ``storage=`` or
the app's. Its buckets are one set per (scope, limit) on every storage: in process
the limit's own limiter (one per shared ``scope``), in Redis a prefix naming the
scope and the limit. The scope is the ``scope=`` given, else the route the limit
is attached to, else its name; the names are the same in every process.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import quote

from bucketlimit import _config

#: The in-process limiters of limit strings with a shared ``scope=``: one per
#: (scope, limit), as their Redis prefix names one set of buckets per (scope, limit).
_SCOPED: dict[tuple[str, _config.ParsedLimit], Any] = {}
_SCOPED_LOCK = threading.Lock()


def qualified_name(thing: object) -> str:
    """A class's (or function's) module and qualified name (``myapp.throttles.Burst``),
    the same in every process."""
    module = getattr(thing, "__module__", None) or "?"
    qualname = getattr(thing, "__qualname__", None) or getattr(thing, "__name__", "?")
    return f"{module}.{qualname}"


def bucket_prefix(scope: str, text: str) -> str:
    """The Redis prefix of a limit string's buckets: the scope they belong to and the
    limit itself; braces (a key's hash tag), colons and the like are escaped."""
    capacity, rate, per = _config.parse_limit(text)
    return f"bucketlimit:{quote(scope, safe='/._-~ ')}:{capacity}:{rate}/{per}:"


def _in_process(scope: str | None, text: str) -> Any:
    if scope is None:
        return _config.limiter(text)
    parsed = _config.parse_limit(text)
    with _SCOPED_LOCK:
        found = _SCOPED.get((scope, parsed))
        if found is None:
            found = _SCOPED[(scope, parsed)] = _config.limiter(parsed)
        return found


class LimitString:
    """One limit string of a limit, and the limiter built from it.

    ``storage`` is the limit's own (``None``: the app's), ``scope`` its shared scope
    (``None``: the route, else the name), ``route`` the route it was attached to.
    """

    __slots__ = ("built", "built_on", "route", "scope", "storage", "text")

    def __init__(self, text: str, storage: str | None, scope: str | None) -> None:
        if storage is not None:
            _config.storage_scheme(storage)  # a bad URI fails here
        self.text = text
        self.storage = storage
        self.scope = scope
        self.route: str | None = None
        self.built: Any = None  # the limiter built, on ``built_on``
        self.built_on = ""

    def bucket_scope(self, name: str) -> str:
        return self.scope or self.route or name

    def build(self, storage: str, name: str, asyncio: bool) -> Any:
        """The limiter on the limit's own storage, else ``storage`` (the asyncio Redis
        limiter where ``asyncio``), keeping the buckets of (scope, limit)."""
        where = self.storage or storage
        if _config.storage_scheme(where)[0] == _config.MEMORY:
            built = _in_process(self.scope, self.text)
        else:
            built = _config.limiter(
                self.text,
                storage=where,
                async_=True if asyncio else None,
                prefix=bucket_prefix(self.bucket_scope(name), self.text),
            )
        self.built, self.built_on = built, where
        return built

    def attach(self, route: str | None, in_use: bool, name: str, asyncio: bool) -> Any:
        """Records the route; returns the limiter built again under it when the one in
        use was built before (under the name, in Redis), else ``None``."""
        self.route = route
        stale = route is not None and in_use and self.scope is None
        if not stale or _config.storage_scheme(self.built_on)[0] == _config.MEMORY:
            return None  # the same buckets either way
        return self.build(self.built_on, name, asyncio)
