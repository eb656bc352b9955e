"""The Redis store's Lua scripts: one round trip each, all of one tenant's slot.

``FILL``      a request's lookups: the chain named by the view's ``want`` walked up to its
              first absent key (whose parent's children come along), probe keys with their
              children, children and identity lists, bodies of the records it returns, and
              the routing affinity of the chain's last present keys when asked
``PATH``      a session's records from its leaf up to element 0 (all or nothing)
``SESSIONS``  a tenant's live sessions with their totals
``WRITE``     a whole turn, atomically: the heal check, insert-if-absent, the sliding-TTL
              touch of the matched path, the totals moved from the previous leaf and added

Every script has a shebang, so Redis rejects any access outside the slot of its declared key
(``KEYS[1]``, the tenant's sessions zset), in a cluster or not; the read scripts are
``no-writes``. Key names are built in Lua from the tenant's base (``ARGV[1]``) and hex
keys, per the layout of :mod:`proxy.store.redis.layout`; records are read without decoding,
by the offsets of :mod:`proxy.store.redis.codec`.

**Damage.** A key of another type than the layout says (a string where a sessions index
belongs, a list for totals), a record shorter than its header, or totals whose numbers do not
parse, is never an error: the read scripts take it as absent, the write script replaces it
(a write that failed half-way would leave a turn half-recorded: Lua scripts do not roll back),
and each script returns how many it met, which the store counts as corrupt entries.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .codec import RECORD_HEAD

__all__ = ["FILL", "PATH", "SESSIONS", "WRITE", "WRITE_TOKEN_MS", "Script"]

WRITE_TOKEN_MS = 60_000
"""How long an applied write's token is kept: a retried write within it is not counted twice."""

_PRELUDE = """
local base = ARGV[1]
local damaged = 0
-- A key of another type than kvwarm keeps there is damage: read as absent, and counted.
local function read(...)
  local v = redis.pcall(...)
  if type(v) == 'table' and v.err then
    if string.sub(v.err, 1, 9) == 'WRONGTYPE' then
      damaged = damaged + 1
      return false
    end
    return error(v)
  end
  return v
end
-- So is a record shorter than its fixed header (the scripts read it by offset).
local function record(key)
  local rec = read('GET', key)
  if rec and #rec < __HEAD__ then
    damaged = damaged + 1
    return false
  end
  return rec
end
-- A record starts with its parent (1..32), identity (33..64) and body hash (65..128) in hex,
-- then flags (129) and depth (130..133): what the scripts read, without decoding.
local function parent_of(rec) return string.sub(rec, 1, 32) end
local function ident_of(rec) return string.sub(rec, 33, 64) end
local function blob_of(rec)
  if bit.band(string.byte(rec, 129), 4) == 0 then return string.sub(rec, 65, 128) end
  return nil
end
local recs, blobs, seen, bseen = {}, {}, {}, {}
local function add(k, rec)
  seen[k] = rec
  recs[#recs + 1] = k
  recs[#recs + 1] = rec
  local b = blob_of(rec)
  if b then
    if not bseen[b] then
      bseen[b] = true
      local body = read('GET', base .. 'b:' .. b)
      if body then
        blobs[#blobs + 1] = b
        blobs[#blobs + 1] = body
      end
    end
  end
end
local function node(k)
  local rec = seen[k]
  if rec then return rec end
  rec = record(base .. 'n:' .. k)
  if rec then add(k, rec) end
  return rec
end
local function depth(rec)
  return (struct.unpack('>I4', string.sub(rec, 130, 133)))
end
local F = {'turns', 'prompt_tokens', 'cached_tokens', 'completion_tokens', 'unknown_cache_turns',
  'cost_usd', 'billed', 'repaired', 'last_break', 'model', 'created', 'updated'}
"""

_READ = "#!lua flags=no-writes\n"
"""Read scripts may run while Redis is over ``maxmemory`` (and on replicas). Every script has a
shebang, so Redis rejects any access outside the slot of its declared key, in a cluster or not."""

_FILL = (
    _READ
    + _PRELUDE
    + """
-- ARGV: base, children limit, identity limit, parent of the chain, n, chain keys...,
--       n, keys..., n, parents..., n, identities...,
--       affinity depth (0: none), n, chain keys known present...
local climit, ilimit = tonumber(ARGV[2]), tonumber(ARGV[3])
local absent, lists, listed = {}, {}, {}
local function members(kind, id, limit)
  if listed[kind .. id] then return end
  listed[kind .. id] = true
  local out = {}
  for _, m in ipairs(read('ZRANGE', base .. kind .. ':' .. id, -limit, -1) or {}) do
    if node(m) then out[#out + 1] = m end
  end
  lists[#lists + 1] = {kind, id, out}
end
local parent = ARGV[4]
local i = 5
local n = tonumber(ARGV[i]); i = i + 1
local broken, walked = false, {}
for _ = 1, n do
  local k = ARGV[i]; i = i + 1
  if not broken then
    if node(k) then
      parent = k
      walked[#walked + 1] = k
    else
      broken = true
      absent[#absent + 1] = k
      members('c', parent, climit)
    end
  end
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local k = ARGV[i]; i = i + 1
  -- A key asked off the chain is a probe (a tool-result permutation, a diagnosis): the
  -- planner's next step reads its children, so they come along.
  if node(k) then members('c', k, climit) else absent[#absent + 1] = k end
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do members('c', ARGV[i], climit); i = i + 1 end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do members('i', ARGV[i], ilimit); i = i + 1 end
-- Routing affinity: the replica remembered for each of the chain's last present keys (those
-- known before, then those just found), so the router's look-up needs no round trip of its own.
local rdepth = tonumber(ARGV[i]); i = i + 1
n = tonumber(ARGV[i]); i = i + 1
local ask, routes = {}, {}
for _ = 1, n do ask[#ask + 1] = ARGV[i]; i = i + 1 end
if rdepth > 0 then
  for _, k in ipairs(walked) do ask[#ask + 1] = k end
  for j = math.max(1, #ask - rdepth + 1), #ask do
    routes[#routes + 1] = ask[j]
    routes[#routes + 1] = read('GET', base .. 'r:' .. ask[j]) or ''
  end
end
return {recs, blobs, absent, lists, routes, damaged}
"""
)

_PATH = (
    _READ
    + _PRELUDE
    + """
-- ARGV: base, leaf. Records leaf first; nothing when any ancestor is missing.
local k = ARGV[2]
for _ = 1, 1000000 do
  local rec = node(k)
  if not rec then return {{}, {}, damaged} end
  if depth(rec) == 0 then return {recs, blobs, damaged} end
  k = parent_of(rec)
end
return {{}, {}, damaged}
"""
)

_SESSIONS = (
    _READ
    + _PRELUDE
    + """
-- ARGV: base. Per live session: leaf, depth, totals fields (entries whose leaf or totals
-- expired are skipped; the write script prunes them by age); then the damage met.
local out = {}
for _, leaf in ipairs(read('ZREVRANGE', KEYS[1], 0, -1) or {}) do
  local rec = record(base .. 'n:' .. leaf)
  local t = rec and read('HMGET', base .. 't:' .. leaf, unpack(F))
  if t and t[1] then
    out[#out + 1] = leaf
    out[#out + 1] = depth(rec)
    for f = 1, #F do out[#out + 1] = t[f] end
  end
end
return {out, damaged}
"""
)

_WRITE = (
    "#!lua\n"
    + _PRELUDE
    + """
-- ARGV: base, ttl ms, now (s), token, heal, tenant, index cap, touch slack ms,
--       n, path keys (root first)..., n, (key, parent, depth, record, blob body or '') x n,
--       totals mode ('0' none, '1' given previous leaf, '2' search the path),
--       [leaf, previous leaf or '', turn fields...]
local ttl, now, token, heal, tenant = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6]
-- A key of another type than this script writes there is damage: replaced, and counted.
local function fix(key, want)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= want then
    redis.call('DEL', key)
    damaged = damaged + 1
  end
end
local cap, slack = tonumber(ARGV[7]), tonumber(ARGV[8])
local nowms = tonumber(now) * 1000
local i = 9
local npath = tonumber(ARGV[i]); i = i + 1
local path, pkeys, pathdepth = {}, {}, {}
for j = 1, npath do
  path[j] = ARGV[i]; i = i + 1
  pkeys[j] = base .. 'n:' .. path[j]
  pathdepth[path[j]] = j - 1
end

-- Heal: the matched path must be stored before anything hangs below it.
local function all_there()
  for j = 1, npath, 1000 do  -- unpack() is bounded by Lua's C stack
    local last = math.min(j + 999, npath)
    if redis.call('EXISTS', unpack(pkeys, j, last)) < last - j + 1 then return false end
  end
  return true
end
if heal == '0' and npath > 0 and not all_there() then
  local gone = {}
  for j = 1, npath do
    if redis.call('EXISTS', pkeys[j]) == 0 then gone[#gone + 1] = j - 1 end
  end
  return {'heal', gone}
end
if token ~= '' and not redis.call('SET', base .. 'w:' .. token, '1', 'NX', 'PX', __TOKEN_MS__) then
  return {'dup'}
end

-- Insert if absent, parents first; children and identity lists ordered by server time.
local t = redis.call('TIME')
local score = tonumber(t[1]) * 1000000 + tonumber(t[2])
local function index(zkey, member)
  fix(zkey, 'zset')
  score = score + 1
  -- The cap is checked on about one insert in 16: a list may run a little over it.
  if redis.call('ZADD', zkey, 'NX', score, member) == 1 and score % 16 == 0
      and redis.call('ZCARD', zkey) > cap then
    redis.call('ZREMRANGEBYRANK', zkey, 0, -cap - 1)
  end
  redis.call('PEXPIRE', zkey, ttl)
end
-- Insert if absent: a damaged record in the way is replaced.
local function put(key, rec)
  if redis.call('SET', key, rec, 'NX', 'PX', ttl) then return true end
  if record(key) then return false end
  redis.call('SET', key, rec, 'PX', ttl)
  return true
end
local added, fresh = 0, {}
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local k, parent, d, rec, body = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3], ARGV[i + 4]
  i = i + 5
  local ok
  if d == 0 then
    ok = parent == tenant
  elseif fresh[parent] then
    ok = fresh[parent] == d - 1
  elseif pathdepth[parent] then
    ok = pathdepth[parent] == d - 1
  else
    local prec = record(base .. 'n:' .. parent)
    ok = prec and depth(prec) == d - 1
  end
  if ok and put(base .. 'n:' .. k, rec) then
    if body ~= '' then redis.call('SET', base .. 'b:' .. blob_of(rec), body, 'PX', ttl) end
    index(base .. 'c:' .. parent, k)
    index(base .. 'i:' .. ident_of(rec), k)
    fresh[k] = d
    added = added + 1
  end
end

-- The session this turn continues: the deepest path node holding totals.
local mode = ARGV[i]; i = i + 1
local leaf, prev, from = '', '', 0
if mode ~= '0' then
  leaf, prev = ARGV[i], ARGV[i + 1]; i = i + 2
end
if mode == '2' then
  for j = npath, 1, -1 do
    if redis.call('EXISTS', base .. 't:' .. path[j]) == 1 then
      if path[j] ~= leaf then prev = path[j] end
      from = j
      break
    end
  end
end

-- Touch (sliding expiry): every path node whose expiry is more than SLACK short of a full
-- TTL is refreshed with its lists and body. A session records when its whole path was last
-- seen fresh; within SLACK of that only the nodes below its previous leaf are checked, so a
-- continuing turn costs a few calls, not one per node.
local touched = nowms
if from > 0 then
  local last = tonumber(read('HGET', base .. 't:' .. path[from], 'touched') or '0') or 0
  if last >= nowms - slack then touched = last else from = 0 end
end
local refreshed = false
for j = from + 1, npath do
  local left = redis.call('PTTL', pkeys[j])
  if left >= 0 and left < ttl - slack then
    local rec = record(pkeys[j])
    redis.call('PEXPIRE', pkeys[j], ttl)
    redis.call('PEXPIRE', base .. 'c:' .. path[j], ttl)
    redis.call('PEXPIRE', base .. 't:' .. path[j], ttl)
    if rec then
      redis.call('PEXPIRE', base .. 'i:' .. ident_of(rec), ttl)
      local b = blob_of(rec)
      if b then redis.call('PEXPIRE', base .. 'b:' .. b, ttl) end
    end
    refreshed = true
  end
end
if refreshed then redis.call('PEXPIRE', base .. 'c:' .. tenant, ttl) end
if mode == '0' then return {'ok', added, 0, damaged} end

-- Totals: those of the previous leaf move down to this one, then the turn is added.
local turn = {}
for f = 1, #F do turn[F[f]] = ARGV[i]; i = i + 1 end
local INT = {'turns', 'prompt_tokens', 'cached_tokens', 'completion_tokens', 'unknown_cache_turns', 'repaired'}
local NUMBERS = {'cost_usd', 'created', 'updated', unpack(INT)}
-- Stored totals; damaged ones (another type, a field missing or not a number) are dropped.
local function load(key)
  fix(key, 'hash')
  local v = redis.call('HGETALL', key)
  if #v == 0 then return nil end
  local out = {}
  for j = 1, #v, 2 do out[v[j]] = v[j + 1] end
  for _, f in ipairs(F) do
    if out[f] == nil then out = nil break end
  end
  for _, f in ipairs(out and NUMBERS or {}) do
    if tonumber(out[f]) == nil then out = nil break end
  end
  if out == nil then
    redis.call('DEL', key)
    damaged = damaged + 1
  end
  return out
end
local function combine(a, b)
  if a == nil then return b end
  if b == nil then return a end
  local c = {}
  for _, f in ipairs(INT) do c[f] = string.format('%d', tonumber(a[f]) + tonumber(b[f])) end
  c.cost_usd = string.format('%.17g', tonumber(a.cost_usd) + tonumber(b.cost_usd))
  c.billed = (a.billed == '1' or b.billed == '1') and '1' or '0'
  c.last_break = (b.last_break ~= '' and b.last_break) or a.last_break
  c.model = (b.model ~= '' and b.model) or a.model
  local ca, cb = tonumber(a.created), tonumber(b.created)
  if ca == 0 or (cb ~= 0 and cb < ca) then c.created = b.created else c.created = a.created end
  if tonumber(b.updated) > tonumber(a.updated) then c.updated = b.updated else c.updated = a.updated end
  return c
end
local moved = nil
if prev ~= '' and prev ~= leaf then moved = load(base .. 't:' .. prev) end
local c = combine(combine(moved, load(base .. 't:' .. leaf)), turn)
if tonumber(c.created) == 0 then c.created = now end
local stored = 0
if fresh[leaf] or pathdepth[leaf] or redis.call('EXISTS', base .. 'n:' .. leaf) == 1 then
  fix(KEYS[1], 'zset')
  if moved then
    redis.call('DEL', base .. 't:' .. prev)
    redis.call('ZREM', KEYS[1], prev)
  end
  local tk = base .. 't:' .. leaf
  local flat = {'touched', string.format('%.17g', touched)}
  for f = 1, #F do
    flat[#flat + 1] = F[f]
    flat[#flat + 1] = c[F[f]]
  end
  redis.call('HSET', tk, unpack(flat))
  redis.call('PEXPIRE', tk, ttl)
  redis.call('ZADD', KEYS[1], now, leaf)
  redis.call('PEXPIRE', KEYS[1], ttl)
  if score % 16 == 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.17g', tonumber(now) - ttl / 1000))
  end
  stored = 1
end
-- Reply: 'ok', nodes added, totals stored (1/0), damaged keys met, the session's totals.
local out = {'ok', added, stored, damaged}
for f = 1, #F do out[#out + 1] = c[F[f]] end
return out
"""
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Script:
    """A Lua script, run by its SHA1 (loaded again when the server lost it)."""

    name: str
    source: str
    sha: str


def _script(name: str, source: str) -> Script:
    source = source.replace("__HEAD__", str(RECORD_HEAD)).replace("__TOKEN_MS__", str(WRITE_TOKEN_MS))
    return Script(name=name, source=source, sha=hashlib.sha1(source.encode()).hexdigest())


FILL = _script("fill", _FILL)
PATH = _script("path", _PATH)
SESSIONS = _script("sessions", _SESSIONS)
WRITE = _script("write", _WRITE)
