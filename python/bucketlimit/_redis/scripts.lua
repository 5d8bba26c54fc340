-- The Lua scripts of the Redis layer, as named fragments (docs/design.md §6).
-- script.py assembles each script from them when a limiter is made; the
-- protocol (each script's KEYS, ARGV and replies, the stored forms) is the
-- table in scripts.md beside this file.
--
-- A line "--- name" starts the fragment `name`; it runs to the next such line.
-- A line "--> name" is replaced by the fragment `name`, pasted: a Lua function
-- is made anew on every call of a script, and one shared by two paths measured
-- 3-7 % more server time per allow (interleaved usec_per_call, 30 rounds).
-- So a fragment's inputs and outputs are the locals it names; the scripts that
-- paste it declare them. "$capacity", "$unit" and "$rate" are a limiter's
-- numbers, written into its own script. Comment lines are left out of the
-- scripts sent (Redis keeps every distinct script until restart).
--
-- The token bucket must match src/bucket.rs: the same integer units and the
-- same rounding, so the Redis and in-process limiters give identical decisions
-- and delays on the same clock. Lua has only doubles: every quantity here is an
-- integer below 2^53 (the limiter rejects capacity*unit + rate >= 2^53 and clock
-- readings beyond 2^53 µs, and a bucket owes at most D capacities, D =
-- min(MAX_DEBT_CAPACITIES, floor((2^53 - 1 - rate) / full) - 1), so that
-- (1 + D) * full + rate < 2^53 bounds every balance, debt, wait and cap line),
-- and then +, -, * and comparisons are exact, and so are floor(a / b) and
-- ceil(a / b) for 0 <= a < 2^53, b >= 1: the quotient is rounded by less than
-- 1/b, which never carries it across an integer. A product that may pass 2^53
-- (elapsed time * rate) is only compared with a smaller exact value, which
-- rounding (monotone) cannot make it equal or smaller than. Integers are
-- written with string.format('%d') (tostring would round to 14 digits) and the
-- replies hold only integers (Redis truncates numbers).

--- limiter
-- One limiter's calls on its buckets, its numbers written in: the common call,
-- an allow of one token on the server's clock, sends one key and no argument.
--> numbers
local capacity, unit, rate = $capacity, $unit, $rate
local full = capacity * unit
local cost = ARGV[1] and tonumber(ARGV[1]) or 1
local op = ARGV[2] or 'allow'
local server_now = nil
local given = ARGV[3]
--> clock
if op == 'many' then
  --> many
end
--> one bucket

--- general
-- The calls over several limiters' buckets and permits (allow_all, reserve_all,
-- acquire_all and their give-backs and charges), and a permit key's own calls:
-- each bucket's numbers are arguments.
--> numbers
local np = tonumber(ARGV[1]) or 0
local op = ARGV[2]
local nb = (#KEYS - 4 * np) / 2
local server_now = nil
-- What the buckets of the call answered so far, which its permits follow.
local all_allowed, delay = true, 0
local permits_read, permits_write, answers = nil, nil, {}
if np > 0 then
  --> permit functions
  if op ~= 'allow' and op ~= 'reserve' and op ~= 'give-back' and op ~= 'charge' then
    --> permit alone
  end
end
--> several buckets

--- heartbeat
-- The live processes sharing a limiter (docs/design.md §6, "How many
-- processes"): forget the expired, count this one, answer how many count.
-- ARGV[3]: now in ms, sent where the store refuses TIME in scripts.
local now = tonumber(ARGV[3])
if now == nil then
  local t = redis.call('TIME')
  now = t[1] * 1000 + math.floor(t[2] / 1000)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('ZCARD', KEYS[1])

--- numbers
-- Raised by tests that pair a Redis limiter with a ManualClock standing still
-- while real time runs (see tests/redis/test_redis_parity.py); never 0.
local MIN_TTL_MS = 1
-- Must match MAX_DEBT_CAPACITIES in src/bucket.rs; fewer where that many would
-- not stay exact (script.py max_debt_capacities: the same rule).
local MAX_DEBT_CAPACITIES = 1000
local EXACT = 9007199254740992 -- 2^53
local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max

--- server time
-- server_now: the server's TIME in µs, read once per call.
if server_now == nil then
  local t = redis.call('TIME')
  server_now = t[1] * 1000000 + t[2]
end

--- clock
-- now: the µs `given` ('' or nil: the server's TIME).
local now = given
if now == nil or now == '' then
  --> server time
  now = server_now
else
  now = tonumber(now)
end

--- debt
-- debt: the most units the bucket may owe (D capacities, above).
local debt = min(MAX_DEBT_CAPACITIES, floor((EXACT - 1 - rate) / full) - 1) * full

--- read
-- The bucket as stored in `value` (false: no key): balance, its units; refilled,
-- the µs it was refilled to; headroom, the units that may still be given back
-- (nil: as many as the cap leaves room for); leased, the units its leases hold
-- (0: none); earliest, when the first of their records expires; expired, the
-- records read that have (nil until they are read). A missing bucket is full.
-- bad: the error reply for a value of any other shape (key `position` of `count`).
local balance, refilled, headroom, leased, earliest, expired, bad = full, now, nil, 0, nil, nil, nil
if value then
  local bs, ls = string.match(value, '^(%-?%d+) (%-?%d+)$')
  local hs, cs, xs = nil, nil, nil
  if bs == nil then
    bs, ls, hs = string.match(value, '^(%-?%d+) (%-?%d+) (%d+)$')
    if bs == nil then
      bs, ls, hs, cs, xs = string.match(value, '^(%-?%d+) (%-?%d+) (%-?%d+) (%d+) (%-?%d+)$')
      leased, earliest = tonumber(cs) or 0, tonumber(xs)
    end
    headroom = tonumber(hs)
  end
  balance, refilled = tonumber(bs), tonumber(ls)
  if balance == nil or refilled == nil or balance >= EXACT or balance <= -EXACT
      or refilled >= EXACT or refilled <= -EXACT
      or (hs and (headroom == nil or headroom >= EXACT or headroom < (cs and -1 or 0)))
      or (cs and (leased >= EXACT or earliest == nil or earliest >= EXACT or earliest <= -EXACT)) then
    bad = redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. position .. ' of ' .. count)
  elseif headroom == -1 then
    headroom = nil -- a leased bucket's "no headroom constraint"
  end
end

--- lease records
-- The bucket's lease records (the hash `leases`), read by a lease call, and by
-- any call once the earliest has expired: leased and earliest from the live
-- ones, holders their number, mine the units of the caller's own (a lease
-- call), expired the others by expiry ({expiry, units, caller}), which leave
-- the cap in that order. A missing bucket is full: its live leases leave it.
if op == 'lease' or (leased > 0 and now >= earliest) then
  local records = redis.call('HGETALL', leases)
  expired, leased, earliest, holders, mine = {}, 0, nil, 0, nil
  local live = 0
  for j = 1, #records, 2 do
    local amount, expiry = string.match(records[j + 1], '^(%d+) (%-?%d+)$')
    amount, expiry = tonumber(amount), tonumber(expiry)
    if amount == nil or expiry == nil or amount >= EXACT or expiry >= EXACT or expiry <= -EXACT then
      return redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. position .. ' of ' .. count)
    end
    leased = leased + amount
    if expiry <= now then
      expired[#expired + 1] = {expiry, amount, records[j]}
    else
      live, holders = live + amount, holders + 1
      if op == 'lease' and records[j] == caller then
        mine = amount
      end
      if earliest == nil or expiry < earliest then
        earliest = expiry
      end
    end
  end
  if #expired > 1 then
    table.sort(expired, function(one, other) return one[1] < other[1] end)
  end
  if not value then
    leased, expired = live, {}
  end
end

--- refill
-- The bucket refilled to now under its cap: full less what its leases hold
-- (while leases are out the bucket plus every lease never holds more than
-- full). Through each expired record's expiry first: the bucket refills to it
-- under the cap it had until then, so expiring never adds what the refill
-- would not. A clock that went back adds nothing and never moves refilled back.
local cap = full - leased
if value then
  -- More than its cap: written under a larger capacity (or before leases were known).
  if balance > cap then
    balance = cap
  end
  if expired then
    for k = 1, #expired do
      local upto, back = expired[k][1], expired[k][2]
      --> refill to
      leased, cap = leased - back, cap + back
    end
  end
  local upto = now
  --> refill to
  -- The cap line (balance + headroom) never passes the cap.
  if headroom and headroom >= cap - balance then
    headroom = nil
  end
else
  balance = cap
end

--- refill to
-- Exact when below what is missing; any larger product means full.
if upto > refilled then
  local added = (upto - refilled) * rate
  if added >= cap - balance then
    balance, headroom = cap, nil
  else
    balance = balance + added
  end
  refilled = upto
end

--- expired records leave
-- By a call that writes: the bucket is written with what they left.
if expired and #expired > 0 and op ~= 'peek' then
  for k = 1, #expired do
    redis.call('HDEL', leases, expired[k][3])
  end
  write = true
end

--- allow check
-- An allow of `need` units: refused while the bucket holds less; longest, the
-- longest wait among the refused (-1: never, at rate 0).
if balance < need then
  all_allowed = false
  if rate == 0 or longest == -1 then
    longest = -1
  else
    longest = max(longest, ceil((need - balance) / rate))
  end
end

--- allow spend
balance = balance - need
-- The cap line does not move: the headroom grows by what was spent.
if headroom then
  headroom = headroom + need
  if headroom >= cap - balance then
    headroom = nil
  end
end

--- reserve check
-- A reservation of `need` units: in debt if need be, down to the debt bound,
-- within max_wait µs ('' or nil: no limit). delay, the longest wait of the
-- call's buckets (-1: never); refused (longest, all_allowed) past a bound: for
-- as long as it takes the refill to bring it back within.
local refused_for, wait = 0, 0
local after = balance - need
if after < 0 then
  if rate == 0 then
    refused_for, wait = -1, -1
  else
    wait = ceil(-after / rate)
    --> debt
    local beyond = -after - debt
    if beyond > 0 then
      refused_for = ceil(beyond / rate)
    end
    -- Delays shrink one for one with time: ceil((x - t*p)/p) = ceil(x/p) - t.
    if max_wait and max_wait ~= '' then
      refused_for = max(refused_for, wait - tonumber(max_wait))
    end
  end
end
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

--- reserve spend
if balance - need < 0 then
  -- A waiter: the cap line drops to its balance, so nothing given back by those
  -- before it can be used alongside or before it. Its line: where it waits.
  local before = headroom or cap - balance
  balance, headroom = balance - need, 0
  line = {refilled, balance, before}
else
  --> allow spend
end

--- give back
-- `need` units back (a refund, a reservation's cancel, a settle below its
-- cost), within the headroom. A missing bucket is full: nothing to give back.
-- line_at, line_balance, line_headroom: the line of the reservation given back
-- ('' or nil: none), reserved its cost.
if value then
  write = true
end
local room = headroom or cap - balance
local last = false
if line_at and line_at ~= '' then
  -- Still the last waiter: the cap line is where it left it, refilled since.
  local elapsed = refilled - tonumber(line_at)
  last = elapsed >= 0 and elapsed * rate == balance + room - tonumber(line_balance)
end
if last then
  -- The exact undo: the previous waiter becomes the last again. All of it
  -- back: as if it had never been made (its headroom before it).
  balance = min(cap, balance + need)
  if cost >= tonumber(reserved) then
    headroom = tonumber(line_headroom)
  end
  if headroom and headroom >= cap - balance then
    headroom = nil
  end
else
  -- Only what the cap line allows: nothing ahead of a later waiter.
  local back = min(need, room)
  balance = balance + back
  if headroom then
    headroom = headroom - back
  end
end

--- charge
-- Use that happened: debt allowed, down to the bound, where it stops; longest
-- the wait until the bucket is out of debt.
--> debt
local lower = max(balance - need, -debt)
--> lower
if balance < 0 then
  longest = rate == 0 and -1 or ceil(-balance / rate)
end

--- lower
-- The balance down to `lower`, written; the cap line stays where it is: the
-- headroom grows by what was used (a charge, an upstream's report).
if headroom then
  headroom = min(headroom + (balance - lower), cap - lower)
  if headroom == cap - lower then
    headroom = nil
  end
end
balance = lower
write = true

--- observe
-- An upstream's report (Bucket::observed in src/bucket.rs; docs/design.md §4,
-- "Following the upstream"): `cost` is the most units the bucket may hold when
-- the report was made, `age` µs ago. The bound now is that plus the bucket's
-- own refill over the age (a product past what is missing means full: it
-- bounds nothing); the balance becomes at most that, never below the debt
-- bound, and the cap line stays. longest: 0 when it holds a token, else the
-- wait for one.
local added = age * rate
if added < cap - cost and cost + added < balance then
  --> debt
  local lower = max(cost + added, -debt)
  --> lower
end
if balance >= unit then
  longest = 0
else
  longest = rate == 0 and -1 or ceil((unit - balance) / rate)
end

--- lease
-- A lease (docs/design.md §6, "Hot keys: leases"), which has no twin in
-- src/bucket.rs. First this caller's previous lease ends: its record goes, and
-- what it did not use (`unused` tokens) comes back as any give-back does,
-- within the headroom. An expired record gave nothing back: its tokens are
-- spent. Then the new one, of up to `want` tokens: as many as the bucket
-- holds, if that is this call's cost and half of want (an allow of that many);
-- else as many as it will hold within max_wait µs, waiting its turn as a
-- reservation does (the cap line drops; within the debt bound), if that is
-- this call's cost; else none. (Half: a process that finds the bucket short
-- waits a little for a larger lease rather than make many small ones.) A lease
-- of more than this call's cost, or one that waits, is recorded until twice
-- the period after it starts (the caller stops using it one period in, so a
-- give-back it sends then still finds it).
if mine then
  leased, cap, holders = leased - mine, cap + mine, holders - 1
  returned = min(unused, floor((headroom or cap - balance) / unit))
  balance = balance + returned * unit
  if headroom then
    headroom = headroom - returned * unit
  end
  redis.call('HDEL', leases, caller)
end
if want > 0 then
  if balance >= need and balance >= ceil(want / 2) * unit then
    granted = min(want, floor(balance / unit))
    balance = balance - granted * unit
    if headroom then
      headroom = headroom + granted * unit
      if headroom >= cap - balance then
        headroom = nil
      end
    end
  elseif rate > 0 then
    -- A product past the debt bound is only compared with it (exact below).
    local reach = max_wait * rate
    --> debt
    if reach > debt then
      reach = debt
    end
    local most = floor((balance + reach) / unit)
    if most >= cost then
      granted = min(want, most)
      balance, headroom = balance - granted * unit, 0
      -- No wait when what it took was there (part of a token may be left).
      delay = balance < 0 and ceil(-balance / rate) or 0
    end
  end
  if granted == 0 then
    longest = rate == 0 and -1 or ceil((need - balance) / rate)
  else
    longest = delay
    if granted > cost or delay > 0 then
      local expiry = now + delay + 2 * period
      leased, cap, holders = leased + granted * unit, cap - granted * unit, holders + 1
      redis.call('HSET', leases, caller, string.format('%d %d', granted * unit, expiry))
      if earliest == nil or expiry < earliest then
        earliest = expiry
      end
      local ttl = ceil((delay + 2 * period) / 1000)
      if redis.call('PTTL', leases) < ttl then
        redis.call('PEXPIRE', leases, string.format('%d', ttl))
      end
    end
  end
end
write = true

--- write
-- The bucket stored when the call `write`s: "B L" when its headroom is as much
-- as the cap leaves room for, "B L H" otherwise, "B L H C X" while leases are
-- out (H -1 for none); deleted when full (a full bucket answers exactly like a
-- missing one); no TTL at rate 0 (SET also clears one left by another
-- configuration); else the time until full in ms, rounded up, never 0, and
-- while leases are out until the last record expires and then until full.
-- until_full: µs until full (-1: never); remaining: whole tokens held.
local until_full = 0
if balance < full then
  until_full = rate == 0 and -1 or ceil((full - balance) / rate)
end
if write then
  local stored
  if leased > 0 then
    stored = string.format('%d %d %d %d %d', balance, refilled, headroom or -1, leased, earliest)
  elseif headroom then
    stored = string.format('%d %d %d', balance, refilled, headroom)
  else
    stored = string.format('%d %d', balance, refilled)
  end
  if until_full == 0 then
    redis.call('DEL', key)
  elseif until_full == -1 then
    redis.call('SET', key, stored)
  else
    local ttl = max(MIN_TTL_MS, ceil(until_full / 1000))
    if leased > 0 then
      ttl = ttl + max(0, redis.call('PTTL', leases))
    end
    redis.call('SET', key, stored, 'PX', string.format('%d', ttl))
  end
end
local remaining = balance > 0 and floor(balance / unit) or 0

--- one bucket
-- Every call on one bucket but a batch: allow, peek, reserve, charge, give
-- back, observe, lease. Without the lease hash (KEYS[2]) a bucket with leases
-- out is not read: its error reply says so, and the call goes again with it.
local key, leases = KEYS[1], KEYS[2]
local value = redis.call('GET', key)
local position, count = 1, #KEYS
--> read
if bad then
  return bad
end
if leased > 0 and leases == nil then
  return redis.error_reply('BUCKETLIMIT leased bucket in key 1 of 1')
end
-- A lease call's answer and its caller's name, read with its records.
local holders, mine, caller = 0, nil, nil
if leases then
  if op == 'lease' then
    caller = ARGV[5]
  end
  --> lease records
end
--> refill
local need = cost * unit
local longest, all_allowed, write = 0, true, false
if op == 'allow' or op == 'peek' then
  --> allow check
  if all_allowed then
    --> allow spend
    write = op == 'allow'
  end
  --> expired records leave
  --> write
  return {longest, remaining, until_full}
end
--> expired records leave
if op == 'reserve' then
  local max_wait, delay, line = ARGV[4], 0, nil
  --> reserve check
  if all_allowed then
    --> reserve spend
    write = true
  end
  --> write
  local reply = {longest, remaining, until_full, capacity, delay}
  if line then
    reply[6] = line
  end
  return reply
elseif op == 'give-back' then
  local line_at, line_balance, line_headroom, reserved = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
  --> give back
elseif op == 'charge' then
  --> charge
elseif op == 'observe' then
  local age = tonumber(ARGV[4]) or 0
  --> observe
elseif op == 'lease' then
  local want, period = tonumber(ARGV[4]), tonumber(ARGV[6])
  local unused, max_wait = tonumber(ARGV[7]) or 0, tonumber(ARGV[8]) or 0
  local granted, returned, delay = 0, 0, 0
  --> lease
  --> write
  return {longest, remaining, until_full, granted, delay, returned, holders}
else
  return redis.error_reply('BUCKETLIMIT unknown operation ' .. op)
end
--> write
return {longest, remaining, until_full}

--- many
-- A batch of allows, one per key in arrival order (a key may come twice: the
-- second sees the first's write), each decided exactly as the one-key allow
-- alone, all at one instant. Each is answered by 3 values, flattened; an allow
-- whose key holds no bucket, or a bucket with leases out (which a batch does
-- not read), has the one-key call's error reply as its first value and writes
-- nothing, and the others go on.
local reply = {}
local position, count, leases = 1, 1, nil
for i = 1, #KEYS do
  local given_cost = ARGV[3 + i]
  local cost = (given_cost == nil or given_cost == '') and 1 or tonumber(given_cost)
  local need = cost * unit
  local key = KEYS[i]
  local value = redis.pcall('GET', key)
  local j = 3 * i
  if type(value) == 'table' then
    reply[j - 2], reply[j - 1], reply[j] = value, 0, 0 -- WRONGTYPE, for this allow only
  else
    --> read
    if bad == nil and leased > 0 then
      bad = redis.error_reply('BUCKETLIMIT leased bucket in key 1 of 1')
    end
    if bad then
      reply[j - 2], reply[j - 1], reply[j] = bad, 0, 0
    else
      --> refill
      local longest, all_allowed, write = 0, true, false
      --> allow check
      if all_allowed then
        --> allow spend
        write = true
      end
      --> write
      reply[j - 2], reply[j - 1], reply[j] = longest, remaining, until_full
    end
  end
end
return reply

--- several buckets
-- Every bucket of one decision is read and checked before the decision's first
-- write: Redis does not roll a script back. Several buckets take two passes
-- when they spend all or nothing (allow, reserve): the first checks them all,
-- the second reads them again (nothing has changed, the script is atomic and
-- its keys are distinct), spends, writes and answers. Combined like
-- registry::combine in src/registry.rs: retry_after the longest among
-- refusals, the rest from the bucket with the fewest remaining tokens (the
-- first on a tie). The permits come after the buckets of each pass.
local passes = ((nb == 1 and np == 0) or op == 'give-back' or op == 'charge') and 1 or 2
local longest, fewest, reset, limit, lines = 0, nil, nil, nil, nil
local holders, mine, caller = 0, nil, nil -- no lease call here
local count = #KEYS
for pass = 1, passes do
  for i = 1, nb do
    local a = 2 + (i - 1) * 9
    local capacity, unit, rate = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
    local cost, given = tonumber(ARGV[a + 5]), ARGV[a + 1]
    --> clock
    local full = capacity * unit
    local position = 2 * i - 1
    local key, leases = KEYS[position], KEYS[position + 1]
    local value = redis.call('GET', key)
    --> read
    if bad then
      return bad
    end
    --> lease records
    --> refill
    local need = cost * unit
    if pass == 1 then
      if op == 'reserve' then
        local max_wait = ARGV[a + 6]
        --> reserve check
      elseif op == 'allow' then
        --> allow check
      end
    end
    if pass == passes then
      local write = false
      --> expired records leave
      if op == 'give-back' then
        local line_at, line_balance, line_headroom = ARGV[a + 6], ARGV[a + 7], ARGV[a + 8]
        local reserved = ARGV[a + 9]
        --> give back
      elseif op == 'charge' then
        --> charge
      elseif all_allowed then
        if op == 'reserve' then
          local line = nil
          --> reserve spend
          if line then
            if lines == nil then
              lines = {}
              for j = 1, nb do
                lines[j] = false
              end
            end
            lines[i] = line
          end
        else
          --> allow spend
        end
        write = true
      end
      --> write
      if fewest == nil or remaining < fewest then
        fewest, reset, limit = remaining, until_full, capacity
      end
    end
  end
  if np > 0 then
    if pass == 1 then
      local bad = permits_read()
      if bad then
        return bad
      end
    else
      permits_write()
    end
  end
end
if np > 0 then
  return {longest, fewest or -1, reset or -1, limit or -1, delay, lines or false, answers}
end
if op == 'reserve' then
  local reply = {longest, fewest, reset, limit, delay}
  if lines then
    for i = 1, nb do
      reply[5 + i] = lines[i]
    end
  end
  return reply
end
if nb == 1 then
  return {longest, fewest, reset}
end
return {longest, fewest, reset, limit}

--- permit functions
-- Permits (docs/design.md §4 "Permits"), the twin of src/concurrency.rs: the
-- functions of a call that names permit keys, made only then. A permit key's
-- four keys: its hash (the counters, and each waiter's record), the permits
-- held (their expiries; member the token, "token name" when handed to a
-- waiter), the waiters queued (in the order the server ran their calls) and
-- the grants not yet picked up (scored by when their record may be dropped).
local int = function(v) return string.format('%d', v) end
local permit, settle, hand_off, expiries, frees_at, describe, grant, take, pick_up, free, keep

-- The j-th permit key of this call, read: its arguments and its counters, the
-- hash's fields t (the last token), s (the last arrival), x (the horizon: every
-- key of the permit is kept until x + ttl), w (the waiters queued, never fewer
-- than there are), e (at most the earliest expiry of the permits held, '' for
-- none) and g (the earliest time a grant record may be dropped, '' for none).
-- nil and an error reply when they are not numbers.
permit = function(j)
  local a = 2 + (nb + j - 1) * 9
  local k = 2 * nb + 4 * (j - 1) + 1
  local given = ARGV[a + 1]
  local on_given_clock = not (given == nil or given == '')
  --> clock
  local key = KEYS[k]
  local meta = redis.call('HMGET', key, 't', 's', 'x', 'w', 'e', 'g')
  local S = {
    key = key, held = KEYS[k + 1], queue = KEYS[k + 2], grants = KEYS[k + 3], now = now,
    limit = tonumber(ARGV[a + 2]), ttl = tonumber(ARGV[a + 3]), lease = tonumber(ARGV[a + 4]),
    member = ARGV[a + 6], name = ARGV[a + 7], extra = tonumber(ARGV[a + 8]) or 0,
    last_token = tonumber(meta[1] or 0), last_arrival = tonumber(meta[2] or 0),
    horizon = tonumber(meta[3] or now), queued = tonumber(meta[4] or 0),
    first_expiry = tonumber(meta[5] or ''), first_grant = tonumber(meta[6] or ''),
    count = 0, latest = now, dirty = false, new = {},
  }
  if S.last_token == nil or S.last_arrival == nil or S.horizon == nil or S.queued == nil
      or S.last_token >= EXACT or S.horizon >= EXACT or S.horizon <= -EXACT
      or (meta[5] and meta[5] ~= '' and S.first_expiry == nil)
      or (meta[6] and meta[6] ~= '' and S.first_grant == nil) then
    return nil, redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. k .. ' of ' .. #KEYS)
  end
  if meta[1] == false then
    S.new[key] = true
    if on_given_clock then
      -- A clock given to the limiter may stand still or start again where it
      -- was (a ManualClock): a counter the store lost restarts from the real
      -- time, which only grows, so no token is ever granted twice: the floor
      -- the call sends (a store that refuses TIME in scripts), else TIME.
      local floor = tonumber(ARGV[a + 9])
      if floor == nil then
        --> server time
        floor = server_now
      end
      S.last_token = max(S.last_token, floor - 1)
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
  local flat = redis.call('ZRANGE', S.held, 0, -1, 'WITHSCORES')
  local ends = {}
  for j = 2, #flat, 2 do
    ends[#ends + 1] = tonumber(flat[j])
  end
  return ends
end

-- When the k-th slot to free from now (0: the next) is sure to free (ends: the
-- expiries of the permits held, earliest first), if no holder releases or
-- renews and every waiter handed one holds it its whole ttl: each slot frees
-- at its permit's expiry, then every ttl after
-- (Entry::frees_at in src/concurrency.rs: the same binary search; when the
-- expiries lie within one ttl the freeings are periodic, answered at once).
-- Needs a permit held. Beyond 2^53 µs it answers 2^53 - 1.
frees_at = function(ends, k, ttl)
  local count_held = #ends
  if ends[count_held] - ends[1] <= ttl then
    return min(EXACT - 1, ends[(k % count_held) + 1] + floor(k / count_held) * ttl)
  end
  local wanted = k + 1
  local lo, hi = ends[1], min(EXACT - 1, ends[count_held] + k * ttl)
  while lo < hi do
    local mid = lo + floor((hi - lo) / 2)
    local freed = 0
    for j = 1, count_held do
      if mid < ends[j] then
        break
      end
      freed = freed + floor((mid - ends[j]) / ttl) + 1
      if freed >= wanted then
        break
      end
    end
    if freed >= wanted then
      hi = mid
    else
      lo = mid + 1
    end
  end
  return lo
end

-- The key as it stands (State::describe): the permits free, and the µs until
-- every permit, the `waiting` waiters' included, is sure to be free.
describe = function(S, ends, waiting)
  local count_held = #ends
  local drained = S.now
  if count_held > 0 then
    drained = ends[count_held]
    if waiting > 0 then
      drained = max(drained, frees_at(ends, waiting - 1, S.ttl) + S.ttl)
    end
  end
  return max(0, S.limit - count_held), max(0, drained - S.now)
end

-- A new permit held by member "token" or, handed to a waiter, "token name",
-- expiring at `expiry`; its token is the key's last one + 1, and at least
-- now (a counter the store lost starts from the server's time, whatever the
-- clock): it grows even across a key forgotten, or a server that lost it.
grant = function(S, expiry, name)
  local token = max(S.last_token + 1, S.now)
  S.last_token = token
  local member = name and (int(token) .. ' ' .. name) or int(token)
  redis.call('ZADD', S.held, int(expiry), member)
  if S.count == 0 then
    S.new[S.held] = true
  end
  S.count = S.count + 1
  S.first_expiry = S.first_expiry and min(S.first_expiry, expiry) or expiry
  S.latest = max(S.latest, expiry)
  S.dirty = true
  return token
end

-- Applies time (State::settle): drops the permits expired by now (once the
-- earliest may have) and the grant records never picked up, then hands the
-- free slots on.
settle = function(S)
  if S.first_expiry and S.now >= S.first_expiry then
    redis.call('ZREMRANGEBYSCORE', S.held, '-inf', int(S.now))
    S.first_expiry = tonumber(redis.call('ZRANGE', S.held, 0, 0, 'WITHSCORES')[2])
    S.dirty = true
  end
  if S.first_grant and S.now >= S.first_grant then
    local stale = redis.call('ZRANGEBYSCORE', S.grants, '-inf', int(S.now))
    if #stale > 0 then
      redis.call('HDEL', S.key, unpack(stale))
      redis.call('ZREMRANGEBYSCORE', S.grants, '-inf', int(S.now))
    end
    S.first_grant = tonumber(redis.call('ZRANGE', S.grants, 0, 0, 'WITHSCORES')[2])
    S.dirty = true
  end
  S.count = redis.call('ZCARD', S.held)
  hand_off(S)
end

-- Hands the free slots to the first waiters, in arrival order
-- (State::hand_off; a waiter whose lease lapsed is dropped). Each is told by
-- a message on its channel, "name token remaining reset_after_us", and its
-- record keeps the grant until it picks it up (for one lease: a live waiter
-- asks sooner).
hand_off = function(S)
  local now = S.now
  while S.count < S.limit and S.queued > 0 do
    local first = redis.call('ZRANGE', S.queue, 0, 0)[1]
    if first == nil then
      S.queued, S.dirty = 0, true
      break
    end
    redis.call('ZREM', S.queue, first)
    S.queued, S.dirty = S.queued - 1, true
    local record = redis.call('HGET', S.key, first)
    local deadline = record and tonumber(string.match(record, '^d (%-?%d+)$'))
    if deadline and deadline > now then
      local token = grant(S, now + S.ttl, first)
      local remaining, reset = describe(S, expiries(S), redis.call('ZCARD', S.queue))
      local told = int(token) .. ' ' .. int(remaining) .. ' ' .. int(reset)
      redis.call('HSET', S.key, first, 'g ' .. told)
      if S.first_grant == nil then
        S.new[S.grants] = true
      end
      redis.call('ZADD', S.grants, int(now + S.lease), first)
      S.first_grant = S.first_grant and min(S.first_grant, now + S.lease) or now + S.lease
      S.latest = max(S.latest, now + S.lease)
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
    local last = tonumber(redis.call('ZRANGE', S.held, -1, -1, 'WITHSCORES')[2])
    return {1, token, S.limit - S.count, max(0, last - S.now), 0}
  end
  local ends = expiries(S)
  local waiting = redis.call('ZCARD', S.queue)
  local _, reset = describe(S, ends, waiting)
  local wait = max(0, frees_at(ends, waiting, S.ttl) - S.now)
  if not queue then
    return {0, 0, 0, reset, wait}
  end
  S.last_arrival = S.last_arrival + 1
  redis.call('ZADD', S.queue, int(S.last_arrival), S.name)
  redis.call('HSET', S.key, S.name, 'd ' .. int(S.now + S.lease))
  if waiting == 0 then
    S.new[S.queue] = true
  end
  S.queued = max(S.queued, waiting) + 1
  S.latest = max(S.latest, S.now + S.lease)
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
  redis.call('ZREM', S.grants, S.name)
  return {3, tonumber(token), tonumber(remaining), tonumber(reset), 0}, record
end

-- Releases a permit by its member, then hands its slot on; false when it is
-- not held (released, or expired).
free = function(S, member)
  if redis.call('ZREM', S.held, member) == 0 then
    return false
  end
  S.count = S.count - 1
  local name = string.match(member, '^%d+ (.+)$')
  if name then
    redis.call('HDEL', S.key, name)
    redis.call('ZREM', S.grants, name)
  end
  hand_off(S)
  return true
end

-- After the call's writes: the counters, and every key of the permit kept
-- until its horizon (the latest expiry or lease it holds) and one ttl more.
-- The horizon grows a ttl at a time, so most calls set no TTL; a key's TTL is
-- only ever lengthened.
keep = function(S)
  local grew = S.latest > S.horizon
  if grew then
    S.horizon = S.latest + S.ttl
    S.dirty = true
  end
  if not S.dirty then
    return
  end
  redis.call('HSET', S.key, 't', int(S.last_token), 's', int(S.last_arrival), 'x', int(S.horizon),
    'w', int(S.queued), 'e', S.first_expiry and int(S.first_expiry) or '',
    'g', S.first_grant and int(S.first_grant) or '')
  local ms = int(max(1, ceil((S.horizon - S.now + S.ttl) / 1000)))
  for _, key in ipairs({S.key, S.held, S.queue, S.grants}) do
    if grew or S.new[key] then
      redis.call('PEXPIRE', key, ms)
    end
  end
end

-- In a call over token buckets too (allow_all and reserve_all, acquire_all,
-- their give-backs), after the buckets of each pass. The first pass settles
-- every permit key and looks at it: one busy refuses the call, all or nothing
-- (take_all in src/concurrency.rs); with a waiter's name (acquire_all) the
-- first busy one is where it queues. The second grants, each to live ttl from
-- when the tokens are ready (now + delay + ttl); with the call queued it takes
-- the free ones before that one (held while it waits, in the fixed order of
-- the keys) and queues; refused, it takes nothing and releases the call's own
-- permits (members given: an acquire_all whose tokens were refused). A
-- give-back, in its one pass, releases them. Each permit answers {state, token, remaining,
-- reset_after_us, retry_after_us}: 1 granted (member "token"), 4 kept (a
-- member given, extended by the delay), 2 queued, 0 free and not taken, -1
-- busy, 5 released.
local P, queue_at = {}, nil
permits_read = function()
  for j = 1, np do
    local S, bad = permit(j)
    if S == nil then
      return bad
    end
    settle(S)
    if op == 'give-back' then
      answers[j] = {(S.member and free(S, S.member)) and 1 or 0}
      keep(S)
    else
      S.expiries = expiries(S)
      S.waiting = S.queued > 0 and redis.call('ZCARD', S.queue) or 0
      if S.member == nil and S.count >= S.limit then
        all_allowed = false
        if S.name and queue_at == nil then
          queue_at = j
        end
      end
      P[j] = S
    end
  end
end

permits_write = function()
  for j = 1, np do
    local S = P[j]
    local ends, waiting = S.expiries, S.waiting
    local answer
    if all_allowed or (queue_at ~= nil and j < queue_at) then
      if S.member then
        if all_allowed and delay > 0 and redis.call('ZSCORE', S.held, S.member) then
          local expiry = S.now + delay + S.ttl
          redis.call('ZADD', S.held, 'XX', int(expiry), S.member)
          S.latest = max(S.latest, expiry)
          S.dirty = true
        end
        answer = {4, 0, 0, 0, 0}
      else
        local expiry = S.now + (all_allowed and delay or 0) + S.ttl
        local token = grant(S, expiry, nil)
        local last = max(expiry, ends[#ends] or expiry)
        answer = {1, token, S.limit - S.count, max(0, last - S.now), 0}
      end
    elseif j == queue_at then
      answer = take(S, true)
    elseif S.member and queue_at == nil then
      answer = {free(S, S.member) and 5 or 0, 0, 0, 0, 0}
    elseif #ends < S.limit then
      local remaining, reset = describe(S, ends, waiting)
      if S.name then
        -- acquire_all takes its permits, then finds its tokens refused and
        -- releases them (src/py_concurrency.rs after_permits): each answers as
        -- its grant would have.
        remaining, reset = remaining - 1, max(reset, S.ttl)
      end
      answer = {0, 0, remaining, reset, 0}
    else
      local _, reset = describe(S, ends, waiting)
      answer = {-1, 0, 0, reset, max(0, frees_at(ends, waiting, S.ttl) - S.now)}
    end
    answers[j] = answer
    keep(S)
  end
end

--- permit alone
-- A permit key alone: a concurrency limiter's own calls.
local S, bad = permit(1)
if S == nil then
  return bad
end
if op == 'valid' then
  -- Held and not expired; a read, nothing settled or written.
  local expiry = redis.call('ZSCORE', S.held, S.member)
  return {(expiry and tonumber(expiry) > S.now) and 1 or 0}
end
settle(S)
local reply
if op == 'take' or op == 'queue' then
  reply = take(S, op == 'queue')
elseif op == 'poll' or op == 'give-up' then
  -- A waiter's poll (its grant, or its place, its lease renewed) or its
  -- timeout's end (its grant, or it leaves the queue, refused). A waiter no
  -- longer queued (its lease lapsed) takes a permit or queues again at the
  -- back (poll), or takes one or is refused (give-up).
  local record
  reply, record = pick_up(S)
  if reply == nil and record and string.find(record, '^d ') then
    local place = redis.call('ZRANK', S.queue, S.name)
    if place ~= nil then
      local ends = expiries(S)
      if op == 'poll' then
        redis.call('HSET', S.key, S.name, 'd ' .. int(S.now + S.lease))
        S.latest = max(S.latest, S.now + S.lease)
        S.dirty = true
        reply = {2, 0, 0, 0, max(0, frees_at(ends, place, S.ttl) - S.now)}
      else
        redis.call('ZREM', S.queue, S.name)
        redis.call('HDEL', S.key, S.name)
        S.queued, S.dirty = S.queued - 1, true
        local waiting = redis.call('ZCARD', S.queue)
        local _, reset = describe(S, ends, waiting)
        reply = {0, 0, 0, reset, max(0, frees_at(ends, waiting, S.ttl) - S.now)}
      end
    end
  end
  if reply == nil then
    redis.call('HDEL', S.key, S.name)
    reply = take(S, op == 'poll')
  end
elseif op == 'abandon' then
  -- A waiter gives up (cancelled, or its caller failed): it leaves the
  -- queue, or releases at once the permit it was handed, for the next.
  local handed, record = pick_up(S)
  if handed then
    free(S, int(handed[2]) .. ' ' .. S.name)
  elseif record then
    if redis.call('ZREM', S.queue, S.name) == 1 then
      S.queued, S.dirty = S.queued - 1, true
    end
    redis.call('HDEL', S.key, S.name)
  end
  reply = {handed and 1 or 0}
elseif op == 'release' then
  reply = {free(S, S.member) and 1 or 0}
elseif op == 'renew' then
  -- To ttl after now + extra, only while held (never brought back).
  local expiry = 0
  if redis.call('ZSCORE', S.held, S.member) then
    expiry = S.now + S.extra + S.ttl
    redis.call('ZADD', S.held, 'XX', int(expiry), S.member)
    S.latest = max(S.latest, expiry)
    S.dirty = true
  end
  reply = {expiry > 0 and 1 or 0, expiry}
elseif op == 'in-flight' then
  reply = {S.count}
else
  return redis.error_reply('BUCKETLIMIT unknown operation ' .. op)
end
keep(S)
return reply
