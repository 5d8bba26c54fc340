"""The client's address behind trusted proxies (``X-Forwarded-For``)."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable, Iterable
from typing import TypeVar

from bucketlimit._web.errors import KeyFunctionError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# A hop that is not an address is kept as it is (the proxy wrote it: "unknown",
# an obfuscated RFC 7239 identifier); cut so that it stays a valid limiter key.
_MAX_OPAQUE_HOP = 256


def _parse_address(text: str) -> Address | None:
    """An IP address from a peer or an X-Forwarded-For hop, or ``None``.

    Accepts ``1.2.3.4``, ``1.2.3.4:5678``, ``::1``, ``[::1]`` and ``[::1]:5678``
    (some proxies write the port). IPv4-mapped IPv6 becomes the IPv4 address, so
    ``::ffff:10.0.0.1`` matches ``10.0.0.0/8``.
    """
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class TrustedProxies:
    """The proxy networks whose ``X-Forwarded-For`` entries the app believes.

    ``TrustedProxies(["10.0.0.0/8", "fd00::/8", "192.0.2.7"])``. A bare address is
    a one-address network; host bits set (``"10.0.0.1/8"``) is a ``ValueError``,
    as a typo there would silently trust the wrong machines.
    """

    __slots__ = ("networks",)

    def __init__(self, networks: Iterable[str | Network] = ()) -> None:
        if isinstance(networks, str):
            raise TypeError(
                f"trusted_proxies must be a list of networks, not one string: [{networks!r}]"
            )
        self.networks: tuple[Network, ...] = tuple(
            n
            if isinstance(n, (ipaddress.IPv4Network, ipaddress.IPv6Network))
            else ipaddress.ip_network(n)
            for n in networks
        )

    def __contains__(self, address: Address | None) -> bool:
        if address is None:
            return False
        return any(address.version == n.version and address in n for n in self.networks)

    def __repr__(self) -> str:
        return f"TrustedProxies({[str(n) for n in self.networks]!r})"


def forwarded_client(
    peer: str | None, forwarded_for: Iterable[str], trusted: TrustedProxies
) -> str | None:
    """The client's address: the peer, or the right-most untrusted X-Forwarded-For hop.

    ``forwarded_for`` holds the values of every ``X-Forwarded-For`` line in order.
    If the peer is not a trusted proxy its header is ignored entirely: anyone can
    write one. Otherwise the hops are read from the right (each trusted proxy
    appends the address it saw) and the first one that is not a trusted proxy is
    the client. If every hop is trusted, the left-most one is the best we know.
    Returns ``None`` only when there is no peer at all.
    """
    if peer is None:
        return None
    peer_address = _parse_address(peer)
    if peer_address is None or peer_address not in trusted:
        return str(peer_address) if peer_address is not None else peer
    hops = [hop.strip() for value in forwarded_for for hop in value.split(",")]
    hops = [hop for hop in hops if hop]
    if not hops:
        return str(peer_address)
    for hop in reversed(hops):
        address = _parse_address(hop)
        if address is None:
            return hop[:_MAX_OPAQUE_HOP]
        if address not in trusted:
            return str(address)
    leftmost = _parse_address(hops[0])
    return str(leftmost)


def check_ipv6_prefix(ipv6_prefix: int) -> int:
    """``ipv6_prefix`` must be an int from 0 to 128 (the bits an IPv6 key keeps)."""
    if isinstance(ipv6_prefix, bool) or not isinstance(ipv6_prefix, int):
        raise TypeError(f"ipv6_prefix must be an int, got {type(ipv6_prefix).__name__}")
    if not 0 <= ipv6_prefix <= 128:
        raise ValueError(f"ipv6_prefix must be from 0 to 128, got {ipv6_prefix}")
    return ipv6_prefix


def subnet_key(address: str, ipv6_prefix: int = 64) -> str:
    """The key of a client address: IPv4 as it is, IPv6 as its ``/ipv6_prefix`` network.

    One IPv6 host is handed a whole /64 (every home line and cloud machine gets
    one), so keying by the full address would give it 2^64 buckets. IPv4-mapped
    IPv6 (``::ffff:192.0.2.1``) is its IPv4 address. Text that is not an address
    is kept as it is.

    >>> subnet_key("2001:db8:1:2:aaaa::1"), subnet_key("::ffff:192.0.2.1")
    ('2001:db8:1:2::/64', '192.0.2.1')
    """
    return _subnet_key(address, check_ipv6_prefix(ipv6_prefix))


@functools.lru_cache(maxsize=8192)
def _subnet_key(address: str, ipv6_prefix: int) -> str:
    # Cached: parsing an address is most of the default key's cost, and a server
    # sees the same peers again and again (the cache is bounded: a flood of new
    # addresses only evicts).
    parsed = _parse_address(address)
    return address if parsed is None else _address_key(parsed, ipv6_prefix)


def _address_key(address: Address, ipv6_prefix: int) -> str:
    if isinstance(address, ipaddress.IPv4Address) or ipv6_prefix == 128:
        return str(address)
    return str(ipaddress.IPv6Network((address, ipv6_prefix), strict=False))


R = TypeVar("R")  # the framework's request type


def client_address_key(
    trusted_proxies: Iterable[str | Network],
    peer: Callable[[R], str | None],
    forwarded_for: Callable[[R], Iterable[str]],
    missing: str,
    ipv6_prefix: int = 64,
) -> Callable[[R], str]:
    """The adapters' ``client_address`` key function, for a framework that reads the
    peer address with ``peer(request)`` and the ``X-Forwarded-For`` lines with
    ``forwarded_for(request)``; ``missing`` says where a missing peer should be.

    With no trusted proxies (the default) the key is the direct peer and
    ``X-Forwarded-For`` is ignored: a client cannot pick its own key by sending one.
    Behind proxies, the key is the right-most hop that is not one of them. Either
    way an IPv6 client is keyed by its ``/ipv6_prefix`` network (:func:`subnet_key`).
    """
    trusted = TrustedProxies(trusted_proxies)
    prefix = check_ipv6_prefix(ipv6_prefix)

    def no_peer() -> KeyFunctionError:
        return KeyFunctionError(
            f"the request has no peer address ({missing}), so client_address() "
            "cannot key it; give the limit another key="
        )

    if not trusted.networks:

        def direct(request: R) -> str:
            address = peer(request)
            if address is None:
                raise no_peer()
            return _subnet_key(address, prefix)

        key = direct
    else:

        def behind_proxies(request: R) -> str:
            address = forwarded_client(peer(request), forwarded_for(request), trusted)
            if address is None:
                raise no_peer()
            return _subnet_key(address, prefix)

        key = behind_proxies
    networks = list(map(str, trusted.networks))
    key.__qualname__ = f"client_address({networks!r}, ipv6_prefix={prefix})"
    return key
