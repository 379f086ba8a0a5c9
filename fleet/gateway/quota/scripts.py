"""The Lua scripts the Redis quota backend runs (``fleet.gateway.quota.redis``): each one
atomic in Redis, on Redis's clock, so gateways with skewed clocks agree."""

# KEYS[1]: the tenant's GCRA time (µs); KEYS[2]: its leases (a sorted set scored by expiry).
# ARGV: rps, burst, concurrency (0: none), lease id, lease lifetime (µs).
# Returns {1, 0} allowed; {0, µs to wait} over the rate; {-1, 0} over the concurrency.
QUOTA_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = 1000000 / tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local allowed_at = tat - (burst - 1) * interval
if now < allowed_at then
  return {0, math.ceil(allowed_at - now)}
end
local concurrency = tonumber(ARGV[3])
if concurrency > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= concurrency then
    return {-1, 0}
  end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[5]), ARGV[4])
  redis.call('PEXPIRE', KEYS[2], math.ceil(tonumber(ARGV[5]) / 1000))
end
tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
return {1, 0}
"""


# KEYS[1]: the tenant's token-budget time (µs). ARGV: tokens per minute, tokens to spend (0:
# only ask; below 0: a refund of a reservation not used), and 1 to reserve: spend only if a
# token is there now, in the same step (so concurrent generations cannot all start on the
# last token). GCRA over tokens: a minute's worth may be saved up, and a generation may take
# the budget into debt (it is not cut off mid-answer); the next one waits until a token is
# back. A refund never saves up more than a whole budget. Returns the µs to wait for a token
# (0: one is there, and a reservation was made).
TOKENS_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = 60000000 / tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local n = tonumber(ARGV[2])
if n == 0 or ARGV[3] == '1' then
  local wait = tat - now - (60000000 - interval)
  if wait > 0 then return math.ceil(wait) end
  if n == 0 then return 0 end
end
tat = tat + n * interval
if tat < now then tat = now end
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
return 0
"""
