-- The token bucket of docs/design.md §4, run atomically inside Redis.
--
-- Must match src/bucket.rs: the same integer units and the same rounding, so
-- RedisTokenBucketLimiter and the in-process TokenBucketLimiter give identical
-- decisions and delays on the same clock. Lua has only doubles: every quantity
-- here is an integer below 2^53 (the limiter rejects capacity*unit + p >= 2^53
-- and clock readings beyond 2^53 µs, and a bucket owes at most D capacities,
-- D = min(MAX_DEBT_CAPACITIES, floor((2^53 - 1 - p) / full) - 1), so that
-- (1 + D) * full + p < 2^53 bounds every balance, debt, wait and cap line), and
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
--           'c' charge, 'r' give back (refund, cancel, settle below the cost),
--           'o' observe (an upstream's report: one key, see below); the own form
--           also 'm' and 'l' (below)
-- then 9 values per key:
--           now   microseconds, or '' to read the server's TIME
--           capacity, unit (units per token), p (units refilled per µs), cost
--           then 4 more: for a reservation its max_wait in µs ('': no limit);
--           for a give-back the reservation's line, where it waited: l, cap,
--           the headroom before it and its cost ('': none); for an observe the
--           report's age in µs (its cost is the report's cap, in units)
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
-- And one more, 'l' (lease; docs/design.md §6, "Hot keys: leases"), which has
-- no twin in src/bucket.rs: an in-process limiter has nothing to lease. It is
-- an allow of n tokens, or a reservation of n, and the records below; ARGV[1]
-- the call's cost (the least it takes), ARGV[2] 'l', ARGV[3] now, ARGV[4] want
-- (0: only give back), ARGV[5] the caller's name (one lease per caller and
-- key), ARGV[6] the period in µs, ARGV[7] the tokens its previous lease left
-- unused, ARGV[8] the longest wait in µs. Reply {retry_after_us, remaining,
-- reset_after_us, granted, delay_us, returned, holders}.
--
-- Leases. A lease of n tokens is charged to the bucket as an allow (or a
-- reservation) of n would be, and recorded in the hash KEYS[i] .. ':leases'
-- (same hash tag, so same slot; a bucket's key never holds a second ':'):
-- field the caller, value "units expiry", expiry on the script's clock twice
-- the period after the lease starts (the caller stops using it one period in,
-- so a give-back it sends then still finds it). While leases are out their
-- units c lower the bucket's cap to top = full - c: the tokens left in them
-- are still the bucket's, so the bucket plus every lease never holds more than
-- full, and what the processes use in any window stays within capacity +
-- rate * T. A lease given back while its record lives returns what it did not
-- use, within the headroom; an expired record leaves the cap (the bucket then
-- refills into the room) and gives nothing back: a process that died under-
-- admits, never over-admits. A bucket with leases out is stored "B L H C X"
-- (H -1 for none, C = c, X the earliest expiry): every call on it reads the
-- records once X has passed. The straight-line path leaves such a bucket to
-- the general loop (a batch answers its allow with an error reply, and its
-- client sends that allow alone).
--
-- One bucket allowed or peeked at (every limiter's common call, allow_all of
-- one bucket) and a batch take the straight-line path: per key read, refill,
-- check, spend, write, answer, as Bucket::allow in src/bucket.rs. Everything
-- else (reservations, charges, give-backs, leases, several keys, a bucket
-- with leases out) takes the general loop below it.
--
-- An observe ('o', Bucket::observed in src/bucket.rs) applies an upstream's
-- report, which the limiter reduced to one number with the core's rule
-- (_core.observation_cap): cap, the most units the bucket may hold when the
-- report was made, age µs ago. The bound now is cap plus the bucket's own
-- refill over the age; the balance becomes at most that, never higher, and the
-- cap line stays (as for a charge). Its reply is {retry_after_us, remaining,
-- reset_after_us} of the bucket as it stands: retry_after_us 0 when it holds a
-- token, else the wait for one. (docs/design.md §4, "Following the upstream".)
--
-- A bucket is its balance B in units (negative: a debt of waiting
-- reservations, at most D capacities, see above), the microsecond L it
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
-- Must match MAX_DEBT_CAPACITIES in src/bucket.rs; fewer where that many would
-- not stay exact (script.py max_debt_capacities: the same rule).
local MAX_DEBT_CAPACITIES = 1000
local EXACT = 9007199254740992 -- 2^53
local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max

local cost = ARGV[1] and tonumber(ARGV[1]) or 1
local mode = ARGV[2] or 'a'
local n = #KEYS
-- The first key's configuration; in the own form the limiter's (see above).
local capacity, unit, p, cost, x, own = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), 8, false -- config
-- Permit keys (the general form only): the last np of KEYS; nb buckets before them.
local np = own and 0 or (tonumber(ARGV[1]) or 0)
local nb = n - np

-- The straight-line path: one allow or peek of one bucket, or a batch of allows.
if mode == 'm' or (n == 1 and np == 0 and (mode == 'a' or mode == 'p')) then
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
  -- A bucket with leases out ("Leases" above) is read by the general loop: a
  -- lone allow goes there; a batch's allow gets an error reply that its client
  -- answers by sending that allow alone.
  local leased = false
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
      if bs == nil and string.find(value, '^%-?%d+ %-?%d+ %-?%d+ %d+ %-?%d+$') then
        if not batch then
          leased = true
          break
        end
        bad = redis.error_reply('BUCKETLIMIT leased bucket in key 1 of 1')
      elseif b == nil or l == nil or b >= EXACT or b <= -EXACT or l >= EXACT or l <= -EXACT
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
  if not leased then
    return reply
  end
end

-- The general loop: several buckets, reservations, charges, give-backs.
local server_now = nil

local passes = ((n == 1 and np == 0) or mode == 'r' or mode == 'c') and 1 or 2
local all_allowed = true
-- The answer: the longest wait among refusals (-1: never), then the tightest
-- bucket's remaining tokens, time to full and capacity; for a reservation the
-- longest delay and the lines.
local longest, fewest, reset, limit = 0, nil, nil, nil
local delay, lines = 0, nil -- lines: made when a reservation waits
-- A lease call's answer: tokens granted and given back, the live leases of the
-- key after it; mine: the units of this caller's live record, read with them.
local granted, returned, holders, mine = 0, 0, 0, nil

-- Permits (docs/design.md §4 "Permits"; "Permits" above): the functions of a
-- call that names permit keys, made only then (a bucket's call makes none).
local permits_check, permits_write, permits_release, answers = nil, nil, nil, {}
-- general form only: begin
local permit, settle, hand_off, expiries, frees_at, describe, grant, take, pick_up, free, keep
if np > 0 then
  local fmt = function(v) return string.format('%d', v) end

  -- The permit key KEYS[i] of this call, read: its arguments and its counters,
  -- the hash's fields t (the last token), s (the last arrival), x (the horizon:
  -- every key of the permit is kept until x + ttl), w (the waiters queued, never
  -- fewer than there are), e (at most the earliest expiry of the permits held,
  -- '' for none) and g (the earliest time a grant record may be dropped, '' for
  -- none). nil and an error reply when they are not numbers.
  permit = function(i)
    local a = 2 + (i - 1) * 9
    local now = ARGV[a + 1]
    local given = not (now == nil or now == '')
    if not given then
      if server_now == nil then
        local t = redis.call('TIME')
        server_now = t[1] * 1000000 + t[2]
      end
      now = server_now
    else
      now = tonumber(now)
    end
    local key = KEYS[i]
    local meta = redis.call('HMGET', key, 't', 's', 'x', 'w', 'e', 'g')
    local S = {
      key = key, now = now,
      limit = tonumber(ARGV[a + 2]), ttl = tonumber(ARGV[a + 3]), lease = tonumber(ARGV[a + 4]),
      member = ARGV[a + 6], name = ARGV[a + 7], extra = tonumber(ARGV[a + 8]) or 0,
      t = tonumber(meta[1] or 0), s = tonumber(meta[2] or 0), x = tonumber(meta[3] or now),
      w = tonumber(meta[4] or 0), e = tonumber(meta[5] or ''), g = tonumber(meta[6] or ''),
      count = 0, horizon = now, dirty = false, new = {},
    }
    if S.t == nil or S.s == nil or S.x == nil or S.w == nil or S.t >= EXACT or S.x >= EXACT
        or S.x <= -EXACT or (meta[5] and meta[5] ~= '' and S.e == nil)
        or (meta[6] and meta[6] ~= '' and S.g == nil) then
      return nil, redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. i .. ' of ' .. n)
    end
    if meta[1] == false then
      S.new[''] = true
      if given then
        -- A clock given to the limiter may stand still or start again where it
        -- was (a ManualClock): a counter the store lost restarts from the
        -- server's time, which only grows, so no token is ever granted twice.
        if server_now == nil then
          local t = redis.call('TIME')
          server_now = t[1] * 1000000 + t[2]
        end
        S.t = max(S.t, server_now - 1)
      end
    end
    if S.member == '' then
      S.member = nil
    end
    if S.name == '' then
      S.name = nil
    end
    return S
  end

  -- The expiries of the permits held, earliest first.
  expiries = function(S)
    local flat = redis.call('ZRANGE', S.key .. ':h', 0, -1, 'WITHSCORES')
    local e = {}
    for j = 2, #flat, 2 do
      e[#e + 1] = tonumber(flat[j])
    end
    return e
  end

  -- When the k-th slot to free from now (0: the next) is sure to free, if no
  -- holder releases or renews and every waiter handed one holds it its whole
  -- ttl: each slot frees at its permit's expiry, then every ttl after
  -- (Entry::frees_at in src/concurrency.rs: the same binary search; when the
  -- expiries lie within one ttl the freeings are periodic, answered at once).
  -- Needs a permit held. Beyond 2^53 µs it answers 2^53 - 1.
  frees_at = function(e, k, ttl)
    local m = #e
    if e[m] - e[1] <= ttl then
      return min(EXACT - 1, e[(k % m) + 1] + floor(k / m) * ttl)
    end
    local wanted = k + 1
    local lo, hi = e[1], min(EXACT - 1, e[m] + k * ttl)
    while lo < hi do
      local mid = lo + floor((hi - lo) / 2)
      local count = 0
      for j = 1, m do
        if mid < e[j] then
          break
        end
        count = count + floor((mid - e[j]) / ttl) + 1
        if count >= wanted then
          break
        end
      end
      if count >= wanted then
        hi = mid
      else
        lo = mid + 1
      end
    end
    return lo
  end

  -- The key as it stands (State::describe): the permits free, and the µs until
  -- every permit, the w waiters' included, is sure to be free.
  describe = function(S, e, w)
    local m = #e
    local drained = S.now
    if m > 0 then
      drained = e[m]
      if w > 0 then
        drained = max(drained, frees_at(e, w - 1, S.ttl) + S.ttl)
      end
    end
    return max(0, S.limit - m), max(0, drained - S.now)
  end

  -- A new permit held by member "token" or, handed to a waiter, "token name",
  -- expiring at `expiry`; its token is the key's last one + 1, and at least
  -- now (a counter the store lost starts from the server's time, whatever the
  -- clock): it grows even across a key forgotten, or a server that lost it.
  grant = function(S, expiry, name)
    local token = max(S.t + 1, S.now)
    S.t = token
    local member = name and (fmt(token) .. ' ' .. name) or fmt(token)
    redis.call('ZADD', S.key .. ':h', fmt(expiry), member)
    if S.count == 0 then
      S.new[':h'] = true
    end
    S.count = S.count + 1
    S.e = S.e and min(S.e, expiry) or expiry
    S.horizon = max(S.horizon, expiry)
    S.dirty = true
    return token
  end

  -- Applies time (State::settle): drops the permits expired by now (once the
  -- earliest may have) and the grant records never picked up, then hands the
  -- free slots on.
  settle = function(S)
    local held = S.key .. ':h'
    if S.e and S.now >= S.e then
      redis.call('ZREMRANGEBYSCORE', held, '-inf', fmt(S.now))
      S.e = tonumber(redis.call('ZRANGE', held, 0, 0, 'WITHSCORES')[2])
      S.dirty = true
    end
    if S.g and S.now >= S.g then
      local records = S.key .. ':g'
      local stale = redis.call('ZRANGEBYSCORE', records, '-inf', fmt(S.now))
      if #stale > 0 then
        redis.call('HDEL', S.key, unpack(stale))
        redis.call('ZREMRANGEBYSCORE', records, '-inf', fmt(S.now))
      end
      S.g = tonumber(redis.call('ZRANGE', records, 0, 0, 'WITHSCORES')[2])
      S.dirty = true
    end
    S.count = redis.call('ZCARD', held)
    hand_off(S)
  end

  -- Hands the free slots to the first waiters, in arrival order
  -- (State::hand_off; a waiter whose lease lapsed is dropped). Each is told by
  -- a message on its channel, "name token remaining reset_after_us", and its
  -- record keeps the grant until it picks it up (for one lease: a live waiter
  -- asks sooner).
  hand_off = function(S)
    local queue, now = S.key .. ':q', S.now
    while S.count < S.limit and S.w > 0 do
      local first = redis.call('ZRANGE', queue, 0, 0)[1]
      if first == nil then
        S.w, S.dirty = 0, true
        break
      end
      redis.call('ZREM', queue, first)
      S.w, S.dirty = S.w - 1, true
      local record = redis.call('HGET', S.key, first)
      local deadline = record and tonumber(string.match(record, '^d (%-?%d+)$'))
      if deadline and deadline > now then
        local token = grant(S, now + S.ttl, first)
        local remaining, reset = describe(S, expiries(S), redis.call('ZCARD', queue))
        local told = fmt(token) .. ' ' .. fmt(remaining) .. ' ' .. fmt(reset)
        redis.call('HSET', S.key, first, 'g ' .. told)
        if S.g == nil then
          S.new[':g'] = true
        end
        redis.call('ZADD', S.key .. ':g', fmt(now + S.lease), first)
        S.g = S.g and min(S.g, now + S.lease) or now + S.lease
        S.horizon = max(S.horizon, now + S.lease)
        redis.call('PUBLISH', string.match(first, '^(.*)#%d+$') or first, first .. ' ' .. told)
      else
        redis.call('HDEL', S.key, first)
      end
    end
  end

  -- A permit now if one is free (nobody waits then: settle handed them on),
  -- else a refusal, or with `queue` a place at the back of the queue as
  -- S.name. Reply {state, token, remaining, reset_after_us, retry_after_us}:
  -- state 1 granted (member "token"), 0 refused (retry_after_us: until a slot
  -- is sure to be free for a newcomer), 2 queued (retry_after_us: until one is
  -- sure to be the waiter's).
  take = function(S, queue)
    if S.count < S.limit then
      local token = grant(S, S.now + S.extra + S.ttl, nil)
      local last = tonumber(redis.call('ZRANGE', S.key .. ':h', -1, -1, 'WITHSCORES')[2])
      return {1, token, S.limit - S.count, max(0, last - S.now), 0}
    end
    local e = expiries(S)
    local w = redis.call('ZCARD', S.key .. ':q')
    local _, reset = describe(S, e, w)
    local wait = max(0, frees_at(e, w, S.ttl) - S.now)
    if not queue then
      return {0, 0, 0, reset, wait}
    end
    S.s = S.s + 1
    redis.call('ZADD', S.key .. ':q', fmt(S.s), S.name)
    redis.call('HSET', S.key, S.name, 'd ' .. fmt(S.now + S.lease))
    if w == 0 then
      S.new[':q'] = true
    end
    S.w = max(S.w, w) + 1
    S.horizon = max(S.horizon, S.now + S.lease)
    S.dirty = true
    return {2, 0, 0, reset, wait}
  end

  -- The waiter S.name's grant, picked up: reply {3, token, remaining,
  -- reset_after_us, 0} (its member is "token name"); nil and its record when
  -- it has none.
  pick_up = function(S)
    local record = redis.call('HGET', S.key, S.name)
    local token, remaining, reset = nil, nil, nil
    if record then
      token, remaining, reset = string.match(record, '^g (%d+) (%d+) (%d+)$')
    end
    if token == nil then
      return nil, record
    end
    redis.call('HDEL', S.key, S.name)
    redis.call('ZREM', S.key .. ':g', S.name)
    return {3, tonumber(token), tonumber(remaining), tonumber(reset), 0}, record
  end

  -- Releases a permit by its member, then hands its slot on; false when it is
  -- not held (released, or expired).
  free = function(S, member)
    if redis.call('ZREM', S.key .. ':h', member) == 0 then
      return false
    end
    S.count = S.count - 1
    local name = string.match(member, '^%d+ (.+)$')
    if name then
      redis.call('HDEL', S.key, name)
      redis.call('ZREM', S.key .. ':g', name)
    end
    hand_off(S)
    return true
  end

  -- After the call's writes: the counters, and every key of the permit kept
  -- until its horizon (the latest expiry or lease it holds) and one ttl more.
  -- The horizon grows a ttl at a time, so most calls set no TTL; a key's TTL is
  -- only ever lengthened.
  keep = function(S)
    local grew = S.horizon > S.x
    if grew then
      S.x = S.horizon + S.ttl
      S.dirty = true
    end
    if not S.dirty then
      return
    end
    redis.call('HSET', S.key, 't', fmt(S.t), 's', fmt(S.s), 'x', fmt(S.x), 'w', fmt(S.w),
      'e', S.e and fmt(S.e) or '', 'g', S.g and fmt(S.g) or '')
    local ms = fmt(max(1, ceil((S.x - S.now + S.ttl) / 1000)))
    for _, suffix in ipairs({'', ':h', ':q', ':g'}) do
      if grew or S.new[suffix] then
        redis.call('PEXPIRE', S.key .. suffix, ms)
      end
    end
  end

  -- In a call over token buckets too (allow_all 'a', reserve_all and
  -- acquire_all 'v', their give-backs 'r'), after the buckets of each pass.
  -- The first pass settles every permit key and looks at it: one busy refuses
  -- the call, all or nothing (take_all in src/concurrency.rs); with a waiter's
  -- name (acquire_all) the first busy one is where it queues. The second
  -- grants, each to live ttl from when the tokens are ready (now + delay +
  -- ttl); with the call queued it takes the free ones before that one (held
  -- while it waits, in the fixed order of the keys) and queues; refused, it
  -- takes nothing and releases the call's own permits (members given: an
  -- acquire_all whose tokens were refused). A give-back releases them. Each
  -- permit answers {state, token, remaining, reset_after_us, retry_after_us}:
  -- 1 granted (member "token"), 4 kept (a member given, extended by the delay),
  -- 2 queued, 0 free and not taken, -1 busy, 5 released.
  local P, queue_at = {}, nil
  permits_check = function()
    for j = 1, np do
      local S, bad = permit(nb + j)
      if S == nil then
        return bad
      end
      settle(S)
      S.list, S.queued = expiries(S), S.w > 0 and redis.call('ZCARD', S.key .. ':q') or 0
      if S.member == nil and S.count >= S.limit then
        all_allowed = false
        if S.name and queue_at == nil then
          queue_at = j
        end
      end
      P[j] = S
    end
  end

  permits_write = function()
    for j = 1, np do
      local S = P[j]
      local e, w = S.list, S.queued
      local answer
      if all_allowed or (queue_at ~= nil and j < queue_at) then
        if S.member then
          if all_allowed and delay > 0 and redis.call('ZSCORE', S.key .. ':h', S.member) then
            local expiry = S.now + delay + S.ttl
            redis.call('ZADD', S.key .. ':h', 'XX', fmt(expiry), S.member)
            S.horizon = max(S.horizon, expiry)
            S.dirty = true
          end
          answer = {4, 0, 0, 0, 0}
        else
          local expiry = S.now + (all_allowed and delay or 0) + S.ttl
          local token = grant(S, expiry, nil)
          local last = max(expiry, e[#e] or expiry)
          answer = {1, token, S.limit - S.count, max(0, last - S.now), 0}
        end
      elseif j == queue_at then
        answer = take(S, true)
      elseif S.member and queue_at == nil then
        answer = {free(S, S.member) and 5 or 0, 0, 0, 0, 0}
      elseif #e < S.limit then
        local remaining, reset = describe(S, e, w)
        if S.name then
          -- acquire_all takes its permits, then finds its tokens refused and
          -- releases them (src/py_concurrency.rs after_permits): each answers as
          -- its grant would have.
          remaining, reset = remaining - 1, max(reset, S.ttl)
        end
        answer = {0, 0, remaining, reset, 0}
      else
        local _, reset = describe(S, e, w)
        answer = {-1, 0, 0, reset, max(0, frees_at(e, w, S.ttl) - S.now)}
      end
      answers[j] = answer
      keep(S)
    end
  end

  permits_release = function()
    for j = 1, np do
      local S, bad = permit(nb + j)
      if S == nil then
        return bad
      end
      settle(S)
      answers[j] = {(S.member and free(S, S.member)) and 1 or 0}
      keep(S)
    end
  end

  -- A permit key alone: the ConcurrencyLimiter's own calls (modes in capitals).
  if nb == 0 and string.find(mode, '^%u$') then
    local S, bad = permit(1)
    if S == nil then
      return bad
    end
    if mode == 'K' then
      -- Valid: held and not expired; a read, nothing settled or written.
      local expiry = redis.call('ZSCORE', S.key .. ':h', S.member)
      return {(expiry and tonumber(expiry) > S.now) and 1 or 0}
    end
    settle(S)
    local reply
    if mode == 'T' or mode == 'Q' then
      reply = take(S, mode == 'Q')
    elseif mode == 'W' or mode == 'G' then
      -- A waiter's poll ('W': its grant, or its place, its lease renewed) or its
      -- timeout's end ('G': its grant, or it leaves the queue, refused). A
      -- waiter no longer queued (its lease lapsed) takes a permit or queues
      -- again at the back ('W'), or takes one or is refused ('G').
      local record
      reply, record = pick_up(S)
      if reply == nil and record and string.find(record, '^d ') then
        local k = redis.call('ZRANK', S.key .. ':q', S.name)
        if k ~= nil then
          local e = expiries(S)
          if mode == 'W' then
            redis.call('HSET', S.key, S.name, 'd ' .. fmt(S.now + S.lease))
            S.horizon = max(S.horizon, S.now + S.lease)
            S.dirty = true
            reply = {2, 0, 0, 0, max(0, frees_at(e, k, S.ttl) - S.now)}
          else
            redis.call('ZREM', S.key .. ':q', S.name)
            redis.call('HDEL', S.key, S.name)
            S.w, S.dirty = S.w - 1, true
            local w = redis.call('ZCARD', S.key .. ':q')
            local _, reset = describe(S, e, w)
            reply = {0, 0, 0, reset, max(0, frees_at(e, w, S.ttl) - S.now)}
          end
        end
      end
      if reply == nil then
        redis.call('HDEL', S.key, S.name)
        reply = take(S, mode == 'W')
      end
    elseif mode == 'X' then
      -- A waiter gives up (cancelled, or its caller failed): it leaves the
      -- queue, or releases at once the permit it was handed, for the next.
      local handed, record = pick_up(S)
      if handed then
        free(S, fmt(handed[2]) .. ' ' .. S.name)
      elseif record then
        if redis.call('ZREM', S.key .. ':q', S.name) == 1 then
          S.w, S.dirty = S.w - 1, true
        end
        redis.call('HDEL', S.key, S.name)
      end
      reply = {handed and 1 or 0}
    elseif mode == 'R' then
      reply = {free(S, S.member) and 1 or 0}
    elseif mode == 'N' then
      -- Renew: to ttl after now + extra, only while held (never brought back).
      local expiry = 0
      if redis.call('ZSCORE', S.key .. ':h', S.member) then
        expiry = S.now + S.extra + S.ttl
        redis.call('ZADD', S.key .. ':h', 'XX', fmt(expiry), S.member)
        S.horizon = max(S.horizon, expiry)
        S.dirty = true
      end
      reply = {expiry > 0 and 1 or 0, expiry}
    elseif mode == 'I' then
      reply = {S.count}
    else
      return redis.error_reply('BUCKETLIMIT unknown mode ' .. mode)
    end
    keep(S)
    return reply
  end
end
-- general form only: end

for pass = 1, passes do
  for i = 1, nb do
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

    -- c: units of this bucket leased out (neither given back nor expired), xmin
    -- the earliest expiry of their records; the bucket holds at most top = full - c.
    local b, l, h, c, xmin = full, now, nil, 0, nil
    local value = redis.call('GET', KEYS[i])
    if value then
      local bs, ls = string.match(value, '^(%-?%d+) (%-?%d+)$')
      local hs, cs, xs = nil, nil, nil
      if bs == nil then
        bs, ls, hs = string.match(value, '^(%-?%d+) (%-?%d+) (%d+)$')
        if bs == nil then
          bs, ls, hs, cs, xs = string.match(value, '^(%-?%d+) (%-?%d+) (%-?%d+) (%d+) (%-?%d+)$')
          c, xmin = tonumber(cs) or 0, tonumber(xs)
        end
        h = tonumber(hs)
      end
      b, l = tonumber(bs), tonumber(ls)
      if b == nil or l == nil or b >= EXACT or b <= -EXACT or l >= EXACT or l <= -EXACT
          or (hs and (h == nil or h >= EXACT or h < (cs and -1 or 0)))
          or (cs and (c >= EXACT or xmin == nil or xmin >= EXACT or xmin <= -EXACT)) then
        return redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. i .. ' of ' .. n)
      end
      if h == -1 then
        h = nil -- a leased bucket's "no headroom constraint"
      end
    end
    -- A lease call reads the bucket's lease records; any call does once the
    -- earliest has expired. Expired records leave (deleted by the last pass of a
    -- call that writes), in order of expiry: the bucket refills to each under the
    -- cap it had until then, so expiring never adds what the refill would not.
    local gone = nil
    if mode == 'l' or (c > 0 and now >= xmin) then
      local records = redis.call('HGETALL', KEYS[i] .. ':leases')
      gone, c, xmin, holders, mine = {}, 0, nil, 0, nil
      local live = 0
      for j = 1, #records, 2 do
        local amount, expiry = string.match(records[j + 1], '^(%d+) (%-?%d+)$')
        amount, expiry = tonumber(amount), tonumber(expiry)
        if amount == nil or expiry == nil or amount >= EXACT or expiry >= EXACT or expiry <= -EXACT then
          return redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. i .. ' of ' .. n)
        end
        c = c + amount
        if expiry <= now then
          gone[#gone + 1] = {expiry, amount, records[j]}
        else
          live, holders = live + amount, holders + 1
          if mode == 'l' and records[j] == ARGV[x + 1] then
            mine = amount
          end
          if xmin == nil or expiry < xmin then
            xmin = expiry
          end
        end
      end
      if #gone > 1 then
        table.sort(gone, function(one, other) return one[1] < other[1] end)
      end
      if not value then
        c, gone = live, {} -- a missing bucket is full: all its live leases leave it
      end
    end
    local top = full - c
    if value then
      -- More than its cap: written under a larger capacity (or before leases
      -- were known); a bucket holds at most full - c.
      if b > top then
        b = top
      end
      -- Refill (through each expiry, then to now); a clock that went back adds
      -- nothing and never moves l back.
      local k = 0
      repeat
        k = k + 1
        local stop, back = now, nil
        if gone and gone[k] then
          stop, back = gone[k][1], gone[k][2]
        end
        if stop > l then
          -- Exact when below what is missing; any larger product means full.
          local added = (stop - l) * p
          if added >= top - b then
            b, h = top, nil
          else
            b = b + added
          end
          l = stop
        end
        if back then
          c, top = c - back, top + back
        end
      until back == nil
      -- H <= top - B: the cap line never passes the cap.
      if h and h >= top - b then
        h = nil
      end
    else
      b = top
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
          local debt = min(MAX_DEBT_CAPACITIES, floor((EXACT - 1 - p) / full) - 1) * full
          local beyond = -after - debt
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
      elseif mode ~= 'r' and mode ~= 'c' and mode ~= 'o' and mode ~= 'l' and b < need then
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
      if gone and #gone > 0 and mode ~= 'p' then
        -- The expired records leave, and the bucket is written with what they left.
        for k = 1, #gone do
          redis.call('HDEL', KEYS[i] .. ':leases', gone[k][3])
        end
        write = true
      end
      if mode == 'r' then
        -- A missing bucket is full: there is nothing to give back.
        write = value ~= false
        local headroom = h or top - b
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
          b = min(top, b + need)
          if cost >= tonumber(ARGV[x + 3]) then
            h = tonumber(ARGV[x + 2])
          end
          if h and h >= top - b then
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
      elseif mode == 'o' then
        -- The report's bound: its cap refilled over its age, at this bucket's rate
        -- (a product past what is missing means full: it bounds nothing).
        -- (With leases out the bucket's cap is top, not full: "Leases" above.)
        local age = tonumber(ARGV[x]) or 0
        local added = age * p
        if added < top - cost and cost + added < b then
          -- Never below the debt bound (the limiter sends a cap above it too).
          local debt = min(MAX_DEBT_CAPACITIES, floor((EXACT - 1 - p) / full) - 1) * full
          local bound = max(cost + added, -debt)
          -- The cap line stays: the headroom grows by what the upstream spent.
          if h then
            h = min(h + (b - bound), top - bound)
            if h == top - bound then
              h = nil
            end
          end
          b = bound
          write = true
        end
        if b >= unit then
          longest = 0
        else
          longest = p == 0 and -1 or ceil((unit - b) / p)
        end
      elseif mode == 'c' then
        -- Use that happened: debt allowed, down to the bound, where it stops.
        local debt = min(MAX_DEBT_CAPACITIES, floor((EXACT - 1 - p) / full) - 1) * full
        local after = max(b - need, -debt)
        if h then
          h = min(h + (b - after), top - after)
          if h == top - after then
            h = nil
          end
        end
        b = after
        write = true
        if b < 0 then
          longest = p == 0 and -1 or ceil(-b / p)
        end
      elseif mode == 'l' then
        -- A lease (the own form only; "Leases" above). First this caller's
        -- previous lease ends: its record goes, and what it did not use comes
        -- back as any give-back does, within the headroom (nothing ahead of a
        -- waiter). An expired record gave nothing back: its tokens are spent.
        local want, period = tonumber(ARGV[x]), tonumber(ARGV[x + 2])
        local unused, max_wait = tonumber(ARGV[x + 3]) or 0, tonumber(ARGV[x + 4]) or 0
        local leases = KEYS[i] .. ':leases'
        if mine then
          c, top, holders = c - mine, top + mine, holders - 1
          returned = min(unused, floor((h or top - b) / unit))
          b = b + returned * unit
          if h then
            h = h - returned * unit
          end
          redis.call('HDEL', leases, ARGV[x + 1])
        end
        -- Then the new one: as many tokens as the bucket holds, up to want, if
        -- that is this call's cost and half of want (an allow of that many); else
        -- as many as it will hold within max_wait, up to want, waiting its turn as
        -- a reservation does (the cap line drops; within the debt bound), if that
        -- is this call's cost; else none. (Half: a process that finds the bucket
        -- short waits a little for a larger lease rather than make many small ones.)
        if want > 0 then
          if b >= need and b >= ceil(want / 2) * unit then
            granted = min(want, floor(b / unit))
            b = b - granted * unit
            if h then
              h = h + granted * unit
              if h >= top - b then
                h = nil
              end
            end
          elseif p > 0 then
            -- A product past the debt bound is only compared with it (exact below).
            local reach = max_wait * p
            local debt = min(MAX_DEBT_CAPACITIES, floor((EXACT - 1 - p) / full) - 1) * full
            if reach > debt then
              reach = debt
            end
            local most = floor((b + reach) / unit)
            if most >= cost then
              granted = min(want, most)
              b, h = b - granted * unit, 0
              delay = ceil(-b / p)
            end
          end
          if granted == 0 then
            longest = p == 0 and -1 or ceil((need - b) / p)
          else
            longest = delay
            if granted > cost or delay > 0 then
              -- More than this call spends at once: recorded until it expires on
              -- the server's clock, twice the period after it starts.
              local expiry = now + delay + 2 * period
              c, top, holders = c + granted * unit, top - granted * unit, holders + 1
              redis.call('HSET', leases, ARGV[x + 1], string.format('%d %d', granted * unit, expiry))
              if xmin == nil or expiry < xmin then
                xmin = expiry
              end
              local ttl = ceil((delay + 2 * period) / 1000)
              if redis.call('PTTL', leases) < ttl then
                redis.call('PEXPIRE', leases, string.format('%d', ttl))
              end
            end
          end
        end
        write = true
      elseif all_allowed then
        if mode == 'v' and b - need < 0 then
          -- A waiter: the cap line drops to its balance, so nothing given back
          -- by those before it can be used alongside or before it.
          local before = h or top - b
          b, h = b - need, 0
          if lines == nil then
            lines = {}
            for j = 1, nb do
              lines[j] = false
            end
          end
          lines[i] = {l, b, before}
        else
          b = b - need
          -- The cap line does not move: the headroom grows by what was spent.
          if h then
            h = h + need
            if h >= top - b then
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
        if c > 0 then
          bucket = string.format('%d %d %d %d %d', b, l, h or -1, c, xmin)
        elseif h then
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
          if c > 0 then
            -- Kept until its last lease record expires, and then until full.
            ttl = ttl + max(0, redis.call('PTTL', KEYS[i] .. ':leases'))
          end
          redis.call('SET', KEYS[i], bucket, 'PX', string.format('%d', ttl))
        end
      end
      local remaining = b > 0 and floor(b / unit) or 0
      if fewest == nil or remaining < fewest then
        fewest, reset, limit = remaining, until_full, capacity
      end
    end
  end
  if np > 0 then
    local bad
    if mode == 'r' then
      bad = permits_release()
    elseif pass == 1 then
      bad = permits_check()
    else
      permits_write()
    end
    if bad then
      return bad
    end
  end
end

if np > 0 then
  return {longest, fewest or -1, reset or -1, limit or -1, delay, lines or false, answers}
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
if mode == 'l' then
  return {longest, fewest, reset, granted, delay, returned, holders}
end
if n == 1 then
  return {longest, fewest, reset}
end
return {longest, fewest, reset, limit}
