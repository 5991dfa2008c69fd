"""The prefix index's Redis scripts (radixserve.common.prefix_index.RedisPrefixIndex runs them):
Lua, run by Redis as the calling user, so its ACL rules hold for every key and command in them."""

# Keys, P the key prefix (standalone Redis; the scripts touch keys they compute, so not for Redis
# Cluster):
#   P b:{hash}          SET of pods holding the block           TTL entry_ttl_s: may be evicted
#   P p:{pod}:blocks    SET of the pod's block hashes (to drop  TTL entry_ttl_s: may be evicted
#                       them all at once)
#   P p:{pod}:hb        "<expires at, ms on Redis's clock> <load JSON>": the pod's heartbeat; no TTL
#   P pods              SET of pods that published (for sweeping); no TTL
# Scripts take the prefix and the pod as ARGV[1], ARGV[2]. Each stored block's keys get their TTL
# again (PEXPIRE) when written; the heartbeat's SET drops any TTL the key had.
APPLY = """
local ns, pod, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local blocks = ns .. 'p:' .. pod .. ':blocks'
local n = tonumber(ARGV[4])
for i = 5, 4 + n do
  local b = ns .. 'b:' .. ARGV[i]
  redis.call('SADD', b, pod)
  redis.call('PEXPIRE', b, ttl)
  redis.call('SADD', blocks, ARGV[i])
end
if n > 0 then redis.call('PEXPIRE', blocks, ttl) end
local unheld = 0
for i = 5 + n, #ARGV do
  redis.call('SREM', ns .. 'b:' .. ARGV[i], pod)
  unheld = unheld + 1 - redis.call('SREM', blocks, ARGV[i])
end
redis.call('SADD', ns .. 'pods', pod)
return unheld
"""

# Drops up to ARGV[3] of the pod's blocks and returns how many it still has: called until 0, so no
# single call blocks Redis for long however many blocks the pod had.
CLEAR = """
local ns, pod = ARGV[1], ARGV[2]
local blocks = ns .. 'p:' .. pod .. ':blocks'
for _, h in ipairs(redis.call('SPOP', blocks, tonumber(ARGV[3]))) do
  redis.call('SREM', ns .. 'b:' .. h, pod)
end
return redis.call('SCARD', blocks)
"""

# After CLEAR: the pod's heartbeat and its place in the pod list.
FORGET = """
local ns, pod = ARGV[1], ARGV[2]
redis.call('DEL', ns .. 'p:' .. pod .. ':blocks', ns .. 'p:' .. pod .. ':hb')
redis.call('SREM', ns .. 'pods', pod)
return 1
"""

NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Returns 1 if the pod's previous heartbeat had not expired yet. A key of another type (not ours)
# is overwritten, not an error.
BEAT = (
    """
local ns, pod = ARGV[1], ARGV[2]
local hb = ns .. 'p:' .. pod .. ':hb'
"""
    + NOW_MS
    + """
local prev = redis.pcall('GET', hb)
local live = 0
if type(prev) == 'string' then
  local exp = tonumber(string.match(prev, '^(%d+) '))
  if exp and exp > now then live = 1 end
end
redis.call('SET', hb, string.format('%.0f', now + tonumber(ARGV[3])) .. ' ' .. ARGV[4])
redis.call('SADD', ns .. 'pods', pod)
return live
"""
)

# Redis's time (ms), then each pod and its heartbeat (nil: none, or a key of another type).
PODS = (
    """
local ns = ARGV[1]
"""
    + NOW_MS
    + """
local out = {now}
for _, p in ipairs(redis.call('SMEMBERS', ns .. 'pods')) do
  local v = redis.pcall('GET', ns .. 'p:' .. p .. ':hb')
  table.insert(out, p)
  table.insert(out, type(v) == 'string' and v or false)
end
return out
"""
)

MATCH = """
local ns = ARGV[1]
local alive = nil
local counts = {}
for i = 2, #ARGV do
  local members = redis.call('SMEMBERS', ns .. 'b:' .. ARGV[i])
  local next_alive = {}
  local any = false
  for _, m in ipairs(members) do
    if alive == nil or alive[m] then
      next_alive[m] = true
      counts[m] = i - 1
      any = true
    end
  end
  if not any then break end
  alive = next_alive
end
local out = {}
for m, c in pairs(counts) do
  table.insert(out, m)
  table.insert(out, c)
end
return out
"""
