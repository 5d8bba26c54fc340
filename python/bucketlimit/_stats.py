"""What ``stats()`` returns, as typed dictionaries (docs/design.md §3 and §6).

Importable as ``bucketlimit.LimiterStats`` and ``bucketlimit.RedisLimiterStats``:
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
