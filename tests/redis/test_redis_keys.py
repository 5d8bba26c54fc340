"""Keys and Redis Cluster: ``prefix{tag}:key``, escaped so that no key chooses its slot.

The adversarial keys go through the public API on a real 3-node cluster, and
their slots are asked of the cluster itself (CLUSTER KEYSLOT). The collision
search uses the limiter's key function directly: 10^5 round trips would test
the network, not the encoding.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.crc import key_slot

import bucketlimit
from bucketlimit import MAX_KEY_BYTES
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter
from tests.support.redis_servers import RedisClusterNodes

ADVERSARIAL = [
    "a}{b",
    "{x}",
    "x{y}z",
    "{}",
    "{",
    "}",
    "}{",
    "{{x}}",
    ":",
    "a:b",
    "::",
    "%",
    "%7B",
    "%7Bx%7D",
    "%25",
    "bucketlimit:",
    "bucketlimit:{x}:x",
    "{bucketlimit:}",
    "\r\n",
    "GET x\r\nFLUSHALL\r\n",
    "return redis.call('FLUSHALL')",
    "]]..redis.call('DEL', KEYS[1])--[[",
    "%d %d",
    "KEYS[1]",
    "nil",
    "\x00",
    " ",
    "é{ü}",
    "🔑",
    "{" * MAX_KEY_BYTES,
    "x" * MAX_KEY_BYTES,
    "}" * (MAX_KEY_BYTES // 2) + "{" * (MAX_KEY_BYTES // 2),
]


def escape(part: str) -> bytes:
    """The escaping the README documents, written out again for the test."""
    for char, code in [("%", "%25"), ("{", "%7B"), ("}", "%7D"), (":", "%3A")]:
        part = part.replace(char, code)
    return part.encode()


def command(client: RedisCluster, *args: Any) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def test_adversarial_keys_land_in_their_own_tags_slot(
    redis_cluster: RedisClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    limiter = RedisTokenBucketLimiter(redis_cluster_client, 2, 1, per=3600, processes=1)
    for key in ADVERSARIAL:
        assert limiter.allow(key).remaining == 1
        assert limiter.allow(key).remaining == 0
        expected = limiter.prefix.encode() + b"{" + escape(key) + b"}:" + escape(key)
        assert redis_cluster_client.exists(expected) == 1, key
        slot = command(redis_cluster_client, "CLUSTER", "KEYSLOT", expected)
        assert slot == command(redis_cluster_client, "CLUSTER", "KEYSLOT", escape(key)), key
        assert slot == key_slot(escape(key))
    assert redis_cluster.dbsize() == len(ADVERSARIAL)


def test_a_key_cannot_borrow_another_tags_slot(redis_cluster_client: RedisCluster) -> None:
    """Keys written to target tenant "acme"'s slot land in their own slots."""
    acme = key_slot(b"acme")
    limiter = RedisTokenBucketLimiter(redis_cluster_client, 2, 1)
    for key in ["{acme}", "x{acme}", "}{acme}", "acme}", "{acme", "acme}:{acme}"]:
        limiter.allow(key)
        written = limiter.prefix.encode() + b"{" + escape(key) + b"}:" + escape(key)
        assert redis_cluster_client.exists(written) == 1
        slot = command(redis_cluster_client, "CLUSTER", "KEYSLOT", written)
        assert slot == key_slot(escape(key)) != acme, key


def test_keys_too_long_are_refused_like_the_core(redis_client: redis.Redis) -> None:
    limiter = RedisTokenBucketLimiter(redis_client, 2, 1)
    for key in ["x" * 10_000, "{" * 10_000, "é" * 5000]:
        with pytest.raises(ValueError, match="4096"):
            limiter.allow(key)
    assert redis_client.dbsize() == 0


def test_hash_tag_must_give_a_usable_tag(redis_client: redis.Redis) -> None:
    tags: dict[str, Any] = {"a": "", "b": None, "c": 7, "d": "\ud800"}
    limiter = RedisTokenBucketLimiter(redis_client, 2, 1, hash_tag=lambda k: tags[k])
    with pytest.raises(ValueError, match="empty"):
        limiter.allow("a")
    for key in ("b", "c"):
        with pytest.raises(TypeError, match="hash_tag"):
            limiter.allow(key)
    with pytest.raises(ValueError, match="UTF-8"):
        limiter.allow("d")
    assert redis_client.dbsize() == 0


def test_no_collisions_among_random_pairs() -> None:
    """10^5 random (tag, key) pairs from an alphabet of the dangerous characters:
    distinct pairs give distinct Redis keys, with and without a hash_tag."""
    rng = random.Random(20240611)
    alphabet = "{}:%%7BDd3Aa25 x\r\n"

    def word() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))

    current = {"tag": ""}
    never_connected = redis.Redis(host="127.0.0.1", port=1)
    tagged = RedisTokenBucketLimiter(
        never_connected, 1, 1, prefix="p:", hash_tag=lambda _key: current["tag"]
    )
    plain = RedisTokenBucketLimiter(never_connected, 1, 1, prefix="p:")
    pairs: set[tuple[str, str]] = set()
    keys: set[bytes] = set()
    while len(pairs) < 100_000:
        pair = (word(), word())
        if pair in pairs:
            continue
        pairs.add(pair)
        current["tag"] = pair[0]
        keys.add(tagged.redis_key(pair[1]))
    assert len(keys) == len(pairs)
    singles = {word() for _ in range(100_000)}
    assert len({plain.redis_key(key) for key in singles}) == len(singles)
    # A key of one limiter never equals a tagged key of the other: the tag part differs
    # unless the tag is the key itself, which is then the same bucket by design.
    assert all(plain.redis_key(k) not in keys or (k, k) in pairs for k in singles)


@pytest.mark.timeout(60)  # 3.8 s idle: over a tenth of the default timeout
def test_allow_over_every_slot(
    redis_cluster: RedisClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    """One key in each of the 16384 slots: each call goes to the node owning it."""
    per_slot: dict[int, str] = {}
    i = 0
    while len(per_slot) < 16384:
        key = f"user-{i}"
        per_slot.setdefault(key_slot(escape(key)), key)
        i += 1
    # processes given: this long run would otherwise add the live processes' key
    # (docs/redis.md, "How many processes") to one node's DBSIZE after 10 s.
    limiter = RedisTokenBucketLimiter(redis_cluster_client, 3, 1, per=60, processes=1)
    assert all(limiter.allow(key, 2).remaining == 1 for key in per_slot.values())
    sizes = []
    for server in redis_cluster.servers:
        client = server.client()
        sizes.append(client.dbsize())
        client.close()
    assert sizes == [5461, 5462, 5461], "one key per slot, on the node owning the slot"
    assert all(not limiter.allow(key, 2) for key in list(per_slot.values())[::97])


def tenant(key: str) -> str:
    return key.split("/", 1)[0]


def test_allow_all_with_a_shared_tag(redis_cluster_client: RedisCluster) -> None:
    options: dict[str, Any] = {"hash_tag": tenant, "processes": 1}  # no heartbeat key
    users = RedisTokenBucketLimiter(redis_cluster_client, 3, 0, prefix="u:", **options)
    tenants = RedisTokenBucketLimiter(redis_cluster_client, 4, 0, prefix="t:", **options)
    for name in ("acme", "globex"):
        answers = [
            bucketlimit.allow_all([(users, f"{name}/{user}"), (tenants, name)]).allowed
            for user in ["ann", "ann", "ann", "ann", "bob", "bob"]
        ]
        assert answers == [True, True, True, False, True, False]
    slots = {key_slot(key) for key in redis_cluster_client.scan_iter()}
    assert slots == {key_slot(b"acme"), key_slot(b"globex")}


def test_allow_all_across_slots_is_refused_before_anything_is_spent(
    redis_cluster: RedisClusterNodes, redis_cluster_client: RedisCluster
) -> None:
    users = RedisTokenBucketLimiter(redis_cluster_client, 3, 0, prefix="u:")
    world = RedisTokenBucketLimiter(redis_cluster_client, 4, 0, prefix="w:")
    assert key_slot(b"alice") != key_slot(b"all")
    with pytest.raises(ValueError, match="hash slot"):
        bucketlimit.allow_all([(users, "alice"), (world, "all")])
    with pytest.raises(ValueError, match="hash slot"):
        bucketlimit.allow_all([(users, "alice"), (users, "bob")])
    assert users.stats()["store_calls"] == world.stats()["store_calls"] == 0
    assert redis_cluster.dbsize() == 0
    assert users.peek("alice", 3)


def test_async_cluster(redis_cluster: RedisClusterNodes) -> None:
    async def main(users: AsyncRedisTokenBucketLimiter, client: AsyncRedisCluster) -> None:
        tenants = AsyncRedisTokenBucketLimiter(client, 3, 0, prefix="t:", hash_tag=tenant)
        assert [(await users.allow(key)).allowed for key in ADVERSARIAL[:10]] == [True] * 10
        answers = [
            (await bucketlimit.allow_all([(users, f"acme/{user}"), (tenants, "acme")])).allowed
            for user in ["ann", "ann", "ann", "bob", "cid"]
        ]
        assert answers == [True, True, False, True, False]
        with pytest.raises(ValueError, match="hash slot"):
            await bucketlimit.allow_all([(users, "alice"), (tenants, "all")])
        await client.script_flush()
        assert await users.allow("acme/dan")
        assert users.stats()["script_loads"] >= 1

    async def run() -> None:
        users = AsyncRedisTokenBucketLimiter.from_url(
            redis_cluster.url, 2, 0, cluster=True, prefix="u:", hash_tag=tenant
        )
        client = users.client
        assert isinstance(client, AsyncRedisCluster)
        assert client.retry.get_retries() == 0
        try:
            await main(users, client)
        finally:
            await client.aclose()

    redis_cluster.flush()
    asyncio.run(run())


def test_from_url_cluster(redis_cluster: RedisClusterNodes) -> None:
    redis_cluster.flush()
    limiter = RedisTokenBucketLimiter.from_url(redis_cluster.url, 2, 0, cluster=True)
    client = limiter.client
    assert isinstance(client, RedisCluster)
    assert client.retry.get_retries() == 0
    assert [limiter.allow(k).allowed for k in ["a", "b", "a", "a"]] == [True, True, True, False]
    client.close()
