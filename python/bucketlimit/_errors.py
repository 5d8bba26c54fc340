"""The package's own exception base, and how an error shows a URL: apart from
everything else so that any layer may import it without importing another."""

from __future__ import annotations

import re

# A password given in the query string (redis-py reads ?password=...).
_QUERY_PASSWORD = re.compile(r"([?&;]password=)[^&;#]*", re.IGNORECASE)


class ConfigurationError(Exception):
    """bucketlimit was set up in a way that cannot work, and no retry will fix it.

    The base of every such error: ``bucketlimit.redis.ConfigurationError`` (Redis
    refuses the limiter's commands: credentials, ACLs, a cluster behind a plain
    client, a server too old) and the web adapters' ``ConfigurationError`` (a limit
    configured so that it cannot apply, such as a key function returning no key).
    ``except bucketlimit.ConfigurationError`` catches them all.
    """


def without_password(url: str) -> str:
    """``url`` as an error message or a repr may show it: a password written
    ``***`` (``redis://user:***@host:6379/0``), the rest kept to tell the URL by.

    The password is what lies between the user's colon and the last ``@`` (a
    password may hold an ``@``, and a mistyped URL is read the same way: more
    hidden rather than less), and a ``password=`` in the query string.
    """
    head, at, tail = url.rpartition("@")
    if at:
        start = head.find("://")
        start = 0 if start < 0 else start + 3
        user, colon, _ = head[start:].partition(":")
        if colon:
            head = f"{head[:start]}{user}:***"
        url = f"{head}@{tail}"
    return _QUERY_PASSWORD.sub(r"\1***", url)
