-- The token bucket of DESIGN §4, run atomically inside Redis.
--
-- Must match src/bucket.rs: the same integer units and the same rounding, so
-- RedisTokenBucketLimiter and the in-process TokenBucketLimiter give identical
-- decisions on the same clock. Lua has only doubles: every quantity here is an
-- integer below 2^53 (the limiter rejects capacity*unit + p >= 2^53 and clock
-- readings beyond 2^53 µs), and then +, -, *, floor(a/b) and comparisons are
-- exact. Integers are written with string.format('%d') (tostring would round
-- to 14 digits) and the reply holds only integers (Redis truncates numbers).
--
-- KEYS      the bucket keys; allow ('a') spends from all of them or from none
-- ARGV[1]   'a' allow, 'p' peek (allow without writing), 'r' refund
-- ARGV[2]   cost in tokens (1 <= cost <= every capacity, checked in Python)
-- then 4 values per key:
--           now   microseconds, or '' to read the server's TIME
--           capacity, unit (units per token), p (units refilled per µs)
--
-- A bucket is one string "B L": its balance B in units and the microsecond L
-- it was last refilled to. A missing key is a full bucket; a full bucket is
-- deleted or expires (TTL = time until full, in ms rounded up, never 0), and a
-- rate-0 bucket (p = 0) keeps no TTL. A value that is not "B L" is an error
-- reply, never an allow.
--
-- Reply: {allowed, retry_after_us, remaining, reset_after_us, limit}, waits in
-- whole microseconds and -1 for "never" (rate 0). Several keys are combined
-- like allow_all in src/registry.rs: retry_after the longest among refusals,
-- the rest from the bucket with the fewest remaining tokens (first on a tie).

-- Raised by tests that pair a Redis limiter with a ManualClock standing still
-- while real time runs (see tests/test_redis_parity.py); never 0.
local MIN_TTL_MS = 1
local EXACT = 9007199254740992 -- 2^53

-- floor(a / b) is exact for integers 0 <= a < 2^53, b >= 1: the rounded
-- quotient never crosses an integer. q * b <= a is then exact too.
local function ceil_div(a, b)
  local q = math.floor(a / b)
  if q * b < a then
    q = q + 1
  end
  return q
end

local mode = ARGV[1]
local cost = tonumber(ARGV[2])
local server_now = nil

local n = #KEYS
local balance, last, present = {}, {}, {}
local capacity, unit, rate, full, retry = {}, {}, {}, {}, {}
local all_allowed = true

-- Read and check every bucket before the first write: Redis does not roll
-- a script back.
for i = 1, n do
  local a = 2 + (i - 1) * 4
  local now = ARGV[a + 1]
  if now == '' then
    if server_now == nil then
      local t = redis.call('TIME')
      server_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    end
    now = server_now
  else
    now = tonumber(now)
  end
  capacity[i] = tonumber(ARGV[a + 2])
  unit[i] = tonumber(ARGV[a + 3])
  rate[i] = tonumber(ARGV[a + 4])
  full[i] = capacity[i] * unit[i]

  local b, l = full[i], now
  local value = redis.call('GET', KEYS[i])
  if value then
    local bs, ls = string.match(value, '^(%d+) (%-?%d+)$')
    b, l = tonumber(bs), tonumber(ls)
    if b == nil or l == nil or b >= EXACT or l >= EXACT or l <= -EXACT then
      return redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. i .. ' of ' .. n)
    end
    -- More than full: written under a larger capacity; a bucket holds at most full.
    if b > full[i] then
      b = full[i]
    end
    -- Refill; a clock that went back adds nothing and never moves l back.
    if now > l then
      local missing = full[i] - b
      -- Exact when below missing; any larger product means full.
      local added = (now - l) * rate[i]
      if added >= missing then
        b = full[i]
      else
        b = b + added
      end
      l = now
    end
  end
  balance[i], last[i], present[i] = b, l, value ~= false

  if mode ~= 'r' then
    local need = cost * unit[i]
    if b >= need then
      retry[i] = 0
    else
      all_allowed = false
      if rate[i] == 0 then
        retry[i] = -1
      else
        retry[i] = ceil_div(need - b, rate[i])
      end
    end
  end
end

local function until_full(i)
  local missing = full[i] - balance[i]
  if missing == 0 then
    return 0
  elseif rate[i] == 0 then
    return -1
  end
  return ceil_div(missing, rate[i])
end

local function store(i)
  if balance[i] == full[i] then
    -- A full bucket answers exactly like a missing one.
    redis.call('DEL', KEYS[i])
    return
  end
  local value = string.format('%d %d', balance[i], last[i])
  if rate[i] == 0 then
    -- A quota: no TTL (SET also clears one left by another configuration).
    redis.call('SET', KEYS[i], value)
  else
    local ttl = math.max(MIN_TTL_MS, ceil_div(until_full(i), 1000))
    redis.call('SET', KEYS[i], value, 'PX', string.format('%d', ttl))
  end
end

if mode == 'r' then
  -- A missing bucket is full: there is nothing to give back.
  if present[1] then
    balance[1] = math.min(full[1], balance[1] + cost * unit[1])
    store(1)
  end
  all_allowed = true
elseif all_allowed then
  -- Spend from every bucket; a peek only reports what that would leave.
  for i = 1, n do
    balance[i] = balance[i] - cost * unit[i]
    if mode == 'a' then
      store(i)
    end
  end
end

-- Combine: the tightest bucket reports remaining, reset_after and limit.
local tightest, fewest = 1, nil
local longest = 0
for i = 1, n do
  local remaining = math.floor(balance[i] / unit[i])
  if fewest == nil or remaining < fewest then
    tightest, fewest = i, remaining
  end
  if not all_allowed and retry[i] ~= 0 then
    -- -1 (never) is the longest wait of all.
    if retry[i] == -1 or longest == -1 then
      longest = -1
    elseif retry[i] > longest then
      longest = retry[i]
    end
  end
end

return {
  all_allowed and 1 or 0,
  longest,
  fewest,
  until_full(tightest),
  capacity[tightest],
}
