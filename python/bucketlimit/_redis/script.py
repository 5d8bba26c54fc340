"""The Lua script (``bucket.lua``, the twin of ``src/bucket.rs``), its arguments and replies.

``bucket.lua`` as written is the general form, which ``allow_all`` runs with each
bucket's configuration as arguments. Each limiter runs its own form
(:func:`specialize`): its configuration written into the script, so that the common
call, an allow of one token on the server's clock, sends one key and no argument.
"""

from __future__ import annotations

import enum
import hashlib
import re
from importlib import resources
from typing import Any, Final

#: Lua numbers are doubles: integers are exact below 2**53 and no further.
LUA_EXACT: Final = 2**53

#: Capacities a bucket may owe at most (src/bucket.rs; bucket.lua's MAX_DEBT_CAPACITIES).
MAX_DEBT_CAPACITIES: Final = 1000


def max_debt_capacities(full: int, p: int) -> int:
    """Capacities a bucket of ``full`` units refilled ``p`` a microsecond may owe on
    Redis (bucket.lua's D): MAX_DEBT_CAPACITIES where ``(1 + D) * full + p`` stays
    below 2**53, the most that does where that many would not, and 0 for the
    largest configurations the script computes at all (docs/design.md §4)."""
    return min(MAX_DEBT_CAPACITIES, (LUA_EXACT - 1 - p) // full - 1)


#: The ``now`` argument that asks the general script to read the server's TIME.
SERVER_TIME: Final = b""

#: The arguments of the common call: an allow of one token on the server's clock.
NO_ARGS: Final[tuple[Any, ...]] = ()


class Mode(enum.Enum):
    """What a call does; the value is the script's mode argument (ARGV[2])."""

    ALLOW = b"a"
    PEEK = b"p"
    REFUND = b"r"  # any give-back: refund, a reservation's cancel, settle below its cost
    RESERVE = b"v"
    CHARGE = b"c"
    OBSERVE = b"o"  # an upstream's report: its cap (units) as the cost, its age (µs) after now
    MANY = b"m"  # a batch of allows, one per key (the own form only: shared round trips)
    LEASE = b"l"  # take a lease, give one back (the own form only: docs/design.md §6)
    RESET = b"d"  # not a script mode: a reset deletes the bucket's key
    CHECK = b"check"  # not a script mode: check() runs the script as a peek, then INFO
    # A permit key alone (the general form; bucketlimit._redis.permits): a
    # concurrency limiter's own calls.
    TAKE = b"T"  # try_acquire: a permit now, or a refusal
    QUEUE = b"Q"  # acquire: a permit now, or a place in the key's queue
    POLL = b"W"  # a waiter: its grant, or its place (its lease renewed)
    GIVE_UP = b"G"  # a waiter's timeout ended: its grant, or refused (it leaves)
    ABANDON = b"X"  # a waiter cancelled: it leaves, releasing a grant handed to it
    RELEASE = b"R"  # a permit released by its member
    RENEW = b"N"  # a permit extended, while held
    VALID = b"K"  # whether a permit is held (a read)
    IN_FLIGHT = b"I"  # the permits held now


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

#: The values the general form takes per key (bucket.lua): now, capacity, unit, p,
#: cost, then 4 more (a reservation's max_wait; a give-back's line and cost).
PER_KEY: Final = 9

#: Where the own form reads its 4 more (bucket.lua's config line: ``x = 4``).
OWN_X: Final = 4

#: The value that says "none": no max_wait, no line.
NONE: Final = b""


class Script:
    """A Lua script and its SHA1, the name EVALSHA knows it by."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()


#: The live processes sharing a limiter (docs/design.md §6, "How many processes"):
#: KEYS[1] a sorted set of processes scored by the ms they stop counting at, on the
#: server's clock; ARGV[1] this process, ARGV[2] how long it counts, in ms. One step:
#: forget the expired, count this one, answer how many count.
HEARTBEAT: Final = Script(
    "local t = redis.call('TIME')\n"
    "local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
    "redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)\n"
    "redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])\n"
    "redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
    "return redis.call('ZCARD', KEYS[1])\n"
)

#: bucket.lua as written: the general form, which allow_all runs.
BUCKET_SCRIPT: Final = Script(
    resources.files("bucketlimit._redis").joinpath("bucket.lua").read_text("utf-8")
)

# The one line of bucket.lua that reads a bucket's configuration from ARGV.
_CONFIG_LINE: Final = re.compile(r"^(\s*local ([\w, ]+) = ).*-- config$", re.MULTILINE)

# The part of bucket.lua only the general form runs (its permit keys), which a
# limiter's own form leaves out: it never names a permit key.
_GENERAL_ONLY: Final = re.compile(
    r"^-- general form only: begin$.*?^-- general form only: end$\n?", re.MULTILINE | re.DOTALL
)


def specialize(template: str, capacity: int, unit: int, p: int) -> str:
    """A limiter's own form of the script: ``template`` (bucket.lua) with the limiter's
    configuration written into the line marked ``config`` (its names: capacity, unit
    and p get the numbers, cost the script's ARGV[1], x where the 4 more start after
    now, own ``true``), so that a call sends one key and at most seven arguments. A template whose
    line names only capacity, unit and p (an older bucket.lua, a study's variant)
    gets just those. Comment lines are dropped, and the part marked "general form
    only" (permit keys, which a limiter's own form never names): Redis keeps one
    copy of each distinct script for as long as it runs."""
    own = {"capacity": str(capacity), "unit": str(unit), "p": str(p), "cost": "cost"}
    own["x"] = str(OWN_X)
    own["own"] = "true"

    def written(match: re.Match[str]) -> str:
        names = [name.strip() for name in match.group(2).split(",")]
        if not set(names) <= own.keys():
            raise RuntimeError(f"bucket.lua's config line names {names}")
        return match.group(1) + ", ".join(own[name] for name in names)

    source, found = _CONFIG_LINE.subn(written, template)
    if found != 1:
        raise RuntimeError("bucket.lua has no line ending in '-- config'")
    source = _GENERAL_ONLY.sub("", source)
    lines = [line for line in source.splitlines() if line.strip() and not _is_comment(line)]
    return "\n".join(lines) + "\n"


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("--")
