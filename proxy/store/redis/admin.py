"""The Redis store's admin side: a session's path, its totals, the sessions of one tenant or all.

Off the request path (the admin API, the live page, the CLI): these may name a key without
its tenant, which is then found from the process cache, or else by asking every tenant
listed in ``P:tenants`` (one pipelined ``EXISTS`` each).

Damage is skipped and counted (``counters.corrupt``), never raised: a key of another type
(``P:tenants``, a sessions index, totals), a tenant entry that is not a tenant root, totals
whose numbers do not parse. The scripts report what they skipped themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...core.model import Node, SessionTotals
from ..base import SessionInfo
from .cache import NodeCache, RedisCounters
from .codec import TOTALS_FIELDS, ReplyDecoder, totals_of
from .layout import KeyLayout
from .link import DAMAGED, RedisLink, eval_script
from .scripts import PATH, SESSIONS

__all__ = ["RedisAdmin"]


class RedisAdmin:
    """Paths, totals and session lists of one store."""

    def __init__(
        self, link: RedisLink, layout: KeyLayout, cache: NodeCache, counters: RedisCounters, decoder: ReplyDecoder
    ) -> None:
        self._link = link
        self._layout = layout
        self._cache = cache
        self._counters = counters
        self._decoder = decoder

    async def path(self, leaf: bytes, tenant: bytes | None = None) -> list[Node]:
        """Element 0 down to ``leaf``; empty when any is missing. ``tenant`` spares a lookup."""
        root = await self.tenant_of(leaf, tenant)
        if root is None:
            return []
        base = self._layout.base(root)
        reply = await self._link.guarded("path", lambda c: eval_script(c, PATH, [base + "s"], [base, leaf.hex()]))
        recs, blobs, damaged = reply
        self._counters.corrupt += damaged
        nodes = self._decoder.nodes(root, recs, blobs)
        out = [nodes.get(recs[i]) for i in range(len(recs) - 2, -1, -2)]
        if any(n is None for n in out):
            return []
        return [n for n in out if n is not None]

    async def totals(self, leaf: bytes, tenant: bytes | None = None) -> SessionTotals | None:
        root = await self.tenant_of(leaf, tenant)
        if root is None:
            return None
        values = await self._link.read("totals", "HMGET", self._layout.totals(root, leaf), *TOTALS_FIELDS)
        if values is DAMAGED or values[0] is None:
            return None
        return self._totals(values)

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
        for t, (flat, damaged) in zip(tenants, results, strict=True):
            self._counters.corrupt += damaged
            for i in range(0, len(flat), width):
                info = self._session(t, flat[i : i + width])
                if info is not None:
                    out.append(info)
        out.sort(key=lambda info: info.totals.updated, reverse=True)
        return out

    def _session(self, tenant: bytes, row: Sequence[Any]) -> SessionInfo | None:
        """One row of the sessions script (leaf, depth, totals fields); None: damaged, counted."""
        totals = self._totals(row[2:])
        if totals is None:
            return None
        leaf = _root(row[0])
        if leaf is None:
            self._counters.corrupt += 1
            return None
        return SessionInfo(leaf=leaf, tenant=tenant, depth=int(row[1]), totals=totals)

    def _totals(self, values: Sequence[Any]) -> SessionTotals | None:
        """Totals from their fields; None (counted corrupt) when a number does not parse."""
        try:
            return totals_of(values)
        except (ValueError, TypeError):
            self._counters.corrupt += 1
            return None

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
        """The tenants listed in ``P:tenants``; an entry that names no tenant root is skipped."""
        listed = await self._link.read(what, "ZRANGE", self._layout.tenants, 0, -1)
        if listed is DAMAGED:
            return []
        tenants = [_root(t) for t in listed]
        self._counters.corrupt += tenants.count(None)
        return [t for t in tenants if t is not None]


def _root(text: Any) -> bytes | None:
    """A tenant root or node key (16 bytes) from its hex; None when ``text`` is not one."""
    try:
        key = bytes.fromhex(text.decode())
    except (AttributeError, ValueError):
        return None
    return key if len(key) == 16 else None
