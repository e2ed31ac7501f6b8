"""The Redis store's Lua scripts (redis_store.py holds the key layout). Each runs atomically on the
server, so what several commands did in several round trips is one call and one reply here: the
scheduler pays redis-py's packing, its per-reply timeout and a loop wake-up per call, not per key.
"""

from __future__ import annotations

# Helpers the scripts below start with. forget(): take a worker out of the prefix index (its blocks
# set, and itself from each block's holders). each_chunk(): call fn(first, last) over ARGV[from..to]
# in runs short enough to unpack() into one command's arguments.
_HELPERS = """
local function forget(blocks, id, prefix)
  for _, h in ipairs(redis.call('SMEMBERS', blocks)) do
    redis.call('SREM', prefix .. h, id)
  end
  redis.call('DEL', blocks)
end
local function each_chunk(from, to, fn)
  for first = from, to, 1000 do fn(first, math.min(first + 999, to)) end
end
"""

# KEYS: worker hash. ARGV: load JSON, ttl ms. Renews only a worker that has not expired.
HEARTBEAT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'load', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: worker blocks set, workers set. ARGV: worker id, block key prefix, "1" to also deregister.
DROP_BLOCKS = _HELPERS + """
forget(KEYS[1], ARGV[1], ARGV[2])
if ARGV[3] == '1' then redis.call('SREM', KEYS[2], ARGV[1]) end
return 1
"""

# KEYS: worker hash, worker blocks set, workers set. ARGV: worker id, block key prefix.
# Forgets a worker whose hash expired; atomic, so a worker re-registering meanwhile is kept.
PRUNE_EXPIRED = _HELPERS + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
forget(KEYS[2], ARGV[1], ARGV[2])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""

# KEYS: workers set. ARGV: worker hash key prefix, worker blocks key prefix, block key prefix.
# Returns {id, info, load, ...} of every registered worker whose hash is live, in no order; a worker
# whose hash expired is forgotten with its blocks in the same pass (as PRUNE_EXPIRED does).
LIST_WORKERS = _HELPERS + """
local listed = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HMGET', ARGV[1] .. id, 'info', 'load')
  if fields[1] and fields[2] then
    listed[#listed + 1] = id
    listed[#listed + 1] = fields[1]
    listed[#listed + 1] = fields[2]
  elseif redis.call('EXISTS', ARGV[1] .. id) == 0 then
    forget(ARGV[2] .. id, id, ARGV[3])
    redis.call('SREM', KEYS[1], id)
  end
end
return listed
"""

# KEYS: worker blocks set. ARGV: worker id, block key prefix, "1" to forget the worker's blocks
# first, how many stored hashes follow, the stored hashes, then the evicted ones.
# Applies one report of a worker's prefix-cache changes in that order: reset, stored, evicted.
UPDATE_BLOCKS = _HELPERS + """
local blocks, id, prefix = KEYS[1], ARGV[1], ARGV[2]
if ARGV[3] == '1' then forget(blocks, id, prefix) end
local last_stored = 4 + tonumber(ARGV[4])
each_chunk(5, last_stored, function(first, last)
  redis.call('SADD', blocks, unpack(ARGV, first, last))
end)
each_chunk(last_stored + 1, #ARGV, function(first, last)
  redis.call('SREM', blocks, unpack(ARGV, first, last))
end)
for i = 5, last_stored do redis.call('SADD', prefix .. ARGV[i], id) end
for i = last_stored + 1, #ARGV do redis.call('SREM', prefix .. ARGV[i], id) end
return 1
"""

# ARGV: block key prefix, then a chain of block hashes. Returns {id, n, ...}: each worker caching
# the first block with n, how many leading blocks of the chain it caches (Store.match_prefix).
MATCH_PREFIX = """
local prefix = ARGV[1]
local holders = redis.call('SMEMBERS', prefix .. ARGV[2])
if #holders == 0 then return {} end
local run = {}
for _, id in ipairs(holders) do run[id] = 1 end
local longest = 1
for i = 3, #ARGV do
  if longest < i - 2 then break end
  for _, id in ipairs(redis.call('SMEMBERS', prefix .. ARGV[i])) do
    if run[id] == i - 2 then
      run[id] = i - 1
      longest = i - 1
    end
  end
end
local matched = {}
for _, id in ipairs(holders) do
  matched[#matched + 1] = id
  matched[#matched + 1] = run[id]
end
return matched
"""

# KEYS: claim key. ARGV: owner. Deletes the claim only while that owner holds it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
