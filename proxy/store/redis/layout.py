"""Where the Redis store keeps what: the key layout, every key of a tenant under one hash tag.

``P`` is the key prefix (``store.redis_prefix``, ``kvwarm``), ``T`` a tenant root in hex;
node keys, identities and blob hashes are hex too::

    P:{T}:n:<key>        node record: parent, identity, body hash, flags, depth, tokens,
                         created, role; the body itself when <= INLINE_MAX bytes
    P:{T}:b:<hash>       a body > INLINE_MAX bytes, stored once per tenant by content hash
    P:{T}:c:<parent>     children of a node (or of the tenant root): zset, score = server
                         time of first insert (microseconds), so oldest first
    P:{T}:i:<identity>   the tenant's nodes with this element identity: zset, same scores
    P:{T}:t:<leaf>       a session's running totals: hash (plus ``touched``, see the write script)
    P:{T}:s              the tenant's sessions: zset leaf -> time of its last write
    P:{T}:w:<token>      a write already applied (60 s): a retried write is not counted twice
    P:{T}:r:<key>        the replica (its base URL) that last served the prefix <key>: routing
                         affinity, with its own short TTL (``routing.affinity_ttl_seconds``)
    P:tenants            zset tenant -> last write seen by some process (at most one ZADD per
                         tenant per process per minute): ``sessions()`` of every tenant, and
                         the tenant of a key when an admin call names only the key
    P:secret             the shared tenant-hash secret (no expiry)

**Cluster.** The hash tag ``{T}`` puts everything of one tenant in one slot, so one Lua
script reads a whole request's lookups (nodes, their bodies, children lists, affinity) and
another writes a whole turn (insert-if-absent, touch, totals) atomically, each in one round
trip, with no cross-slot operation. The cost: a tenant lives on one shard, so one very busy
tenant (one API key) loads one shard and its data is bounded by that shard's memory. Only
``P:tenants`` and ``P:secret`` live elsewhere; the tenants entry is refreshed by a plain
command pipelined with a turn's script, at most once a minute per tenant and process.

Bodies are shared across the sessions of a tenant, not across tenants: a cross-tenant blob
would sit in another slot, so a cold read would need a second round trip (the record names
the blob) and every touch a cross-slot write to keep the shared blob alive. A system prompt
sent by 10 000 API keys is therefore stored 10 000 times in Redis (each process still holds
one copy: its cache interns bodies by content hash).
"""

from __future__ import annotations

from ...errors import ConfigError

__all__ = ["KeyLayout"]


class KeyLayout:
    """The key names of one store (one prefix)."""

    __slots__ = ("prefix", "secret", "tenants")

    def __init__(self, prefix: str) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ConfigError("store.redis_prefix", "must be non-empty and hold no '{' or '}'")
        self.prefix = prefix
        self.tenants = f"{prefix}:tenants"
        self.secret = f"{prefix}:secret"

    def base(self, tenant: bytes) -> str:
        """``P:{T}:``: what every key of ``tenant`` starts with (the scripts' ``ARGV[1]``)."""
        return f"{self.prefix}:{{{tenant.hex()}}}:"

    def sessions(self, tenant: bytes) -> str:
        """The tenant's sessions zset: every script's declared key (it names the slot)."""
        return self.base(tenant) + "s"

    def node(self, tenant: bytes, key: bytes) -> str:
        return self.base(tenant) + "n:" + key.hex()

    def totals(self, tenant: bytes, leaf: bytes) -> str:
        return self.base(tenant) + "t:" + leaf.hex()

    def affinity(self, tenant: bytes, key: bytes) -> str:
        return self.base(tenant) + "r:" + key.hex()
