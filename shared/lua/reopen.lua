-- reopen: put ended jobs of a dataset back at the end of its queue, each in one atomic step:
-- the jobs of one RQ registry (canceled: skipped while the budget was exhausted, once it
-- admits them again; failed: `budgetq retry-failed`). RQ's layout, as RQ's registry.requeue
-- writes it (status queued, enqueued_at now, no started_at / ended_at / exc_info), except
-- that RQ removes the registry entry and enqueues in two steps (a job is briefly in neither
-- place) and keeps the job hash's expiry: here the hash is made persistent, so a job
-- waiting in a paused queue never expires.
-- KEYS: 1 RQ registry (canceled or failed)  2 RQ queue list  3 budgetq stats hash of the dataset
-- ARGV: 1 RQ job hash key prefix (keys.RQ_JOB_PREFIX)  2 RQ's status of a queued job
--       (JobStatus.QUEUED)  3 stats field to count (shared.stats.REOPEN_STATS)
--       4 most jobs moved by this call  5 now as RQ formats dates
-- Returns {moved, vanished, left}: vanished counts registry entries whose job hash had
-- expired (dropped: nothing to run), left the entries still in the registry.
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[4]) - 1)
local moved, vanished = 0, 0
local push = {}
for _, id in ipairs(ids) do
  local job_key = ARGV[1] .. id
  redis.call('ZREM', KEYS[1], id)
  if redis.call('EXISTS', job_key) == 1 then
    redis.call('HDEL', job_key, 'started_at', 'ended_at', 'exc_info')
    redis.call('HSET', job_key, 'status', ARGV[2], 'enqueued_at', ARGV[5])
    redis.call('PERSIST', job_key)
    push[#push + 1] = id
    moved = moved + 1
  else
    vanished = vanished + 1
  end
end
for i = 1, #push, 1000 do  -- unpack's stack is bounded
  redis.call('RPUSH', KEYS[2], unpack(push, i, math.min(#push, i + 999)))
end
if moved > 0 then
  redis.call('HINCRBY', KEYS[3], ARGV[3], moved)
end
return {moved, vanished, redis.call('ZCARD', KEYS[1])}
