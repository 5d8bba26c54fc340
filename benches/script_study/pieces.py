"""The pieces of bucket.lua, each as a script of its own, to time on the server.

Every piece runs on one key (``KEYS[1]``) of 1,000, each holding a bucket value
as the script stores it (``"B L"``, 15 and 16 digits: a bucket of the mostly
allowed quota, 10^9 tokens of 10^6 units, at a clock reading of today, each key
a different one), and returns ``1`` unless it says otherwise.

Every piece is sent the same three arguments, new on every call: ``ARGV[1]`` a
bucket value ``"B L"``, ``ARGV[2]`` a TTL in ms, ``ARGV[3]`` a counter ``n``, so
that what a piece writes, parses or formats is a new string each time, as in the
real script: Lua interns strings, and a piece that formats the same constant on
every call would find it made already and cost less than the real thing (fresh
strings are hashed, allocated and later collected). A piece's cost is its time
minus the time of ``return 1`` with the same key and arguments (``BASE``).
"""

from __future__ import annotations

from dataclasses import dataclass

B, L = 999999999000000, 1796124679955000
TTL = 1000000000000  # ms, as the allowed quota's time-until-full writes it


def arguments(n: int) -> tuple[str, str, str]:
    """The arguments of call ``n``: a value, a TTL, the counter."""
    return f"{B - n} {L + n}", str(TTL + n), str(n)


def stored(i: int, short: bool = False) -> str:
    """Key ``i``'s value before the run."""
    if short:
        # The same bucket with fewer digits (see FINDINGS.md): the balance in
        # the quota's own units, the time from an epoch a day before.
        return f"{9000000 - i} {86399955000 + i}"
    return f"{B - i} {L + i}"


NOW = "local t = redis.call('TIME')\nlocal now = t[1] * 1000000 + t[2]\n"
PARSE_MATCH = (
    "local bs, ls = string.match(v, '^(%d+) (%-?%d+)$')\nlocal b, l = tonumber(bs), tonumber(ls)\n"
)
PARSE_FIND = (
    "local sp = string.find(v, ' ', 1, true)\n"
    "local b, l = tonumber(string.sub(v, 1, sp - 1)), tonumber(string.sub(v, sp + 1))\n"
)
# The refill, spend, time-until-full and remaining of the script, on numbers.
ARITHMETIC = """
local full, unit, p, need = 1000000000000000, 1000000, 1, 1000000
local b, l, now = 999999999000000 - n, 1796124679955000 + n, 1796124679955123 + 2 * n
if b > full then b = full end
if now > l then
  local added = (now - l) * p
  if added >= full - b then b = full else b = b + added end
  l = now
end
if b < need then return 0 end
b = b - need
local until_full = 0
if b < full then until_full = p == 0 and -1 or math.ceil((full - b) / p) end
local ttl = math.max(1, math.ceil(until_full / 1000))
local remaining = math.floor(b / unit)
"""


@dataclass(frozen=True)
class Piece:
    name: str
    lua: str
    keys: int = 1  # 0 or 1
    args: bool = True  # sent the three arguments
    value: str | None = "long"  # each key's value before the run: long, short or None
    hash_value: bool = False  # the keys hold a hash {b = B, l = L} instead


BASE = "return 1 (1 key, 3 args)"
N = "local n = tonumber(ARGV[3])\n"

PIECES: list[Piece] = [
    # -- the call itself --------------------------------------------------------
    Piece("return 1, no key, no arg", "return 1", keys=0, args=False),
    Piece("return 1, 1 key, no arg", "return 1", args=False),
    Piece(BASE, "return 1"),
    Piece("return {0, n, n} (the reply's table)", N + "return {0, n, n}"),
    Piece("tonumber(ARGV[3]) (one argument read)", N + "return 1"),
    Piece(
        "the script's header (locals, 3 ARGV reads)",
        "local MIN_TTL_MS = 1\nlocal EXACT = 9007199254740992\n"
        "local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max\n"
        "local cost = ARGV[4] and tonumber(ARGV[4]) or 1\nlocal mode = ARGV[5] or 'a'\n"
        "local now = ARGV[6]\nlocal n = #KEYS\nreturn 1",
    ),
    # -- the commands -----------------------------------------------------------
    Piece("TIME (and now = s * 10^6 + us)", NOW + "return 1"),
    Piece("GET, key present", "local v = redis.call('GET', KEYS[1])\nreturn 1"),
    Piece("GET, key missing", "local v = redis.call('GET', KEYS[1])\nreturn 1", value=None),
    Piece("SET value PX ttl", "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\nreturn 1"),
    Piece(
        "SET value PX ttl, ttl a Lua number",
        N + "redis.call('SET', KEYS[1], ARGV[1], 'PX', 1000000000000 + n)\nreturn 1",
    ),
    Piece("SET value (no TTL)", "redis.call('SET', KEYS[1], ARGV[1])\nreturn 1"),
    Piece("SET value KEEPTTL", "redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')\nreturn 1"),
    Piece(
        "SET value + PEXPIRE ttl",
        "redis.call('SET', KEYS[1], ARGV[1])\nredis.call('PEXPIRE', KEYS[1], ARGV[2])\nreturn 1",
    ),
    Piece("PEXPIRE ttl", "redis.call('PEXPIRE', KEYS[1], ARGV[2])\nreturn 1"),
    Piece(
        "SET + DEL (the 'DEL on full' path, minus the SET)",
        "redis.call('SET', KEYS[1], ARGV[1])\nredis.call('DEL', KEYS[1])\nreturn 1",
    ),
    Piece("DEL, key missing", "redis.call('DEL', KEYS[1])\nreturn 1", value=None),
    Piece(
        "SET short value PX ttl",
        N + "redis.call('SET', KEYS[1], string.sub(ARGV[1], 9), 'PX', ARGV[2])\nreturn 1",
        value="short",
    ),
    Piece(
        "  (string.sub(ARGV[1], 9) alone, to subtract)",
        N + "local v = string.sub(ARGV[1], 9)\nreturn 1",
    ),
    # -- a hash instead of one string --------------------------------------------
    Piece(
        "HMGET b l",
        "local v = redis.call('HMGET', KEYS[1], 'b', 'l')\nreturn 1",
        hash_value=True,
    ),
    Piece("HGET b", "local v = redis.call('HGET', KEYS[1], 'b')\nreturn 1", hash_value=True),
    Piece(
        "HSET b l",
        "redis.call('HSET', KEYS[1], 'b', ARGV[2], 'l', ARGV[3])\nreturn 1",
        hash_value=True,
    ),
    Piece(
        "HSET b l + PEXPIRE",
        "redis.call('HSET', KEYS[1], 'b', ARGV[2], 'l', ARGV[3])\n"
        "redis.call('PEXPIRE', KEYS[1], ARGV[2])\nreturn 1",
        hash_value=True,
    ),
    # -- Lua work on no command -----------------------------------------------------
    Piece("string.match + 2 tonumber", "local v = ARGV[1]\n" + PARSE_MATCH + "return 1"),
    Piece(
        "string.find(anchored pattern) only (a check, no capture)",
        "local ok = string.find(ARGV[1], '^%d+ %-?%d+$')\nreturn 1",
    ),
    Piece("string.find + 2 sub + 2 tonumber", "local v = ARGV[1]\n" + PARSE_FIND + "return 1"),
    Piece(
        "string.match + 2 tonumber, short value",
        "local v = string.sub(ARGV[1], 9)\n" + PARSE_MATCH + "return 1",
    ),
    Piece("arithmetic (refill, spend, until full, ttl)", N + ARITHMETIC + "return 1"),
    Piece(
        "string.format('%d %d') + string.format('%d')",
        N + f"local s = string.format('%d %d', {B} - n, {L} + n)\n"
        f"local t = string.format('%d', {TTL} + n)\nreturn 1",
    ),
    Piece(
        "string.format('%d %d') only",
        N + f"local s = string.format('%d %d', {B} - n, {L} + n)\nreturn 1",
    ),
    Piece(
        "concatenation b .. ' ' .. l (not exact: 14 digits)",
        N + f"local s = ({B} - n) .. ' ' .. ({L} + n)\nreturn 1",
    ),
    # -- the commands together, no arithmetic ----------------------------------------
    Piece(
        "TIME + GET + SET PX (no arithmetic)",
        NOW + "local v = redis.call('GET', KEYS[1])\n"
        "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\nreturn 1",
    ),
    Piece(
        "TIME + GET (a refusal's commands)",
        NOW + "local v = redis.call('GET', KEYS[1])\nreturn 1",
    ),
]


# In-situ ablations of the current script (its allowed form, the mostly allowed
# quota): each removes one piece from the whole script, replacing it by a
# constant or nothing, so that the whole script's time drops by what that piece
# costs *there*, with the garbage and the cache state of a real call. These are
# not answer-preserving; they only attribute the time.
ABLATIONS: list[tuple[str, list[tuple[str, str]]]] = [
    ("current, as sent", []),
    (
        "- parse (string.match + tonumber)",
        [
            (
                "local bs, ls = string.match(value, '^(%d+) (%-?%d+)$')",
                "local bs, ls = 999999999000000, now - 1",
            ),
            ("b, l = tonumber(bs), tonumber(ls)", "b, l = bs, ls"),
        ],
    ),
    (
        "- string.format of the value",
        [("local bucket = string.format('%d %d', b, l)", "local bucket = '999 1796124679955000'")],
    ),
    (
        "- string.format of the TTL",
        [("'PX', string.format('%d', ttl))", "'PX', '1000000')")],
    ),
    ("- TIME", [("local t = redis.call('TIME')", "local t = {1796124679, 955000}")]),
    (
        "- GET",
        [("local value = redis.call('GET', KEYS[i])", "local value = '999 1796124679955000'")],
    ),
    (
        "- SET (the write)",
        [("redis.call('SET', KEYS[i], bucket, 'PX', string.format('%d', ttl))", "local _ = ttl")],
    ),
    (
        "- PX of the SET",
        [
            (
                "redis.call('SET', KEYS[i], bucket, 'PX', string.format('%d', ttl))",
                "redis.call('SET', KEYS[i], bucket)",
            )
        ],
    ),
    ("- the reply's table", [("return {longest, fewest, reset}", "return 0")]),
    (
        "only TIME + GET + SET PX of constants",
        [
            (
                "@all",
                "local t = redis.call('TIME')\nlocal v = redis.call('GET', KEYS[1])\n"
                "redis.call('SET', KEYS[1], '999 1796124679955000', 'PX', '1000000')\nreturn 1",
            )
        ],
    ),
    ("trivial: return 1 (1 key)", [("@all", "return 1")]),
]
