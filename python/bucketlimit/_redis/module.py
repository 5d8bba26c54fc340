"""The Redis/Valkey module's commands: the twins of the scripts' calls (scripts.md;
docs/redis.md, "The module").

The module (``module/`` in the source tree, shipped as the file
``bucketlimit.redis.module_path()`` names) runs the core's arithmetic inside the
server, on the values the script stores, so a key may be served by either. A
limiter's :class:`Engine` says which it uses: ``"auto"`` (the default) sends the
module's command and, when the server says it has none (``unknown command``:
nothing ran), goes back to the script for good; ``"module"`` only the module;
``"lua"`` only the script.

The flows build every call as the script's command (``flows.ScriptCommand``);
the drivers send its twin here instead (:func:`twin`): the same keys, the values
each command takes (the module's commands name the configuration that a
limiter's own form of the script has written in), and a reply of the script's
shape (:func:`parsed`). A call with no twin (the heartbeat, a call over token
buckets and permit keys together) goes as the script.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from importlib import resources
from typing import Any, Final, Literal

logger = logging.getLogger("bucketlimit")

#: The core's debt bound in capacities (src/bucket.rs), which the module keeps.
MAX_DEBT_CAPACITIES: Final = 1000

#: What a limiter runs its calls with (the constructors' ``engine``).
EngineName = Literal["auto", "module", "lua"]
ENGINES: Final = ("auto", "module", "lua")

#: The module file's name in the package (not importable: a hyphen).
MODULE_FILE: Final = "bucketlimit-redis.so"

# The script's operation (ARGV[2]) -> the module's command and how many of the
# script's 4 more values per key it takes (a reservation its max_wait, a give-back
# its line and cost, an observe its age).
_BUCKETS: Final = {
    b"allow": ("BUCKETLIMIT.ALLOW", 0),
    b"peek": ("BUCKETLIMIT.PEEK", 0),
    b"reserve": ("BUCKETLIMIT.RESERVE", 1),
    b"charge": ("BUCKETLIMIT.CHARGE", 0),
    b"give-back": ("BUCKETLIMIT.GIVEBACK", 4),
    b"observe": ("BUCKETLIMIT.OBSERVE", 1),
    b"lease": ("BUCKETLIMIT.LEASE", 5),
}
_PERMITS: Final = {
    b"take": "BUCKETLIMIT.TAKE",
    b"queue": "BUCKETLIMIT.QUEUE",
    b"poll": "BUCKETLIMIT.POLL",
    b"give-up": "BUCKETLIMIT.GIVEUP",
    b"abandon": "BUCKETLIMIT.ABANDON",
    b"release": "BUCKETLIMIT.RELEASE",
    b"renew": "BUCKETLIMIT.RENEW",
    b"valid": "BUCKETLIMIT.VALID",
    b"in-flight": "BUCKETLIMIT.INFLIGHT",
}
#: Keys per bucket and per permit key in the general script (scripts.md): a bucket
#: and its lease hash; a permit's hash and its three sorted sets. The module's
#: commands name the first of each and derive the others (one hash slot).
_BUCKET_KEYS: Final = 2
_PERMIT_KEYS: Final = 4
_MANY: Final = "BUCKETLIMIT.MANY"
_SCRIPT_CALLS: Final = (b"EVALSHA", b"EVAL", "EVALSHA", "EVAL")
#: Values per bucket or permit key in the general script.
_PER_KEY: Final = 9


def module_path() -> str:
    """The path of the Redis/Valkey module file shipped in the package, for
    ``redis-server --loadmodule`` (docs/redis.md, "The module"). Raises
    ``FileNotFoundError`` when this build has none (one built from the sdist
    without ``make module``)."""
    path = str(resources.files("bucketlimit").joinpath(MODULE_FILE))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"this build of bucketlimit ships no Redis module ({path} is missing): "
            "install a wheel, or build it from the source tree with `make module`"
        )
    return path


def check_engine(engine: object) -> EngineName:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
    return engine  # type: ignore[return-value,unused-ignore]  # checked above


class Engine:
    """Which a limiter runs: the module's commands (``module``), or the script.
    ``"auto"`` sends the module's until a server says it has none."""

    __slots__ = ("module", "name")

    def __init__(self, name: EngineName) -> None:
        self.name = name
        #: Whether the drivers send the module's commands now.
        self.module = name != "lua"

    def absent(self, limiter: str, error: BaseException) -> bool:
        """A server answered a module command with ``unknown command``: under
        ``"auto"`` the limiter goes back to the script (True: send it instead);
        under ``"module"`` the call fails (False)."""
        if self.name != "auto":
            return False
        if self.module:
            self.module = False
            logger.debug(
                "%s: the server has no bucketlimit module (%s); the Lua scripts serve it",
                limiter,
                error,
            )
        return True


def unknown(error: BaseException) -> bool:
    """The server has no such command (the module is not loaded): the server's
    reply, or a cluster client's, which looks its commands up first."""
    message = str(error)
    return message.lower().startswith("unknown command") or "command doesn't exist" in message


def twin(state: Any, argv: Sequence[Any]) -> tuple[Any, ...] | None:
    """The module's command for ``argv``, a script call of ``state`` (a token bucket
    or a concurrency limiter's state): its own form (``state.own``) or the general
    form (``state.script``); ``None`` when it has none."""
    if not argv or argv[0] not in _SCRIPT_CALLS:
        return None
    script, n = argv[1], argv[2]
    keys, args = argv[3 : 3 + n], argv[3 + n :]
    if getattr(state, "debt_capacities", MAX_DEBT_CAPACITIES) < MAX_DEBT_CAPACITIES:
        return None  # a bound the module does not keep (engine="auto": the script's)
    own = getattr(state, "own", None)
    if own is not None and script in (own.sha, own.source):
        return _own(state, keys, args)
    general = state.script
    if script in (general.sha, general.source):
        return _general(keys, args)
    return None


def _own(state: Any, keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...] | None:
    """A limiter's own script: cost, operation, now, then up to 5 more (all optional);
    its keys the bucket (and its lease hash, which the module derives), or a batch's
    buckets."""
    mode = _bytes(args[1]) if len(args) > 1 and args[1] else b"allow"
    config = (state.capacity, state.unit, state.p)
    now = args[2] if len(args) > 2 else b""
    if mode == b"many":
        costs = [*args[3:], *[b""] * (len(keys) - len(args[3:]))]  # absent: 1
        pairs: list[Any] = []
        for key, cost in zip(keys, costs, strict=True):
            pairs += (key, cost)
        return (_MANY, now, *config, *pairs)
    found = _BUCKETS.get(mode)
    if found is None:
        return None
    name, more = found
    cost = args[0] if args else 1
    extra = [*args[3 : 3 + more]]
    extra += [b""] * (more - len(extra))
    return (name, keys[0], now, *config, cost, *extra)


def _general(keys: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...] | None:
    """The general script: ARGV[1] the permit keys (4 KEYS each, after the buckets'
    2 each), ARGV[2] the operation, then 9 values per bucket or permit key."""
    permits = int(args[0] or 0)
    mode = _bytes(args[1])
    if permits:
        if permits != 1 or len(keys) != _PERMIT_KEYS or mode not in _PERMITS:
            return None  # token buckets and permits in one call: the script
        now, limit, ttl, lease, _, member, name, extra, _ = args[2 : 2 + _PER_KEY]
        return (_PERMITS[mode], keys[0], now, limit, ttl, lease, member, name, extra)
    found = _BUCKETS.get(mode)
    if found is None:
        return None
    command, more = found
    out: list[Any] = [command]
    for i, key in enumerate(keys[::_BUCKET_KEYS]):
        values = args[2 + i * _PER_KEY : 2 + (i + 1) * _PER_KEY]
        out += (key, *values[:5], *values[5 : 5 + more])
    return tuple(out)


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def parsed(reply: Any) -> Any:
    """A module reply in the script's shape: integers past 2**63 - 1 (which the
    module sends as decimal strings, where Lua's doubles could not reach) as
    ints."""
    if isinstance(reply, list):
        return [parsed(item) for item in reply]
    if isinstance(reply, bytes):
        return int(reply)
    return reply
