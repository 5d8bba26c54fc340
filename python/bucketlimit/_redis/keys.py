"""Redis keys of buckets: ``prefix{tag}:key``, and the one-slot rule of a cluster.

The hash tag comes first, so a Redis Cluster places each bucket by its tag. The tag
is the key itself unless the limiter has a ``hash_tag(key) -> str``. Both parts are
percent-escaped (``%``, ``{``, ``}`` and ``:``), so the only braces in a key are ours:
no key can pick another tag's slot, and two different (tag, key) pairs never share a
Redis key.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Callable, Sequence
from typing import Final

from bucketlimit import _core

# The only characters escaped in keys and tags: '%' (the escape itself), the
# braces Redis reads as a hash tag, and ':' (our separator).
_ESCAPES: Final = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D", ":": "%3A"})

# Keys with none of these need no escaping (the fast path of Keys.bucket).
_NEEDS_ESCAPE: Final = re.compile("[%{}:]").search
# Any key of at most this many characters is at most MAX_KEY_BYTES bytes of UTF-8.
_SHORT_KEY: Final = _core.MAX_KEY_BYTES // 4


def _encode(part: str) -> bytes:
    # str's own methods: a str subclass may override translate or encode, and a key
    # is its content (the in-process limiter reads the characters too).
    return str.encode(str.translate(part, _ESCAPES), "utf-8")


#: The hash slots of a Redis (or Valkey) Cluster.
CLUSTER_SLOTS: Final = 16384


def key_slot(key: bytes) -> int:
    """The cluster hash slot of ``key``, as the server computes it (``CLUSTER KEYSLOT``):
    the CRC16 (XMODEM: polynomial 0x1021, initial value 0, which ``binascii.crc_hqx``
    computes) of its hash tag, modulo 16384. The tag is what lies between the first
    ``{`` and the first ``}`` after it, when that is not empty; else the whole key."""
    start = key.find(b"{")
    if start > -1:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % CLUSTER_SLOTS


class Keys:
    """One limiter's keys: its prefix and hash tag function."""

    __slots__ = ("_hash_tag", "_tag_start", "prefix")

    def __init__(self, prefix: str, hash_tag: Callable[[str], str] | None) -> None:
        if hash_tag is not None and not callable(hash_tag):
            raise TypeError(f"hash_tag must be a callable (key -> str), got {type(hash_tag)}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag of every key.
            raise ValueError(f"prefix must not contain '{{' or '}}', got {prefix!r}")
        self.prefix = prefix.encode("utf-8")
        self._tag_start = self.prefix + b"{"
        self._hash_tag = hash_tag

    def bucket(self, key: str) -> bytes:
        """The Redis key of ``key``'s bucket; validates ``key`` as the core does."""
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
        # A str subclass's content as a plain str: its overridden methods never
        # change the Redis key (hash_tag still gets the key as it was given).
        encoded = _encode(str.__str__(key))
        if self._hash_tag is None:
            tag = encoded
        else:
            raw = self._hash_tag(key)
            if not isinstance(raw, str):
                raise TypeError(f"hash_tag must return a str, got {type(raw).__name__}")
            raw = str.__str__(raw)  # its content: no overridden __len__ or translate
            if not raw:
                # An empty tag would make Redis hash the whole key instead.
                raise ValueError(f"hash_tag returned an empty tag for key {key!r}")
            try:
                tag = _encode(raw)
            except UnicodeEncodeError as e:
                raise ValueError(f"hash_tag returned a tag not encodable as UTF-8: {e}") from None
        return b"%s{%s}:%s" % (self.prefix, tag, encoded)

    def probe(self) -> bytes:
        """A key no bucket has (a bucket's key never ends with its ':'), for ``check()``."""
        return self.prefix + b"{bucketlimit-check}:"

    def processes(self) -> bytes:
        """The sorted set of the live processes sharing this prefix's limiter (no
        bucket's key: those never end with ':')."""
        return self.prefix + b"{bucketlimit-processes}:"


def check_one_slot(keys: Sequence[bytes]) -> None:
    """On a Redis Cluster one script's keys must share a hash slot: say so before sending."""
    slots = {key_slot(k) for k in keys}
    if len(slots) > 1:
        raise ValueError(
            "allow_all on a Redis Cluster needs every key in one hash slot, got slots "
            f"{sorted(slots)}: give the limiters a hash_tag that maps these keys to one tag "
            "(e.g. the tenant)"
        )
