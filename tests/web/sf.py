"""A small parser of RFC 9651 structured-field Lists: what the tests read the
RateLimit fields with, instead of comparing strings."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field

Bare = int | float | str | bytes | bool


@dataclass
class Token:
    value: str


@dataclass
class Item:
    value: Bare | Token
    params: dict[str, Bare | Token] = field(default_factory=dict)


class ParseError(ValueError):
    pass


_KEY = re.compile(r"[a-z*][a-z0-9_.*-]*")
_TOKEN = re.compile(r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*")
_NUMBER = re.compile(r"-?[0-9]{1,15}(\.[0-9]{1,3})?")
_BASE64 = re.compile(r"[A-Za-z0-9+/=]*")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    def peek(self) -> str:
        return self.text[self.at : self.at + 1]

    def ows(self) -> None:
        while self.peek() in (" ", "\t") and self.peek():
            self.at += 1

    def sp(self) -> None:
        while self.peek() == " ":
            self.at += 1

    def bare(self) -> Bare | Token:
        ch = self.peek()
        if ch == '"':
            return self.string()
        if ch == ":":
            return self.byte_sequence()
        if ch == "?":
            self.at += 1
            value = self.peek()
            if value not in ("0", "1"):
                raise ParseError(f"bad boolean at {self.at}")
            self.at += 1
            return value == "1"
        if ch == "-" or ch.isdigit():
            match = _NUMBER.match(self.text, self.at)
            if match is None:
                raise ParseError(f"bad number at {self.at}: {self.text!r}")
            self.at = match.end()
            return float(match.group()) if match.group(1) else int(match.group())
        match = _TOKEN.match(self.text, self.at)
        if match is None:
            raise ParseError(f"bad item at {self.at}: {self.text!r}")
        self.at = match.end()
        return Token(match.group())

    def string(self) -> str:
        self.at += 1
        out = []
        while True:
            ch = self.peek()
            if not ch:
                raise ParseError("unterminated string")
            self.at += 1
            if ch == "\\":
                nxt = self.peek()
                if nxt not in ('"', "\\"):
                    raise ParseError("bad escape")
                out.append(nxt)
                self.at += 1
            elif ch == '"':
                return "".join(out)
            elif not (" " <= ch <= "~"):
                raise ParseError(f"bad character {ch!r} in a string")
            else:
                out.append(ch)

    def byte_sequence(self) -> bytes:
        self.at += 1
        end = self.text.find(":", self.at)
        if end < 0:
            raise ParseError("unterminated byte sequence")
        body = self.text[self.at : end]
        if not _BASE64.fullmatch(body):
            raise ParseError("bad base64")
        self.at = end + 1
        return base64.b64decode(body, validate=True)

    def params(self) -> dict[str, Bare | Token]:
        params: dict[str, Bare | Token] = {}
        while self.peek() == ";":
            self.at += 1
            self.sp()
            match = _KEY.match(self.text, self.at)
            if match is None:
                raise ParseError(f"bad parameter key at {self.at}: {self.text!r}")
            self.at = match.end()
            value: Bare | Token = True
            if self.peek() == "=":
                self.at += 1
                value = self.bare()
            params[match.group()] = value
        return params

    def item(self) -> Item:
        value = self.bare()
        return Item(value, self.params())

    def list(self) -> list[Item]:
        self.sp()
        items = []
        while self.at < len(self.text):
            items.append(self.item())
            self.ows()
            if self.at >= len(self.text):
                break
            if self.peek() != ",":
                raise ParseError(f"expected ',' at {self.at}: {self.text!r}")
            self.at += 1
            self.ows()
            if self.at >= len(self.text):
                raise ParseError("trailing comma")
        return items


def parse_list(text: str) -> list[Item]:
    """An RFC 9651 List, or :class:`ParseError`."""
    return _Parser(text).list()


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
