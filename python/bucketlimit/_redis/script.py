"""The Lua scripts (``scripts.lua``; the token bucket is the twin of ``src/bucket.rs``),
their keys and arguments.

``scripts.lua`` holds named fragments; :func:`assembled` pastes them into the
scripts a limiter sends (the table of their KEYS, ARGV and replies is
``scripts.md`` beside it): each limiter's own script, its configuration written
in, so that the common call, an allow of one token on the server's clock, sends
one key and no argument; the general script, which the calls over several
limiters and the permits run with each bucket's configuration as arguments; and
the heartbeat.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re
from importlib import resources
from typing import Any, Final

#: Lua numbers are doubles: integers are exact below 2**53 and no further.
LUA_EXACT: Final = 2**53

#: Capacities a bucket may owe at most (src/bucket.rs; scripts.lua's MAX_DEBT_CAPACITIES).
MAX_DEBT_CAPACITIES: Final = 1000


def max_debt_capacities(full: int, p: int) -> int:
    """Capacities a bucket of ``full`` units refilled ``p`` a microsecond may owe on
    Redis (the scripts' D): MAX_DEBT_CAPACITIES where ``(1 + D) * full + p`` stays
    below 2**53, the most that does where that many would not, and 0 for the
    largest configurations the script computes at all (docs/design.md §4)."""
    return min(MAX_DEBT_CAPACITIES, (LUA_EXACT - 1 - p) // full - 1)


#: The ``now`` argument that asks the general script to read the server's TIME.
SERVER_TIME: Final = b""

#: The arguments of the common call: an allow of one token on the server's clock.
NO_ARGS: Final[tuple[Any, ...]] = ()


class Mode(enum.Enum):
    """What a call does; the value is the script's operation argument (ARGV[2];
    scripts.md)."""

    ALLOW = b"allow"
    PEEK = b"peek"
    REFUND = b"give-back"  # any give-back: refund, a reservation's cancel, settle below its cost
    RESERVE = b"reserve"
    CHARGE = b"charge"
    OBSERVE = b"observe"  # an upstream's report: its cap (units) as the cost, its age (µs)
    MANY = b"many"  # a batch of allows, one per key (a limiter's own script: shared round trips)
    LEASE = b"lease"  # take a lease, give one back (docs/design.md §6)
    RESET = b"reset"  # not a script's: a reset deletes the bucket's key
    CHECK = b"check"  # not a script's: check() runs the script as a peek, then INFO
    # A permit key alone (the general script; bucketlimit._redis.permits): a
    # concurrency limiter's own calls.
    TAKE = b"take"  # try_acquire: a permit now, or a refusal
    QUEUE = b"queue"  # acquire: a permit now, or a place in the key's queue
    POLL = b"poll"  # a waiter: its grant, or its place (its lease renewed)
    GIVE_UP = b"give-up"  # a waiter's timeout ended: its grant, or refused (it leaves)
    ABANDON = b"abandon"  # a waiter cancelled: it leaves, releasing a grant handed to it
    RELEASE = b"release"  # a permit released by its member
    RENEW = b"renew"  # a permit extended, while held
    VALID = b"valid"  # whether a permit is held (a read)
    IN_FLIGHT = b"in-flight"  # the permits held now


# The members as module constants: reading one through its class costs about
# 80 ns on CPython 3.11, and every call compares its mode several times.
ALLOW, PEEK, REFUND, RESET, CHECK = Mode.ALLOW, Mode.PEEK, Mode.REFUND, Mode.RESET, Mode.CHECK
RESERVE, CHARGE, MANY, OBSERVE, LEASE = (
    Mode.RESERVE,
    Mode.CHARGE,
    Mode.MANY,
    Mode.OBSERVE,
    Mode.LEASE,
)
TAKE, QUEUE, POLL, GIVE_UP, ABANDON = Mode.TAKE, Mode.QUEUE, Mode.POLL, Mode.GIVE_UP, Mode.ABANDON
RELEASE, RENEW, VALID, IN_FLIGHT = Mode.RELEASE, Mode.RENEW, Mode.VALID, Mode.IN_FLIGHT

#: The values the general script takes per bucket or permit key (scripts.md): now,
#: then 8 more (a bucket's capacity, unit, rate, cost and 4 more: a reservation's
#: max_wait, a give-back's line and cost).
PER_KEY: Final = 9

#: The value that says "none": no max_wait, no line.
NONE: Final = b""


class Script:
    """A Lua script and its SHA1, the name EVALSHA knows it by."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()


# -- the keys a script is given besides the bucket's own --------------------------------


def lease_hash(bucket: bytes) -> bytes:
    """The hash of a bucket's lease records (docs/design.md §6, "Hot keys: leases"):
    beside the bucket, in its hash slot."""
    return bucket + b":leases"


def permit_keys(key: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """A permit key's four keys, in the order the general script takes them: its
    hash, the permits held, the waiters queued, the grants not yet picked up (one
    hash slot)."""
    return key, key + b":h", key + b":q", key + b":g"


# -- assembly ---------------------------------------------------------------------------

#: scripts.lua: the fragments every script is assembled from, as a Script (its
#: ``source`` is what counts; a limiter class may run a variant: the parity tests
#: raise its smallest TTL).
FRAGMENTS: Final = Script(
    resources.files("bucketlimit._redis").joinpath("scripts.lua").read_text("utf-8")
)

_FRAGMENT: Final = re.compile(r"^--- (\S.*)$", re.MULTILINE)
_PASTE: Final = re.compile(r"^([ \t]*)--> (\S.*)$", re.MULTILINE)
_NUMBER: Final = re.compile(r"\$(\w+)")


@functools.lru_cache(maxsize=8)
def fragments(source: str) -> dict[str, str]:
    """The fragments of ``source`` by name: each from its line ``--- name`` to the
    next such line."""
    starts = list(_FRAGMENT.finditer(source))
    found: dict[str, str] = {}
    for here, after in zip(starts, [*starts[1:], None], strict=True):
        end = len(source) if after is None else after.start()
        found[here.group(1).strip()] = source[here.end() + 1 : end]
    return found


def assembled(source: str, name: str, **numbers: int) -> str:
    """The script ``name`` of ``source`` (scripts.lua): its fragment with each line
    ``--> other`` replaced by the fragment ``other`` (indented as that line), each
    ``$number`` by ``numbers[number]``, and comment and blank lines left out: Redis
    keeps one copy of each distinct script for as long as it runs."""
    parts = fragments(source)

    def pasted(fragment: str, within: tuple[str, ...]) -> str:
        if fragment not in parts:
            raise RuntimeError(f"scripts.lua has no fragment {fragment!r}")
        if fragment in within:
            raise RuntimeError(f"scripts.lua pastes {fragment!r} into itself")

        def paste(match: re.Match[str]) -> str:
            text = pasted(match.group(2).strip(), (*within, fragment))
            indent = match.group(1)
            return "\n".join(indent + line if line else line for line in text.splitlines())

        return _PASTE.sub(paste, parts[fragment])

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in numbers:
            raise RuntimeError(f"scripts.lua's {name!r} needs ${match.group(1)}")
        return str(numbers[match.group(1)])

    text = pasted(name, ())
    lines = [line for line in text.splitlines() if line.strip() and not _is_comment(line)]
    return _NUMBER.sub(number, "\n".join(lines) + "\n")


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("--")


def limiter_script(source: str, capacity: int, unit: int, rate: int) -> Script:
    """A limiter's own script: its capacity, its unit (units per token) and its rate
    (units refilled per µs, the limiter's ``p``) written in."""
    return Script(assembled(source, "limiter", capacity=capacity, unit=unit, rate=rate))


@functools.lru_cache(maxsize=8)
def general_script(source: str) -> Script:
    """The general script: the calls over several limiters, and the permits (one
    Script per source, which every limiter built from it shares)."""
    return Script(assembled(source, "general"))


#: The general script of scripts.lua as shipped (the permits run it).
GENERAL: Final = general_script(FRAGMENTS.source)

#: The live processes sharing a limiter (docs/design.md §6, "How many processes";
#: scripts.md).
HEARTBEAT: Final = Script(assembled(FRAGMENTS.source, "heartbeat"))
