-- release: give back a reservation (request failed, aborted, or worker shutting down).
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results 8 hist 9 rate
-- ARGV: 1 job id  2 tokens the server generated for it before it ended (0 if unknown):
--       counted as wasted, since no row keeps them
-- Returns the number of tokens released (0 if the job held none).
local generated = tonumber(ARGV[2] or '0')
if generated > 0 then
  redis.call('HINCRBY', KEYS[6], 'generated_tokens', generated)
  redis.call('HINCRBY', KEYS[6], 'wasted_tokens', generated)
end
local held = redis.call('HGET', KEYS[3], ARGV[1])
if not held then
  return 0
end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DECRBY', KEYS[4], tonumber(held))
return tonumber(held)
