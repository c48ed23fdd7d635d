-- features_mark: samples of a dataset are on disk and indexed: mark their ids done and count their bytes
-- and tokens, each sample once (a sample already in the done set adds nothing: a flush retried after a
-- lost reply, or a pass reopening the store, never counts a sample twice).
-- KEYS: 1 features done set 2 features bytes hash (shared/keys.py features_bytes_key)
-- ARGV: id1, bytes1, tokens1, id2, bytes2, tokens2, ...
-- Returns the bytes written after the call.
local added_bytes, added_tokens = 0, 0
for i = 1, #ARGV, 3 do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 1 then
    added_bytes = added_bytes + tonumber(ARGV[i + 1])
    added_tokens = added_tokens + tonumber(ARGV[i + 2])
  end
end
if added_tokens > 0 or added_bytes > 0 then
  redis.call('HINCRBY', KEYS[2], 'tokens', added_tokens)
  return redis.call('HINCRBY', KEYS[2], 'written', added_bytes)
end
return tonumber(redis.call('HGET', KEYS[2], 'written') or '0')
