-- release: give back a reservation (request failed, aborted, or worker shutting down).
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results 8 hist 9 rate
--       10 (optional) RQ started registry of the dataset
-- ARGV: 1 job id  2 tokens the server generated for it before it ended (0 if unknown):
--       counted as wasted, since no row keeps them
--       3 (with KEYS[10]) the caller's registry member "<job id>:<execution id>"
-- With KEYS[10], the release only happens while the caller still holds the job: a worker
-- whose lease ran out (the job was requeued and may run elsewhere, holding a reservation
-- under the same job id) must not give back the new holder's reservation.
-- Returns {status, tokens released}; status is one of
--   RELEASED      the reservation was given back (tokens 0 if the job held none)
--   NOT_OURS      the caller no longer holds the job (its lease ran out; it was requeued)
--   ALREADY_DONE  the prompt is already committed (another copy of the job finished it)
local generated = tonumber(ARGV[2] or '0')
if generated > 0 then
  redis.call('HINCRBY', KEYS[6], 'generated_tokens', generated)
  redis.call('HINCRBY', KEYS[6], 'wasted_tokens', generated)
end
if KEYS[10] and not redis.call('ZSCORE', KEYS[10], ARGV[3]) then
  return {'NOT_OURS', 0}
end
local held = redis.call('HGET', KEYS[3], ARGV[1])
if redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 then
  if held then
    redis.call('HDEL', KEYS[3], ARGV[1])
    redis.call('DECRBY', KEYS[4], tonumber(held))
  end
  return {'ALREADY_DONE', 0}
end
if not held then
  return {'RELEASED', 0}
end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DECRBY', KEYS[4], tonumber(held))
return {'RELEASED', tonumber(held)}
