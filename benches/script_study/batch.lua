-- Study only (benches/script_study/FINDINGS.md): one call deciding #KEYS allows in
-- arrival order, each exactly as bucket.lua's one-key allow on the server's clock
-- would (the arithmetic of its one-key path, variant 1), all at one instant: the
-- server's TIME is read once. The same key may come twice: the second sees the
-- first's write. The basis of the shared round trips (python/bucketlimit/_redis/batching.py).
--
-- KEYS     the buckets, one per decision, in arrival order
-- ARGV[i]  the cost of decision i in tokens (absent: 1)
-- Reply    {retry_after_us, remaining, reset_after_us} per decision, flattened.
local MIN_TTL_MS = 1
local EXACT = 9007199254740992 -- 2^53
local floor, ceil, max = math.floor, math.ceil, math.max
local capacity, unit, p = 0, 0, 0 -- config
local full = capacity * unit
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local reply = {}
for i = 1, #KEYS do
  local cost = ARGV[i]
  local need = (cost and tonumber(cost) or 1) * unit
  local b, l = full, now
  local value = redis.call('GET', KEYS[i])
  if value then
    local bs, ls = string.match(value, '^(%d+) (%-?%d+)$')
    b, l = tonumber(bs), tonumber(ls)
    if b == nil or l == nil or b >= EXACT or l >= EXACT or l <= -EXACT then
      return redis.error_reply('BUCKETLIMIT corrupt bucket value in key ' .. i .. ' of ' .. #KEYS)
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
  local retry = 0
  if b < need then
    retry = p == 0 and -1 or ceil((need - b) / p)
  else
    b = b - need
  end
  local until_full = 0
  if b < full then
    until_full = p == 0 and -1 or ceil((full - b) / p)
  end
  if retry == 0 then
    if until_full == 0 then
      redis.call('DEL', KEYS[i])
    elseif until_full == -1 then
      redis.call('SET', KEYS[i], string.format('%d %d', b, l))
    else
      local ttl = max(MIN_TTL_MS, ceil(until_full / 1000))
      redis.call('SET', KEYS[i], string.format('%d %d', b, l), 'PX', string.format('%d', ttl))
    end
  end
  local j = 3 * i
  reply[j - 2], reply[j - 1], reply[j] = retry, floor(b / unit), until_full
end
return reply
