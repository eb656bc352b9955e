"""The Redis transcript store: one tree shared by every kvwarm process and replica.

:class:`RedisStore` implements :class:`~proxy.store.base.AsyncStore` on Redis (or a
Redis Cluster) through redis-py's asyncio client (hiredis parser). Every process reads
and writes the same tree, so a session whose turns a load balancer spreads over
replicas is matched -- and repaired -- whole on each of them.

**URLs** (``store.backend``)::

    redis://[[user]:password@]host:port[/db]      plain TCP (redis-py ``from_url``)
    rediss://...                                  TLS
    unix:///path/to/redis.sock[?db=N]             a Unix socket
    redis+cluster://[[user]:password@]host:port[,host:port...]
    rediss+cluster://...                          Redis Cluster (TLS): the listed nodes are
                                                  only where discovery starts

"Cluster" is said by the scheme (``+cluster``), not a query flag: a cluster client speaks
another protocol (MOVED/ASK redirections, slot routing) and cannot use ``db`` or a socket.

**Key layout.** ``P`` is the key prefix (``kvwarm``), ``T`` a tenant root in hex; node
keys, identities and blob hashes are hex too::

    P:{T}:n:<key>        node record: parent, identity, body hash, flags, depth, tokens,
                         created, role; the body itself when <= INLINE_MAX bytes
    P:{T}:b:<hash>       a body > INLINE_MAX bytes, stored once per tenant by content hash
    P:{T}:c:<parent>     children of a node (or of the tenant root): zset, score = server
                         time of first insert (microseconds), so oldest first
    P:{T}:i:<identity>   the tenant's nodes with this element identity: zset, same scores
    P:{T}:t:<leaf>       a session's running totals: hash (plus ``touched``, see below)
    P:{T}:s              the tenant's sessions: zset leaf -> time of its last write
    P:{T}:w:<token>      a write already applied (60 s): a retried write is not counted twice
    P:tenants            zset tenant -> last write seen by some process (at most one ZADD per
                         tenant per process per minute): ``sessions()`` of every tenant, and
                         the tenant of a key when an admin call names only the key
    P:secret             the shared tenant-hash secret (no expiry)

**Cluster.** The hash tag ``{T}`` puts everything of one tenant in one slot, so one Lua
script reads a whole request's lookups (nodes, their bodies, children lists) and another
writes a whole turn (insert-if-absent, touch, totals) atomically, each in one round trip,
with no cross-slot operation. The cost: a tenant lives on one shard, so one very busy
tenant (one API key) loads one shard and its data is bounded by that shard's memory.
Only ``P:tenants`` and ``P:secret`` live elsewhere; the tenants entry is refreshed by a
plain command pipelined with a turn's script, at most once a minute per tenant and process.

Bodies are shared across the sessions of a tenant, not across tenants: a cross-tenant
blob would sit in another slot, so a cold read would need a second round trip (the
record names the blob) and every touch a cross-slot write to keep the shared blob alive.
A system prompt sent by 10 000 API keys is therefore stored 10 000 times in Redis (each
process still holds one copy: its cache interns bodies by content hash).

**Memory and expiry.** Every key of a tenant carries the sliding TTL (``ttl_seconds``):
each write of a turn refreshes the matched path's records, bodies, children and identity
lists, and session totals, inside its one script -- but only where the expiry is more
than :data:`TOUCH_SLACK_MS` (or 1% of the TTL) short of a full TTL, and a session
remembers (``touched``) when its whole path was last found fresh, so a turn that follows
its previous one checks only the nodes below the previous leaf: a few calls, not one per
node. Keys may thus expire up to twice the slack early. Memory is bounded by Redis itself: set
``maxmemory`` and ``maxmemory-policy volatile-ttl``. With sliding TTLs the key nearest to
expiry is the one used longest ago, so ``volatile-ttl`` evicts in kvwarm's own LRU order,
and it never evicts ``P:secret`` (which has no TTL): under ``allkeys-lru`` an evicted
secret would be re-created at the next start, and that process would hash tenants
differently from the rest. Either policy is otherwise safe: a missing parent, body or
list is a miss, never an error.

**Secret.** With ``secret`` empty, the first process stores 32 random bytes under
``P:secret`` with ``SET NX`` and every process reads that value back at open, so all of
them key tenant roots alike. A configured secret is used as is (configure the same one
everywhere). Until Redis has answered once, :meth:`RedisStore.secret` raises
:class:`~proxy.errors.StoreError`.

**Reads.** A :class:`RedisView` answers from a bounded per-process LRU cache of nodes
(immutable, so always correct) and from what its fills fetched; what it cannot answer
it records in ``missing`` and reports absent. :meth:`RedisStore.fill` fetches all of it
in one script call; the chain named by :meth:`RedisView.want` is walked server-side up
to the first absent key, whose parent's children come back in the same call (what a
diagnosis reads first), and a key fetched off the chain (a probe) brings its children
along. Given the request's identities too, the view answers "absent" for
``chain(parent, identity)`` under every parent whose whole children list it holds, so
the planner's permutation and diagnosis probes rarely need a second round. ``fill``
returns False when every miss stayed absent: the plan made before it stands.
``children`` and ``by_identity`` return the newest :data:`CHILDREN_LIMIT` /
:data:`IDENTITY_LIMIT` entries, oldest first: the core reads no more than that.

**Writes.** ``write_turn`` is one script call: insert-if-absent (``SET NX``; concurrent
writers converge, a list entry is added once), touch, and the totals moved from the
previous leaf (the deepest path node holding totals) to the new one, atomically. Each
write carries a token kept 60 s, so a command that redis-py retries after a lost reply
is not counted twice.

**Failure.** Every call is bounded by ``timeout`` (socket timeouts and an overall
deadline) and raises :class:`~proxy.errors.StoreError` on any Redis error. A connection
error or a timeout opens a breaker: calls fail at once, :meth:`RedisStore.health` says
``"degraded: ..."``, and a background probe pings with exponential backoff until Redis
answers, when the store resumes by itself. A write whose matched path has vanished
from Redis (restart without persistence, eviction) re-inserts that path from the
process cache first ("heal"), so sessions continue across a Redis wipe.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import secrets
import struct
import sys
import time
from binascii import unhexlify
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from ..core.model import Node, SessionTotals, TurnWrite, chain
from ..errors import ConfigError, StoreError
from .base import Lookups, SessionInfo, StoreStats, StoreView
from .memory import blob_hash
from .urls import SCHEMES, is_redis_url, redacted

__all__ = [
    "CHILDREN_LIMIT",
    "IDENTITY_LIMIT",
    "INLINE_MAX",
    "RedisCounters",
    "RedisStore",
    "RedisView",
    "is_redis_url",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

INLINE_MAX = 1024
"""Bodies up to this many bytes live in the node record; longer ones in a shared blob key."""
CHILDREN_LIMIT = 32
"""Children returned per parent, the newest (``proxy.core.breaks`` compares at most 32)."""
IDENTITY_LIMIT = 256
"""Nodes returned per identity, the newest (``proxy.core.breaks`` examines at most 256)."""
INDEX_CAP = 4096
"""Entries kept in one children or identity list; older ones are dropped from the list."""
WRITE_TOKEN_MS = 60_000
"""How long an applied write's token is kept: a retried write within it is not counted twice."""
TOUCH_SLACK_MS = 60_000
"""A path node whose expiry was refreshed less than this (or 1% of the TTL) ago is not
refreshed again: its expiry may fall this much short of a sliding TTL."""
ANNOUNCE_EVERY = 60.0
"""Seconds between two refreshes of a tenant's ``P:tenants`` entry by one process."""
CACHE_NODE_OVERHEAD = 600
"""Bytes a cached node costs beyond its body (the Node, its key, identity and LRU entry)."""

_HEAD = struct.Struct(">32s32s64sBIIdH")
"""Record header: parent, identity and body hash (in hex: the scripts build key names from
them), flags, depth, tokens, created, role length; then the role, then an inline body."""
_GENERATED, _PARTIAL, _INLINE = 1, 2, 4
_FIELDS = (
    "turns",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "unknown_cache_turns",
    "cost_usd",
    "billed",
    "repaired",
    "last_break",
    "model",
    "created",
    "updated",
)
"""Session totals fields, in the order the scripts send and return them."""

_DOWN_ERRORS: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ClusterError,
    rexc.RedisClusterException,
    OSError,
    TimeoutError,
)
"""Errors that mean Redis is unreachable or too slow: they open the breaker."""
_ANY_ERRORS: tuple[type[BaseException], ...] = (*_DOWN_ERRORS, rexc.RedisError, StoreError)


# -- Lua --------------------------------------------------------------------------------------

_PRELUDE = """
local base = ARGV[1]
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
      local body = redis.call('GET', base .. 'b:' .. b)
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
  rec = redis.call('GET', base .. 'n:' .. k)
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
--       n, keys..., n, parents..., n, identities...
local climit, ilimit = tonumber(ARGV[2]), tonumber(ARGV[3])
local absent, lists, listed = {}, {}, {}
local function members(kind, id, limit)
  if listed[kind .. id] then return end
  listed[kind .. id] = true
  local out = {}
  for _, m in ipairs(redis.call('ZRANGE', base .. kind .. ':' .. id, -limit, -1)) do
    if node(m) then out[#out + 1] = m end
  end
  lists[#lists + 1] = {kind, id, out}
end
local parent = ARGV[4]
local i = 5
local n = tonumber(ARGV[i]); i = i + 1
local broken = false
for _ = 1, n do
  local k = ARGV[i]; i = i + 1
  if not broken then
    if node(k) then
      parent = k
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
return {recs, blobs, absent, lists}
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
  if not rec then return {{}, {}} end
  if depth(rec) == 0 then return {recs, blobs} end
  k = parent_of(rec)
end
return {{}, {}}
"""
)

_SESSIONS = (
    _READ
    + _PRELUDE
    + """
-- ARGV: base. Per live session: leaf, depth, totals fields (entries whose leaf or totals
-- expired are skipped; the write script prunes them by age).
local out = {}
for _, leaf in ipairs(redis.call('ZREVRANGE', KEYS[1], 0, -1)) do
  local rec = redis.call('GET', base .. 'n:' .. leaf)
  local t = redis.call('HMGET', base .. 't:' .. leaf, unpack(F))
  if rec and t[1] then
    out[#out + 1] = leaf
    out[#out + 1] = depth(rec)
    for f = 1, #F do out[#out + 1] = t[f] end
  end
end
return out
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
  score = score + 1
  -- The cap is checked on about one insert in 16: a list may run a little over it.
  if redis.call('ZADD', zkey, 'NX', score, member) == 1 and score % 16 == 0
      and redis.call('ZCARD', zkey) > cap then
    redis.call('ZREMRANGEBYRANK', zkey, 0, -cap - 1)
  end
  redis.call('PEXPIRE', zkey, ttl)
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
    local prec = redis.call('GET', base .. 'n:' .. parent)
    ok = prec and depth(prec) == d - 1
  end
  if ok and redis.call('SET', base .. 'n:' .. k, rec, 'NX', 'PX', ttl) then
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
  local last = tonumber(redis.call('HGET', base .. 't:' .. path[from], 'touched') or '0')
  if last >= nowms - slack then touched = last else from = 0 end
end
local refreshed = false
for j = from + 1, npath do
  local left = redis.call('PTTL', pkeys[j])
  if left >= 0 and left < ttl - slack then
    local rec = redis.call('GET', pkeys[j])
    redis.call('PEXPIRE', pkeys[j], ttl)
    redis.call('PEXPIRE', base .. 'c:' .. path[j], ttl)
    redis.call('PEXPIRE', base .. 'i:' .. ident_of(rec), ttl)
    redis.call('PEXPIRE', base .. 't:' .. path[j], ttl)
    local b = blob_of(rec)
    if b then redis.call('PEXPIRE', base .. 'b:' .. b, ttl) end
    refreshed = true
  end
end
if refreshed then redis.call('PEXPIRE', base .. 'c:' .. tenant, ttl) end
if mode == '0' then return {'ok', added, 0} end

-- Totals: those of the previous leaf move down to this one, then the turn is added.
local turn = {}
for f = 1, #F do turn[F[f]] = ARGV[i]; i = i + 1 end
local function load(key)
  local v = redis.call('HGETALL', key)
  if #v == 0 then return nil end
  local out = {}
  for j = 1, #v, 2 do out[v[j]] = v[j + 1] end
  return out
end
local INT = {'turns', 'prompt_tokens', 'cached_tokens', 'completion_tokens', 'unknown_cache_turns', 'repaired'}
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
local out = {'ok', added, stored}
for f = 1, #F do out[#out + 1] = c[F[f]] end
return out
"""
)


@dataclass(frozen=True, slots=True)
class _Script:
    name: str
    source: str
    sha: str


def _script(name: str, source: str) -> _Script:
    return _Script(name, source, hashlib.sha1(source.encode()).hexdigest())


FILL = _script("fill", _FILL)
PATH = _script("path", _PATH)
SESSIONS = _script("sessions", _SESSIONS)
WRITE = _script("write", _WRITE.replace("__TOKEN_MS__", str(WRITE_TOKEN_MS)))


# -- records ----------------------------------------------------------------------------------


def encode_node(node: Node, digest: bytes) -> tuple[bytes, bytes]:
    """The node's record and, for a body over :data:`INLINE_MAX`, the body to store as a blob."""
    inline = len(node.body) <= INLINE_MAX
    flags = (_GENERATED if node.generated else 0) | (_PARTIAL if node.partial else 0) | (_INLINE if inline else 0)
    role = node.role.encode("utf-8", "surrogatepass")
    head = _HEAD.pack(
        node.parent.hex().encode(),
        node.identity.hex().encode(),
        digest.hex().encode(),
        flags,
        node.depth,
        node.tokens,
        node.created,
        len(role),
    )
    if inline:
        return head + role + node.body, b""
    return head + role, node.body


# -- the per-process cache --------------------------------------------------------------------


@dataclass(slots=True)
class _Blob:
    data: bytes
    refs: int


class NodeCache:
    """A least-recently-used cache of immutable nodes, bounded by bytes; bodies interned by hash."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._nodes: OrderedDict[bytes, tuple[Node, bytes]] = OrderedDict()
        self._blobs: dict[bytes, _Blob] = {}
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def blobs(self) -> int:
        return len(self._blobs)

    def get(self, key: bytes) -> Node | None:
        entry = self._nodes.get(key)
        if entry is None:
            return None
        self._nodes.move_to_end(key)
        return entry[0]

    def blob(self, digest: bytes) -> bytes | None:
        entry = self._blobs.get(digest)
        return None if entry is None else entry.data

    def put(self, node: Node, digest: bytes) -> Node:
        """Cache ``node`` (whose body hashes to ``digest``); returns the cached node."""
        held = self._nodes.get(node.key)
        if held is not None:
            self._nodes.move_to_end(node.key)
            return held[0]
        if self.max_bytes <= 0:
            return node
        blob = self._blobs.get(digest)
        if blob is None:
            blob = self._blobs[digest] = _Blob(node.body, 0)
            self.bytes += len(node.body)
        blob.refs += 1
        if node.body is not blob.data:
            node = Node(
                key=node.key,
                parent=node.parent,
                tenant=node.tenant,
                depth=node.depth,
                role=node.role,
                identity=node.identity,
                body=blob.data,
                tokens=node.tokens,
                generated=node.generated,
                partial=node.partial,
                created=node.created,
            )
        self._nodes[node.key] = (node, digest)
        self.bytes += CACHE_NODE_OVERHEAD
        while self.bytes > self.max_bytes and len(self._nodes) > 1:
            _, (_, old_digest) = self._nodes.popitem(last=False)
            self.bytes -= CACHE_NODE_OVERHEAD
            entry = self._blobs[old_digest]
            entry.refs -= 1
            if entry.refs == 0:
                del self._blobs[old_digest]
                self.bytes -= len(entry.data)
            self.evicted += 1
        return node


@dataclass(slots=True)
class RedisCounters:
    """Cheap local counters of one :class:`RedisStore` (read at scrape time, never from Redis)."""

    hits: int = 0
    """View reads answered by the process cache."""
    misses: int = 0
    """Lookups sent to Redis by fills (nodes, children lists, identity lists)."""
    fills: int = 0
    """Fill round trips."""
    writes: int = 0
    """Turn writes (and inserts, add_turns) that reached Redis."""
    healed: int = 0
    """Path nodes re-inserted from the process cache after Redis lost them."""
    corrupt: int = 0
    """Records or bodies that failed to decode or verify (each a miss)."""
    errors: int = 0
    """Calls that raised :class:`StoreError` (including those refused while degraded)."""


# -- the view ---------------------------------------------------------------------------------


class RedisView:
    """One request's read view: the process cache, plus what this view's fills fetched."""

    __slots__ = (
        "_absent",
        "_children",
        "_found",
        "_hints",
        "_identities",
        "_pending",
        "_store",
        "_wanted",
        "missing",
        "tenant",
    )

    def __init__(self, store: RedisStore, tenant: bytes | None) -> None:
        self._store = store
        self.tenant = tenant
        """The request's tenant root: every lookup of the view is in this tenant's slot."""
        self.missing = Lookups()
        self._found: dict[bytes, Node] = {}
        self._absent: set[bytes] = set()
        self._children: dict[bytes, tuple[Node, ...]] = {}
        self._identities: dict[tuple[bytes, bytes], tuple[Node, ...]] = {}
        self._wanted: tuple[bytes, ...] = ()
        self._hints: tuple[bytes, ...] = ()
        self._pending: list[tuple[bytes, tuple[Node, ...]]] = []

    def get(self, key: bytes) -> Node | None:
        node = self._found.get(key)
        if node is not None:
            return node
        node = self._store._cache.get(key)
        if node is not None:
            self._store.counters.hits += 1
            return node
        if self._pending:
            self._expand()
        if key not in self._absent:
            self.missing.keys.add(key)
        return None

    def children(self, key: bytes) -> Sequence[Node]:
        found = self._children.get(key)
        if found is None:
            self.missing.children.add(key)
            return ()
        return found

    def by_identity(self, tenant: bytes, identity: bytes) -> Sequence[Node]:
        found = self._identities.get((tenant, identity))
        if found is None:
            self.missing.identities.add((tenant, identity))
            return ()
        return found

    def want(self, keys: Sequence[bytes], identities: Sequence[bytes] = ()) -> None:
        """The request's chain keys from element 0: the next fill walks them in one call and
        also brings the children of the first absent key's parent. Replaces an earlier want.

        ``identities`` (optional: the request's element identities) lets the view answer
        "absent" for ``chain(parent, identity)`` wherever it holds the parent's whole
        children list, which spares the planner's permutation and diagnosis probes a round."""
        self._wanted = tuple(keys)
        self._hints = tuple(dict.fromkeys(identities))

    def _known_children(self, parent: bytes, found: tuple[Node, ...]) -> None:
        self._children[parent] = found
        if self._hints and len(found) < CHILDREN_LIMIT:
            self._pending.append((parent, found))

    def _expand(self) -> None:
        """A whole children list rules out ``chain(parent, identity)`` for every hinted
        identity not among them: worked out at the first miss that could need it."""
        absent = self._absent
        for parent, found in self._pending:
            present = {n.key for n in found}
            for ident in self._hints:
                key = chain(parent, ident)
                if key not in present:
                    absent.add(key)
        self._pending.clear()


# -- the store --------------------------------------------------------------------------------


def _cluster_url(url: str) -> tuple[list[tuple[str, int]], str | None, str | None, bool]:
    """``redis+cluster://[[user]:password@]host:port[,host:port...]``: (nodes, user, password, tls)."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    username, _, password = auth.partition(":")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise ConfigError("store.backend", f"cluster node {item!r} is not host:port")
        nodes.append((host, int(port)))
    if parts.path.strip("/") not in ("", "0") or parts.query:
        raise ConfigError("store.backend", "a Redis Cluster URL takes no database and no options")
    return nodes, unquote(username) or None, unquote(password) or None, parts.scheme.lower() == "rediss+cluster"


Client = Redis | RedisCluster


class RedisStore:
    """The transcript tree in Redis, shared by every process that opens the same URL.

    ``url``: one of the forms in the module docstring. ``ttl_seconds``: the sliding expiry
    of every key. ``secret``: the tenant-hash secret, or ``None`` to share one through
    Redis. ``timeout``: the bound of every call (seconds). ``cache_bytes``: the process
    cache of nodes. ``prefix``: the key prefix. ``health_check_interval``: idle seconds
    before redis-py pings a pooled connection. ``retries``: redis-py retries of one command
    on a connection error (with exponential backoff). ``probe_backoff``: first and longest
    pause between probes while Redis is unreachable. ``clock``: stamps session updates.
    """

    shared = True

    def __init__(
        self,
        url: str,
        *,
        ttl_seconds: float,
        secret: bytes | None = None,
        timeout: float = 0.25,
        cache_bytes: int = 64 << 20,
        prefix: str = "kvwarm",
        health_check_interval: float = 10.0,
        retries: int = 1,
        probe_backoff: tuple[float, float] = (0.05, 2.0),
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not is_redis_url(url):
            raise ConfigError("store.backend", f"expected a redis URL ({', '.join(s + '://' for s in SCHEMES)})")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ConfigError("store.redis_prefix", "must be non-empty and hold no '{' or '}'")
        if ttl_seconds <= 0:
            raise ConfigError("store.ttl_seconds", "must be > 0 for a redis store")
        if timeout <= 0:
            raise ConfigError("store.timeout", "must be > 0")
        self.url = url
        self.timeout = timeout
        self.counters = RedisCounters()
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        self._slack_ms = min(TOUCH_SLACK_MS, self._ttl_ms // 100)
        self._ttl = ttl_seconds
        self._prefix = prefix
        self._configured_secret = secret or None
        self._secret: bytes | None = self._configured_secret
        self._cache = NodeCache(cache_bytes)
        self._clock = clock
        self._health_check_interval = health_check_interval
        self._retries = retries
        self._probe_backoff = probe_backoff
        self._cluster = _cluster_url(url) if url.partition("://")[0].lower().endswith("+cluster") else None
        if self._cluster is None:
            try:
                parse_url(url)
            except ValueError as exc:
                raise ConfigError("store.backend", f"{redacted(url)}: {exc}") from exc
        self._client: Client | None = None
        self._down: str | None = "not opened"
        self._full: str | None = None
        self._wake = asyncio.Event()
        self._prober: asyncio.Task[None] | None = None
        self._k_tenants = f"{prefix}:tenants"
        self._announced: dict[bytes, float] = {}
        self._token_prefix = secrets.token_hex(6)
        self._tokens = itertools.count()
        self._k_secret = f"{prefix}:secret"

    # -- lifecycle ----------------------------------------------------------------------------

    def _connect(self) -> Client:
        common: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": Retry(ExponentialBackoff(cap=min(0.5, self.timeout / 2), base=0.005), self._retries),
            "health_check_interval": self._health_check_interval,
            "decode_responses": False,
            "client_name": "kvwarm",
        }
        if self._cluster is None:
            return Redis.from_url(self.url, **common)
        nodes, username, password, ssl = self._cluster
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in nodes],
            username=username,
            password=password,
            ssl=ssl,
            **common,
        )

    async def open(self) -> None:
        """Connect, and load (or create) the shared secret. Redis being down is no error here:
        the store starts degraded and the probe connects it when Redis answers."""
        if self._client is not None:
            return
        self._client = self._connect()
        self._prober = asyncio.get_running_loop().create_task(self._probe_loop(), name="kvwarm-redis-probe")
        try:
            async with asyncio.timeout(self.timeout * 4):
                await self._client.execute_command("PING")
                await self._load_secret()
        except _ANY_ERRORS as exc:
            log.warning("redis store %s unreachable at start: %s", redacted(self.url), exc)
            self._trip(f"unreachable: {exc or type(exc).__name__}")
            return
        self._down = None

    async def close(self) -> None:
        prober, self._prober = self._prober, None
        if prober is not None:
            prober.cancel()
            try:
                await prober
            except asyncio.CancelledError:
                pass
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
        self._down = "closed"

    async def flush(self) -> None:
        """Nothing is pending: every write reached Redis when its call returned."""
        return None

    def evict(self, now: float) -> int:
        """Redis expires keys itself (sliding TTL) and evicts by its ``maxmemory-policy``."""
        return 0

    def secret(self) -> bytes:
        if self._secret is None:
            raise StoreError(f"the redis store {redacted(self.url)} has not answered yet: its shared secret is unknown")
        return self._secret

    def health(self) -> str:
        if self._down is not None:
            return f"degraded: redis {self._down}"
        if self._full is not None:
            return f"degraded: redis {self._full}"
        return "ok"

    def stats(self) -> StoreStats:
        """The process cache (Redis itself is not asked: this runs at scrape time).
        ``sessions`` is 0: only Redis knows, and :meth:`sessions` lists them."""
        cache = self._cache
        return StoreStats(
            nodes=len(cache),
            bytes=cache.bytes,
            blobs=cache.blobs,
            sessions=0,
            corrupt=self.counters.corrupt,
            evicted=cache.evicted,
        )

    # -- failure handling ---------------------------------------------------------------------

    def _trip(self, reason: str) -> None:
        if self._down is None:
            log.warning("redis store %s degraded: %s", redacted(self.url), reason)
        self._down = reason
        self._wake.set()

    async def _probe_loop(self) -> None:
        first, longest = self._probe_backoff
        delay = first
        while True:
            await self._wake.wait()
            await asyncio.sleep(delay)
            client = self._client
            if client is None:
                return
            try:
                async with asyncio.timeout(self.timeout * 4):
                    await client.execute_command("PING")
                    if self._secret is None:
                        await self._load_secret()
            except _ANY_ERRORS as exc:
                delay = min(delay * 2, longest)
                self._down = f"unreachable: {exc or type(exc).__name__}"
                continue
            log.info("redis store %s reachable again", redacted(self.url))
            self._down = None
            self._wake.clear()
            delay = first

    async def _load_secret(self) -> None:
        if self._configured_secret is not None:
            return
        client = self._require()
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("SET", self._k_secret, secrets.token_bytes(32), "NX")
        pipe.execute_command("GET", self._k_secret)
        _, value = await pipe.execute()
        if not isinstance(value, bytes) or not value:
            raise StoreError(f"{self._k_secret} holds no secret")
        self._secret = value

    def _require(self) -> Client:
        if self._client is None:
            raise StoreError("the redis store is not open")
        return self._client

    async def _guarded(self, what: str, call: Callable[[Client], Any]) -> Any:
        """Run ``call(client)`` within ``timeout``; every failure becomes a StoreError."""
        if self._down is not None:
            self.counters.errors += 1
            raise StoreError(f"redis store {what}: redis {self._down}")
        client = self._require()
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                result = await call(client)
        except asyncio.CancelledError:
            # The caller's deadline: when it caught us waiting on Redis for long, Redis is slow.
            if time.monotonic() - started >= self.timeout / 2:
                self._trip(f"slow: no answer in {time.monotonic() - started:.3f}s")
            raise
        except _DOWN_ERRORS as exc:
            self.counters.errors += 1
            self._trip(f"unreachable: {exc or type(exc).__name__}")
            raise StoreError(f"redis store {what}: {exc or type(exc).__name__}") from exc
        except rexc.ResponseError as exc:
            self.counters.errors += 1
            if isinstance(exc, rexc.OutOfMemoryError) or str(exc).startswith("OOM"):
                self._full = "out of memory (maxmemory reached; set maxmemory-policy volatile-ttl)"
            raise StoreError(f"redis store {what}: {exc}") from exc
        except rexc.RedisError as exc:
            self.counters.errors += 1
            raise StoreError(f"redis store {what}: {exc}") from exc
        return result

    async def _eval(self, client: Client, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except rexc.NoScriptError:
            await client.execute_command("SCRIPT LOAD", script.source)
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    async def _pipeline(self, client: Client, ops: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Commands in one round trip (per node in a cluster); a script is ``(_Script, keys, args)``.

        A script the server lost (restart) is loaded and re-run alone; any other error raises."""
        if len(ops) == 1 and isinstance(ops[0][0], _Script):
            script, keys, args = ops[0]
            return [await self._eval(client, script, keys, args)]
        pipe = client.pipeline(transaction=False)
        for op in ops:
            if isinstance(op[0], _Script):
                script, keys, args = op
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            else:
                pipe.execute_command(*op)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        for i, (op, result) in enumerate(zip(ops, results, strict=True)):
            if isinstance(result, rexc.NoScriptError) and isinstance(op[0], _Script):
                results[i] = await self._eval(client, op[0], op[1], op[2])
            elif isinstance(result, Exception):
                raise result
        return results

    # -- keys ---------------------------------------------------------------------------------

    def _base(self, tenant: bytes) -> str:
        return f"{self._prefix}:{{{tenant.hex()}}}:"

    # -- reads ---------------------------------------------------------------------------------

    def view(self, tenant: bytes | None = None) -> RedisView:
        """A read view for one request of ``tenant`` (its root). Without a tenant the view
        answers from the process cache only, and its fill raises :class:`StoreError`."""
        return RedisView(self, tenant)

    async def fill(self, view: StoreView) -> bool:
        """Fetch what the view missed, and the chain it wants, in one round trip (one per
        tenant). True when a lookup the planner missed came back non-empty: only then can
        planning again give another answer (every miss was planned as absent)."""
        if not isinstance(view, RedisView) or view._store is not self:
            raise TypeError("RedisStore.fill takes a view of this store")
        missing = view.missing
        asked = (tuple(missing.keys), tuple(missing.children), tuple(missing.identities))
        wanted, view._wanted = view._wanted, ()
        cache = self._cache
        start = next(
            (i for i, k in enumerate(wanted) if k not in view._found and k not in view._absent and cache.get(k) is None),
            len(wanted),
        )
        chain_keys = wanted[start:]
        keys = [k for k in missing.keys if k not in view._found and k not in view._absent and k not in chain_keys]
        parents = [p for p in missing.children if p not in view._children]
        identities = [ti for ti in missing.identities if ti not in view._identities]
        missing.clear()
        if not (chain_keys or keys or parents or identities):
            return False
        tenant = view.tenant
        if tenant is None:
            raise StoreError("a redis view needs the request's tenant root: call store.view(root)")
        by_tenant: dict[bytes, list[bytes]] = {}
        for t, ident in identities:
            by_tenant.setdefault(t, []).append(ident)
        own = by_tenant.pop(tenant, [])
        parent_of_chain = (wanted[start - 1] if start else tenant).hex() if chain_keys else ""
        ops: list[tuple[Any, ...]] = [
            (FILL, [self._base(tenant) + "s"], self._fill_args(tenant, parent_of_chain, chain_keys, keys, parents, own))
        ]
        others = list(by_tenant.items())
        for t, idents in others:
            ops.append((FILL, [self._base(t) + "s"], self._fill_args(t, "", (), (), (), idents)))
        self.counters.fills += 1
        self.counters.misses += len(chain_keys) + len(keys) + len(parents) + len(identities)
        results = await self._guarded("fill", lambda c: self._pipeline(c, ops))
        self._absorb(view, tenant, results[0])
        for (t, _), result in zip(others, results[1:], strict=True):
            self._absorb(view, t, result)
        found, kids, lists = view._found, view._children, view._identities
        return (
            any(k in found for k in asked[0])
            or any(kids.get(p) for p in asked[1])
            or any(lists.get(ti) for ti in asked[2])
        )

    def _fill_args(
        self,
        tenant: bytes,
        parent: str,
        chain_keys: Sequence[bytes],
        keys: Sequence[bytes],
        parents: Sequence[bytes],
        identities: Sequence[bytes],
    ) -> list[Any]:
        return [
            self._base(tenant),
            CHILDREN_LIMIT,
            IDENTITY_LIMIT,
            parent,
            len(chain_keys),
            *(k.hex() for k in chain_keys),
            len(keys),
            *(k.hex() for k in keys),
            len(parents),
            *(p.hex() for p in parents),
            len(identities),
            *(i.hex() for i in identities),
        ]

    def _absorb(self, view: RedisView, tenant: bytes, reply: Any) -> None:
        recs, blobs, absent, lists = reply
        nodes = self._decode_all(tenant, recs, blobs)
        view._found.update((n.key, n) for n in nodes.values())
        for h in absent:
            view._absent.add(unhexlify(h))
        for kind, ident, members in lists:
            found = tuple(nodes[m] for m in members if m in nodes)
            if kind == b"c":
                view._known_children(unhexlify(ident), found)
            else:
                view._identities[(tenant, unhexlify(ident))] = found

    def _decode_all(self, tenant: bytes, recs: Sequence[bytes], blobs: Sequence[bytes]) -> dict[bytes, Node]:
        """Nodes of a script's reply, by hex key; corrupt records are counted and left out."""
        bodies = {blobs[i]: blobs[i + 1] for i in range(0, len(blobs), 2)}
        out: dict[bytes, Node] = {}
        for i in range(0, len(recs), 2):
            hexkey = recs[i]
            node = self._decode(tenant, hexkey, recs[i + 1], bodies)
            if node is not None:
                out[hexkey] = node
        return out

    def _decode(self, tenant: bytes, hexkey: bytes, rec: bytes, bodies: dict[bytes, bytes]) -> Node | None:
        cache = self._cache
        try:
            key = unhexlify(hexkey)
            cached = cache.get(key)
            if cached is not None:
                return cached
            hparent, hidentity, hdigest, flags, depth, tokens, created, role_len = _HEAD.unpack_from(rec)
            parent, identity, digest = unhexlify(hparent), unhexlify(hidentity), unhexlify(hdigest)
            end = _HEAD.size + role_len
            role = sys.intern(rec[_HEAD.size : end].decode("utf-8", "surrogatepass"))
        except (struct.error, UnicodeDecodeError, ValueError):
            self.counters.corrupt += 1
            return None
        if chain(parent, identity) != key or (depth == 0 and parent != tenant):
            self.counters.corrupt += 1
            return None
        body: bytes | None
        if flags & _INLINE:
            body = rec[end:]  # as sound as the record it is part of
        else:
            body = cache.blob(digest)
            if body is None:
                body = bodies.get(hdigest)
                if body is None:
                    return None  # the blob expired or was evicted: a miss
                if blob_hash(body) != digest:
                    self.counters.corrupt += 1
                    return None
        node = Node(
            key, parent, tenant, depth, role, identity, body, tokens, bool(flags & _GENERATED), bool(flags & _PARTIAL), created
        )
        return cache.put(node, digest)

    async def path(self, leaf: bytes, tenant: bytes | None = None) -> list[Node]:
        """Element 0 down to ``leaf``; empty when any is missing. ``tenant`` spares a lookup
        (else the process cache, or a look-up in every known tenant, names it)."""
        root = await self._tenant_of(leaf, tenant)
        if root is None:
            return []
        base = self._base(root)
        reply = await self._guarded("path", lambda c: self._eval(c, PATH, [base + "s"], [base, leaf.hex()]))
        recs, blobs = reply
        nodes = self._decode_all(root, recs, blobs)
        out = [nodes.get(recs[i]) for i in range(len(recs) - 2, -1, -2)]
        if any(n is None for n in out):
            return []
        return [n for n in out if n is not None]

    async def totals(self, leaf: bytes, tenant: bytes | None = None) -> SessionTotals | None:
        root = await self._tenant_of(leaf, tenant)
        if root is None:
            return None
        key = self._base(root) + "t:" + leaf.hex()
        values = await self._guarded("totals", lambda c: c.execute_command("HMGET", key, *_FIELDS))
        if values[0] is None:
            return None
        return _totals(values)

    async def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        """Sessions most recently updated first; every tenant's when ``tenant`` is None."""
        if tenant is not None:
            tenants = [tenant]
        else:
            listed = await self._guarded("sessions", lambda c: c.execute_command("ZRANGE", self._k_tenants, 0, -1))
            tenants = [bytes.fromhex(t.decode()) for t in listed]
        if not tenants:
            return []
        ops = [(SESSIONS, [self._base(t) + "s"], [self._base(t)]) for t in tenants]
        results = await self._guarded("sessions", lambda c: self._pipeline(c, ops))
        out: list[SessionInfo] = []
        width = 2 + len(_FIELDS)
        for t, flat in zip(tenants, results, strict=True):
            for i in range(0, len(flat), width):
                leaf = bytes.fromhex(flat[i].decode())
                out.append(SessionInfo(leaf=leaf, tenant=t, depth=int(flat[i + 1]), totals=_totals(flat[i + 2 : i + width])))
        out.sort(key=lambda info: info.totals.updated, reverse=True)
        return out

    async def _tenant_of(self, key: bytes, tenant: bytes | None) -> bytes | None:
        if tenant is not None:
            return tenant
        node = self._cache.get(key)
        if node is not None:
            return node.tenant
        # An admin call without the tenant: ask every known tenant (one pipelined EXISTS each).
        listed = await self._guarded("lookup", lambda c: c.execute_command("ZRANGE", self._k_tenants, 0, -1))
        tenants = [bytes.fromhex(t.decode()) for t in listed]
        if not tenants:
            return None
        ops = [("EXISTS", self._base(t) + "n:" + key.hex()) for t in tenants]
        found = await self._guarded("lookup", partial(self._pipeline, ops=ops))
        return next((t for t, hit in zip(tenants, found, strict=True) if hit), None)

    # -- writes -------------------------------------------------------------------------------

    async def write_turn(self, turn: TurnWrite) -> None:
        """One round trip: the tenant's script (heal check, insert-if-absent, touch, totals),
        once a minute with the tenant's entry in ``P:tenants`` beside it."""
        tenant = await self._turn_tenant(turn)
        if tenant is None:
            raise StoreError("redis store write: the turn's tenant is unknown (no nodes, path not cached)")
        await self._write(tenant, turn.nodes, turn.path, turn.leaf, None, turn.totals, search=True)

    async def insert(self, nodes: Sequence[Node]) -> int:
        groups: dict[bytes, list[Node]] = {}
        for node in nodes:
            groups.setdefault(node.tenant, []).append(node)
        added = 0
        for tenant, group in groups.items():
            reply = await self._write(tenant, group, (), None, None, None, search=False)
            added += int(reply[1])
        return added

    async def add_turn(
        self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals, tenant: bytes | None = None
    ) -> SessionTotals:
        root = await self._tenant_of(leaf, tenant)
        if root is None and parent_leaf is not None:
            root = await self._tenant_of(parent_leaf, None)
        if root is None:
            # Neither leaf is known here: like a leaf that is not stored, nothing is kept.
            alone = _normalized(totals, self._clock())
            alone.created = alone.created or self._clock()
            return alone
        reply = await self._write(root, (), (), leaf, parent_leaf, totals, search=False)
        if reply[0] == b"dup":
            return await self.totals(leaf, root) or _normalized(totals, self._clock())
        return _totals(reply[3:])

    async def _turn_tenant(self, turn: TurnWrite) -> bytes | None:
        if turn.tenant:
            return turn.tenant
        if turn.nodes:
            return turn.nodes[0].tenant
        for key in (turn.leaf, *reversed(turn.path)):
            node = self._cache.get(key)
            if node is not None:
                return node.tenant
        return await self._tenant_of(turn.leaf, None)

    async def _write(
        self,
        tenant: bytes,
        nodes: Sequence[Node],
        path: Sequence[bytes],
        leaf: bytes | None,
        parent_leaf: bytes | None,
        totals: SessionTotals | None,
        *,
        search: bool,
    ) -> list[Any]:
        now = self._clock()
        base = self._base(tenant)
        path = [k for k in path if k != tenant]
        encoded = [(n, *self._encode(n)) for n in nodes if n.tenant == tenant]
        token = f"{self._token_prefix}{next(self._tokens)}" if totals is not None else ""
        ops: list[tuple[Any, ...]] = []
        heal = "0"
        for _ in range(2):
            args: list[Any] = [
                base, self._ttl_ms, repr(now), token, heal, tenant.hex(), INDEX_CAP, self._slack_ms, len(path)
            ]
            args.extend(k.hex() for k in path)
            args.append(len(encoded))
            for node, _, record, body in encoded:
                args.extend((node.key.hex(), node.parent.hex(), node.depth, record, body))
            if totals is None or leaf is None:
                args.append("0")
            else:
                args.extend(("2" if search else "1", leaf.hex(), parent_leaf.hex() if parent_leaf else ""))
                args.extend(_turn_fields(_normalized(totals, now)))
            ops = [(WRITE, [base + "s"], args)]
            announce = totals is not None and now - self._announced.get(tenant, -ANNOUNCE_EVERY) >= ANNOUNCE_EVERY
            if announce:
                ops.append(("ZADD", self._k_tenants, now, tenant.hex()))
                ops.append(("ZREMRANGEBYSCORE", self._k_tenants, "-inf", f"({now - self._ttl!r}"))
            results = await self._guarded("write", partial(self._pipeline, ops=ops))
            if announce:
                if len(self._announced) >= 100_000:
                    self._announced.clear()
                self._announced[tenant] = now
            reply: list[Any] = results[0]
            if reply[0] != b"heal":
                break
            # Redis lost part of the matched path (restart, eviction): put it back from the
            # process cache, parents first, then write again without the check.
            healed = [self._cache.get(path[int(i)]) for i in reply[1]]
            back = [(n, *self._encode(n)) for n in healed if n is not None]
            self.counters.healed += len(back)
            encoded = back + encoded
            heal = "1"
        self.counters.writes += 1
        if self._full is not None:
            self._full = None
        for node, digest, _, _ in encoded:
            self._cache.put(node, digest)
        return reply

    @staticmethod
    def _encode(node: Node) -> tuple[bytes, bytes, bytes]:
        digest = blob_hash(node.body)
        record, body = encode_node(node, digest)
        return digest, record, body


def _normalized(totals: SessionTotals, now: float) -> SessionTotals:
    """A turn as ``add_turn`` counts it: at least one turn, updated now unless stamped."""
    return SessionTotals(
        turns=max(totals.turns, 1),
        prompt_tokens=totals.prompt_tokens,
        cached_tokens=totals.cached_tokens,
        completion_tokens=totals.completion_tokens,
        unknown_cache_turns=totals.unknown_cache_turns,
        cost_usd=totals.cost_usd,
        billed=totals.billed,
        repaired=totals.repaired,
        last_break=totals.last_break,
        model=totals.model,
        created=totals.created,
        updated=totals.updated or now,
    )


def _turn_fields(t: SessionTotals) -> list[str]:
    return [
        str(t.turns),
        str(t.prompt_tokens),
        str(t.cached_tokens),
        str(t.completion_tokens),
        str(t.unknown_cache_turns),
        repr(float(t.cost_usd)),
        "1" if t.billed else "0",
        str(t.repaired),
        t.last_break,
        t.model,
        repr(float(t.created)),
        repr(float(t.updated)),
    ]


def _totals(values: Sequence[Any]) -> SessionTotals:
    v = [x.decode("utf-8", "surrogatepass") if isinstance(x, bytes) else str(x) for x in values]
    return SessionTotals(
        turns=int(v[0]),
        prompt_tokens=int(v[1]),
        cached_tokens=int(v[2]),
        completion_tokens=int(v[3]),
        unknown_cache_turns=int(v[4]),
        cost_usd=float(v[5]),
        billed=v[6] == "1",
        repaired=int(v[7]),
        last_break=v[8],
        model=v[9],
        created=float(v[10]),
        updated=float(v[11]),
    )
