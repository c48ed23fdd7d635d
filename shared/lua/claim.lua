-- claim: take up to N jobs off a dataset's RQ queue and mark them started, atomically, so
-- a worker killed at any instant never loses a job: a claimed job is in the started
-- registry (rq:wip) with a lease, and the maintenance pass requeues it once the lease ends.
-- KEYS: 1 RQ queue list  2 RQ started registry (zset of "<job id>:<execution id>")
-- ARGV: 1 how many  2 lease end (unix seconds)  3 execution id prefix (unique per call)
--       4 now as RQ formats dates  5 worker name  6 RQ job hash key prefix (keys.RQ_JOB_PREFIX)
--       7 RQ's status of a started job (JobStatus.STARTED)
-- Returns a list of {job id, execution id, the job's data field (RQ's zlib-compressed,
-- serialized call), its result_ttl field (how long RQ keeps it once finished; finish.lua)};
-- a job whose hash has vanished (deleted by an operator) is skipped.
local ids = redis.call('LPOP', KEYS[1], tonumber(ARGV[1]))
if not ids then
  return {}
end
local out = {}
-- One ZADD for the whole batch: every command is Redis CPU spent per prompt (bench/ceiling.py).
local members = {}
for i, id in ipairs(ids) do
  local job_key = ARGV[6] .. id
  -- HMGET first: a missing hash and a missing field both read false; only then ask which
  -- (a hash without data is still claimed, and fails as unreadable, as before).
  local fields = redis.call('HMGET', job_key, 'data', 'result_ttl')
  local data = fields[1]
  if not data and redis.call('EXISTS', job_key) == 1 then data = '' end
  if data then
    local exec = ARGV[3] .. i
    members[#members + 1] = ARGV[2]
    members[#members + 1] = id .. ':' .. exec
    if #members >= 1000 then  -- unpack's stack is bounded: a huge claim goes in slices
      redis.call('ZADD', KEYS[2], unpack(members))
      members = {}
    end
    redis.call('HSET', job_key, 'status', ARGV[7], 'started_at', ARGV[4], 'last_heartbeat', ARGV[4],
               'worker_name', ARGV[5])
    out[#out + 1] = {id, exec, data, fields[2] or ''}
  end
end
if #members > 0 then
  redis.call('ZADD', KEYS[2], unpack(members))
end
return out
