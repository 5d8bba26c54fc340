"""Token buckets shared through Redis (DESIGN §6): the same answers as the in-process limiter.

    from bucketlimit.redis import RedisTokenBucketLimiter

    limiter = RedisTokenBucketLimiter.from_url("redis://localhost:6379/0", 10, 2)
    if not limiter.allow("user-42"):
        ...  # 429

The arithmetic of DESIGN §4 runs inside Redis as one Lua script (``lua/bucket.lua``),
one atomic step per call, so processes never race on a read-modify-write. The script
reads the server's ``TIME``, so processes with skewed clocks agree; a ``clock`` given
to the limiter is sent to the script instead (tests, single-clock setups). Each
limiter sends its own form of the script, its configuration written in
(:func:`_specialize`), so that the common call carries one key and no argument;
``allow_all`` sends the script as written, the configurations as arguments.

A script is sent with EVALSHA; only a ``NOSCRIPT`` reply (the server lost its script
cache: restart, failover, ``SCRIPT FLUSH``) is answered by sending the script itself
once more, which is safe because the script did not run. Nothing else is retried: a
command that timed out may have run, and sending it again could charge twice.

When the store fails (DESIGN §6) the ``on_store_error`` policy answers instead, a
breaker skips the store for ``retry_interval`` seconds before one call probes it,
and a refusal cache keeps a refused key from reaching the store until its wait has
passed (``bucketlimit._resilience``). Errors are sorted once, in
``bucketlimit._redis_errors``: store faults go to the policy, configuration errors
are raised whatever it says.

Keys are ``prefix{tag}:key``: the hash tag first, so a Redis Cluster places each
bucket by its tag. The tag is the key itself unless the limiter has a
``hash_tag(key) -> str``. Both parts are percent-escaped (``%``, ``{``, ``}`` and
``:``), so the only braces in a key are ours: no key can pick another tag's slot,
and two different (tag, key) pairs never share a Redis key.
"""

from __future__ import annotations

import hashlib
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from typing import Any, ClassVar, Final, SupportsIndex

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError
from redis.retry import Retry

from bucketlimit import _core
from bucketlimit._core import Decision
from bucketlimit._redis.errors import (
    CONFIG,
    CORRUPT,
    FAULT,
    ConfigurationError,
    CorruptBucketError,
    StoreUnavailableError,
    check_version,
    classify,
    configuration_error,
    store_error,
)
from bucketlimit._redis.resilience import (
    CLOSED,
    LOCAL,
    RAISE,
    Breaker,
    Fallback,
    Gate,
    RefusalCache,
    check_policy,
    check_processes,
    check_retry_interval,
    degraded,
)

__all__ = [
    "AsyncRedisTokenBucketLimiter",
    "ConfigurationError",
    "CorruptBucketError",
    "RedisTokenBucketLimiter",
    "StoreUnavailableError",
    "allow_all",
    "allow_all_async",
]

SyncClient = redis.Redis | RedisCluster
AsyncClient = redis.asyncio.Redis | AsyncRedisCluster

#: Lua numbers are doubles: integers are exact below 2**53 and no further.
LUA_EXACT: Final = 2**53

#: The timeouts ``from_url`` gives its client, in seconds: a limiter that waits
#: longer than this for its store is slower than having no limiter at all.
DEFAULT_TIMEOUT: Final = 0.25

# The only characters escaped in keys and tags: '%' (the escape itself), the
# braces Redis reads as a hash tag, and ':' (our separator).
_ESCAPES: Final = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D", ":": "%3A"})

# Script modes (ARGV[2] of lua/bucket.lua; an allow sends none).
_ALLOW: Final = b"a"
_PEEK: Final = b"p"
_REFUND: Final = b"r"
# Not a script mode: reset deletes the bucket's key.
_RESET: Final = b"d"
# ARGV "now" asking the general script to read the server's TIME.
_SERVER_TIME: Final = b""
# The arguments of the common call: an allow of one token on the server's clock.
_NO_ARGS: Final[tuple[Any, ...]] = ()

# Keys with none of these need no escaping (the fast path of _RedisLimiter._key).
_NEEDS_ESCAPE: Final = re.compile("[%{}:]").search
# Any key of at most this many characters is at most MAX_KEY_BYTES bytes of UTF-8.
_SHORT_KEY: Final = _core.MAX_KEY_BYTES // 4


class _Script:
    """A Lua script and its SHA1, the name EVALSHA knows it by."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()


#: lua/bucket.lua as written: the general form, which allow_all runs.
_BUCKET_SCRIPT: Final = _Script(
    resources.files("bucketlimit._redis").joinpath("bucket.lua").read_text("utf-8")
)

# The one line of lua/bucket.lua that reads a bucket's configuration from ARGV.
_CONFIG_LINE: Final = re.compile(r"^(\s*local capacity, unit, p = ).*-- config$", re.MULTILINE)


def _specialize(template: str, capacity: int, unit: int, p: int) -> str:
    """A limiter's own form of the script: ``template`` (lua/bucket.lua) with the
    limiter's configuration written into the line marked ``config``, so that a call
    sends one key and at most three arguments. Comment lines are dropped: Redis keeps
    one copy of each distinct script for as long as it runs."""
    source, found = _CONFIG_LINE.subn(rf"\g<1>{capacity}, {unit}, {p}", template)
    if found != 1:
        raise RuntimeError("lua/bucket.lua has no line ending in '-- config'")
    lines = [line for line in source.splitlines() if line.strip() and not _is_comment(line)]
    return "\n".join(lines) + "\n"


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("--")


def _encode(part: str) -> bytes:
    return part.translate(_ESCAPES).encode("utf-8")


def _seconds(micros: int) -> float:
    """A wait from the script: whole microseconds, -1 for never."""
    return math.inf if micros < 0 else micros / 1_000_000


def _decision(reply: Any, limit: int) -> Decision:
    """The script's reply ``{retry_after_us, remaining, reset_after_us[, limit]}``;
    ``limit`` is the capacity of the one bucket asked about."""
    retry_after, remaining, reset_after = reply[0], reply[1], reply[2]
    if len(reply) > 3:
        limit = reply[3]  # several buckets: the tightest one's
    return Decision(
        retry_after == 0, _seconds(retry_after), remaining, _seconds(reset_after), limit
    )


class _Counters:
    """The numbers ``stats()`` reports; a lock, since many threads may share a limiter.

    A call that the store answers takes the lock once (:meth:`answered`).
    """

    __slots__ = (
        "_lock",
        "allowed",
        "fallback_decisions",
        "refusal_cache_hits",
        "refused",
        "script_loads",
        "store_calls",
        "store_errors",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.allowed = self.refused = self.store_calls = self.script_loads = 0
        self.store_errors = self.fallback_decisions = self.refusal_cache_hits = 0

    def call(self, *, reload: bool = False) -> None:
        """A command sent (``reload``: a script sent whole after ``NOSCRIPT``)."""
        with self._lock:
            self.store_calls += 1
            self.script_loads += reload

    def answered(self, allowed: bool) -> None:
        """An allow the store answered: one command, one decision."""
        with self._lock:
            self.store_calls += 1
            if allowed:
                self.allowed += 1
            else:
                self.refused += 1

    def decided(self, allowed: bool) -> None:
        with self._lock:
            if allowed:
                self.allowed += 1
            else:
                self.refused += 1

    def store_error(self) -> None:
        with self._lock:
            self.store_errors += 1

    def fallback(self) -> None:
        with self._lock:
            self.fallback_decisions += 1

    def cache_hit(self, *, decided: bool) -> None:
        """A refusal answered by the refusal cache (``decided``: an allow's)."""
        with self._lock:
            self.refusal_cache_hits += 1
            self.refused += decided

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: getattr(self, name) for name in self.__slots__ if name != "_lock"}


class _Call:
    """One request on its way to the store, with what it takes to answer without it."""

    __slots__ = ("args", "checks", "cost", "gate", "key", "keys", "mode", "script", "started")

    def __init__(
        self,
        mode: bytes,
        key: str,
        cost: int,
        script: _Script,
        keys: list[bytes],
        args: Sequence[Any],
        *,
        started: float = 0.0,
        checks: Sequence[tuple[_RedisLimiter, str]] | None = None,
    ) -> None:
        self.mode = mode
        self.key = key  # "" for allow_all, which has checks instead
        self.cost = cost
        self.script = script
        self.keys = keys
        self.args = args
        self.started = started  # time.monotonic() before sending, for the refusal cache
        self.checks = checks
        self.gate = Gate.STORE


class _RedisLimiter:
    """What the sync and async classes share: configuration, keys, script arguments,
    and everything a call decides around the store (refusal cache, breaker, policy).

    The two subclasses differ only in how they talk to the client (``_run``,
    ``_execute``, and ``allow``, whose common case is written out in full there).
    """

    # lua/bucket.lua: allow_all runs it as it is; each limiter runs its own form
    # (_specialize). A class attribute so that a test may swap it.
    _script: ClassVar[_Script] = _BUCKET_SCRIPT
    # A redis.Redis, RedisCluster or one of their asyncio twins (set by the subclass).
    _client: object

    def __init__(
        self,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None,
        *,
        per: float | SupportsIndex,
        prefix: str,
        hash_tag: Callable[[str], str] | None,
        on_store_error: str,
        processes: SupportsIndex,
        retry_interval: float,
        refusal_cache: bool,
    ) -> None:
        capacity, p, unit = _core.exact_units(capacity, rate, per=per)
        if clock is not None and not callable(clock):
            raise TypeError(
                "clock must be a zero-argument callable returning seconds, "
                f"got {type(clock).__name__}"
            )
        if hash_tag is not None and not callable(hash_tag):
            raise TypeError(f"hash_tag must be a callable (key -> str), got {type(hash_tag)}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag of every key.
            raise ValueError(f"prefix must not contain '{{' or '}}', got {prefix!r}")
        if capacity * unit + p >= LUA_EXACT:
            raise ValueError(
                f"capacity {capacity} with rate {rate!r} per {per!r} is beyond the exact range "
                "of the Redis script: Lua numbers are doubles, exact only below 2**53, and "
                f"capacity * units per token + units per microsecond = {capacity * unit + p}"
            )
        self._capacity: int = capacity
        self._p: int = p
        self._unit: int = unit
        self._per = per if isinstance(per, float) else float(operator.index(per))
        self._clock = clock
        self._prefix = prefix.encode("utf-8")
        self._tag_start = self._prefix + b"{"
        self._hash_tag = hash_tag
        # This limiter's own script, and the per-bucket arguments after `now` that
        # allow_all sends with the general one.
        self._own = _Script(_specialize(self._script.source, capacity, unit, p))
        self._config_args = (capacity, unit, p)
        self._counters = _Counters()

        # Without the store (DESIGN §6).
        self._policy = check_policy(on_store_error)
        self._processes = check_processes(processes)
        self._retry_interval = check_retry_interval(retry_interval)
        if not isinstance(refusal_cache, bool):
            raise TypeError(f"refusal_cache must be a bool, got {type(refusal_cache).__name__}")
        self._fallback = Fallback(
            self._policy,
            capacity,
            p,
            unit,
            processes=self._processes,
            retry_interval=self._retry_interval,
            clock=clock,
        )
        self._breaker = Breaker(
            self._retry_interval,
            f"{type(self).__name__}(prefix={prefix!r})",
            self._fallback.description,
        )
        # Only on the store's clock: an injected clock (a ManualClock) may jump ahead
        # of time.monotonic(), which the cache measures waits with.
        self._refusals = RefusalCache() if refusal_cache and clock is None else None

    # -- read-only configuration -------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def rate(self) -> float:
        """Tokens per second (``rate / per`` as given)."""
        return self._p / (self._unit // 1_000_000)

    @property
    def per(self) -> float:
        return self._per

    @property
    def prefix(self) -> str:
        return self._prefix.decode("utf-8")

    @property
    def on_store_error(self) -> str:
        return self._policy

    @property
    def processes(self) -> int:
        return self._processes

    @property
    def retry_interval(self) -> float:
        return self._retry_interval

    @property
    def refusal_cache(self) -> bool:
        """Whether refusals are remembered (asked for, and the store's clock in use)."""
        return self._refusals is not None

    def stats(self) -> dict[str, int]:
        """Counters of this limiter object: ``allowed`` and ``refused`` decisions,
        ``store_calls`` (commands sent), ``script_loads`` (scripts re-sent after
        ``NOSCRIPT``), ``store_errors`` (store faults, corrupt buckets included),
        ``fallback_decisions`` (answers with ``degraded=True``), ``breaker_openings``
        (outages) and ``refusal_cache_hits`` (refusals answered without the store)."""
        stats = self._counters.snapshot()
        stats["breaker_openings"] = self._breaker.openings
        return stats

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(capacity={self._capacity}, rate={self.rate * self._per!r}, "
            f"per={self._per!r}, prefix={self.prefix!r})"
        )

    # -- keys and arguments --------------------------------------------------------

    def _key(self, key: str) -> bytes:
        """The Redis key of ``key``'s bucket: ``prefix{tag}:key``, both parts escaped."""
        if (
            self._hash_tag is None
            and type(key) is str
            and 0 < len(key) <= _SHORT_KEY
            and not _NEEDS_ESCAPE(key)
        ):
            # The common case, checked and built in a few steps: a short key with
            # nothing to escape is its own tag.
            try:
                encoded = key.encode("utf-8")
            except UnicodeEncodeError:
                pass  # a lone surrogate: check_key says so below
            else:
                return self._tag_start + encoded + b"}:" + encoded
        _core.check_key(key)
        encoded = _encode(key)
        if self._hash_tag is None:
            tag = encoded
        else:
            raw = self._hash_tag(key)
            if not isinstance(raw, str):
                raise TypeError(f"hash_tag must return a str, got {type(raw).__name__}")
            if not raw:
                # An empty tag would make Redis hash the whole key instead.
                raise ValueError(f"hash_tag returned an empty tag for key {key!r}")
            try:
                tag = _encode(raw)
            except UnicodeEncodeError as e:
                raise ValueError(f"hash_tag returned a tag not encodable as UTF-8: {e}") from None
        return b"%s{%s}:%s" % (self._prefix, tag, encoded)

    def _now(self) -> int | bytes:
        """The script's ``now``: the injected clock in µs, or "read the server's TIME"."""
        if self._clock is None:
            return _SERVER_TIME
        seconds = self._clock()
        micros = _core.clock_to_micros(seconds)
        if not -LUA_EXACT < micros < LUA_EXACT:
            raise ValueError(
                f"clock returned {seconds!r}: the Redis script computes in Lua doubles, "
                "so readings must stay within +/-2**53 microseconds"
            )
        return micros

    def _args(self, mode: bytes, cost: int) -> tuple[Any, ...]:
        """The arguments of this limiter's own script: cost, mode, now, each only when
        needed (the script takes 1, an allow and the server's TIME when absent)."""
        if self._clock is not None:
            return cost, mode, self._now()
        if mode != _ALLOW:
            return cost, mode
        return _NO_ARGS if cost == 1 else (cost,)

    def _call(
        self, mode: bytes, key: str, cost: object
    ) -> tuple[int, list[bytes], tuple[Any, ...]]:
        """Cost, keys and arguments of a one-bucket call; validates like the core."""
        cost = _core.check_cost(cost, self._capacity)
        keys = [self._key(key)]
        return cost, keys, self._args(mode, cost)

    def _check_call(self) -> tuple[list[bytes], tuple[Any, ...]]:
        """A peek at a key no bucket has (a bucket's key never ends with its ':')."""
        return [self._prefix + b"{bucketlimit-check}:"], self._args(_PEEK, 1)

    # -- one call: the refusal cache, the breaker, the store, the policy ---------------
    #
    # The subclasses send (`_execute`); everything else is decided here, once.

    def _begin(self, mode: bytes, key: str, cost: object) -> _Call | Decision | None:
        """Validates a call and answers it when the store need not or cannot be asked."""
        args: tuple[Any, ...] = ()
        if mode == _RESET:
            keys, charged = [self._key(key)], 0
        else:
            charged, keys, args = self._call(mode, key, cost)
        started = 0.0
        if self._refusals is not None:
            if mode in (_ALLOW, _PEEK):
                started = time.monotonic()
                cached = self._refusals.get(keys[0], charged, started)
                if cached is not None:
                    self._counters.cache_hit(decided=mode == _ALLOW)
                    return cached
            else:
                self._refusals.drop(keys[0])  # this process gives tokens back
        if mode == _RESET:
            self._fallback.reset(key)  # full again here too, for the next outage
        return self._admit(_Call(mode, key, charged, self._own, keys, args, started=started))

    def _admit(self, call: _Call) -> _Call | Decision | None:
        call.gate = self._breaker.admit()
        if call.gate is Gate.SKIP:
            return self._without_store(call, None)
        return call

    def _answered(self, call: _Call, reply: Any) -> Decision | None:
        self._counters.call()
        self._breaker.succeeded(call.gate)
        if call.mode in (_REFUND, _RESET):
            return None
        decision = _decision(reply, self._capacity)
        if self._refusals is not None and call.checks is None:
            self._remember(call.keys[0], call.cost, decision, call.started)
        return decision

    def _remember(self, bucket: bytes, cost: int, decision: Decision, started: float) -> None:
        """Tells the refusal cache what the store answered about ``bucket``."""
        assert self._refusals is not None
        if not decision.allowed:
            self._refusals.put(bucket, cost, decision, started)
        elif self._refusals.entries:
            self._refusals.drop(bucket)

    # -- allow's common case -------------------------------------------------------------
    #
    # Every request runs allow(): the subclasses write its common case out (the
    # breaker closed, the store answering), with the same steps as _begin, _execute
    # and _answered in fewer calls, and hand everything else to those.

    def _allowed(self, reply: Any, bucket: bytes, cost: int, started: float) -> Decision:
        """The decision of an allow the store answered: ``_answered`` for one bucket."""
        if self._breaker.open:
            self._breaker.succeeded(Gate.STORE)  # opened by another call meanwhile
        retry_after, remaining, reset_after = reply
        allowed = retry_after == 0
        decision = Decision(
            allowed,
            0.0 if allowed else _seconds(retry_after),
            remaining,
            reset_after / 1_000_000 if reset_after >= 0 else math.inf,
            self._capacity,
        )
        self._counters.answered(allowed)
        if self._refusals is not None and (not allowed or self._refusals.entries):
            self._remember(bucket, cost, decision, started)
        return decision

    def _allow_failed(
        self,
        key: str,
        cost: int,
        bucket: bytes,
        args: tuple[Any, ...],
        started: float,
        error: BaseException,
    ) -> Decision:
        """allow() when its command failed: the policy answers, or this raises."""
        if isinstance(error, ResponseError):
            converted = store_error(error, [bucket])
            if converted is not error:
                converted.__cause__ = error
                error = converted
        call = _Call(_ALLOW, key, cost, self._own, [bucket], args, started=started)
        decision = self._failed(call, error)
        assert decision is not None  # allow always decides
        self._counters.decided(decision.allowed)
        return decision

    def _failed(self, call: _Call, error: BaseException) -> Decision | None:
        """Answers a call whose command failed, or raises."""
        self._counters.call()
        kind = classify(error)
        if kind == FAULT:
            self._counters.store_error()
            self._breaker.failed(call.gate, error)
            return self._without_store(call, error)
        if kind == CORRUPT:
            # The store answered, so it works: no breaker; and never an allow.
            self._counters.store_error()
            self._breaker.succeeded(call.gate)
            if self._raises(call):
                raise error
            if call.mode in (_REFUND, _RESET):
                return None
            self._counters.fallback()
            return self._fallback.refusal()
        self._breaker.release(call.gate)
        if kind == CONFIG:
            raise configuration_error(error) from error
        raise error

    def _raises(self, call: _Call) -> bool:
        limiters = [self] if call.checks is None else [limiter for limiter, _ in call.checks]
        return any(limiter._policy == RAISE for limiter in limiters)

    def _without_store(self, call: _Call, error: BaseException | None) -> Decision | None:
        """The policy's answer; ``error`` is None when the breaker skipped the store."""
        if self._raises(call):
            if error is not None:
                raise error
            raise StoreUnavailableError(self._breaker.describe())
        if call.mode == _REFUND:
            # Lost for the store, which keeps the charge: never more than the limit.
            self._fallback.refund(call.key, call.cost)
            return None
        if call.mode == _RESET:
            return None  # lost for the store; the local bucket is full already
        self._counters.fallback()
        if call.checks is not None:
            return _fallback_all(call.checks, call.cost)
        return self._fallback.decide(call.key, call.cost, peek=call.mode == _PEEK)


def _plan_all(checks: Iterable[Any], cost: object) -> tuple[Any, list[bytes], list[Any]]:
    """The limiter to send through, keys and arguments of one ``allow_all`` script
    (the general form of lua/bucket.lua: cost, mode, then now and the configuration
    of each bucket).

    Everything is checked here, before anything is sent: pairs, duplicates, one
    client, costs, keys and (on a cluster) one hash slot.
    """
    limiters: list[_RedisLimiter] = []
    keys: list[bytes] = []
    args: list[Any] = [0, _ALLOW]
    seen: set[tuple[int, str]] = set()
    for item in checks:
        try:
            limiter, key = item
        except (TypeError, ValueError):
            raise TypeError(
                f"allow_all takes a sequence of (limiter, key) pairs, got {type(item).__name__}"
            ) from None
        if not isinstance(limiter, _RedisLimiter):
            raise TypeError(f"allow_all got {type(limiter).__name__} among Redis limiters")
        if limiters and limiter._client is not limiters[0]._client:
            raise ValueError(
                "allow_all runs one script on one client: every Redis limiter in it "
                "must share the same client object"
            )
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if (id(limiter), key) in seen:
            raise ValueError(f"allow_all got the same (limiter, key) twice: key {key!r}")
        seen.add((id(limiter), key))
        checked = _core.check_cost(cost, limiter.capacity)
        bucket = limiter._key(key)
        if bucket in keys:
            # Two limiters with one prefix: the script would read the bucket twice
            # and charge it once.
            raise ValueError(
                f"allow_all names the Redis key {bucket!r} twice: limiters sharing a "
                "client need different prefixes"
            )
        limiters.append(limiter)
        keys.append(bucket)
        args += [limiter._now(), *limiter._config_args]
        args[0] = checked
    if not limiters:
        raise ValueError("allow_all needs at least one (limiter, key)")
    client = limiters[0]._client
    if isinstance(client, (RedisCluster, AsyncRedisCluster)):
        slots = {key_slot(k) for k in keys}
        if len(slots) > 1:
            raise ValueError(
                "allow_all on a Redis Cluster needs every key in one hash slot, got slots "
                f"{sorted(slots)}: give the limiters a hash_tag that maps these keys to one tag "
                "(e.g. the tenant)"
            )
    return limiters[0], keys, args


def _fallback_all(checks: Sequence[tuple[_RedisLimiter, str]], cost: int) -> Decision:
    """``allow_all`` without the store: each limiter's policy, combined as allow_all is.

    Any ``"closed"`` limiter refuses the whole call; ``"open"`` ones allow their
    part; the ``"local"`` ones decide together in process, all or nothing, charged
    at most the smallest of their shares (one cost for all, as in ``allow_all``).
    """
    for limiter, _ in checks:
        if limiter._policy == CLOSED:
            return limiter._fallback.refusal()
    local = []
    for limiter, key in checks:
        if limiter._fallback.local is not None:
            local.append((limiter._fallback.local, key))
    if not local:
        return checks[0][0]._fallback.decide("", cost, peek=False)  # all "open"
    shares = [limiter._fallback.share for limiter, _ in checks if limiter._policy == LOCAL]
    return degraded(_core.allow_all(local, min(cost, *shares)))


def _client_options(timeout: float, no_retries: Retry | AsyncRetry) -> dict[str, Any]:
    """What ``from_url`` gives a client: short timeouts, and a command that failed
    is never sent again (it may have run: a resend could charge twice)."""
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": no_retries}


def _count_all(checks: Iterable[Any], decision: Decision) -> Decision:
    for limiter, _ in checks:
        limiter._counters.decided(decision.allowed)
    return decision


class RedisTokenBucketLimiter(_RedisLimiter):
    """Token buckets in Redis, shared by every process using the same keys and prefix.

    ``client`` is a ``redis.Redis`` or ``redis.cluster.RedisCluster`` as you built
    it (timeouts, TLS, pool); turn its retries off (see the README: a retried
    timeout can charge twice) or use :meth:`from_url`. ``capacity``, ``rate``,
    ``clock`` and ``per`` mean what they mean for
    :class:`bucketlimit.TokenBucketLimiter`; ``clock=None`` uses the server's time.
    ``prefix`` starts every key (no braces); ``hash_tag(key) -> str`` picks the
    Redis Cluster hash tag of a key (default: the key itself).

    When the store fails: ``on_store_error`` is ``"local"`` (this process's share of
    each bucket, with ``processes`` processes sharing the limit), ``"open"``,
    ``"closed"`` or ``"raise"``; the store is then skipped for ``retry_interval``
    seconds (0: never skipped). ``refusal_cache=False`` asks the store about every
    call of a refused key. Nothing is sent at construction: the first call (or
    :meth:`check`) connects.
    """

    _client: SyncClient

    def __init__(
        self,
        client: SyncClient,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
        prefix: str = "bucketlimit:",
        hash_tag: Callable[[str], str] | None = None,
        on_store_error: str = LOCAL,
        processes: SupportsIndex = 1,
        retry_interval: float = 1.0,
        refusal_cache: bool = True,
    ) -> None:
        if not isinstance(client, (redis.Redis, RedisCluster)):
            raise TypeError(
                "client must be a redis.Redis or redis.cluster.RedisCluster "
                f"(use AsyncRedisTokenBucketLimiter for asyncio clients), got {type(client)}"
            )
        super().__init__(
            capacity,
            rate,
            clock,
            per=per,
            prefix=prefix,
            hash_tag=hash_tag,
            on_store_error=on_store_error,
            processes=processes,
            retry_interval=retry_interval,
            refusal_cache=refusal_cache,
        )
        self._client = client

    @classmethod
    def from_url(
        cls,
        url: str,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
        prefix: str = "bucketlimit:",
        hash_tag: Callable[[str], str] | None = None,
        on_store_error: str = LOCAL,
        processes: SupportsIndex = 1,
        retry_interval: float = 1.0,
        refusal_cache: bool = True,
        cluster: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> RedisTokenBucketLimiter:
        """A limiter on a new client for ``url``: ``timeout`` seconds to connect and
        to answer, and no command retries. ``cluster=True`` builds a ``RedisCluster``."""
        options = _client_options(timeout, Retry(NoBackoff(), 0))
        client: SyncClient
        if cluster:
            client = RedisCluster.from_url(url, **options)
        else:
            client = redis.Redis.from_url(url, **options)
        return cls(
            client,
            capacity,
            rate,
            clock,
            per=per,
            prefix=prefix,
            hash_tag=hash_tag,
            on_store_error=on_store_error,
            processes=processes,
            retry_interval=retry_interval,
            refusal_cache=refusal_cache,
        )

    @property
    def client(self) -> SyncClient:
        return self._client

    def _run(self, script: _Script, keys: list[bytes], args: Sequence[Any]) -> Any:
        """Sends a script (``allow`` writes these steps out for its common case).

        The caller counts the command (``_answered``, ``_failed``); a ``NOSCRIPT``
        and its reload are counted in :meth:`_reload`.
        """
        # execute_command rather than evalsha: two frames fewer, same path.
        execute: Callable[..., Any] = self._client.execute_command
        try:
            try:
                return execute("EVALSHA", script.sha, len(keys), *keys, *args)
            except NoScriptError:
                return self._reload(script, keys, args)
        except ResponseError as e:
            raise store_error(e, keys) from e

    def _reload(self, script: _Script, keys: list[bytes], args: Sequence[Any]) -> Any:
        """After ``NOSCRIPT``: the script did not run, so sending it whole is safe (and
        caches it again)."""
        self._counters.call(reload=True)
        execute: Callable[..., Any] = self._client.execute_command
        return execute("EVAL", script.source, len(keys), *keys, *args)

    def _execute(self, call: _Call | Decision | None) -> Decision | None:
        """Sends a call :meth:`_begin` did not answer, and answers it."""
        if not isinstance(call, _Call):
            return call
        try:
            if call.mode == _RESET:
                reply = self._client.delete(*call.keys)
            else:
                reply = self._run(call.script, call.keys, call.args)
        except BaseException as error:
            return self._failed(call, error)
        return self._answered(call, reply)

    def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """Refills the key's bucket and spends ``cost`` tokens if it holds that many."""
        # The common case in full (see _RedisLimiter._allowed).
        if type(cost) is not int or not 0 < cost <= self._capacity:
            cost = _core.check_cost(cost, self._capacity)
        bucket = self._key(key)
        args = _NO_ARGS if cost == 1 and self._clock is None else self._args(_ALLOW, cost)
        started = 0.0
        refusals = self._refusals
        if refusals is not None:
            started = time.monotonic()
            if refusals.entries:
                cached = refusals.get(bucket, cost, started)
                if cached is not None:
                    self._counters.cache_hit(decided=True)
                    return cached
        if self._breaker.open:
            call = _Call(_ALLOW, key, cost, self._own, [bucket], args, started=started)
            decision = self._execute(self._admit(call))
            assert decision is not None  # allow always decides
            self._counters.decided(decision.allowed)
            return decision
        execute: Callable[..., Any] = self._client.execute_command  # untyped in redis-py
        try:
            try:
                reply = execute("EVALSHA", self._own.sha, 1, bucket, *args)
            except NoScriptError:
                reply = self._reload(self._own, [bucket], args)
        except BaseException as error:
            return self._allow_failed(key, cost, bucket, args, started, error)
        return self._allowed(reply, bucket, cost, started)

    def peek(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """What ``allow`` would answer now; writes nothing."""
        decision = self._execute(self._begin(_PEEK, key, cost))
        assert decision is not None  # peek always decides
        return decision

    def refund(self, key: str, cost: SupportsIndex) -> None:
        """Gives back ``cost`` tokens reserved but not used; never above capacity."""
        self._execute(self._begin(_REFUND, key, cost))

    def reset(self, key: str) -> None:
        """Makes the key's bucket full again (deletes it)."""
        self._execute(self._begin(_RESET, key, None))

    def check(self) -> None:
        """Asks the store now: connects, authenticates, runs the script (a peek at a
        key no bucket uses, so nothing is written) and reads the server's version.

        Raises :class:`ConfigurationError` for what no retry will fix, and the
        client's error when the store cannot be reached: ``on_store_error`` does not
        apply. Call it at start-up to fail early; the limiter never calls it.
        """
        keys, args = self._check_call()
        try:
            self._counters.call()
            self._run(self._own, keys, args)
            try:
                info: object = self._client.info("server")
            except NoPermissionError:
                info = None  # INFO forbidden: the script ran, which is what counts
        except Exception as e:
            if classify(e) == CONFIG:
                raise configuration_error(e) from e
            raise
        check_version(info)


class AsyncRedisTokenBucketLimiter(_RedisLimiter):
    """:class:`RedisTokenBucketLimiter` for ``redis.asyncio`` clients: the methods
    that talk to Redis are coroutines. Same buckets, keys, answers and failure
    handling (the breaker and caches take no lock across an ``await``)."""

    _client: AsyncClient

    def __init__(
        self,
        client: AsyncClient,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
        prefix: str = "bucketlimit:",
        hash_tag: Callable[[str], str] | None = None,
        on_store_error: str = LOCAL,
        processes: SupportsIndex = 1,
        retry_interval: float = 1.0,
        refusal_cache: bool = True,
    ) -> None:
        if not isinstance(client, (redis.asyncio.Redis, AsyncRedisCluster)):
            raise TypeError(
                "client must be a redis.asyncio.Redis or redis.asyncio.RedisCluster "
                f"(use RedisTokenBucketLimiter for blocking clients), got {type(client)}"
            )
        super().__init__(
            capacity,
            rate,
            clock,
            per=per,
            prefix=prefix,
            hash_tag=hash_tag,
            on_store_error=on_store_error,
            processes=processes,
            retry_interval=retry_interval,
            refusal_cache=refusal_cache,
        )
        self._client = client

    @classmethod
    def from_url(
        cls,
        url: str,
        capacity: SupportsIndex,
        rate: float | SupportsIndex,
        clock: Callable[[], float] | None = None,
        *,
        per: float | SupportsIndex = 1,
        prefix: str = "bucketlimit:",
        hash_tag: Callable[[str], str] | None = None,
        on_store_error: str = LOCAL,
        processes: SupportsIndex = 1,
        retry_interval: float = 1.0,
        refusal_cache: bool = True,
        cluster: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> AsyncRedisTokenBucketLimiter:
        """Like :meth:`RedisTokenBucketLimiter.from_url`, with a ``redis.asyncio`` client."""
        options = _client_options(timeout, AsyncRetry(NoBackoff(), 0))
        client: AsyncClient
        if cluster:
            client = AsyncRedisCluster.from_url(url, **options)
        else:
            client = redis.asyncio.Redis.from_url(url, **options)
        return cls(
            client,
            capacity,
            rate,
            clock,
            per=per,
            prefix=prefix,
            hash_tag=hash_tag,
            on_store_error=on_store_error,
            processes=processes,
            retry_interval=retry_interval,
            refusal_cache=refusal_cache,
        )

    @property
    def client(self) -> AsyncClient:
        return self._client

    async def _run(self, script: _Script, keys: list[bytes], args: Sequence[Any]) -> Any:
        """Sends a script: :meth:`RedisTokenBucketLimiter._run`, awaited."""
        execute: Callable[..., Any] = self._client.execute_command
        try:
            try:
                return await execute("EVALSHA", script.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await self._reload(script, keys, args)
        except ResponseError as e:
            raise store_error(e, keys) from e

    async def _reload(self, script: _Script, keys: list[bytes], args: Sequence[Any]) -> Any:
        """:meth:`RedisTokenBucketLimiter._reload`, awaited."""
        self._counters.call(reload=True)
        execute: Callable[..., Any] = self._client.execute_command
        return await execute("EVAL", script.source, len(keys), *keys, *args)

    async def _execute(self, call: _Call | Decision | None) -> Decision | None:
        """Sends a call :meth:`_begin` did not answer, and answers it."""
        if not isinstance(call, _Call):
            return call
        try:
            if call.mode == _RESET:
                reply = await self._client.delete(*call.keys)
            else:
                reply = await self._run(call.script, call.keys, call.args)
        except BaseException as error:  # CancelledError too: a probe must be released
            return self._failed(call, error)
        return self._answered(call, reply)

    async def allow(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """Refills the key's bucket and spends ``cost`` tokens if it holds that many."""
        # The common case in full (see _RedisLimiter._allowed).
        if type(cost) is not int or not 0 < cost <= self._capacity:
            cost = _core.check_cost(cost, self._capacity)
        bucket = self._key(key)
        args = _NO_ARGS if cost == 1 and self._clock is None else self._args(_ALLOW, cost)
        started = 0.0
        refusals = self._refusals
        if refusals is not None:
            started = time.monotonic()
            if refusals.entries:
                cached = refusals.get(bucket, cost, started)
                if cached is not None:
                    self._counters.cache_hit(decided=True)
                    return cached
        if self._breaker.open:
            call = _Call(_ALLOW, key, cost, self._own, [bucket], args, started=started)
            decision = await self._execute(self._admit(call))
            assert decision is not None  # allow always decides
            self._counters.decided(decision.allowed)
            return decision
        try:
            try:
                reply = await self._client.execute_command(
                    "EVALSHA", self._own.sha, 1, bucket, *args
                )
            except NoScriptError:
                reply = await self._reload(self._own, [bucket], args)
        except BaseException as error:  # CancelledError too: counted, and raised again
            return self._allow_failed(key, cost, bucket, args, started, error)
        return self._allowed(reply, bucket, cost, started)

    async def peek(self, key: str, cost: SupportsIndex = 1) -> Decision:
        """What ``allow`` would answer now; writes nothing."""
        decision = await self._execute(self._begin(_PEEK, key, cost))
        assert decision is not None  # peek always decides
        return decision

    async def refund(self, key: str, cost: SupportsIndex) -> None:
        """Gives back ``cost`` tokens reserved but not used; never above capacity."""
        await self._execute(self._begin(_REFUND, key, cost))

    async def reset(self, key: str) -> None:
        """Makes the key's bucket full again (deletes it)."""
        await self._execute(self._begin(_RESET, key, None))

    async def check(self) -> None:
        """:meth:`RedisTokenBucketLimiter.check`, awaited."""
        keys, args = self._check_call()
        try:
            self._counters.call()
            await self._run(self._own, keys, args)
            try:
                info: object = await self._client.info("server")
            except NoPermissionError:
                info = None  # INFO forbidden: the script ran, which is what counts
        except Exception as e:
            if classify(e) == CONFIG:
                raise configuration_error(e) from e
            raise
        check_version(info)


def allow_all(
    checks: Iterable[tuple[RedisTokenBucketLimiter, str]], cost: SupportsIndex = 1
) -> Decision:
    """``bucketlimit.allow_all`` for Redis limiters sharing one client: one script
    that checks every bucket before it spends from any."""
    checks = list(checks)
    limiter, keys, args = _plan_all(checks, cost)
    if not isinstance(limiter, RedisTokenBucketLimiter):
        raise TypeError("allow_all takes RedisTokenBucketLimiter instances here")
    # Sent through the first limiter: its breaker, its policy for the store's faults.
    call = _Call(_ALLOW, "", args[0], limiter._script, keys, args, checks=checks)
    decision = limiter._execute(limiter._admit(call))
    assert decision is not None  # an allow always decides
    return _count_all(checks, decision)


async def allow_all_async(
    checks: Iterable[tuple[AsyncRedisTokenBucketLimiter, str]], cost: SupportsIndex = 1
) -> Decision:
    """:func:`allow_all` for :class:`AsyncRedisTokenBucketLimiter` instances."""
    checks = list(checks)
    limiter, keys, args = _plan_all(checks, cost)
    if not isinstance(limiter, AsyncRedisTokenBucketLimiter):
        raise TypeError("allow_all_async takes AsyncRedisTokenBucketLimiter instances")
    call = _Call(_ALLOW, "", args[0], limiter._script, keys, args, checks=checks)
    decision = await limiter._execute(limiter._admit(call))
    assert decision is not None  # an allow always decides
    return _count_all(checks, decision)


def _route_allow_all(checks: list[Any], cost: object) -> Any:
    """For ``bucketlimit.allow_all``: the Redis answer (a coroutine for asyncio
    limiters), or ``None`` when no Redis limiter is named."""
    kinds: set[str | None] = set()
    for item in checks:
        try:
            limiter, _ = item
        except (TypeError, ValueError):
            limiter = None  # not a pair: the core says so
        if isinstance(limiter, RedisTokenBucketLimiter):
            kinds.add("redis")
        elif isinstance(limiter, AsyncRedisTokenBucketLimiter):
            kinds.add("asyncio redis")
        else:
            kinds.add(None)
    if kinds == {"redis"}:
        return allow_all(checks, cost)  # type: ignore[arg-type]  # cost is checked inside
    if kinds == {"asyncio redis"}:
        return allow_all_async(checks, cost)  # type: ignore[arg-type]
    if kinds <= {None}:
        return None
    raise TypeError(
        "allow_all cannot mix in-process, Redis and asyncio Redis limiters: each kind "
        "keeps its buckets elsewhere, so no single step can check them all"
    )
