-- requeue: put a started job back at the front of its queue and give back its reservation,
-- atomically. Used on graceful shutdown, for a paused dataset, for a request aborted in
-- flight (its admission withdrawn: it runs again once admitted), and by the maintenance pass
-- for jobs whose lease ended (their worker died).
-- A job whose prompt is already committed (its worker died between commit and finish) is
-- not queued again: its job hash goes (nothing is left to run) and it counts as
-- already_done, so a prompt is never both a row and queued (shared/ledger.py).
-- KEYS: 1 RQ started registry  2 RQ queue list  3 RQ job hash  4 resv  5 reserved  6 stats
--       7 done set of the dataset
-- ARGV: 1 registry member "<job id>:<execution id>"  2 job id  3 stats field to count
--       (shared.stats.REQUEUE_STATS: requeued | recovered | aborted)
--       4 if not empty: only when the lease ended before this time
--       (unix seconds), so a lease renewed meanwhile is left alone
--       5 RQ's status of a queued job (JobStatus.QUEUED)
-- Returns 1 if requeued (or settled as already done), 0 if the member was already gone or
-- its lease was renewed.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return 0
end
if ARGV[4] ~= '' and tonumber(score) > tonumber(ARGV[4]) then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
local held = redis.call('HGET', KEYS[4], ARGV[2])
if held then
  redis.call('HDEL', KEYS[4], ARGV[2])
  redis.call('DECRBY', KEYS[5], tonumber(held))
end
if redis.call('SISMEMBER', KEYS[7], ARGV[2]) == 1 then
  redis.call('DEL', KEYS[3])
  redis.call('HINCRBY', KEYS[6], 'already_done', 1)
  return 1
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('HSET', KEYS[3], 'status', ARGV[5])
  redis.call('LPUSH', KEYS[2], ARGV[2])
end
redis.call('HINCRBY', KEYS[6], ARGV[3], 1)
return 1
