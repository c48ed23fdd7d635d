-- reserve: admit requests against a dataset's token budget, atomically.
-- An item script (shared/scripts.py): one call admits one or several jobs of the dataset, in
-- order, exactly as separate calls would; the dataset's settings and counters are read once
-- and the reserved counter written once for them all (Redis CPU per prompt: bench/ceiling.py).
-- KEYS: 1 conf (hash) 2 used (string) 3 resv (hash job->tokens) 4 reserved (string)
--       5 done (set) 6 stats (hash): the first six of keys.budget_keys
-- ARGV: 1 results before the running mean may go below the prior (budget.PRIOR_UNTIL)
--       2 results before the end-game margin applies (budget.MARGIN_AFTER)
--       then per item, 4 each: job id, max_tokens of this request, prompt tokens (counted
--       only when conf.count == 'total'; 0 if unknown; with several requests, summed over
--       them without the answers), requests the job sends (regenerate: all: one per user
--       turn). The reservation covers them all: strict reserves requests x max_tokens, soft
--       requests x the mean per request; with count = total, each request also carries the
--       earlier answers in its prompt: requests x (requests - 1) / 2 answers.
-- Returns one {status, tokens_reserved} per item; status is one of
--   ADMIT      reservation written (or already held by this job: idempotent on retry)
--   DONE       the prompt was already committed: do not send it again
--   PAUSED     the dataset is paused by an operator, or held by the producer (conf.hold: its
--              output disk is full; the same answer, so workers stop reserving alike)
--   EXHAUSTED  the budget is crossed (soft, drain) or can no longer fit this request (strict)
--   WAIT       the budget may still fit it once requests in flight finish
-- A reservation is the request's admission ticket: commit counts a result only while its
-- ticket is held (see commit.lua), so withdrawing tickets stops late results from counting.
local ITEM = 4
-- strict's bound on an answer sent back as context: its tokens (never more than generated,
-- reasoning is not sent back) plus what re-tokenizing its text may add
local ANSWER_SLACK = 8
local prior_until = tonumber(ARGV[1])
local margin_after = tonumber(ARGV[2])
local conf = redis.call('HMGET', KEYS[1], 'limit', 'mode', 'paused', 'prior_mean', 'count', 'end_margin_z',
                        'hold')
local limit = tonumber(conf[1])
if not limit then
  return redis.error_reply('budgetq: dataset not registered: ' .. KEYS[1])
end
local paused = conf[3] == '1' or (conf[7] and conf[7] ~= '')
local mode = conf[2] or 'soft'
local total = conf[5] == 'total'
local counters = redis.call('MGET', KEYS[2], KEYS[4])  -- one command: used, reserved
local used = tonumber(counters[1] or '0')
local reserved = tonumber(counters[2] or '0')
local added = 0       -- reserved tokens written by this call: one INCRBY at the end
-- soft: the running mean and spread of completed requests (commit.lua keeps them) and the
-- number in flight; read once, the in-flight count kept up to date as items are admitted.
local n, m, sd2, in_flight = 0, 0, 0, 0
if mode == 'soft' then
  -- extra_requests: requests beyond one per committed result (regenerate: all), so the mean
  -- stays a mean per request
  local stats = redis.call('HMGET', KEYS[6], 'committed', 'truncated', 'sum_completion', 'sum_sq_completion',
                           'extra_requests')
  n = tonumber(stats[1] or '0') + tonumber(stats[2] or '0') + tonumber(stats[5] or '0')
  if n > 0 then
    m = tonumber(stats[3] or '0') / n
    sd2 = tonumber(stats[4] or '0') / n - m * m
  end
  in_flight = redis.call('HLEN', KEYS[3])
end

local function write(job, est)
  redis.call('HSET', KEYS[3], job, est)
  added = added + est
  in_flight = in_flight + 1
  return {'ADMIT', est}
end

local function admit(job, max_tokens, prompt_tokens, requests)
  if redis.call('SISMEMBER', KEYS[5], job) == 1 then
    return {'DONE', 0}
  end
  local held = redis.call('HGET', KEYS[3], job)
  if held then
    return {'ADMIT', tonumber(held)}
  end
  if paused then
    return {'PAUSED', 0}
  end
  -- count = total: earlier answers sent again as context, in answers (0 for one request)
  local context_answers = requests * (requests - 1) / 2
  local extra = 0
  if total then extra = prompt_tokens end
  local est
  local margin = 0
  if mode == 'drain' then
    -- The naive policy: admit while under the budget, reserve nothing.
    if used >= limit then return {'EXHAUSTED', 0} end
    return write(job, 0)
  elseif mode == 'strict' then
    -- Reserve the worst case so used can never pass the limit.
    est = requests * max_tokens + extra
    if total then est = est + context_answers * (max_tokens + ANSWER_SLACK) end
    if used + est > limit then return {'EXHAUSTED', 0} end
  else
    if used >= limit then return {'EXHAUSTED', 0} end
    -- A fresh request's expected length: the running mean of completed ones. Short answers
    -- finish first, so an early mean is biased low: until enough results are in, never
    -- reserve below the configured prior. Requests that keep running get their reservation
    -- raised by the worker as they age (adjust.lua), which is what tapers the end.
    local mean = tonumber(conf[4] or '1')
    if n > 0 then
      if n >= prior_until or m > mean then mean = m end
      -- The end game: the requests in flight will produce about their reservations in all,
      -- give or take sd * sqrt(in flight + 1). Keeping end_margin_z of that spread free means
      -- the crossing comes with few requests still running, so few are aborted (waste), at
      -- the cost of a slower last few percent. Far from the budget it changes nothing.
      local z = tonumber(conf[6] or '0')
      if z > 0 and n >= margin_after and sd2 > 0 then
        margin = z * math.sqrt(sd2 * (in_flight + 1))
      end
    end
    local per = math.ceil(mean)
    if per > max_tokens then per = max_tokens end
    if per < 1 then per = 1 end
    est = requests * per + extra
    if total then est = est + context_answers * per end
    -- Fill the tail: with nothing in flight and budget left, always admit one.
    if in_flight == 0 then
      return write(job, est)
    end
  end
  if used + reserved + added + est + margin > limit then
    return {'WAIT', 0}
  end
  return write(job, est)
end

local out = {}
for base = 3, #ARGV, ITEM do
  out[#out + 1] = admit(ARGV[base], tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2] or '0'),
                        tonumber(ARGV[base + 3]))
end
if added > 0 then
  redis.call('INCRBY', KEYS[4], added)
end
return out
