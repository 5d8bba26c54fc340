-- The token bucket of docs/design.md §4, run atomically inside Redis.
--
-- Must match src/bucket.rs: the same integer units and the same rounding, so
-- RedisTokenBucketLimiter and the in-process TokenBucketLimiter give identical
-- decisions and delays on the same clock. Lua has only doubles: every quantity
-- here is an integer below 2^53 (the limiter rejects
-- (1 + MAX_DEBT_CAPACITIES) * capacity*unit + p >= 2^53, which bounds every
-- balance, debt, wait and cap line, and clock readings beyond 2^53 µs), and
-- then +, -, * and comparisons are exact, and so are floor(a / b) and
-- ceil(a / b) for 0 <= a < 2^53, b >= 1: the quotient is rounded by less than
-- 1/b, which never carries it across an integer. A product that may pass 2^53
-- (elapsed time * p) is only compared with a smaller exact value, which
-- rounding (monotone) cannot make it equal or smaller than.
-- Integers are written with string.format('%d') (tostring would round to 14
-- digits) and the reply holds only integers (Redis truncates numbers).
--
-- One template, two forms. As written it is the general form, run by
-- allow_all / reserve_all (and the give-backs and charges of a reserve_all)
-- over buckets of different configurations:
--
-- KEYS      the bucket keys; allow ('a') and reserve ('v') spend from all of
--           them or from none
-- ARGV[1]   unused ('')
-- ARGV[2]   the mode: 'a' allow, 'p' peek (allow without writing), 'v' reserve,
--           'c' charge, 'r' give back (refund, cancel, settle below the cost)
-- then 9 values per key:
--           now   microseconds, or '' to read the server's TIME
--           capacity, unit (units per token), p (units refilled per µs), cost
--           then 4 more: for a reservation its max_wait in µs ('': no limit);
--           for a give-back the reservation's line, where it waited: l, cap,
--           the headroom before it and its cost ('': none)
--
-- Each limiter runs its own form (script.py, specialize): the line marked
-- "config" below with the limiter's three numbers written in (and own = true).
-- It takes one key, and ARGV is only cost (1 when absent), then the mode ('a'
-- when absent), then now (the server's TIME when absent), then the 4 more: the
-- common call, an allow of one token on the server's clock, sends no argument
-- at all. Both forms do the same arithmetic, in the same lines.
--
-- The own form has one more mode, 'm' (many): a batch of allows, one per key
-- in arrival order (a key may come twice: the second sees the first's write),
-- each decided exactly as the one-key allow would decide it alone, all at one
-- instant (TIME read once). ARGV[1] unused (''), ARGV[2] 'm', ARGV[3] now (''
-- for the server's TIME), then the cost of each allow ('' or absent: 1). Its
-- reply is 3 values per allow, flattened; an allow whose key holds no bucket
-- has the one-key call's error reply (key 1 of 1) as its first value and
-- writes nothing, and the others go on. (docs/design.md §6, "Shared round
-- trips".)
--
-- One bucket allowed or peeked at (every limiter's common call, allow_all of
-- one bucket) and a batch take the straight-line path: per key read, refill,
-- check, spend, write, answer, as Bucket::allow in src/bucket.rs. Everything
-- else (reservations, charges, give-backs, several keys) takes the general
-- loop below it.
--
-- A bucket is its balance B in units (negative: a debt of waiting
-- reservations, at most MAX_DEBT_CAPACITIES capacities), the microsecond L it
-- was last refilled to, and its headroom H: how many units may still be given
-- back (0 <= H <= full - B; the cap line B + H refills with the balance; see
-- "Giving back" in docs/design.md §4). It is stored as the string "B L" when
-- H == full - B (no constraint but the capacity: every bucket that never had
-- a waiter) and "B L H" otherwise; here h == nil stands for H == full - B, so
-- such a bucket costs nothing more than it did before reservations. A missing
-- key is a full bucket (H = 0); a full bucket is deleted or expires (TTL =
-- time until full, in ms rounded up, never 0: a bucket in debt keeps its TTL
-- and never expires before it is full), and a rate-0 bucket (p = 0) keeps no
-- TTL. A value of any other shape is an error reply, never an allow.
--
-- Reply: {retry_after_us, remaining, reset_after_us}, waits in whole
-- microseconds and -1 for "never" (rate 0); retry_after_us is 0 exactly when
-- the request is allowed (a charge: when the bucket is not in debt after it).
-- With several keys a fourth value, the limit, follows. A reservation always
-- replies {retry_after_us, remaining, reset_after_us, limit, delay_us, line
-- per key}: delay_us the longest wait of its buckets (-1: never), and each
-- line {l, cap, headroom before} where the reservation waits in that bucket
-- (the bucket's L and balance right after it, when its H is 0, and its H
-- before it), false (nil in the reply) where it does not, and no line at all
-- when it waits in none;
-- a give-back of the reservation sends its line back, with its cost.
-- Several keys are combined like reserve_all in src/registry.rs: retry_after
-- the longest among refusals, the rest from the bucket with the fewest
-- remaining tokens (first on a tie).
--
-- Every bucket of one decision is read and checked before the decision's
-- first write: Redis does not roll a script back (a batch's allows are
-- separate decisions). One bucket is checked, spent and answered in one pass.
-- Several take two when they spend all or nothing (allow, reserve): the first
-- checks them all, the second reads them again (nothing has changed, the
-- script is atomic and its keys are distinct), spends, writes and answers.
-- The code is straight-line per bucket, with no table or function made per
-- call beyond the reply (and a reservation's lines): this runs on every
-- request. That is why the lines that read, check and refill a stored bucket
-- stand twice, once in each path, and must be kept the same: a local function
-- shared by both is made anew on every call of the script, and measured
-- 3-7 % more server time per allow (interleaved usec_per_call, 30 rounds).

-- Raised by tests that pair a Redis limiter with a ManualClock standing still
-- while real time runs (see tests/redis/test_redis_parity.py); never 0.
local MIN_TTL_MS = 1
-- Must match MAX_DEBT_CAPACITIES in src/bucket.rs.
local MAX_DEBT_CAPACITIES = 1000
local EXACT = 9007199254740992 -- 2^53
local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max

local cost = ARGV[1] and tonumber(ARGV[1]) or 1
local mode = ARGV[2] or 'a'
local n = #KEYS
-- The first key's configuration; in the own form the limiter's (see above).
local capacity, unit, p, cost, x, own = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), 8, false -- config

-- The straight-line path: one allow or peek of one bucket, or a batch of allows.
if mode == 'm' or (n == 1 and (mode == 'a' or mode == 'p')) then
  local now = ARGV[3]
  if now == nil or now == '' then
    local t = redis.call('TIME')
    now = t[1] * 1000000 + t[2]
  else
    now = tonumber(now)
  end
  local batch = mode == 'm'
  -- A batch goes on past a key of the wrong type: that allow alone would fail.
  local get = batch and redis.pcall or redis.call
  local full = capacity * unit
  local reply = batch and {} or nil -- one allow answers with its own table
  for i = 1, n do
    if batch then
      local c = ARGV[3 + i]
      cost = (c == nil or c == '') and 1 or tonumber(c)
    end
    local need = cost * unit
    local b, l, h = full, now, nil
    local value = get('GET', KEYS[i])
    local bad = nil
    if batch and type(value) == 'table' then
      bad = value -- WRONGTYPE, for this allow only
    elseif value then
      local bs, ls = string.match(value, '^(%-?%d+) (%-?%d+)$')
      local hs = nil
      if bs == nil then
        bs, ls, hs = string.match(value, '^(%-?%d+) (%-?%d+) (%d+)$')
        h = tonumber(hs)
      end
      b, l = tonumber(bs), tonumber(ls)
      if b == nil or l == nil or b >= EXACT or b <= -EXACT or l >= EXACT or l <= -EXACT
          or (hs and (h == nil or h >= EXACT)) then
        bad = redis.error_reply('BUCKETLIMIT corrupt bucket value in key 1 of 1')
        if not batch then
          return bad
        end
      else
        -- More than full: written under a larger capacity; a bucket holds at most full.
        if b > full then
          b = full
        end
        -- Refill; a clock that went back adds nothing and never moves l back.
        if now > l then
          -- Exact when below what is missing; any larger product means full.
          local added = (now - l) * p
          if added >= full - b then
            b, h = full, nil
          else
            b = b + added
          end
          l = now
        end
        -- H <= full - B: the cap line never passes the capacity.
        if h and h >= full - b then
          h = nil
        end
      end
    end
    local j = 3 * i
    if bad then
      reply[j - 2], reply[j - 1], reply[j] = bad, 0, 0
    else
      local retry = 0
      if b < need then
        retry = p == 0 and -1 or ceil((need - b) / p)
      else
        b = b - need
        -- The cap line does not move: the headroom grows by what was spent.
        if h then
          h = h + need
          if h >= full - b then
            h = nil
          end
        end
      end
      -- Microseconds until full; -1: never (rate 0).
      local until_full = 0
      if b < full then
        until_full = p == 0 and -1 or ceil((full - b) / p)
      end
      if retry == 0 and mode ~= 'p' then
        local bucket
        if h then
          bucket = string.format('%d %d %d', b, l, h)
        else
          bucket = string.format('%d %d', b, l)
        end
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
      local remaining = b > 0 and floor(b / unit) or 0
      if not batch then
        return {retry, remaining, until_full}
      end
      reply[j - 2], reply[j - 1], reply[j] = retry, remaining, until_full
    end
  end
  return reply
end

-- The general loop: several buckets, reservations, charges, give-backs.
local server_now = nil
local passes = (n == 1 or mode == 'r' or mode == 'c') and 1 or 2
local all_allowed = true
-- The answer: the longest wait among refusals (-1: never), then the tightest
-- bucket's remaining tokens, time to full and capacity; for a reservation the
-- longest delay and the lines.
local longest, fewest, reset, limit = 0, nil, nil, nil
local delay, lines = 0, nil -- lines: made when a reservation waits

for pass = 1, passes do
  for i = 1, n do
    local a = 2 + (i - 1) * 9
    if not own then
      capacity, unit, p, cost, x = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), a + 6
    end
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

    local b, l, h = full, now, nil
    local value = redis.call('GET', KEYS[i])
    if value then
      local bs, ls = string.match(value, '^(%-?%d+) (%-?%d+)$')
      local hs = nil
      if bs == nil then
        bs, ls, hs = string.match(value, '^(%-?%d+) (%-?%d+) (%d+)$')
        h = tonumber(hs)
      end
      b, l = tonumber(bs), tonumber(ls)
      if b == nil or l == nil or b >= EXACT or b <= -EXACT or l >= EXACT or l <= -EXACT
          or (hs and (h == nil or h >= EXACT)) then
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
          b, h = full, nil
        else
          b = b + added
        end
        l = now
      end
      -- H <= full - B: the cap line never passes the capacity.
      if h and h >= full - b then
        h = nil
      end
    end

    local need = cost * unit
    -- This bucket's part of a reservation: refused for (0: granted) and its delay.
    local refused_for, wait = 0, 0
    if mode == 'v' then
      local after = b - need
      if after < 0 then
        if p == 0 then
          refused_for, wait = -1, -1
        else
          wait = ceil(-after / p)
          -- Past the bound: refused until the refill brings it back within.
          local beyond = -after - MAX_DEBT_CAPACITIES * full
          if beyond > 0 then
            refused_for = ceil(beyond / p)
          end
          -- Delays shrink one for one with time: ceil((x - t*p)/p) = ceil(x/p) - t.
          local max_wait = ARGV[x]
          if max_wait and max_wait ~= '' then
            refused_for = max(refused_for, wait - tonumber(max_wait))
          end
        end
      end
    end

    if pass == 1 then
      if mode == 'v' then
        if delay ~= -1 then
          delay = wait == -1 and -1 or max(delay, wait)
        end
        if refused_for ~= 0 then
          all_allowed = false
          if refused_for == -1 or longest == -1 then
            longest = -1
          else
            longest = max(longest, refused_for)
          end
        end
      elseif mode ~= 'r' and mode ~= 'c' and b < need then
        all_allowed = false
        if p == 0 or longest == -1 then
          longest = -1 -- never: the longest wait of all
        else
          longest = max(longest, ceil((need - b) / p))
        end
      end
    end

    if pass == passes then
      -- Spend (or give back, or charge) and write, then answer.
      local write = false
      if mode == 'r' then
        -- A missing bucket is full: there is nothing to give back.
        write = value ~= false
        local headroom = h or full - b
        local line_l = ARGV[x]
        local last = false
        if line_l and line_l ~= '' then
          -- Still the last waiter: the cap line is where it left it, refilled since.
          local elapsed = l - tonumber(line_l)
          last = elapsed >= 0 and elapsed * p == b + headroom - tonumber(ARGV[x + 1])
        end
        if last then
          -- The exact undo: the previous waiter becomes the last again. All of
          -- it back: as if it had never been made (its headroom before it).
          b = min(full, b + need)
          if cost >= tonumber(ARGV[x + 3]) then
            h = tonumber(ARGV[x + 2])
          end
          if h and h >= full - b then
            h = nil
          end
        else
          -- Only what the cap line allows: nothing ahead of a later waiter.
          local back = min(need, headroom)
          b = b + back
          if h then
            h = h - back
          end
        end
      elseif mode == 'c' then
        -- Use that happened: debt allowed, down to the bound, where it stops.
        local after = max(b - need, -MAX_DEBT_CAPACITIES * full)
        if h then
          h = min(h + (b - after), full - after)
          if h == full - after then
            h = nil
          end
        end
        b = after
        write = true
        if b < 0 then
          longest = p == 0 and -1 or ceil(-b / p)
        end
      elseif all_allowed then
        if mode == 'v' and b - need < 0 then
          -- A waiter: the cap line drops to its balance, so nothing given back
          -- by those before it can be used alongside or before it.
          local before = h or full - b
          b, h = b - need, 0
          if lines == nil then
            lines = {}
            for j = 1, n do
              lines[j] = false
            end
          end
          lines[i] = {l, b, before}
        else
          b = b - need
          -- The cap line does not move: the headroom grows by what was spent.
          if h then
            h = h + need
            if h >= full - b then
              h = nil
            end
          end
        end
        write = mode ~= 'p'
      end
      -- Microseconds until full; -1: never (rate 0).
      local until_full = 0
      if b < full then
        until_full = p == 0 and -1 or ceil((full - b) / p)
      end
      if write then
        local bucket
        if h then
          bucket = string.format('%d %d %d', b, l, h)
        else
          bucket = string.format('%d %d', b, l)
        end
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
      local remaining = b > 0 and floor(b / unit) or 0
      if fewest == nil or remaining < fewest then
        fewest, reset, limit = remaining, until_full, capacity
      end
    end
  end
end

if mode == 'v' then
  local reply = {longest, fewest, reset, limit, delay}
  if lines then
    for i = 1, n do
      reply[5 + i] = lines[i]
    end
  end
  return reply
end
if n == 1 then
  return {longest, fewest, reset}
end
return {longest, fewest, reset, limit}
