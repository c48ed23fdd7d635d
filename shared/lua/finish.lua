-- finish: record how jobs ended, in RQ's own layout: the started-registry entry goes, the job
-- hash gets its status, the job goes into the finished / failed / canceled registry, and its
-- result into RQ's result stream, so rq-dashboard and `rq` show it. A finished job whose
-- result_ttl is 0 is deleted instead (hash and result stream), as RQ's own worker does with
-- such a job: nothing is kept, which is what a fleet wants (producer.result_ttl_s).
-- Only the job's current holder records it: if the entry is gone (the lease ran out and the
-- job was requeued, maybe running elsewhere), nothing is written.
-- A job that ends as committed (its item's field 17 is '1') must be in the dataset's done set
-- here. It is not when its commit was acknowledged by a master that then died before the
-- replica now promoted had it (replication is asynchronous): the job is then put back on its
-- queue (its reservation given back), counted lost_commit, and runs again. Recorded instead,
-- the prompt would be in no ledger state (neither done nor queued nor running) and, if the
-- collector had not read the lost row yet, in no file either, while the run ended complete.
-- An item script (shared/scripts.py): one call records one or several jobs of a dataset, in
-- order; registry entries and stats counters are written once per call.
-- KEYS: 1 RQ started registry  2 RQ finished registry  3 RQ failed registry
--       4 RQ canceled registry  5 budgetq stats hash of the dataset  6 done set  7 RQ queue list
--       8 resv  9 reserved
-- ARGV: 1 RQ job hash key prefix (keys.RQ_JOB_PREFIX)  2 RQ result stream key prefix
--       3 worker name  4 most entries kept in a result stream (shared.jobs.RESULT_STREAM_MAXLEN)
--       5 RQ's status of a queued job (JobStatus.QUEUED)
--       then per item, 17 each:
--        1 registry member "<job>:<execution>"  2 job id  3 status (finished|failed|canceled)
--        4 the KEYS index of its registry (2, 3 or 4)  5 ended_at (RQ's date format)
--        6 registry score  7 ttl (s) of the job hash and result; 0: delete the job
--        8 result type (1 successful, 2 failed, 0 none)  9 return value (base64 JSON) or ''
--       10 exc_string (base64 zlib) or ''  11 execution id  12 execution started_at (unix s)
--       13 execution ended_at (unix s)  14 exc_info for the job hash (zlib) or ''
--       15 meta for the job hash (JSON) or ''  16 stats field to count
--          (shared.stats.ENDING_STATS) or ''
--       17 '1' if the job ends as committed (its prompt must be in the done set), else ''
-- Returns one code per item: 1 recorded, 0 this caller no longer holds the job, 2 its commit is
-- not here (lost in a failover): requeued.
local ITEM = 17
local registry = {[2] = {}, [3] = {}, [4] = {}}  -- KEYS index -> {score, member, ...}
local stats = {}

-- Optional fields go into a HSET / XADD argument list only when there is a value.
local function put(fields, name, value)
  if value ~= '' then
    fields[#fields + 1] = name
    fields[#fields + 1] = value
  end
end

local function finish(a)
  if redis.call('ZREM', KEYS[1], a[1]) == 0 then
    return 0
  end
  local job_key = ARGV[1] .. a[2]
  if a[17] == '1' and redis.call('SISMEMBER', KEYS[6], a[2]) == 0 then
    local held = redis.call('HGET', KEYS[8], a[2])
    if held then
      redis.call('HDEL', KEYS[8], a[2])
      redis.call('DECRBY', KEYS[9], tonumber(held))
    end
    if redis.call('EXISTS', job_key) == 1 then
      redis.call('HSET', job_key, 'status', ARGV[5])
      redis.call('LPUSH', KEYS[7], a[2])
    end
    redis.call('HINCRBY', KEYS[5], 'lost_commit', 1)  -- rare (a failover): not batched with the others
    return 2
  end
  local results_key = ARGV[2] .. a[2]
  local ttl = tonumber(a[7])
  if a[16] ~= '' then
    stats[a[16]] = (stats[a[16]] or 0) + 1
  end
  if ttl == 0 then
    redis.call('DEL', job_key, results_key)
    return 1
  end
  -- EXPIRE answers whether the job hash still exists (an operator may have deleted it), which
  -- saves an EXISTS; the HSET that follows keeps the expiry. One HSET for every field.
  if redis.call('EXPIRE', job_key, ttl) == 1 then
    local fields = {'status', a[3], 'ended_at', a[5]}
    put(fields, 'exc_info', a[14])
    put(fields, 'meta', a[15])
    redis.call('HSET', job_key, unpack(fields))
    local members = registry[tonumber(a[4])]
    members[#members + 1] = a[6]
    members[#members + 1] = a[2]
  end
  if a[8] ~= '0' then
    local fields = {'type', a[8], 'worker_name', ARGV[3], 'execution_id', a[11],
                    'execution_started_at', a[12], 'execution_ended_at', a[13]}
    put(fields, 'return_value', a[9])
    put(fields, 'exc_string', a[10])
    redis.call('XADD', results_key, 'MAXLEN', ARGV[4], '*', unpack(fields))
    redis.call('EXPIRE', results_key, ttl)
  end
  return 1
end

local out = {}
for base = 6, #ARGV, ITEM do
  out[#out + 1] = finish({unpack(ARGV, base, base + ITEM - 1)})
end
for index, members in pairs(registry) do
  -- unpack's stack is bounded: a huge call goes in slices
  for i = 1, #members, 1000 do
    redis.call('ZADD', KEYS[index], unpack(members, i, math.min(#members, i + 999)))
  end
end
for field, by in pairs(stats) do
  redis.call('HINCRBY', KEYS[5], field, by)
end
return out
