-- commit: count one finished request exactly once and hand its result to the collector.
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results (stream)
-- ARGV: 1 job id  2 tokens to count  3 result row (JSON)  4 dataset name
-- Returns {status, used}: COMMITTED, or DUPLICATE when the prompt was already committed
-- (a retry after a crash): then nothing is counted and nothing is written.
local job = ARGV[1]
local tokens = tonumber(ARGV[2])
local held = redis.call('HGET', KEYS[3], job)
if held then
  redis.call('HDEL', KEYS[3], job)
  redis.call('DECRBY', KEYS[4], tonumber(held))
end
if redis.call('SADD', KEYS[5], job) == 0 then
  redis.call('HINCRBY', KEYS[6], 'duplicate', 1)
  return {'DUPLICATE', tonumber(redis.call('GET', KEYS[2]) or '0')}
end
local used = redis.call('INCRBY', KEYS[2], tokens)
redis.call('HINCRBY', KEYS[6], 'committed', 1)
redis.call('HINCRBY', KEYS[6], 'sum_tokens', tokens)
redis.call('HINCRBYFLOAT', KEYS[6], 'sum_sq_tokens', tokens * tokens)
redis.call('XADD', KEYS[7], '*', 'id', job, 'ds', ARGV[4], 'row', ARGV[3])
return {'COMMITTED', used}
