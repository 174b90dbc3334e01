"""The Lua scripts of the Redis store (gateway/server/redis_store/__init__.py): each a step that must
happen whole, against what other replicas do at the same time."""

from __future__ import annotations

from typing import Any

# Copy a batch of events and the snapshot. KEYS: hash, stream, attached, the
# owner's liveness key, the index, the result key, the set of jobs that can go
# on elsewhere, [idempotency key]. ARGV: job
# id, snapshot, retention ms, terminal seq ('' while running), terminal type,
# owner, idempotency key, the key's value, lease ms, liveness ms, now, the
# seq whose data is kept apart ('' for none), then (seq, type, data) triples. 1
# written; 0 the job was ended elsewhere; 2 Redis lost the job (restarted
# empty): send its log again from seq 1; 3 another replica took the job over.
#
# Writing is a sign of life (the liveness key), so a job Redis lost and gets
# back is never taken for an orphan between its copy and the next heartbeat; and
# a job copied afresh is listed and keeps its idempotency key again. Its keys are
# leased from then too: a stream begun just before its owner died expires with
# the rest. A big result is kept once, in the result key, which its stream entry
# and the hash (`tsize`) refer to; readers take it a piece at a time (`InRedis`).
MIRROR = """
if redis.call('HEXISTS', KEYS[1], 'tseq') == 1 then return 0 end
local fresh = redis.call('EXISTS', KEYS[1]) == 0
if fresh and tonumber(ARGV[13]) > 1 then return 2 end
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[6] then return 3 end
redis.call('SET', KEYS[4], '1', 'PX', ARGV[10])
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq') or '0')
local partials = 0
for i = 13, #ARGV, 3 do
  local seq = tonumber(ARGV[i])
  if seq > last then
    if ARGV[i] == ARGV[12] then
      redis.call('SET', KEYS[6], ARGV[i + 2])
      redis.call('XADD', KEYS[2], ARGV[i] .. '-0', 'type', ARGV[i + 1], 'size', #ARGV[i + 2])
      redis.call('HSET', KEYS[1], 'tsize', #ARGV[i + 2])
    else
      redis.call('XADD', KEYS[2], ARGV[i] .. '-0', 'type', ARGV[i + 1], 'data', ARGV[i + 2])
    end
    if ARGV[i + 1] == 'partial' then partials = partials + 1 end
    last = seq
  end
end
redis.call('HSET', KEYS[1], 'last_seq', last, 'snapshot', ARGV[2], 'owner', ARGV[6], 'key', ARGV[7])
if partials > 0 then redis.call('HINCRBY', KEYS[1], 'partials', partials) end
local own = {KEYS[1], KEYS[2], KEYS[3], KEYS[6], KEYS[8]}
redis.call('ZADD', KEYS[5], ARGV[11], ARGV[1])
if fresh and KEYS[8] then redis.call('SET', KEYS[8], ARGV[8], 'NX') end
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'tseq', ARGV[4], 'ttype', ARGV[5])
  redis.call('ZREM', KEYS[7], ARGV[1])
  for _, key in ipairs(own) do redis.call('PEXPIRE', key, ARGV[3]) end
else
  for _, key in ipairs(own) do redis.call('PEXPIRE', key, ARGV[9]) end
end
return 1
"""

# End a job whose owner is silent. KEYS: owner's liveness key, hash, stream,
# attached, result, [idempotency key]. ARGV: expected last seq, error data, snapshot,
# retention ms, the terminal's seq. 1 done, 0 not needed, -1 the log moved on.
FINALIZE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[2], 'tseq') == 1 then return 0 end
if redis.call('HGET', KEYS[2], 'last_seq') ~= ARGV[1] then return -1 end
redis.call('XADD', KEYS[3], ARGV[5] .. '-0', 'type', 'error', 'data', ARGV[2])
redis.call('HSET', KEYS[2], 'last_seq', ARGV[5], 'tseq', ARGV[5], 'ttype', 'error', 'snapshot', ARGV[3])
for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
return 1
"""

# Re-lease a running job's keys (never a finished one's: that would stretch its
# retention) and read its cancel flag; -1 if Redis lost the job, -2 if another
# replica took it over. KEYS: hash, stream, attached, result, [idem]. ARGV:
# lease ms, this replica.
LEASE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[2] then return -2 end
if redis.call('HEXISTS', KEYS[1], 'tseq') == 0 then
  for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return redis.call('HGET', KEYS[1], 'cancel')
"""

# Take over a job whose owner is silent, to go on with it here from its
# checkpoint. KEYS: the owner's liveness key, hash, stream, attached, result,
# the set of jobs that can go on elsewhere, [idem]. ARGV: the owner read, this
# replica, lease ms, the most times a job is taken over, now, job id. 0 not
# (its owner lives, it ended, or another replica took it); -1 taken over too
# often already; else its last seq, partial events, idempotency key, request
# and whether a client ever followed it. Taken by this replica already (a call
# sent again after a lost answer): the same answer again.
TAKE_OVER = """
if redis.call('EXISTS', KEYS[2]) == 0 or redis.call('HEXISTS', KEYS[2], 'tseq') == 1 then
  redis.call('ZREM', KEYS[6], ARGV[6])
  return 0
end
local owner = redis.call('HGET', KEYS[2], 'owner')
local request = redis.call('HGET', KEYS[2], 'request')
if not request then return 0 end
if owner ~= ARGV[2] then
  if redis.call('EXISTS', KEYS[1]) == 1 or owner ~= ARGV[1] then return 0 end
  if redis.call('HINCRBY', KEYS[2], 'taken', 1) > tonumber(ARGV[4]) then return -1 end
  redis.call('HSET', KEYS[2], 'owner', ARGV[2])
  redis.call('ZADD', KEYS[6], ARGV[5], ARGV[6])
  for i = 2, #KEYS do
    if i ~= 6 then redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
  end
end
local followed = redis.call('HEXISTS', KEYS[2], 'followed') == 1 or redis.call('ZCARD', KEYS[4]) > 0
return {redis.call('HGET', KEYS[2], 'last_seq'), redis.call('HGET', KEYS[2], 'partials') or '0',
  redis.call('HGET', KEYS[2], 'key') or '', request, followed and 1 or 0}
"""

# Give a job taken over back, for another replica to take (this one could not admit it now: a
# refusal that may pass). KEYS: hash. ARGV: this replica.
GIVE_BACK = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] or redis.call('HEXISTS', KEYS[1], 'tseq') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'owner', '')
redis.call('HINCRBY', KEYS[1], 'taken', -1)
return 1
"""

# Leave a running job for another replica to go on with (this one stops): no
# owner, first in the order jobs are taken over in, and not counted against
# the times it may be taken over. KEYS: hash, the set of jobs that can go on
# elsewhere. ARGV: this replica, job id, now. 1 it is not this replica's now
# (left, or another took it over); 0 it ended, or Redis lost it.
LEAVE = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'tseq') == 1 then return 0 end
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'owner', '')
  redis.call('HINCRBY', KEYS[1], 'taken', -1)
  redis.call('ZADD', KEYS[2], -tonumber(ARGV[3]), ARGV[2])
end
return 1
"""

# A replica follows a job until ARGV[2] ms from now (server time). KEYS: attached. ARGV: replica, ttl, lease.
ATTACH = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# How many replicas follow the job now (lapsed members are dropped). KEYS: attached.
LIVE = """
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
return redis.call('ZCARD', KEYS[1])
"""

# Unbind a key from a job. KEYS: the key. ARGV: the job id. The value is "<job id> <request
# digest>", or the job id alone where an older replica bound it.
RELEASE = """
local bound = redis.call('GET', KEYS[1])
if bound and (bound == ARGV[1] or string.sub(bound, 1, #ARGV[1] + 1) == ARGV[1] .. ' ') then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Set a flag (ARGV[1]: cancel, followed) on a job that still exists (never recreate an expired hash).
FLAG = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], '1') return 1 end
return 0
"""


class Scripts:
    """The scripts, registered on one client: each a call (`keys=`, `args=`, and `client=` a pipeline)."""

    def __init__(self, client: Any) -> None:
        self.mirror = client.register_script(MIRROR)
        self.finalize = client.register_script(FINALIZE)
        self.lease = client.register_script(LEASE)
        self.attach = client.register_script(ATTACH)
        self.live = client.register_script(LIVE)
        self.release = client.register_script(RELEASE)
        self.flag = client.register_script(FLAG)
        self.take_over = client.register_script(TAKE_OVER)
        self.leave = client.register_script(LEAVE)
        self.give_back = client.register_script(GIVE_BACK)
