"""The Lua scripts of the Redis queue: each one is a step that must happen atomically.

submit   SET NX the dedup key (or compare fingerprints), write the job hash, XADD the job (with its feed).
complete store the result (its output's JSON, or an error), wake waiters (PUBLISH; a small result rides along), record the seq/replay log,
         XACK + XDEL the entry, all fenced by the worker's lease token: a worker that lost its lease changes nothing.
cancel   only while no worker has read the job: swap its stream entry for a Skip (the seq_id stays held) and store
         the cancelled result. A job read by a worker is running; reading is what starts it, so no extra step.
deliver  read a result (or not) and, on its first delivery, extend its life by the result TTL.
snapshot record a newer durable snapshot of a model and drop the replay log it covers.
forget   drop a released model's durable state (replay log, last seq_id, snapshot record).
renew / release  keep or give up a lease only while holding it.
"""

from __future__ import annotations

SUBMIT = """
-- KEYS: dedup, job, stream
-- ARGV: job_id, fingerprint, use_dedup, dedup_ttl, job_ttl, job_json, tenant, result kind, model, seq, base, feed,
--       queue
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
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'job', ARGV[6], 'feed', ARGV[12])
redis.call('HSET', KEYS[2], 'tenant', ARGV[7], 'kind', ARGV[8], 'state', 'queued', 'model', ARGV[9],
           'seq', ARGV[10], 'base', ARGV[11], 'feed', ARGV[12], 'entry', entry, 'queue', ARGV[13])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return {2, ARGV[1]}
"""

_STORE = """
-- Store a job's first result, mark the job done, add its feed event, wake its waiters; false if it had one already.
local function store(result, job, feed, feedseq, job_id, body, cat, msg, ttl, channel, feed_name, feed_ttl, inline_max)
  if redis.call('EXISTS', result) == 1 then return false end
  redis.call('HSET', result, 'body', body, 'cat', cat, 'msg', msg)
  redis.call('EXPIRE', result, ttl)
  if redis.call('EXISTS', job) == 1 then
    redis.call('HSET', job, 'state', 'done')
    redis.call('EXPIRE', job, ttl)
  end
  if feed_name ~= '' then
    local cursor = redis.call('INCR', feedseq)
    local event = 'x||' .. job_id
    if cat == '' then event = 'f|' .. string.len(body) .. '|' .. job_id end
    redis.call('ZADD', feed, cursor, event)
    redis.call('EXPIRE', feed, feed_ttl)
    redis.call('EXPIRE', feedseq, feed_ttl)
    redis.call('PUBLISH', channel, 'f:' .. feed_name)
  end
  if string.len(body) <= tonumber(inline_max) then  -- small: the push carries the result (no read-back)
    redis.call('PUBLISH', channel, 'r:' .. job_id .. '|' .. cat .. '|' .. string.len(msg) .. '|' .. msg .. body)
  else
    redis.call('PUBLISH', channel, 'j:' .. job_id)
  end
  return true
end
"""

COMPLETE = _STORE + """
-- KEYS: result, job, stream, oplog, lastseq, lease, feed, feedseq
-- ARGV: 1 lease token ('' = unfenced), 2 job_id, 3 stream entry ('' = none), 4 body (the output's JSON), 5 error
--       category ('' = ok), 6 error message, 7 result ttl, 8 seq ('' = not run in seq order), 9 replay job json
--       ('' = none), 10 channel, 11 feed name ('' = none), 12 feed ttl, 13 group, 14 largest body published with the
--       wake-up
if ARGV[1] ~= '' and redis.call('GET', KEYS[6]) ~= ARGV[1] then return -1 end
local first = store(KEYS[1], KEYS[2], KEYS[7], KEYS[8], ARGV[2], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[10],
                    ARGV[11], ARGV[12], ARGV[14])
if ARGV[8] ~= '' then
  local last = tonumber(redis.call('GET', KEYS[5]) or '-1')
  if tonumber(ARGV[8]) > last then redis.call('SET', KEYS[5], ARGV[8]) end
  if ARGV[9] ~= '' then redis.call('ZADD', KEYS[4], ARGV[8], ARGV[9]) end
end
if ARGV[3] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[13], ARGV[3])
  redis.call('XDEL', KEYS[3], ARGV[3])
end
if first then return 1 end
return 0
"""

CANCEL = _STORE + """
-- KEYS: result, job, stream, feed, feedseq
-- ARGV: 1 job_id, 2 stream entry, 3 the job as a Skip (json), 4 error category, 5 error message, 6 result ttl,
--       7 channel, 8 feed name, 9 feed ttl, 10 group, 11 largest body published with the wake-up.
-- Returns 1 if cancelled, 0 if too late (a worker read the job, or it is done).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if #redis.call('XRANGE', KEYS[3], ARGV[2], ARGV[2]) == 0 then return 0 end  -- done and acknowledged, or gone
local read, pending = pcall(redis.call, 'XPENDING', KEYS[3], ARGV[10], ARGV[2], ARGV[2], 1)
if read and #pending > 0 then return 0 end  -- a worker has it: running (no group yet: nobody read it)
redis.call('XDEL', KEYS[3], ARGV[2])
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'job', ARGV[3], 'feed', ARGV[8])
redis.call('HSET', KEYS[2], 'entry', entry)
store(KEYS[1], KEYS[2], KEYS[4], KEYS[5], ARGV[1], '', ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[11])
return 1
"""

DELIVER = """
-- KEYS: result, job.  ARGV: result ttl, '1' = only record the delivery (the caller has the result from its push)
local r = redis.call('HMGET', KEYS[1], 'body', 'cat', 'msg', 'delivered')
if not r[1] then return false end
if not r[4] then
  redis.call('HSET', KEYS[1], 'delivered', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
end
if ARGV[2] == '1' then return 1 end
return r
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
