-- reserve: admit one request against a dataset's token budget, atomically.
-- KEYS: 1 conf (hash) 2 used (string) 3 resv (hash job->tokens) 4 reserved (string)
--       5 done (set) 6 stats (hash) 7 results (stream, unused)
-- ARGV: 1 job id  2 max_tokens of this request
-- Returns {status, tokens_reserved}; status is one of
--   ADMIT      reservation written (or already held by this job: idempotent on retry)
--   DONE       the prompt was already committed: do not send it again
--   PAUSED     the dataset is paused by an operator
--   EXHAUSTED  the budget is crossed (soft) or can no longer fit this request (strict)
--   WAIT       the budget may still fit it once requests in flight finish
local job = ARGV[1]
local max_tokens = tonumber(ARGV[2])
if redis.call('SISMEMBER', KEYS[5], job) == 1 then
  return {'DONE', 0}
end
local held = redis.call('HGET', KEYS[3], job)
if held then
  return {'ADMIT', tonumber(held)}
end
local conf = redis.call('HMGET', KEYS[1], 'limit', 'mode', 'paused', 'prior_mean')
local limit = tonumber(conf[1])
if not limit then
  return redis.error_reply('budgetq: dataset not registered: ' .. KEYS[1])
end
if conf[3] == '1' then
  return {'PAUSED', 0}
end
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
local reserved = tonumber(redis.call('GET', KEYS[4]) or '0')
local est
if conf[2] == 'strict' then
  -- strict: reserve the worst case so used can never pass the limit.
  est = max_tokens
  if used + est > limit then
    redis.call('HINCRBY', KEYS[6], 'skipped', 1)
    return {'EXHAUSTED', 0}
  end
else
  if used >= limit then
    redis.call('HINCRBY', KEYS[6], 'skipped', 1)
    return {'EXHAUSTED', 0}
  end
  local stats = redis.call('HMGET', KEYS[6], 'committed', 'sum_tokens', 'sum_sq_tokens')
  local n = tonumber(stats[1] or '0')
  -- Short answers finish first, so an early running mean is biased low: never reserve
  -- below the configured prior.
  local mean = tonumber(conf[4] or '1')
  local cv2 = 0
  if n > 0 then
    local m = tonumber(stats[2] or '0') / n
    if m > mean then mean = m end
    if n > 1 then
      cv2 = (tonumber(stats[3] or '0') / n - m * m) / (m * m)
      if cv2 < 0 then cv2 = 0 end
    end
  end
  -- Requests still in flight are length-biased (the long ones are the ones left running):
  -- their expected length is mean * (1 + cv^2), the inspection paradox, so reserve that.
  est = math.ceil(mean * (1 + cv2))
  if est > max_tokens then est = max_tokens end
  if est < 1 then est = 1 end
  -- Fill the tail: with nothing in flight and budget left, always admit one.
  if reserved == 0 then
    redis.call('HSET', KEYS[3], job, est)
    redis.call('INCRBY', KEYS[4], est)
    return {'ADMIT', est}
  end
end
if used + reserved + est > limit then
  return {'WAIT', 0}
end
redis.call('HSET', KEYS[3], job, est)
redis.call('INCRBY', KEYS[4], est)
return {'ADMIT', est}
