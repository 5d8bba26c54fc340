"""The package's own exception base, apart from everything else so that any layer
may import it without importing another."""

from __future__ import annotations


class ConfigurationError(Exception):
    """bucketlimit was set up in a way that cannot work, and no retry will fix it.

    The base of every such error: ``bucketlimit.redis.ConfigurationError`` (Redis
    refuses the limiter's commands: credentials, ACLs, a cluster behind a plain
    client, a server too old) and the web adapters' ``ConfigurationError`` (a limit
    configured so that it cannot apply, such as a key function returning no key).
    ``except bucketlimit.ConfigurationError`` catches them all.
    """
