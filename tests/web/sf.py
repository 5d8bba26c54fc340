"""The RateLimit fields read with http-sf, an independent RFC 9651 parser checked
against the official structured-field tests, instead of comparing strings.

``ratelimit`` and ``ratelimit_policy`` add draft-11's own rules (which members and
parameters each field has, and their types) on top of the grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import http_sf

Bare = int | float | str | bytes | bool | http_sf.Token


@dataclass
class Item:
    value: Bare
    params: dict[str, Bare] = field(default_factory=dict)


class ParseError(ValueError):
    pass


def parse_list(text: str) -> list[Item]:
    """An RFC 9651 List, or :class:`ParseError`."""
    try:
        parsed: Any = http_sf.parse(text.encode("ascii"), tltype="list")
    except (http_sf.StructuredFieldError, UnicodeEncodeError) as error:
        raise ParseError(str(error)) from error
    return [Item(value, dict(params)) for value, params in parsed]


def parse_item(text: str) -> Item:
    """An RFC 9651 Item (e.g. an Integer field), or :class:`ParseError`."""
    try:
        parsed: Any = http_sf.parse(text.encode("ascii"), tltype="item")
        value, params = parsed
    except (http_sf.StructuredFieldError, UnicodeEncodeError) as error:
        raise ParseError(str(error)) from error
    return Item(value, dict(params))


def integer(text: str) -> int:
    """A field that is one sf-Integer with no parameters (X-RateLimit-Remaining)."""
    item = parse_item(text)
    assert type(item.value) is int, f"not an Integer field: {text!r}"
    assert not item.params, f"an Integer field has no parameters: {text!r}"
    return item.value


def _integer(value: object) -> int:
    """``value`` when it is an sf-integer (not a boolean, not a decimal)."""
    assert type(value) is int, f"not an Integer: {value!r}"
    return value


def ratelimit_policy(text: str) -> dict[str, Item]:
    """``RateLimit-Policy`` as draft-11 defines it: a non-empty List of String items
    with an Integer ``q`` >= 0 (required), ``w`` > 0 and a Byte Sequence ``pk``."""
    items = parse_list(text)
    assert items, "RateLimit-Policy is a non-empty list"
    policies: dict[str, Item] = {}
    for item in items:
        assert isinstance(item.value, str), item
        assert item.value not in policies, f"policy {item.value!r} twice"
        assert _integer(item.params.get("q")) >= 0, item
        if "w" in item.params:
            assert _integer(item.params["w"]) >= 1, item
        if "pk" in item.params:
            assert isinstance(item.params["pk"], bytes), item
        if "qu" in item.params:
            assert item.params["qu"] in ("requests", "content-bytes", "concurrent-requests")
        policies[item.value] = item
    return policies


def ratelimit(text: str) -> dict[str, Item]:
    """``RateLimit``: a List of String items with Integer ``r`` >= 0 (required),
    ``t`` >= 0 and a Byte Sequence ``pk``."""
    limits: dict[str, Item] = {}
    for item in parse_list(text):
        assert isinstance(item.value, str), item
        assert item.value not in limits, f"limit {item.value!r} twice"
        assert _integer(item.params.get("r")) >= 0, item
        if "t" in item.params:
            assert _integer(item.params["t"]) >= 0, item
        if "pk" in item.params:
            assert isinstance(item.params["pk"], bytes), item
        limits[item.value] = item
    return limits
