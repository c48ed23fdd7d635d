-- commit: count finished requests exactly once and hand their results to the collector.
-- An item script (shared/scripts.py): one call commits one or several results of the dataset,
-- in order, exactly as separate calls would; the settings are read once, and the counters
-- (used, reserved, stats, histogram, rate) are summed here and written once per call, not per
-- result: every command is Redis CPU spent per prompt (bench/ceiling.py). Only a Lua error
-- could stop a call half way, and none of its commands can raise on these keys.
-- KEYS: 1 conf 2 used 3 resv 4 reserved 5 done 6 stats 7 results (stream) 8 hist 9 rate
--       10 discards (reason -> answers, reason:tokens -> their tokens)
--       11 retried (set: jobs whose discarded answer was already sent again once)
-- ARGV: 1 histogram bins (keys.HIST_BINS)  2 rate bucket width, s (keys.RATE_BUCKET_S)
--       3 how long rate buckets are kept, s (keys.RATE_KEEP_S)
--       then per item, 8 each: job id, prompt tokens, completion tokens (what the server
--       generated), result row (JSON), finish reason ('length' = cut by max_tokens), each
--       request's completion tokens, comma-separated, when the result took several
--       (regenerate: all; '' otherwise), whose sum is the completion tokens, the discard
--       reason ('' = none: the worker's guard or a quality gate refused the answer, e.g.
--       'loop', 'empty', 'validator:<text>'), and '1' when a discarded prompt is to be sent
--       again (retry_discarded) rather than end discarded. The histogram, the spread and
--       stats.extra_requests stay per request, so reserve.lua's mean is per request.
-- What counts follows the dataset's conf: count = completion | total (prompt + completion);
-- keep = complete sets results cut by max_tokens aside (side file); budget_counts = kept
-- (default: only rows count) | spent (truncated and discarded answers count too: every token
-- generated under a ticket).
-- Returns one {status, used} per item; status is one of
--   COMMITTED  counted and handed to the collector
--   CROSSED    counted, and this result crossed a soft budget: every other admission of
--              the dataset was withdrawn (requests still running are to be aborted)
--   TRUNCATED  kept aside (side file), marked done, counted only with budget_counts spent
--   DISCARDED  refused by the guard or a gate: side file with its reason, marked done (a ledger
--              state of its own), counted only with budget_counts spent
--   RETRY      refused, and the prompt is to be sent again: side file, its ticket given back,
--              not marked done (the job asks for a new admission), counted only with spent.
--              Once per prompt: a job already in KEYS[11] ends DISCARDED instead, so a prompt
--              is never sent a third time, whichever worker (or run) commits the attempts.
--   (with spent, a truncated or discarded answer that crosses a soft budget also withdraws the
--   other admissions, as CROSSED does; the worker's control loop sees its tickets gone)
--   DUPLICATE  the prompt was already committed (a retry after a crash): nothing counted
--   REJECTED   this request's admission was withdrawn (budget crossed, lowered with
--              --abort-in-flight, or its lease was lost): nothing counted, tokens wasted
local ITEM = 8
local conf = redis.call('HMGET', KEYS[1], 'limit', 'mode', 'max_tokens', 'count', 'keep', 'budget_counts')
local spent = conf[6] == 'spent'
local limit = tonumber(conf[1])
local bins = tonumber(ARGV[1])
local width = math.max(1, math.floor(tonumber(conf[3] or bins) / bins))
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
local used_before = used
local unreserve = 0   -- tokens of the reservations taken back: one DECRBY at the end
local stats = {}      -- stats field -> increment, one HINCRBY each at the end
local hist = {}       -- histogram bin -> increment
local rate_tokens = 0
local discards = {}   -- discards hash field -> increment

local function bump(field, by)
  stats[field] = (stats[field] or 0) + by
end

-- Add a counted result's tokens to used; true when it crossed a soft budget (every other
-- admission is then withdrawn: results still on their way are rejected, so used stays within
-- [limit, limit + max_tokens)).
local function count(tokens)
  used = used + tokens
  rate_tokens = rate_tokens + tokens
  if conf[2] == 'soft' and used >= limit and used - tokens < limit then
    local others = redis.call('HLEN', KEYS[3])
    if others > 0 then
      redis.call('DEL', KEYS[3])
      redis.call('SET', KEYS[4], 0)
      unreserve = 0  -- the reservations taken back so far went with the SET
      bump('withdrawn', others)
    end
    return true
  end
  return false
end

local function commit(job, prompt_tokens, generated, row, finish_reason, lengths_csv, discard, retry)
  local held = redis.call('HGET', KEYS[3], job)
  if held then
    redis.call('HDEL', KEYS[3], job)
    unreserve = unreserve + tonumber(held)
  end
  -- Sent again: the prompt is not done. SISMEMBER here, SADD once the result is known to be ours.
  local again = held and discard ~= '' and retry == '1' and redis.call('SISMEMBER', KEYS[11], job) == 0
  -- Held: SADD both marks the prompt done and says whether it already was (one command where
  -- SISMEMBER + SADD were two). Not held (or to be sent again): only look, a rejected result
  -- must not mark it done.
  local fresh
  if held and not again then
    fresh = redis.call('SADD', KEYS[5], job) == 1
  else
    fresh = redis.call('SISMEMBER', KEYS[5], job) == 0
  end
  if not fresh then
    bump('duplicate_result', 1)
    bump('wasted_tokens', generated)
    return {'DUPLICATE', used}
  end
  bump('generated_tokens', generated)
  if not held then
    bump('rejected', 1)
    bump('wasted_tokens', generated)
    return {'REJECTED', used}
  end
  -- Lengths feed the reservation estimates whether or not the row counts.
  local tokens = generated
  if conf[4] == 'total' then tokens = tokens + prompt_tokens end
  local lengths = {generated}
  if lengths_csv ~= '' then
    lengths = {}
    for n in string.gmatch(lengths_csv, '[^,]+') do lengths[#lengths + 1] = tonumber(n) end
    bump('extra_requests', #lengths - 1)
  end
  bump('sum_completion', generated)
  for _, n in ipairs(lengths) do
    local bin = math.floor(n / width)
    hist[bin] = (hist[bin] or 0) + 1
    -- With sum_completion, the spread of lengths: reserve.lua's end-game margin.
    bump('sum_sq_completion', n * n)
  end
  if discard ~= '' then
    -- Not a committed or truncated result, so not in reserve.lua's count of results: every one of
    -- its requests is extra (the #lengths - 1 beyond the first are already counted above).
    bump('extra_requests', 1)
    bump('discarded_tokens', generated)
    local kind = string.match(discard, '^[^:]*')   -- 'validator:<text>' -> 'validator'
    discards[kind] = (discards[kind] or 0) + 1
    discards[kind .. ':tokens'] = (discards[kind .. ':tokens'] or 0) + generated
    redis.call('XADD', KEYS[7], '*', 'id', job, 'kind', 'discarded', 'row', row)
    if spent then
      bump('sum_tokens', tokens)
      count(tokens)
    end
    if again then
      redis.call('SADD', KEYS[11], job)
      bump('discard_retried', 1)
      return {'RETRY', used}
    end
    bump('discarded', 1)
    return {'DISCARDED', used}
  end
  if conf[5] == 'complete' and finish_reason == 'length' then
    bump('truncated', 1)
    bump('truncated_tokens', generated)
    redis.call('XADD', KEYS[7], '*', 'id', job, 'kind', 'truncated', 'row', row)
    if spent then
      bump('sum_tokens', tokens)
      count(tokens)
    end
    return {'TRUNCATED', used}
  end
  bump('committed', 1)
  bump('sum_tokens', tokens)
  bump('kept_tokens', generated)
  redis.call('XADD', KEYS[7], '*', 'id', job, 'kind', 'row', 'row', row)
  if count(tokens) then
    return {'CROSSED', used}
  end
  return {'COMMITTED', used}
end

local out = {}
for base = 4, #ARGV, ITEM do
  out[#out + 1] = commit(ARGV[base], tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), ARGV[base + 3],
                         ARGV[base + 4], ARGV[base + 5], ARGV[base + 6], ARGV[base + 7])
end
if used > used_before then
  redis.call('INCRBY', KEYS[2], used - used_before)
end
if unreserve > 0 then
  redis.call('DECRBY', KEYS[4], unreserve)
end
for field, by in pairs(stats) do
  redis.call('HINCRBY', KEYS[6], field, by)
end
for bin, by in pairs(hist) do
  redis.call('HINCRBY', KEYS[8], bin, by)
end
for f, by in pairs(discards) do
  redis.call('HINCRBY', KEYS[10], f, by)
end
if rate_tokens > 0 then
  local now = redis.call('TIME')
  local bucket_s = tonumber(ARGV[2])
  local bucket = tonumber(now[1]) - tonumber(now[1]) % bucket_s
  if redis.call('HINCRBY', KEYS[9], bucket, rate_tokens) == rate_tokens then
    -- A new bucket: drop buckets older than the keep time so the hash stays small.
    for _, f in ipairs(redis.call('HKEYS', KEYS[9])) do
      if tonumber(f) < bucket - tonumber(ARGV[3]) then redis.call('HDEL', KEYS[9], f) end
    end
  end
end
return out
