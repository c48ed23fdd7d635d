-- withdraw: cancel every admission of a dataset (operator's --abort-in-flight). Results of
-- the requests still running are then rejected by commit.lua; workers see abort_epoch
-- change and disconnect them, which makes SGLang abort the generation.
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results 8 hist 9 rate
-- ARGV: none
-- Returns the number of admissions withdrawn.
local n = redis.call('HLEN', KEYS[3])
redis.call('DEL', KEYS[3])
redis.call('SET', KEYS[4], 0)
redis.call('HINCRBY', KEYS[1], 'abort_epoch', 1)
if n > 0 then redis.call('HINCRBY', KEYS[6], 'withdrawn', n) end
return n
