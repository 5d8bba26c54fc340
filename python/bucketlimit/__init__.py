"""bucketlimit: an exact, thread-safe token-bucket rate limiter with a Rust core.

>>> from bucketlimit import TokenBucketLimiter
>>> limiter = TokenBucketLimiter(capacity=10, rate=2)
>>> bool(limiter.allow("user-42"))
True
"""

from bucketlimit._core import MAX_KEY_BYTES, Decision, TokenBucketLimiter, __version__, allow_all

__all__ = ["MAX_KEY_BYTES", "Decision", "TokenBucketLimiter", "__version__", "allow_all"]
