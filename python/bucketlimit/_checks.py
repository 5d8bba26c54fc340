"""Where ``bucketlimit.allow_all`` and the ``*_all`` family send their checks
(docs/design.md §2).

The in-process limiters are checked by the core (``bucketlimit._core``). A module
that adds limiters keeping their buckets elsewhere (``bucketlimit.redis``)
registers a :class:`Backend` for its classes when it is imported, so the
top-level package never imports a Redis client: no Redis limiter can exist before
its module was imported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class Backend(Protocol):
    """The ``*_all`` family over one kind of limiter; ``kind`` names it in errors."""

    kind: str

    def allow_all(self, checks: Iterable[Any], cost: Any) -> Any: ...
    def reserve_all(self, checks: Iterable[Any], cost: Any, max_wait: Any) -> Any: ...
    def acquire_all(self, checks: Iterable[Any], cost: Any, timeout: Any) -> Any: ...
    def acquire_all_async(self, checks: Iterable[Any], cost: Any, timeout: Any) -> Any: ...


_BACKENDS: dict[type, Backend] = {}

#: The kind of the limiters the core checks, in errors.
IN_PROCESS = "in-process"


def register(limiter_class: type, backend: Backend) -> None:
    """``limiter_class`` (and its subclasses) are checked by ``backend``."""
    _BACKENDS[limiter_class] = backend


def _backend_of(limiter: object) -> Backend | None:
    for cls in type(limiter).__mro__:
        backend = _BACKENDS.get(cls)
        if backend is not None:
            return backend
    return None


def route(checks: Iterable[Any], what: str) -> tuple[Iterable[Any], Backend | None]:
    """The checks (a list once read) and the backend of their limiters, or ``None``
    for the core. Kinds cannot be mixed: each keeps its buckets elsewhere, so no
    single step can check them all (``TypeError``). Anything that is not a check
    is left for the core to reject as it always has."""
    if not _BACKENDS:
        return checks, None
    checks = list(checks)
    found: dict[str, Backend | None] = {}
    for item in checks:
        limiter = item[0] if isinstance(item, tuple) and item else None
        backend = _backend_of(limiter)
        found[IN_PROCESS if backend is None else backend.kind] = backend
    if len(found) > 1:
        kinds = ", ".join(sorted(found))
        raise TypeError(
            f"{what} cannot mix {kinds} limiters: each kind keeps its buckets elsewhere, "
            "so no single step can check them all"
        )
    return checks, next(iter(found.values()), None)
