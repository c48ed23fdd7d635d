-- adjust: set new reservations for requests still in flight (soft mode). The worker raises
-- a request's reservation as it runs: a request running for a while is likely a long one,
-- so its expected final length grows. This is what tapers admissions near the budget.
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results 8 hist 9 rate
-- ARGV: job1, tokens1, job2, tokens2, ...
-- Only reservations still held are changed (a withdrawn one stays withdrawn).
-- Returns the new total reserved.
local delta = 0
for i = 1, #ARGV, 2 do
  local old = redis.call('HGET', KEYS[3], ARGV[i])
  if old then
    local new = tonumber(ARGV[i + 1])
    redis.call('HSET', KEYS[3], ARGV[i], new)
    delta = delta + new - tonumber(old)
  end
end
if delta ~= 0 then
  return redis.call('INCRBY', KEYS[4], delta)
end
return tonumber(redis.call('GET', KEYS[4]) or '0')
