"""The Redis store's admin side: a session's path, its totals, the sessions of one tenant or all.

Off the request path (the admin API, the live page, the CLI): these may name a key without
its tenant, which is then found from the process cache, or else by asking every tenant
listed in ``P:tenants`` (one pipelined ``EXISTS`` each).
"""

from __future__ import annotations

from ..core.model import Node, SessionTotals
from .base import SessionInfo
from .redis_cache import NodeCache
from .redis_codec import TOTALS_FIELDS, ReplyDecoder, totals_of
from .redis_layout import KeyLayout
from .redis_link import RedisLink
from .redis_scripts import PATH, SESSIONS

__all__ = ["RedisAdmin"]


class RedisAdmin:
    """Paths, totals and session lists of one store."""

    def __init__(self, link: RedisLink, layout: KeyLayout, cache: NodeCache, decoder: ReplyDecoder) -> None:
        self._link = link
        self._layout = layout
        self._cache = cache
        self._decoder = decoder

    async def path(self, leaf: bytes, tenant: bytes | None = None) -> list[Node]:
        """Element 0 down to ``leaf``; empty when any is missing. ``tenant`` spares a lookup."""
        root = await self.tenant_of(leaf, tenant)
        if root is None:
            return []
        base = self._layout.base(root)
        link = self._link
        reply = await link.guarded("path", lambda c: link.eval(c, PATH, [base + "s"], [base, leaf.hex()]))
        recs, blobs = reply
        nodes = self._decoder.nodes(root, recs, blobs)
        out = [nodes.get(recs[i]) for i in range(len(recs) - 2, -1, -2)]
        if any(n is None for n in out):
            return []
        return [n for n in out if n is not None]

    async def totals(self, leaf: bytes, tenant: bytes | None = None) -> SessionTotals | None:
        root = await self.tenant_of(leaf, tenant)
        if root is None:
            return None
        key = self._layout.totals(root, leaf)
        values = await self._link.guarded("totals", lambda c: c.execute_command("HMGET", key, *TOTALS_FIELDS))
        if values[0] is None:
            return None
        return totals_of(values)

    async def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        """Sessions most recently updated first; every tenant's when ``tenant`` is None."""
        tenants = [tenant] if tenant is not None else await self._tenants("sessions")
        if not tenants:
            return []
        layout = self._layout
        ops = [(SESSIONS, [layout.sessions(t)], [layout.base(t)]) for t in tenants]
        results = await self._link.run("sessions", ops)
        out: list[SessionInfo] = []
        width = 2 + len(TOTALS_FIELDS)
        for t, flat in zip(tenants, results, strict=True):
            for i in range(0, len(flat), width):
                leaf = bytes.fromhex(flat[i].decode())
                out.append(SessionInfo(leaf=leaf, tenant=t, depth=int(flat[i + 1]), totals=totals_of(flat[i + 2 : i + width])))
        out.sort(key=lambda info: info.totals.updated, reverse=True)
        return out

    async def tenant_of(self, key: bytes, tenant: bytes | None) -> bytes | None:
        """``tenant`` when given, else the tenant holding node ``key`` (None: no tenant does)."""
        if tenant is not None:
            return tenant
        node = self._cache.get(key)
        if node is not None:
            return node.tenant
        # An admin call without the tenant: ask every known tenant (one pipelined EXISTS each).
        tenants = await self._tenants("lookup")
        if not tenants:
            return None
        found = await self._link.run("lookup", [("EXISTS", self._layout.node(t, key)) for t in tenants])
        return next((t for t, hit in zip(tenants, found, strict=True) if hit), None)

    async def _tenants(self, what: str) -> list[bytes]:
        key = self._layout.tenants
        listed = await self._link.guarded(what, lambda c: c.execute_command("ZRANGE", key, 0, -1))
        return [bytes.fromhex(t.decode()) for t in listed]
