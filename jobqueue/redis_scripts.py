"""The Lua scripts of the Redis queue: each one is a step that must happen atomically.

submit   SET NX the dedup key (or compare fingerprints), write the job hash, XADD the job.
start    mark a batch of fetched jobs running; tell the worker whether it was cancelled meanwhile and which feed it has.
complete store the result bytes, wake waiters (PUBLISH; a small result rides along), record the seq/replay log,
         XACK + XDEL the entry, all fenced by the worker's lease token: a worker that lost its lease changes nothing.
deliver  read a result (or not) and, on its first delivery, extend its life by the result TTL.
snapshot record a newer durable snapshot of a model and drop the replay log it covers.
forget   drop a released model's durable state (replay log, last seq_id, snapshot record).
renew / release  keep or give up a lease only while holding it.
"""

from __future__ import annotations

SUBMIT = """
-- KEYS: dedup, job, stream
-- ARGV: job_id, fingerprint, use_dedup, dedup_ttl, job_ttl, job_json, tenant, rtype, model, seq, base, feed
if ARGV[3] == '1' then
  local ok = redis.call('SET', KEYS[1], ARGV[1] .. '|' .. ARGV[2], 'NX', 'EX', ARGV[4])
  if not ok then
    local seen = redis.call('GET', KEYS[1])
    local sep = string.find(seen, '|', 1, true)
    local id = string.sub(seen, 1, sep - 1)
    if string.sub(seen, sep + 1) ~= ARGV[2] then return {0, id} end
    return {1, id}
  end
end
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'job', ARGV[6])
redis.call('HSET', KEYS[2], 'tenant', ARGV[7], 'rtype', ARGV[8], 'state', 'queued', 'model', ARGV[9],
           'seq', ARGV[10], 'base', ARGV[11], 'feed', ARGV[12], 'entry', entry)
redis.call('EXPIRE', KEYS[2], ARGV[5])
return {2, ARGV[1]}
"""

START = """
-- KEYS: the job hashes of a batch just read.  Returns {state before, feed} per job (state false: expired job).
local out = {}
for i, key in ipairs(KEYS) do
  local r = redis.call('HMGET', key, 'state', 'feed')
  if r[1] == 'queued' then redis.call('HSET', key, 'state', 'running') end
  out[i] = r
end
return out
"""

COMPLETE = """
-- KEYS: result, job, stream, oplog, lastseq, lease, feed, feedseq
-- ARGV: 1 lease token ('' = unfenced), 2 job_id, 3 stream entry ('' = none), 4 media, 5 body, 6 error category
--       ('' = ok), 7 error message, 8 result ttl, 9 seq ('' = not run in seq order), 10 replay job json ('' = none),
--       11 channel, 12 feed name ('' = none), 13 feed ttl, 14 group, 15 only_if_queued ('1' = cancel),
--       16 largest body published with the wake-up (-1 = none)
if ARGV[1] ~= '' and redis.call('GET', KEYS[6]) ~= ARGV[1] then return -1 end
if ARGV[15] == '1' and redis.call('HGET', KEYS[2], 'state') ~= 'queued' then return -2 end
local first = redis.call('EXISTS', KEYS[1]) == 0
if first then
  redis.call('HSET', KEYS[1], 'media', ARGV[4], 'body', ARGV[5], 'cat', ARGV[6], 'msg', ARGV[7])
  redis.call('EXPIRE', KEYS[1], ARGV[8])
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('HSET', KEYS[2], 'state', 'done')
    redis.call('EXPIRE', KEYS[2], ARGV[8])
  end
  if ARGV[12] ~= '' then
    local cursor = redis.call('INCR', KEYS[8])
    local event = 'x||' .. ARGV[2]
    if ARGV[6] == '' then event = 'f|' .. string.len(ARGV[5]) .. '|' .. ARGV[2] end
    redis.call('ZADD', KEYS[7], cursor, event)
    redis.call('EXPIRE', KEYS[7], ARGV[13])
    redis.call('EXPIRE', KEYS[8], ARGV[13])
    redis.call('PUBLISH', ARGV[11], 'f:' .. ARGV[12])
  end
  if string.len(ARGV[5]) <= tonumber(ARGV[16]) then  -- small: the push carries the result (no read-back)
    redis.call('PUBLISH', ARGV[11], 'r:' .. ARGV[2] .. '|' .. ARGV[4] .. '|' .. ARGV[6] .. '|' ..
               string.len(ARGV[7]) .. '|' .. ARGV[7] .. ARGV[5])
  else
    redis.call('PUBLISH', ARGV[11], 'j:' .. ARGV[2])
  end
end
if ARGV[9] ~= '' then
  local last = tonumber(redis.call('GET', KEYS[5]) or '-1')
  if tonumber(ARGV[9]) > last then redis.call('SET', KEYS[5], ARGV[9]) end
  if ARGV[10] ~= '' then redis.call('ZADD', KEYS[4], ARGV[9], ARGV[10]) end
end
if ARGV[3] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[14], ARGV[3])
  redis.call('XDEL', KEYS[3], ARGV[3])
end
if first then return 1 end
return 0
"""

DELIVER = """
-- KEYS: result, job.  ARGV: result ttl, '1' = only record the delivery (the caller has the result from its push)
local r = redis.call('HMGET', KEYS[1], 'media', 'delivered')
if not r[1] then return false end
if not r[2] then
  redis.call('HSET', KEYS[1], 'delivered', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
end
if ARGV[2] == '1' then return 1 end
return redis.call('HMGET', KEYS[1], 'media', 'body', 'cat', 'msg')
"""

SNAPSHOT = """
-- KEYS: snapshot, oplog, lease.  ARGV: token, seq, storage key.  Returns {recorded?, key to delete}
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return {-1, ''} end
local old = redis.call('HMGET', KEYS[1], 'seq', 'key')
if old[1] and tonumber(old[1]) >= tonumber(ARGV[2]) then return {0, ARGV[3]} end
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'key', ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
return {1, old[2] or ''}
"""

FORGET = """
-- KEYS: snapshot, oplog, last seq, lease.  ARGV: token.  Returns the snapshot's storage key ('' if none); -1 when
-- this worker does not hold the lease.
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return -1 end
local key = redis.call('HGET', KEYS[1], 'key')
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return key or ''
"""

RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
