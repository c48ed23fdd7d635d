-- release: give back a reservation (request failed, aborted, or worker shutting down).
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results
-- ARGV: 1 job id
-- Returns the number of tokens released (0 if the job held none).
local held = redis.call('HGET', KEYS[3], ARGV[1])
if not held then
  return 0
end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DECRBY', KEYS[4], tonumber(held))
return tonumber(held)
