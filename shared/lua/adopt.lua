-- adopt: mark results already on disk as committed (reconcile after Redis lost data).
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results 8 hist 9 rate
-- ARGV: job1, counted1, completion1, job2, counted2, completion2, ...
--       counted is -1 for a row kept aside (truncated side file), -2 for a discarded answer
--       that ended its prompt (discarded side file): done, not counted.
-- A prompt already in the done set is left alone, so adopting twice never counts twice.
-- Returns {adopted, tokens added to used}.
local adopted, added = 0, 0
for i = 1, #ARGV, 3 do
  if redis.call('SADD', KEYS[5], ARGV[i]) == 1 then
    adopted = adopted + 1
    -- it enters the ledger here, not through the queue (shared/ledger.py)
    redis.call('HINCRBY', KEYS[6], 'adopted', 1)
    local counted = tonumber(ARGV[i + 1])
    local completion = tonumber(ARGV[i + 2])
    redis.call('HINCRBY', KEYS[6], 'sum_completion', completion)
    redis.call('HINCRBY', KEYS[6], 'sum_sq_completion', completion * completion)
    if counted >= 0 then
      redis.call('INCRBY', KEYS[2], counted)
      redis.call('HINCRBY', KEYS[6], 'committed', 1)
      redis.call('HINCRBY', KEYS[6], 'sum_tokens', counted)
      redis.call('HINCRBY', KEYS[6], 'kept_tokens', completion)
      added = added + counted
    elseif counted == -2 then
      redis.call('HINCRBY', KEYS[6], 'discarded', 1)
    else
      redis.call('HINCRBY', KEYS[6], 'truncated', 1)
    end
  end
end
return {adopted, added}
