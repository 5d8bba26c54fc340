"""A Redis URL's password never shows: not in a client's repr, nor in any error that
names the URL (a scheme typo, an unknown scheme, a malformed sentinel URL, a client
of the wrong kind). A real server that requires the password shows it is used."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import bucketlimit
from bucketlimit.redis import AsyncRedisTokenBucketLimiter, RedisTokenBucketLimiter, client_from_url
from tests.support.redis_servers import ServerFactory

SECRET = "s3cret-Pa55"


@pytest.fixture
def url(redis_server_factory: ServerFactory) -> str:
    """A server that takes commands only with the password, and its URL with it."""
    server = redis_server_factory.start()
    with server.client() as admin:
        admin.config_set("requirepass", SECRET)
    return f"redis://default:{SECRET}@127.0.0.1:{server.port}/0"


def test_a_clients_repr_hides_the_password_the_client_uses(url: str) -> None:
    limiter = RedisTokenBucketLimiter.from_url(url, 5, 1, prefix="secret:")
    assert limiter.allow("k").remaining == 4, "the URL's password did not reach the server"
    for client in (client_from_url(url), client_from_url(url, asyncio=True), limiter.client):
        assert SECRET not in repr(client)
    assert "default:***@127.0.0.1" in repr(client_from_url(url))
    assert SECRET not in repr(limiter)
    limiter.client.close()


def test_a_client_of_the_wrong_kind_is_named_without_its_password(url: str) -> None:
    with pytest.raises(TypeError, match="lazy asyncio client") as sync_error:
        RedisTokenBucketLimiter(client_from_url(url, asyncio=True), 5, 1)
    with pytest.raises(TypeError, match="lazy blocking client") as async_error:
        AsyncRedisTokenBucketLimiter(client_from_url(url), 5, 1)
    for error in (sync_error, async_error):
        assert SECRET not in str(error.value)
        assert "default:***@127.0.0.1" in str(error.value)


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: bucketlimit.limiter("1/second", storage=f"redsi://u:{SECRET}@h"), "storage must"),
        (lambda: RedisTokenBucketLimiter.from_url(f"redsi://u:{SECRET}@h", 5, 1), "url must"),
        (lambda: client_from_url(f"redis+sentinel://u:{SECRET}@/mymaster"), "host:port pairs"),
        (lambda: client_from_url(f"redis+sentinel://u:{SECRET}@h:x/m"), "host:port pairs"),
        (lambda: client_from_url(f"redis+sentinel://u:{SECRET}@h:26379"), "names the service"),
        (lambda: client_from_url(f"redsi://h/0?password={SECRET}"), "url must"),
    ],
    ids=["scheme typo", "unknown scheme", "no host", "bad port", "no service", "in the query"],
)
def test_an_error_naming_a_url_hides_its_password(build: Callable[[], object], words: str) -> None:
    with pytest.raises(ValueError, match=words) as error:
        build()
    assert SECRET not in str(error.value)
    assert "***" in str(error.value), "the URL is not named at all"
