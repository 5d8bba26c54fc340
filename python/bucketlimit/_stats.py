"""What ``stats()`` returns, as typed dictionaries (docs/design.md §3 and §6).

Importable as ``bucketlimit.LimiterStats``, ``bucketlimit.RedisLimiterStats``,
``bucketlimit.ConcurrencyStats``, ``bucketlimit.RedisConcurrencyStats`` and
``bucketlimit.LimitStats`` (a web limit's):
a type checker then knows ``stats()["allowed"]`` is an ``int`` and reports a
misspelt key. At run time they are plain ``dict`` objects.
"""

from __future__ import annotations

from typing import TypedDict


class LimiterStats(TypedDict):
    """``TokenBucketLimiter.stats()``: counters since the limiter was made."""

    allowed: int  # decisions that admitted a request
    refused: int  # decisions that refused one
    keys: int  # buckets held now (``len(limiter)``)
    evicted: int  # buckets dropped to stay within ``max_keys``
    refused_new_keys: int  # new keys refused because ``max_keys`` buckets were all in use


class RedisLimiterStats(TypedDict):
    """``RedisTokenBucketLimiter.stats()`` (and the asyncio twin's): this object's counters."""

    allowed: int  # decisions that admitted a request (degraded ones included)
    refused: int  # decisions that refused one (degraded ones included)
    store_calls: int  # commands sent to the store
    script_loads: int  # scripts sent whole after NOSCRIPT
    store_errors: int  # store faults and corrupt buckets
    fallback_decisions: int  # answers without the store (``degraded=True``)
    refusal_cache_hits: int  # refusals answered from the refusal cache
    lost_refunds: int  # give-backs that could not reach the store (never sent again)
    breaker_openings: int  # outages: times the breaker opened
    breaker_open: int  # breakers open now: 0 or 1, or one per cluster node whose breaker is open
    # Leases (``lease=``; docs/redis.md, "Hot keys: leases"); 0 without leasing.
    lease_hits: int  # decisions answered from a lease, in process (counted in ``allowed``)
    lease_round_trips: int  # commands that took or gave back a lease
    lease_tokens: int  # tokens leased: charged to the store's bucket ahead of use
    lease_tokens_returned: int  # leased tokens given back unused
    lease_tokens_expired: int  # leased tokens neither used nor given back (spent for the store)


class ConcurrencyStats(TypedDict):
    """``ConcurrencyLimiter.stats()``: counters since the limiter was made, and what it
    holds now."""

    granted: int  # permits granted (at once, or handed to a waiter)
    refused: int  # requests refused: no permit in time, or a new key with no room
    released: int  # permits released by their holder before they expired
    expired: int  # permits freed by their ttl (counted when a call notices)
    abandoned: int  # waits given up by a cancellation or an exception
    refused_new_keys: int  # new keys refused because ``max_keys`` keys were all in use
    keys: int  # keys held in memory now
    in_flight: int  # permits held now, every key
    waiting: int  # callers queued now, every key


class RedisConcurrencyStats(TypedDict):
    """``RedisConcurrencyLimiter.stats()`` (and the asyncio twin's): this object's
    counters, and its waiters now."""

    granted: int  # permits granted (degraded ones included)
    refused: int  # requests refused (degraded ones included)
    released: int  # permits released by their holder before they expired
    abandoned: int  # waits given up by a cancellation or an exception
    store_calls: int  # commands sent to the store
    script_loads: int  # scripts sent whole after NOSCRIPT
    store_errors: int  # store faults and corrupt keys
    fallback_decisions: int  # answers without the store (``degraded=True``)
    lost_releases: int  # releases that could not reach the store (those permits expire)
    breaker_openings: int  # outages: times the breaker opened
    breaker_open: int  # breakers open now
    waiting: int  # this object's callers waiting now
    wakeups: int  # grants told to its waiters by a message (pub/sub)


class _LimitRequests(TypedDict):
    requests_allowed: int  # admitted, and the request ran
    requests_refused: int  # refused by this limit
    requests_given_back: int  # admitted, then refused by another limit: the charge given back
    requests_abandoned: int  # the client left while the request waited
    shadow_refusals: int  # would-be refusals of a shadow limit (the request ran)


class LimitStats(_LimitRequests, total=False):
    """A web limit's ``stats()`` (every adapter's ``Limit``): one outcome per request
    it decided, in this process; its requests' permits when it has a concurrency
    limit; the store's counters of its Redis limiters (docs/metrics.md, "Web
    limits")."""

    granted: int  # permits its requests got (at once or after waiting)
    expired: int  # permits of its requests that went their ttl without a renewal
    in_flight: int  # its requests holding a permit now
    waiting: int  # its requests waiting for a permit now
    store_calls: int  # the store's counters, summed over its Redis limiters
    store_errors: int
    script_loads: int
    fallback_decisions: int
    refusal_cache_hits: int
    lost_refunds: int
    lost_releases: int
    breaker_openings: int
    breaker_open: int
