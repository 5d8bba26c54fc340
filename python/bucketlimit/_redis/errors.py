"""What an error from the Redis client means to a limiter (docs/design.md §6), decided once.

:func:`classify` sorts every error a command can raise into four kinds:

- ``FAULT``: the store is down, slow, or cannot serve now (connection errors,
  timeouts, ``BUSY``, ``LOADING``, ``READONLY``, ``OOM``, ``MISCONF``,
  ``CLUSTERDOWN``, ``MASTERDOWN``, ``TRYAGAIN``): the ``on_store_error`` policy
  answers and the breaker opens.
- ``CORRUPT``: a bucket's key holds something that is not a bucket: a store fault
  that is never an allow.
- ``CONFIG``: no retry will fix it (credentials, ACLs, a cluster behind a plain
  client, a server too old for the script): :class:`ConfigurationError`, whatever
  the policy, so a misconfigured limiter never silently fails open.
- ``EXHAUSTED``: the client's own connection pool is full (redis-py's
  ``MaxConnectionsError``, which the drivers wait out for a while first, or a
  blocking pool that found no free connection within its timeout): this process
  is busy, not the store down. The policy answers that one call
  (``degraded=True``) and the breaker stays as it was.
- ``REDIRECTED``: a cluster client gave up after 16 ``MOVED``/``ASK``/``TRYAGAIN``
  replies in a row (``ClusterError("TTL exhausted.")``), as redis-py's asyncio
  cluster client can during a slot migration: every node answered, none ran the
  script. Sent once more; if it storms again, answered like ``EXHAUSTED``.
- ``OTHER``: not the store's doing (a bug, a cancellation): raised as it is.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Final

from bucketlimit import _errors
from bucketlimit._redis import clients
from bucketlimit._redis.clients import CLIENT_MODULES, errors

# One table for both clients: each name below is a tuple of that class from every
# installed library (redis-py's and valkey-py's), so one isinstance check sorts
# either client's errors.
AskError: Final = errors("AskError")
AuthenticationError: Final = errors("AuthenticationError", "AuthenticationWrongNumberOfArgsError")
AuthorizationError: Final = errors("AuthorizationError", "NoPermissionError")
ClusterCrossSlotError: Final = errors("ClusterCrossSlotError")
ClusterError: Final = errors("ClusterError")
ExternalAuthProviderError: Final = errors("ExternalAuthProviderError")  # redis-py only
InvalidResponse: Final = errors("InvalidResponse")
MaxConnectionsError: Final = errors("MaxConnectionsError")
MovedError: Final = errors("MovedError")
NoPermissionError: Final = errors("NoPermissionError")
NoScriptError: Final = errors("NoScriptError")
OutOfMemoryError: Final = errors("OutOfMemoryError")
ReadOnlyError: Final = errors("ReadOnlyError")
ClusterException: Final = errors("RedisClusterException", "ValkeyClusterException")
ResponseError: Final = errors("ResponseError")
#: Every error of the client libraries (their base classes).
LibraryError: Final = errors("RedisError", "ValkeyError")
SlotNotCoveredError: Final = errors("SlotNotCoveredError")
TryAgainError: Final = errors("TryAgainError")
ClientConnectionError: Final = errors("ConnectionError")
ClientTimeoutError: Final = errors("TimeoutError")

if TYPE_CHECKING:
    from redis.exceptions import ConnectionError as _ConnectionErrorBase
    from redis.exceptions import ResponseError as _ResponseErrorBase
else:
    # With redis-py installed these are its classes (and valkey-py's too, when both
    # are); with valkey-py alone, valkey-py's.
    _ResponseErrorBase = clients.base("ResponseError", Exception)
    _ConnectionErrorBase = clients.base("ConnectionError", ConnectionError)


class CorruptBucketError(_ResponseErrorBase):
    """A bucket's key holds a value the script does not recognise as a bucket.

    Such a value is never read as an allow. It is a store fault, counted in
    ``stats()["store_errors"]``: under ``on_store_error="raise"`` the call raises
    this error; under every other policy the call is refused (``degraded=True``).
    It is a ``ResponseError`` of the installed client libraries (redis-py's, and
    valkey-py's when it is installed), so code catching store errors sees it.
    """


class ConfigurationError(_errors.ConfigurationError):
    """Redis refused the limiter's commands for a reason no retry will fix.

    Wrong credentials, an ACL that forbids EVALSHA, EVAL or the limiter's keys, a
    Redis Cluster node behind a plain client, a server that cannot run the script
    (too old, scripting renamed away), something that does not speak Redis. It is
    raised at first use (or by ``check()``) whatever ``on_store_error`` says, so a
    misconfigured limiter never silently admits everything; the client's error is
    its ``__cause__``.
    """


class ExactRangeError(_errors.ConfigurationError, ValueError):
    """A configuration the Redis script cannot compute exactly: Lua numbers are
    doubles, exact only below 2**53, and a bucket may owe up to
    ``MAX_DEBT_CAPACITIES`` capacities (docs/design.md §4), so the constructor
    refuses ``(1 + MAX_DEBT_CAPACITIES) * capacity * units per token + units per
    microsecond >= 2**53``. A ``ValueError`` too: a wrong value, raised at once."""


class StoreUnavailableError(_ConnectionErrorBase):
    """Under ``on_store_error="raise"``: the store failed moments ago and the breaker
    skips it until ``retry_interval`` has passed, so no command was sent.

    A ``ConnectionError`` of the installed client libraries (redis-py's, and
    valkey-py's when it is installed), so code catching the client's errors catches
    it too.
    """


# The public errors are documented and raised as bucketlimit.redis's.
for _error in (CorruptBucketError, ConfigurationError, StoreUnavailableError):
    _error.__module__ = "bucketlimit.redis"

#: Writes after TIME in a script need effects replication, the default since 5.0.
MIN_VERSION: Final = (5, 0)
MIN_VERSION_TEXT: Final = "5.0"

# How an error from the client is handled (see classify).
FAULT: Final = "fault"  # the store is down, slow or cannot serve now: the policy answers
CORRUPT: Final = "corrupt"  # a bucket's key holds something else: refused, never allowed
CONFIG: Final = "configuration"  # no retry will fix it: ConfigurationError
OTHER: Final = "other"  # not the store's doing (a bug, a cancellation): raised as is
EXHAUSTED: Final = "exhausted"  # the client's pool is full: the policy answers, no breaker
REDIRECTED: Final = "redirected"  # a redirect storm: nothing ran; resent once, then as EXHAUSTED

# What redis-py's cluster clients raise after RedisClusterRequestTTL redirections.
_REDIRECT_STORM: Final = "TTL exhausted."

# What redis-py's BlockingConnectionPool raises when no connection is free in time.
_POOL_TIMEOUT: Final = "No connection available."

# Checked before FAULT_ERRORS: redis-py's authentication errors are ConnectionErrors.
_CONFIG_ERRORS: Final = (
    *AuthenticationError,  # NOAUTH, WRONGPASS, invalid password
    *AuthorizationError,  # and NOPERM: an ACL forbids a command or a key
    *ExternalAuthProviderError,
    *AskError,  # MOVED or ASK: a cluster node behind a plain client
    *ClusterCrossSlotError,  # CROSSSLOT: keys of one call in different slots
    *InvalidResponse,  # whatever answers does not speak the Redis protocol
)
FAULT_ERRORS: Final = (
    *ClientConnectionError,  # refused, reset, closed; LOADING (BusyLoadingError); max clients
    *ClientTimeoutError,
    *ReadOnlyError,  # a replica after a failover
    *OutOfMemoryError,  # OOM: maxmemory reached
    *ClusterError,  # CLUSTERDOWN, MASTERDOWN
    *TryAgainError,  # TRYAGAIN: a slot being migrated
    *SlotNotCoveredError,
    OSError,
    asyncio.TimeoutError,  # not an OSError before Python 3.11
)
# Error replies the client has no class for, by their first word. valkey-py's
# standalone client has none for the cluster replies (only its cluster client
# parses them into AskError, TryAgainError, ...): a plain valkey.Valkey in front
# of a cluster node sees MOVED as a bare ResponseError.
FAULT_REPLIES: Final = (
    "BUSY ",
    "LOADING ",
    "MISCONF ",
    "NOREPLICAS ",
    "MASTERDOWN ",
    "TRYAGAIN ",
    "CLUSTERDOWN ",
)
_CLUSTER_REPLIES: Final = ("MOVED ", "ASK ", "CROSSSLOT ")
_TOO_OLD_REPLIES: Final = ("unknown command", "unknown subcommand")
# An ACL forbidding a command or a key the script uses (Redis 7, Valkey).
_SCRIPT_DENIED: Final = "The user executing the script can't"
# A store that refuses a command inside scripts (ElastiCache Serverless: TIME).
_NOT_FROM_SCRIPT: Final = "not allowed from script"
# A store that runs no Lua: Valkey 9 with its Lua engine (a module) unloaded.
_NO_SCRIPTING: Final = ("ERR Could not find scripting engine", "Could not find scripting engine")
# What redis-py's cluster clients say, as a RedisClusterException, when no node
# answers or the nodes they reached do not cover the slots: the store is down.
CLUSTER_OUTAGES: Final = (
    "Redis Cluster cannot be connected",
    "Valkey Cluster cannot be connected",
    "All slots are not covered",
    "startup_nodes could not agree",
)


def _raised_by_the_client(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is in the client library."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return isinstance(module, str) and module.startswith(CLIENT_MODULES)


def _caused_by_fault(error: BaseException) -> bool:
    """Whether ``error`` was raised while handling a store fault (its cause chain)."""
    seen: set[int] = set()
    cause = error.__cause__ or error.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, FAULT_ERRORS) and not isinstance(cause, _CONFIG_ERRORS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def classify(error: BaseException) -> str:
    """Whether ``error`` is a store fault, a corrupt bucket, a configuration error or other."""
    if isinstance(error, CorruptBucketError):
        return CORRUPT
    if isinstance(error, MaxConnectionsError) or (
        type(error) in ClientConnectionError and str(error) == _POOL_TIMEOUT
    ):
        return EXHAUSTED
    if type(error) in ClusterError and str(error) == _REDIRECT_STORM:
        return REDIRECTED
    if isinstance(error, _CONFIG_ERRORS):
        return CONFIG
    if isinstance(error, FAULT_ERRORS):
        return FAULT
    if isinstance(error, AttributeError) and _raised_by_the_client(error):
        # redis-py's asyncio cluster client closing a connection another task is
        # using ("'NoneType' object has no attribute 'writelines'"): a lost connection.
        return FAULT
    if isinstance(error, ClusterException):
        # The cluster client found no node to ask (every node down or hung, slots
        # uncovered): an outage. Anything else it refuses before sending is a mistake.
        if _caused_by_fault(error) or str(error).startswith(CLUSTER_OUTAGES):
            return FAULT
        return CONFIG
    if isinstance(error, ResponseError):
        reply = str(error)
        if reply.startswith(FAULT_REPLIES):
            return FAULT
        if reply.startswith(_CLUSTER_REPLIES):
            return CONFIG  # a cluster node behind a plain client (see FAULT_REPLIES)
        # EVALSHA renamed away, or Redis < 5 refusing writes after TIME in a script.
        if reply.startswith(_TOO_OLD_REPLIES) or "non deterministic" in reply:
            return CONFIG
        if reply.startswith((_SCRIPT_DENIED, *_NO_SCRIPTING)) or _NOT_FROM_SCRIPT in reply:
            return CONFIG  # an ACL forbids a command or key the script uses; no Lua
    return OTHER


def configuration_error(error: BaseException) -> ConfigurationError:
    if isinstance(error, AuthenticationError):
        hint = "check the client's username and password"
    elif (
        isinstance(error, AuthorizationError)
        or str(error).startswith(_SCRIPT_DENIED)
        or _NOT_FROM_SCRIPT in str(error)
    ):
        hint = (
            "the Redis user needs EVALSHA, EVAL and DEL, and within the script GET, SET, "
            "PEXPIRE, PTTL, HGETALL, HSET, HDEL and TIME, on keys starting with the prefix "
            "(a store that refuses TIME to scripts: time_source='auto', the default, or "
            "'store' or 'client' sends the time instead)"
        )
    elif isinstance(error, (*AskError, *ClusterCrossSlotError, *ClusterException)) or (
        isinstance(error, ResponseError) and str(error).startswith(_CLUSTER_REPLIES)
    ):
        hint = (
            "this is a Redis Cluster: use redis.cluster.RedisCluster or "
            "valkey.cluster.ValkeyCluster (or their asyncio twins), "
            "and keep the keys of one allow_all in one hash slot"
        )
    elif isinstance(error, InvalidResponse):
        hint = "the server at this address does not speak the Redis protocol"
    elif str(error).startswith(_NO_SCRIPTING):
        hint = (
            "this store runs no Lua scripts, which bucketlimit's Redis limiters need: "
            "load its Lua engine (Valkey 9: `loadmodule` the lua module, or MODULE LOAD) "
            "or bucketlimit's module (bucketlimit.redis.module_path(), used by "
            "engine='auto' or 'module'), or use a store that runs EVAL and EVALSHA"
        )
    else:
        hint = f"the script needs Redis {MIN_VERSION_TEXT} or later, with EVALSHA and EVAL"
    return ConfigurationError(
        f"Redis refused bucketlimit's commands ({type(error).__name__}: {error}): {hint}. "
        "This is a configuration error, not an outage: on_store_error does not apply"
    )


def check_version(info: object) -> None:
    """Raises ConfigurationError when INFO says the server is older than 5.0.

    ``info`` is ``INFO server`` as a dict, or a dict of them (one per cluster node).
    """
    if not isinstance(info, dict):
        return
    nodes = [info] if "redis_version" in info else list(info.values())
    for node in nodes:
        if not isinstance(node, dict) or "redis_version" not in node:
            continue
        text = str(node["redis_version"])
        try:
            version = tuple(int(part) for part in text.split(".")[:2])
        except ValueError:
            continue  # not a version we can read: the script ran, which is what counts
        if version < MIN_VERSION:
            raise ConfigurationError(
                f"Redis {text} is too old: bucketlimit's script needs Redis "
                f"{MIN_VERSION_TEXT} or later (it writes after reading TIME)"
            )


# The start of the error reply the script gives for a value that is not a bucket.
_CORRUPT_REPLY: Final = "BUCKETLIMIT corrupt"


def leased_bucket(error: BaseException) -> bool:
    """The script's reply to a call on a bucket with leases out that did not name the
    bucket's lease hash (scripts.md; for a batch, one allow's): nothing ran for it,
    and it is sent again, alone, with the lease hash (docs/design.md §6, "Hot keys:
    leases")."""
    return isinstance(error, ResponseError) and str(error).startswith(_LEASED_REPLY)


_LEASED_REPLY: Final = "BUCKETLIMIT leased bucket"


def store_error(error: BaseException, keys: list[bytes]) -> BaseException:
    """A reply saying a bucket's key holds something else, as a :class:`CorruptBucketError`.

    The script reports a string that is not a bucket by the key's position (a key
    may hold "\\r\\n", which an error reply cannot carry); Redis reports any
    other type (a list, a hash) as ``WRONGTYPE``, without saying which key.
    """
    message = str(error)
    position = re.match(_CORRUPT_REPLY + r" bucket value in key (\d+) ", message)
    if position:
        return CorruptBucketError(
            f"the value at {keys[int(position[1]) - 1]!r} is not a bucketlimit bucket"
        )
    if message.startswith("WRONGTYPE"):
        where = repr(keys[0]) if len(keys) == 1 else f"one of {keys!r}"
        return CorruptBucketError(f"the value at {where} is not a bucketlimit bucket: {message}")
    return error


def read_only(error: BaseException) -> bool:
    """A ``READONLY`` reply: a demoted primary (or a replica) that still answers reads,
    so the store counts as failing until a write succeeds (see ``Breaker``)."""
    return isinstance(error, ReadOnlyError)
