-- Variant 2 of the study (benches/script_study/FINDINGS.md): variant 1, its write
-- PSETEX key ttl value (SET value PX ttl without the option parsing).
-- Stored form, arguments and replies unchanged.
--
-- The token bucket of docs/design.md §4, run atomically inside Redis.
--
-- Must match src/bucket.rs: the same integer units and the same rounding, so
-- RedisTokenBucketLimiter and the in-process TokenBucketLimiter give identical
-- decisions on the same clock. Lua has only doubles: every quantity here is an
-- integer below 2^53 (the limiter rejects capacity*unit + p >= 2^53 and clock
-- readings beyond 2^53 µs), and then +, -, * and comparisons are exact, and so
-- are floor(a / b) and ceil(a / b) for 0 <= a < 2^53, b >= 1: the quotient is
-- rounded by less than 1/b, which never carries it across an integer.
-- Integers are written with string.format('%d') (tostring would round to 14
-- digits) and the reply holds only integers (Redis truncates numbers).
--
-- One template, two forms. As written it is the general form, run by
-- allow_all over buckets of different configurations:
--
-- KEYS      the bucket keys; allow ('a') spends from all of them or from none
-- ARGV[1]   cost in tokens (1 <= cost <= every capacity, checked in Python)
-- ARGV[2]   'a' allow, 'p' peek (allow without writing), 'r' refund (one key)
-- then 4 values per key:
--           now   microseconds, or '' to read the server's TIME
--           capacity, unit (units per token), p (units refilled per µs)
--
-- Each limiter runs its own form (script.py, specialize): the line marked
-- "config" below with the limiter's three numbers written in. It takes one
-- key, and ARGV is only cost (1 when absent), then the mode ('a' when absent),
-- then now (the server's TIME when absent): the common call, an allow of one
-- token on the server's clock, sends no argument at all. Both forms do the
-- same arithmetic, in the same lines.
--
-- A bucket is one string "B L": its balance B in units and the microsecond L
-- it was last refilled to. A missing key is a full bucket; a full bucket is
-- deleted or expires (TTL = time until full, in ms rounded up, never 0), and a
-- rate-0 bucket (p = 0) keeps no TTL. A value that is not "B L" is an error
-- reply, never an allow.
--
-- Reply: {retry_after_us, remaining, reset_after_us}, waits in whole
-- microseconds and -1 for "never" (rate 0); retry_after_us is 0 exactly when
-- the request is allowed. With several keys a fourth value, the limit, follows.
-- Several keys are combined like allow_all in src/registry.rs: retry_after the
-- longest among refusals, the rest from the bucket with the fewest remaining
-- tokens (first on a tie).
--
-- Every bucket is read and checked before the first write: Redis does not
-- roll a script back. One bucket is checked, spent and answered in one pass.
-- Several take two: the first checks them all, the second reads them again
-- (nothing has changed, the script is atomic and its keys are distinct),
-- spends, writes and answers. The code is straight-line per bucket, with no
-- table or function made per call beyond the reply: this runs on every
-- request.

-- Raised by tests that pair a Redis limiter with a ManualClock standing still
-- while real time runs (see tests/redis/test_redis_parity.py); never 0.
local MIN_TTL_MS = 1
local EXACT = 9007199254740992 -- 2^53
local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max

-- One key (every limiter's own call): the same arithmetic as the general loop
-- below, straight through: no passes, no combining.
if #KEYS == 1 then
  local capacity, unit, p = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]) -- config
  local cost = ARGV[1]
  cost = cost and tonumber(cost) or 1
  local mode = ARGV[2] or 'a'
  local now = ARGV[3]
  if now == nil or now == '' then
    local t = redis.call('TIME')
    now = t[1] * 1000000 + t[2]
  else
    now = tonumber(now)
  end
  local full, need = capacity * unit, cost * unit
  local b, l = full, now
  local value = redis.call('GET', KEYS[1])
  if value then
    local bs, ls = string.match(value, '^(%d+) (%-?%d+)$')
    b, l = tonumber(bs), tonumber(ls)
    if b == nil or l == nil or b >= EXACT or l >= EXACT or l <= -EXACT then
      return redis.error_reply('BUCKETLIMIT corrupt bucket value in key 1 of 1')
    end
    if b > full then
      b = full
    end
    if now > l then
      local added = (now - l) * p
      if added >= full - b then
        b = full
      else
        b = b + added
      end
      l = now
    end
  end
  local retry, write = 0, false
  if mode == 'r' then
    write = value ~= false
    b = min(full, b + need)
  elseif b < need then
    retry = p == 0 and -1 or ceil((need - b) / p)
  else
    b = b - need
    write = mode == 'a'
  end
  local until_full = 0
  if b < full then
    until_full = p == 0 and -1 or ceil((full - b) / p)
  end
  if write then
    if until_full == 0 then
      redis.call('DEL', KEYS[1])
    elseif until_full == -1 then
      redis.call('SET', KEYS[1], string.format('%d %d', b, l))
    else
      local ttl = max(MIN_TTL_MS, ceil(until_full / 1000))
      redis.call('PSETEX', KEYS[1], string.format('%d', ttl), string.format('%d %d', b, l))
    end
  end
  return {retry, floor(b / unit), until_full}
end

-- Several keys (allow_all): the general form, as in bucket.lua.
local cost = ARGV[1] and tonumber(ARGV[1]) or 1
local mode = ARGV[2] or 'a'
local n = #KEYS
local server_now = nil

local passes = n == 1 and 1 or 2
local all_allowed = true
-- The answer: the longest wait among refusals (-1: never), then the tightest
-- bucket's remaining tokens, time to full and capacity.
local longest, fewest, reset, limit = 0, nil, nil, nil

for pass = 1, passes do
  for i = 1, n do
    local a = 2 + (i - 1) * 4
    local capacity, unit, p = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
    local now = ARGV[a + 1]
    if now == nil or now == '' then
      if server_now == nil then
        local t = redis.call('TIME')
        server_now = t[1] * 1000000 + t[2]
      end
      now = server_now
    else
      now = tonumber(now)
    end
    local full = capacity * unit

    local b, l = full, now
    local value = redis.call('GET', KEYS[i])
    if value then
      local bs, ls = string.match(value, '^(%d+) (%-?%d+)$')
      b, l = tonumber(bs), tonumber(ls)
      if b == nil or l == nil or b >= EXACT or l >= EXACT or l <= -EXACT then
        return redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. i .. ' of ' .. n)
      end
      -- More than full: written under a larger capacity; a bucket holds at most full.
      if b > full then
        b = full
      end
      -- Refill; a clock that went back adds nothing and never moves l back.
      if now > l then
        -- Exact when below what is missing; any larger product means full.
        local added = (now - l) * p
        if added >= full - b then
          b = full
        else
          b = b + added
        end
        l = now
      end
    end

    local need = cost * unit
    if pass == 1 and mode ~= 'r' and b < need then
      all_allowed = false
      if p == 0 or longest == -1 then
        longest = -1 -- never: the longest wait of all
      else
        longest = max(longest, ceil((need - b) / p))
      end
    end

    if pass == passes then
      -- Spend (or give back) and write, then answer.
      local write = false
      if mode == 'r' then
        -- A missing bucket is full: there is nothing to give back.
        write = value ~= false
        b = min(full, b + need)
      elseif all_allowed then
        b = b - need
        write = mode == 'a'
      end
      -- Microseconds until full; -1: never (rate 0).
      local until_full = 0
      if b < full then
        until_full = p == 0 and -1 or ceil((full - b) / p)
      end
      if write then
        local bucket = string.format('%d %d', b, l)
        if until_full == 0 then
          -- A full bucket answers exactly like a missing one.
          redis.call('DEL', KEYS[i])
        elseif until_full == -1 then
          -- A quota: no TTL (SET also clears one left by another configuration).
          redis.call('SET', KEYS[i], bucket)
        else
          local ttl = max(MIN_TTL_MS, ceil(until_full / 1000))
          redis.call('SET', KEYS[i], bucket, 'PX', string.format('%d', ttl))
        end
      end
      local remaining = floor(b / unit)
      if fewest == nil or remaining < fewest then
        fewest, reset, limit = remaining, until_full, capacity
      end
    end
  end
end

if n == 1 then
  return {longest, fewest, reset}
end
return {longest, fewest, reset, limit}
