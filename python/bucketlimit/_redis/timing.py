"""Where a Redis limiter's calls take their time from (docs/design.md §6, "Time").

By default each script reads the store's ``TIME`` (``"script"``), so processes
with skewed clocks agree. Some stores refuse ``TIME`` inside scripts (ElastiCache
Serverless: "This Redis command is not allowed from script"; an ACL without it).
There the calls send the time instead, and the script never moves a bucket's
clock back (it refills only forward), so the bound stays ``capacity + rate * T``
plus ``rate`` times the disagreement of the times sent:

- ``"store"``: the store's ``TIME`` read as a command, kept as an offset to this
  host's monotonic clock and read again every :data:`REFRESH` seconds (processes
  then disagree by at most half a round trip each, plus the drift between two
  readings);
- ``"client"``: this host's wall clock (``time.time``; hosts kept by NTP
  disagree by its error), where the store refuses ``TIME`` altogether.

``time_source="auto"`` (the default) starts with ``"script"`` and, at the first
script the store refuses for it, reads ``TIME`` as a command: ``"store"`` when it
answers, else ``"client"``; one INFO line says so. A limiter given a ``clock``
sends that clock's readings, as always; under ``"store"`` and ``"client"`` the
real time is still sent where a permit's counter the store lost starts again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any, Final, Literal, cast

logger = logging.getLogger("bucketlimit")

#: Where the calls take their time from (the limiters' ``time_source``).
TimeSource = Literal["auto", "script", "store", "client"]
TIME_SOURCES: Final = ("auto", "script", "store", "client")
AUTO: Final = "auto"
SCRIPT: Final = "script"
STORE: Final = "store"
CLIENT: Final = "client"

#: Seconds between two readings of the store's TIME under ``"store"``.
REFRESH: Final = 30.0

# What a store says when a script may not run TIME (or a command the ACL forbids).
_REFUSED_IN_SCRIPT: Final = ("not allowed from script", "The user executing the script can't")


def check_time_source(source: object) -> TimeSource:
    if not isinstance(source, str):
        raise TypeError(f"time_source must be a str, got {type(source).__name__}")
    if source not in TIME_SOURCES:
        raise ValueError(
            f"time_source must be one of {', '.join(map(repr, TIME_SOURCES))}, got {source!r}"
        )
    return cast("TimeSource", source)


class StoreTime:
    """One limiter's time source (see the module docstring): whether its calls send
    the time (``supplied``), and the time they send, in µs."""

    __slots__ = ("_lock", "_offset", "_read_at", "choice", "source", "supplied")

    def __init__(self, choice: TimeSource) -> None:
        self.choice = choice
        self.source: str = SCRIPT if choice in (AUTO, SCRIPT) else choice
        self.supplied = self.source != SCRIPT
        self._offset: int | None = None  # the store's µs less this host's monotonic µs
        self._read_at = -math.inf
        self._lock = threading.Lock()

    def stale(self) -> bool:
        """Whether the store's TIME is due to be read (``"store"`` only)."""
        return self.source == STORE and time.monotonic() - self._read_at >= REFRESH

    def read(self, reply: Any, before: int, after: int) -> None:
        """The store's ``TIME`` (``[seconds, microseconds]``), asked at ``before`` and
        answered at ``after`` (``time.monotonic_ns()``): taken as read halfway."""
        seconds, micros = (int(value) for value in reply[:2])
        with self._lock:
            self._offset = seconds * 1_000_000 + micros - (before + after) // 2_000
            self._read_at = time.monotonic()

    def micros(self) -> int:
        """The time a call sends now, in µs."""
        if self.source == CLIENT or self._offset is None:
            return time.time_ns() // 1_000
        return time.monotonic_ns() // 1_000 + self._offset

    def refused(self, error: BaseException) -> bool:
        """Whether ``error``, a script's, may be the store refusing TIME to scripts
        under ``"auto"``: the call goes once more, with the time sent (another
        call may have switched the source meanwhile: then it is sent already)."""
        return self.choice == AUTO and any(words in str(error) for words in _REFUSED_IN_SCRIPT)

    def switch(self, name: str, why: BaseException, reply: Any, before: int, after: int) -> None:
        """The store refused TIME to a script (``why``): the calls send the time from
        now on, the store's (``reply`` to a TIME command, ``None`` when refused too)
        or this host's; said once, at INFO."""
        if reply is not None:
            self.read(reply, before, after)
            self.source, what = (
                STORE,
                (
                    "the store's TIME read as a command, kept against this host's monotonic "
                    f"clock (read again every {REFRESH:g} s)"
                ),
            )
        else:
            self.source, what = CLIENT, "this host's clock (the store refuses TIME altogether)"
        self.supplied = True
        logger.info(
            "%s: the store refuses TIME inside scripts (%s); its calls send the time "
            "instead: %s (docs/redis.md, 'Managed stores'; time_source= chooses it)",
            name,
            why,
            what,
        )


def with_time(argv: Sequence[Any], layout: str, micros: int) -> tuple[Any, ...]:
    """A script call's ``argv`` (``EVALSHA|EVAL script numkeys keys... args...``) with
    the time it leaves to the script's TIME filled in (scripts.md): ``layout`` is
    ``"limiter"`` (ARGV[3]), ``"general"`` (each key's first value, and a permit
    key's floor) or ``"heartbeat"`` (ARGV[3], in ms)."""
    keys = int(argv[2])
    head, args = list(argv[: 3 + keys]), list(argv[3 + keys :])
    if layout == "heartbeat":
        if len(args) < 3:
            args.append(micros // 1_000)
    elif layout == "limiter":
        args += [b""] * (3 - len(args))
        if args[0] in ("", b""):
            args[0] = 1
        if args[1] in ("", b""):
            args[1] = b"allow"
        if args[2] in ("", b""):
            args[2] = micros
    else:
        permits = int(args[0] or 0)
        groups = (len(args) - 2) // 9
        for group in range(groups):
            at = 2 + group * 9
            if args[at] in ("", b""):
                args[at] = micros
            if group >= groups - permits and args[at + 8] in ("", b""):
                args[at + 8] = micros  # the real time, where a lost counter starts again
    return (*head, *args)
