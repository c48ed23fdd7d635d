-- finish: record how a job ended, in RQ's own layout, in one step: the started-registry entry
-- goes, the job hash gets its status, the job goes into the finished / failed / canceled
-- registry, and its result into RQ's result stream, so rq-dashboard and `rq` show it.
-- Only the job's current holder records it: if the entry is gone (the lease ran out and the
-- job was requeued, maybe running elsewhere), nothing is written.
-- KEYS: 1 RQ started registry  2 RQ job hash  3 RQ registry to add to  4 RQ result stream
--       5 budgetq stats hash of the dataset
-- ARGV: 1 registry member "<job>:<execution>"  2 job id  3 status (finished|failed|canceled)
--       4 ended_at (RQ's date format)  5 registry score  6 ttl (s) of the job hash and result
--       7 result type (1 successful, 2 failed, 0 none)  8 return value (base64 JSON) or ''
--       9 exc_string (base64 zlib) or ''  10 worker name  11 execution id
--       12 execution started_at (unix s)  13 execution ended_at (unix s)
--       14 exc_info for the job hash (zlib) or ''  15 meta for the job hash (JSON) or ''
--       16 stats field to count (shared.stats.ENDING_STATS) or ''
--       17 most entries kept in the result stream (shared.jobs.RESULT_STREAM_MAXLEN)
-- Returns 1 if recorded, 0 if this caller no longer holds the job.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return 0
end
-- EXPIRE answers whether the job hash still exists (an operator may have deleted it), which
-- saves an EXISTS; the HSET that follows keeps the expiry. One HSET for every field.
if redis.call('EXPIRE', KEYS[2], tonumber(ARGV[6])) == 1 then
  local fields = {'status', ARGV[3], 'ended_at', ARGV[4]}
  if ARGV[14] ~= '' then
    fields[#fields + 1] = 'exc_info'
    fields[#fields + 1] = ARGV[14]
  end
  if ARGV[15] ~= '' then
    fields[#fields + 1] = 'meta'
    fields[#fields + 1] = ARGV[15]
  end
  redis.call('HSET', KEYS[2], unpack(fields))
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[2])
end
if ARGV[7] ~= '0' then
  local fields = {'type', ARGV[7], 'worker_name', ARGV[10], 'execution_id', ARGV[11],
                  'execution_started_at', ARGV[12], 'execution_ended_at', ARGV[13]}
  if ARGV[8] ~= '' then
    fields[#fields + 1] = 'return_value'
    fields[#fields + 1] = ARGV[8]
  end
  if ARGV[9] ~= '' then
    fields[#fields + 1] = 'exc_string'
    fields[#fields + 1] = ARGV[9]
  end
  redis.call('XADD', KEYS[4], 'MAXLEN', ARGV[17], '*', unpack(fields))
  redis.call('EXPIRE', KEYS[4], tonumber(ARGV[6]))
end
if ARGV[16] ~= '' then
  redis.call('HINCRBY', KEYS[5], ARGV[16], 1)
end
return 1
