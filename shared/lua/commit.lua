-- commit: count one finished request exactly once and hand its result to the collector.
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results (stream) 8 hist 9 rate
-- ARGV: 1 job id  2 prompt tokens  3 completion tokens (what the server generated)
--       4 result row (JSON)  5 finish reason ('length' = cut by max_tokens)
--       6 histogram bins (keys.HIST_BINS)  7 rate bucket width, s (keys.RATE_BUCKET_S)
--       8 how long rate buckets are kept, s (keys.RATE_KEEP_S)
--       9 optional: each request's completion tokens, comma-separated, when the result took
--         several (regenerate: all); ARGV[3] is their sum. The histogram, the spread and
--         stats.extra_requests stay per request, so reserve.lua's mean is per request.
-- What counts follows the dataset's conf: count = completion | total (prompt + completion);
-- keep = complete sets results cut by max_tokens aside (side file, not counted).
-- Returns {status, used}; status is one of
--   COMMITTED  counted and handed to the collector
--   CROSSED    counted, and this result crossed a soft budget: every other admission of
--              the dataset was withdrawn (requests still running are to be aborted)
--   TRUNCATED  kept aside (side file), marked done, not counted
--   DUPLICATE  the prompt was already committed (a retry after a crash): nothing counted
--   REJECTED   this request's admission was withdrawn (budget crossed, lowered with
--              --abort-in-flight, or its lease was lost): nothing counted, tokens wasted
local job = ARGV[1]
local generated = tonumber(ARGV[3])
local held = redis.call('HGET', KEYS[3], job)
if held then
  redis.call('HDEL', KEYS[3], job)
  redis.call('DECRBY', KEYS[4], tonumber(held))
end
-- Held: SADD both marks the prompt done and says whether it already was (one command where
-- SISMEMBER + SADD were two). Not held: only look, a rejected result must not mark it done.
local fresh
if held then
  fresh = redis.call('SADD', KEYS[5], job) == 1
else
  fresh = redis.call('SISMEMBER', KEYS[5], job) == 0
end
if not fresh then
  redis.call('HINCRBY', KEYS[6], 'duplicate', 1)
  redis.call('HINCRBY', KEYS[6], 'wasted_tokens', generated)
  return {'DUPLICATE', tonumber(redis.call('GET', KEYS[2]) or '0')}
end
redis.call('HINCRBY', KEYS[6], 'generated_tokens', generated)
if not held then
  redis.call('HINCRBY', KEYS[6], 'rejected', 1)
  redis.call('HINCRBY', KEYS[6], 'wasted_tokens', generated)
  return {'REJECTED', tonumber(redis.call('GET', KEYS[2]) or '0')}
end
-- Lengths feed the reservation estimates whether or not the row counts.
local conf = redis.call('HMGET', KEYS[1], 'limit', 'mode', 'max_tokens', 'count', 'keep')
local tokens = generated
if conf[4] == 'total' then tokens = tokens + tonumber(ARGV[2]) end
local bins = tonumber(ARGV[6])
local width = math.max(1, math.floor(tonumber(conf[3] or bins) / bins))
local lengths = {generated}
if ARGV[9] and ARGV[9] ~= '' then
  lengths = {}
  for n in string.gmatch(ARGV[9], '[^,]+') do lengths[#lengths + 1] = tonumber(n) end
  redis.call('HINCRBY', KEYS[6], 'extra_requests', #lengths - 1)
end
redis.call('HINCRBY', KEYS[6], 'sum_completion', generated)
for _, n in ipairs(lengths) do
  redis.call('HINCRBY', KEYS[8], math.floor(n / width), 1)
  -- With sum_completion, the spread of lengths: reserve.lua's end-game margin.
  redis.call('HINCRBY', KEYS[6], 'sum_sq_completion', n * n)
end
if conf[5] == 'complete' and ARGV[5] == 'length' then
  redis.call('HINCRBY', KEYS[6], 'truncated', 1)
  redis.call('HINCRBY', KEYS[6], 'truncated_tokens', generated)
  redis.call('XADD', KEYS[7], '*', 'id', job, 'kind', 'truncated', 'row', ARGV[4])
  return {'TRUNCATED', tonumber(redis.call('GET', KEYS[2]) or '0')}
end
local used = redis.call('INCRBY', KEYS[2], tokens)
redis.call('HINCRBY', KEYS[6], 'committed', 1)
redis.call('HINCRBY', KEYS[6], 'sum_tokens', tokens)
local now = redis.call('TIME')
local bucket_s = tonumber(ARGV[7])
local bucket = tonumber(now[1]) - tonumber(now[1]) % bucket_s
if redis.call('HINCRBY', KEYS[9], bucket, tokens) == tokens then
  -- A new bucket: drop buckets older than the keep time so the hash stays small.
  for _, f in ipairs(redis.call('HKEYS', KEYS[9])) do
    if tonumber(f) < bucket - tonumber(ARGV[8]) then redis.call('HDEL', KEYS[9], f) end
  end
end
redis.call('XADD', KEYS[7], '*', 'id', job, 'kind', 'row', 'row', ARGV[4])
local limit = tonumber(conf[1])
if conf[2] == 'soft' and used >= limit and used - tokens < limit then
  -- This result crossed the budget. Withdraw every other admission: results still on
  -- their way are then rejected, so used stays within [limit, limit + max_tokens).
  local others = redis.call('HLEN', KEYS[3])
  if others > 0 then
    redis.call('DEL', KEYS[3])
    redis.call('SET', KEYS[4], 0)
    redis.call('HINCRBY', KEYS[6], 'withdrawn', others)
  end
  return {'CROSSED', used}
end
return {'COMMITTED', used}
