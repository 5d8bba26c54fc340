"""The Redis limiters' parts (``bucketlimit.redis`` is the public module)."""
