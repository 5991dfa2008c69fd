"""The prefix index's Redis scripts (radixserve.common.prefix_index.RedisPrefixIndex runs them):
Lua, run by Redis as the calling user, so its ACL rules hold for every key and command in them."""

# Keys, P the key prefix (standalone Redis; the scripts touch keys they compute, so not for Redis
# Cluster):
#   P k:{hash}          HASH holder -> tier (0 device, 1 host,   TTL entry_ttl_s: may be evicted
#                       2 disk; common/kv_tier.py), a holder
#                       being a pod or a shared disk location
#                       ("@<directory id>")
#   P p:{pod}:blocks    SET of the blocks the pod reported (to   TTL entry_ttl_s: may be evicted
#                       drop its entries all at once)
#   P p:{pod}:hb        "<expires at, ms on Redis's clock> <load JSON>": the pod's heartbeat; no TTL
#   P pods              SET of pods that published (for sweeping); no TTL
# (Before tiers a block was a SET ``b:{hash}`` of pods: a new key, so pods and gateways of either
# version never write each other's keys during an upgrade; they only miss each other's blocks.)
# Scripts take the prefix and the pod as ARGV[1], ARGV[2]. Each stored block's keys get their TTL
# again (PEXPIRE) when written; the heartbeat's SET drops any TTL the key had.
#
# APPLY: ARGV[4] the pod's shared disk location ("" none), ARGV[5] n, then n (hash, tier) pairs, then
# the removed hashes. A disk block goes to the location (and leaves the pod's own entry); a removed
# block the pod reported but holds no entry of was on the shared disk: its file went.
APPLY = """
local ns, pod, ttl, loc = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local blocks = ns .. 'p:' .. pod .. ':blocks'
local n = tonumber(ARGV[5])
local last = 5 + 2 * n
for i = 6, last, 2 do
  local k = ns .. 'k:' .. ARGV[i]
  if ARGV[i + 1] == '2' and loc ~= '' then
    redis.call('HSET', k, loc, 2)
    redis.call('HDEL', k, pod)
  else
    redis.call('HSET', k, pod, ARGV[i + 1])
  end
  redis.call('PEXPIRE', k, ttl)
  redis.call('SADD', blocks, ARGV[i])
end
if n > 0 then redis.call('PEXPIRE', blocks, ttl) end
local unheld = 0
for i = last + 1, #ARGV do
  local k = ns .. 'k:' .. ARGV[i]
  local held = redis.call('SREM', blocks, ARGV[i])
  local own = redis.call('HDEL', k, pod)
  unheld = unheld + 1 - held
  if held == 1 and own == 0 and loc ~= '' then redis.call('HDEL', k, loc) end
end
redis.call('SADD', ns .. 'pods', pod)
return unheld
"""

# Drops up to ARGV[3] of the pod's own entries and returns how many it still has: called until 0, so
# no single call blocks Redis for long however many blocks the pod had. (A shared location's entries
# stay: its files outlive the pod's tree; they expire with their TTL.)
CLEAR = """
local ns, pod = ARGV[1], ARGV[2]
local blocks = ns .. 'p:' .. pod .. ':blocks'
for _, h in ipairs(redis.call('SPOP', blocks, tonumber(ARGV[3]))) do
  redis.call('HDEL', ns .. 'k:' .. h, pod)
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

# MATCH: ARGV[2] m, then m (pod, "@<location>") pairs: the pods that load from a shared disk, then the
# prompt's hashes. Per pod, the best tier it can load each leading block from (its own entry, its
# location's); the walk stops at the first block no pod still matching holds. Returns pod, device,
# host, disk counts, ...
MATCH = """
local ns, m = ARGV[1], tonumber(ARGV[2])
local pods_at = {}
for i = 3, 2 + 2 * m, 2 do
  local l = ARGV[i + 1]
  local ps = pods_at[l]
  if ps == nil then ps = {}; pods_at[l] = ps end
  ps[#ps + 1] = ARGV[i]
end
local first = 3 + 2 * m
local last, tier_at, counts = {}, {}, {}
-- pod p holds block i at tier t: count it if p held every block before (its last one is i - 1); a
-- pod seen at block i already (its own entry and its directory's) keeps the better tier
local function see(p, t, i)
  local prev = last[p]
  if prev == i then
    local old = tier_at[p]
    if t < old then
      local c = counts[p]
      c[old + 1] = c[old + 1] - 1
      c[t + 1] = c[t + 1] + 1
      tier_at[p] = t
    end
    return true
  end
  if i ~= first and prev ~= i - 1 then return false end
  local c = counts[p]
  if c == nil then c = {0, 0, 0}; counts[p] = c end
  c[t + 1] = c[t + 1] + 1
  last[p], tier_at[p] = i, t
  return true
end
for i = first, #ARGV do
  local flat = redis.call('HGETALL', ns .. 'k:' .. ARGV[i])
  local any = false
  for j = 1, #flat, 2 do
    local holder, t = flat[j], tonumber(flat[j + 1]) or 0
    if string.byte(holder, 1) == 64 then  -- '@': a directory, for the pods that mount it
      local ps = pods_at[holder]
      if ps then
        for _, p in ipairs(ps) do
          if see(p, t, i) then any = true end
        end
      end
    elseif see(holder, t, i) then
      any = true
    end
  end
  if not any then break end
end
local out = {}
for p, c in pairs(counts) do
  out[#out + 1] = p
  out[#out + 1] = c[1]
  out[#out + 1] = c[2]
  out[#out + 1] = c[3]
end
return out
"""
