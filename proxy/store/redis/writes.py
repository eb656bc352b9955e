"""The Redis store's writes: a whole turn in one script call, atomically, with no double count.

``write_turn`` is one round trip: insert-if-absent (``SET NX``; concurrent writers converge,
a list entry is added once), the sliding-TTL touch of the matched path, and the totals moved
from the previous leaf (the deepest path node holding totals) to the new one. Each write
that adds totals carries a token kept 60 s, so a command that redis-py retries after a lost
reply is not counted twice. Once a minute per tenant and process, the tenant's entry in
``P:tenants`` is refreshed by a command pipelined beside the script.

**Expiry.** Every key of a tenant carries the sliding TTL (``ttl_seconds``): each write of a
turn refreshes the matched path's records, bodies, children and identity lists, and
session totals -- but only where the expiry is more than :data:`TOUCH_SLACK_MS` (or 1% of
the TTL) short of a full TTL, and a session remembers (``touched``) when its whole path was
last found fresh, so a turn that follows its previous one checks only the nodes below the
previous leaf: a few calls, not one per node. Keys may thus expire up to twice the slack
early.

**Heal.** A write whose matched path has vanished from Redis (a restart without
persistence, eviction) gets the missing positions back; the path is re-inserted from the
process cache first, parents first, and the write runs again without the check, so
sessions continue across a Redis wipe. Redis having lost data, the shared secret is checked
first (:meth:`~proxy.store.redis.secret.SharedSecret.sync`): when another process's secret
now stands, this turn (keyed under the old one) is not written.

**Damage.** The script replaces keys of another type than it writes and reports how many
(counted as corrupt entries); a damaged ``P:tenants`` is replaced by this tenant's entry.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ...core.model import Node, SessionTotals, TurnWrite
from ...errors import StoreError
from .cache import NodeCache, RedisCounters
from .codec import encoded, normalized, totals_of, turn_fields
from .layout import KeyLayout
from .link import RedisLink
from .reads import UNNAMED
from .scripts import WRITE

__all__ = ["ANNOUNCE_EVERY", "INDEX_CAP", "TOUCH_SLACK_MS", "RedisWrites"]

INDEX_CAP = 4096
"""Entries kept in one children or identity list; older ones are dropped from the list."""
TOUCH_SLACK_MS = 60_000
"""A path node whose expiry was refreshed less than this (or 1% of the TTL) ago is not
refreshed again: its expiry may fall this much short of a sliding TTL."""
ANNOUNCE_EVERY = 60.0
"""Seconds between two refreshes of a tenant's ``P:tenants`` entry by one process."""

_Encoded = tuple[Node, bytes, bytes, bytes]
"""A node with its body hash, record and blob body."""


class RedisWrites:
    """Turn writes, inserts and totals of one store. ``tenant_of`` names the tenant of a key
    that is not cached here (the admin side's look-up)."""

    def __init__(
        self,
        link: RedisLink,
        layout: KeyLayout,
        cache: NodeCache,
        counters: RedisCounters,
        *,
        ttl_seconds: float,
        tenant_of: Callable[[bytes, bytes | None], Awaitable[bytes | None]],
        totals: Callable[[bytes, bytes], Awaitable[SessionTotals | None]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._link = link
        self._layout = layout
        self._cache = cache
        self._counters = counters
        self._ttl = ttl_seconds
        self._ttl_ms = max(1, round(ttl_seconds * 1000))
        self._slack_ms = min(TOUCH_SLACK_MS, self._ttl_ms // 100)
        self._tenant_of = tenant_of
        self._stored_totals = totals
        self._clock = clock
        self._announced: dict[bytes, float] = {}
        self._token_prefix = secrets.token_hex(6)
        self._tokens = itertools.count()

    async def write_turn(self, turn: TurnWrite) -> None:
        """One round trip: the tenant's script (heal check, insert-if-absent, touch, totals),
        once a minute with the tenant's entry in ``P:tenants`` beside it."""
        tenant = await self._turn_tenant(turn)
        if tenant is None:
            raise StoreError("redis store write: the turn's tenant is unknown (no nodes, path not cached)")
        if not tenant:
            raise StoreError(f"redis store write: {UNNAMED}")
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
            alone = normalized(totals, self._clock())
            alone.created = alone.created or self._clock()
            return alone
        reply = await self._write(root, (), (), leaf, parent_leaf, totals, search=False)
        if reply[0] == b"dup":
            return await self._stored_totals(leaf, root) or normalized(totals, self._clock())
        return totals_of(reply[4:])

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
        path = [k for k in path if k != tenant]
        todo: list[_Encoded] = [(n, *encoded(n)) for n in nodes if n.tenant == tenant]
        token = f"{self._token_prefix}{next(self._tokens)}" if totals is not None else ""
        heal = "0"
        for _ in range(2):
            args = self._args(tenant, now, token, heal, path, todo, leaf, parent_leaf, totals, search)
            ops: list[tuple[Any, ...]] = [(WRITE, [self._layout.sessions(tenant)], args)]
            announce = totals is not None and now - self._announced.get(tenant, -ANNOUNCE_EVERY) >= ANNOUNCE_EVERY
            if announce:
                ops.append(("ZADD", self._layout.tenants, now, tenant.hex()))
                ops.append(("ZREMRANGEBYSCORE", self._layout.tenants, "-inf", f"({now - self._ttl!r}"))
            results = await self._link.run("write", ops, lenient_from=1)
            if announce:
                await self._announced_in(results[1:], tenant, now)
            reply: list[Any] = results[0]
            if reply[0] != b"heal":
                break
            # Redis lost part of the matched path (restart, eviction): put it back from the
            # process cache, parents first, then write again without the check. A restart
            # may have lost the shared secret too.
            if await self._link.guarded("secret", self._link.secret.sync):
                raise StoreError("redis store write: the shared secret changed; this turn was keyed under the old one")
            healed = [self._cache.get(path[int(i)]) for i in reply[1]]
            back: list[_Encoded] = [(n, *encoded(n)) for n in healed if n is not None]
            self._counters.healed += len(back)
            todo = back + todo
            heal = "1"
        self._counters.writes += 1
        if reply[0] == b"ok":
            self._counters.corrupt += int(reply[3])
        self._link.full = None
        for node, digest, _, _ in todo:
            self._cache.put(node, digest)
        return reply

    async def _announced_in(self, results: Sequence[Any], tenant: bytes, now: float) -> None:
        """Note the tenant announced in ``P:tenants``; a damaged key (another type) is replaced."""
        if any(isinstance(r, Exception) for r in results):
            self._counters.corrupt += 1
            key = self._layout.tenants
            await self._link.run("write", [("DEL", key), ("ZADD", key, now, tenant.hex())])
        if len(self._announced) >= 100_000:
            self._announced.clear()
        self._announced[tenant] = now

    def _args(
        self,
        tenant: bytes,
        now: float,
        token: str,
        heal: str,
        path: Sequence[bytes],
        todo: Sequence[_Encoded],
        leaf: bytes | None,
        parent_leaf: bytes | None,
        totals: SessionTotals | None,
        search: bool,
    ) -> list[Any]:
        """The write script's ARGV (see :mod:`proxy.store.redis.scripts`)."""
        args: list[Any] = [
            self._layout.base(tenant), self._ttl_ms, repr(now), token, heal, tenant.hex(), INDEX_CAP, self._slack_ms, len(path)
        ]
        args.extend(k.hex() for k in path)
        args.append(len(todo))
        for node, _, record, body in todo:
            args.extend((node.key.hex(), node.parent.hex(), node.depth, record, body))
        if totals is None or leaf is None:
            args.append("0")
        else:
            args.extend(("2" if search else "1", leaf.hex(), parent_leaf.hex() if parent_leaf else ""))
            args.extend(turn_fields(normalized(totals, now)))
        return args
