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
    MANY = b"m"  # a batch of allows, one per key (the own form only: shared round trips)
    RESET = b"d"  # not a script mode: a reset deletes the bucket's key
    CHECK = b"check"  # not a script mode: check() runs the script as a peek, then INFO


# The members as module constants: reading one through its class costs about
# 80 ns on CPython 3.11, and every call compares its mode several times.
ALLOW, PEEK, REFUND, RESET, CHECK = Mode.ALLOW, Mode.PEEK, Mode.REFUND, Mode.RESET, Mode.CHECK
RESERVE, CHARGE, MANY = Mode.RESERVE, Mode.CHARGE, Mode.MANY

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


#: bucket.lua as written: the general form, which allow_all runs.
BUCKET_SCRIPT: Final = Script(
    resources.files("bucketlimit._redis").joinpath("bucket.lua").read_text("utf-8")
)

# The one line of bucket.lua that reads a bucket's configuration from ARGV.
_CONFIG_LINE: Final = re.compile(r"^(\s*local ([\w, ]+) = ).*-- config$", re.MULTILINE)


def specialize(template: str, capacity: int, unit: int, p: int) -> str:
    """A limiter's own form of the script: ``template`` (bucket.lua) with the limiter's
    configuration written into the line marked ``config`` (its names: capacity, unit
    and p get the numbers, cost the script's ARGV[1], x where the 4 more start after
    now, own ``true``), so that a call sends one key and at most seven arguments. A template whose
    line names only capacity, unit and p (an older bucket.lua, a study's variant)
    gets just those. Comment lines are dropped: Redis keeps one copy of each
    distinct script for as long as it runs."""
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
    lines = [line for line in source.splitlines() if line.strip() and not _is_comment(line)]
    return "\n".join(lines) + "\n"


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("--")
