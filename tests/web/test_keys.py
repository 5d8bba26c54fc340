"""The default key groups IPv6 clients by subnet (a security property: one host
owns a whole /64), directly and through trusted proxies."""

from __future__ import annotations

import ipaddress

import pytest
from flask import Flask

from bucketlimit import TokenBucketLimiter
from bucketlimit._web.addresses import subnet_key
from bucketlimit.flask import Limit, RateLimit, client_address, remote_address

ONE_64 = ipaddress.IPv6Network("2001:db8:aa:bb::/64")


def peers_of(network: ipaddress.IPv6Network, count: int) -> list[str]:
    step = network.num_addresses // count
    return [str(network[i * step + 1]) for i in range(count)]


def flask_app(limit: Limit) -> Flask:
    app = Flask(__name__)
    RateLimit(limit, app)
    app.add_url_rule("/", "hello", lambda: "hi")
    return app


class Peer:
    """What the Flask key function reads of a request."""

    def __init__(self, remote_addr: str) -> None:
        self.remote_addr = remote_addr


def test_ten_thousand_addresses_of_one_64_share_one_bucket() -> None:
    keys = {remote_address(Peer(peer)) for peer in peers_of(ONE_64, 10_000)}  # type: ignore[arg-type]
    assert keys == {"2001:db8:aa:bb::/64"}
    limiter = TokenBucketLimiter(1000, 0)
    app = flask_app(Limit(limiter))
    client = app.test_client()
    for peer in peers_of(ONE_64, 1000):  # through the app too
        assert client.get("/", environ_base={"REMOTE_ADDR": peer}).status_code == 200
    assert len(limiter) == 1  # one bucket, now empty
    refused = client.get("/", environ_base={"REMOTE_ADDR": str(ONE_64[12345])})
    assert refused.status_code == 403
    other = client.get("/", environ_base={"REMOTE_ADDR": "2001:db8:aa:bc::1"})
    assert other.status_code == 200  # the next /64 is another client
    assert len(limiter) == 2


def test_two_64s_do_not_share() -> None:
    assert subnet_key("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert subnet_key("2001:db8:0:2::1") == "2001:db8:0:2::/64"
    assert subnet_key("2001:db8:0:1:ffff:ffff:ffff:ffff") == "2001:db8:0:1::/64"


def test_ipv4_mapped_ipv6_is_the_ipv4_address() -> None:
    limiter = TokenBucketLimiter(2, 0)
    app = flask_app(Limit(limiter))
    client = app.test_client()
    assert client.get("/", environ_base={"REMOTE_ADDR": "::ffff:192.0.2.9"}).status_code == 200
    assert client.get("/", environ_base={"REMOTE_ADDR": "192.0.2.9"}).status_code == 200
    assert client.get("/", environ_base={"REMOTE_ADDR": "::ffff:c000:209"}).status_code == 403
    assert len(limiter) == 1
    assert remote_address.__qualname__ == "client_address([], ipv6_prefix=64)"


def test_the_prefix_is_configurable() -> None:
    assert subnet_key("2001:db8:1:2:3:4:5:6", 48) == "2001:db8:1::/48"
    assert subnet_key("2001:db8:1:2:3:4:5:6", 128) == "2001:db8:1:2:3:4:5:6"
    assert subnet_key("2001:db8:1:2:3:4:5:6", 0) == "::/0"
    assert subnet_key("192.0.2.1", 48) == "192.0.2.1"  # IPv4 is never grouped
    assert subnet_key("[2001:db8::1]:443") == "2001:db8::/64"
    assert subnet_key("unknown") == "unknown"


def test_through_trusted_proxies_the_client_is_grouped_too() -> None:
    limiter = TokenBucketLimiter(2, 0)
    app = flask_app(Limit(limiter, key=client_address(["10.0.0.0/8"], ipv6_prefix=56)))
    client = app.test_client()
    proxy = {"REMOTE_ADDR": "10.0.0.1"}
    for hop in ("2001:db8:0:100::1", "2001:db8:0:1ff::2", "::ffff:198.51.100.7"):
        answer = client.get("/", environ_base=proxy, headers={"X-Forwarded-For": hop})
        assert answer.status_code == 200
    refused = client.get("/", environ_base=proxy, headers={"X-Forwarded-For": "2001:db8:0:180::9"})
    assert refused.status_code == 403  # the same /56 as the first two
    mapped = "198.51.100.7"  # the IPv4-mapped hop: its IPv4 bucket, one token spent
    assert limiter.peek(mapped).allowed
    assert not limiter.peek(mapped, 2).allowed
    forged = {"X-Forwarded-For": "2001:db8:0:1::1"}
    direct = client.get("/", environ_base={"REMOTE_ADDR": "2001:db8:0:100::5"}, headers=forged)
    assert direct.status_code == 403  # not a proxy: its own /56, header ignored


@pytest.mark.parametrize(
    ("prefix", "error"),
    [(-1, ValueError), (129, ValueError), (64.0, TypeError), (True, TypeError), ("64", TypeError)],
)
def test_bad_prefix_lengths_are_errors(prefix: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="ipv6_prefix"):
        client_address(ipv6_prefix=prefix)  # type: ignore[arg-type]
    with pytest.raises(error, match="ipv6_prefix"):
        subnet_key("2001:db8::1", prefix)  # type: ignore[arg-type]
