"""The Redis store's request-path reads: a view per request, and the fill that answers what it missed.

:meth:`RedisReads.fill` fetches everything a view missed, and the chain it wants, in one
script call (one per tenant: the request's own, plus any other tenant a ``by_identity``
probe named). The chain named by :meth:`~proxy.store.redis.view.RedisView.want` is walked
server-side up to the first absent key, whose parent's children come back in the same
call (what a diagnosis reads first), and a key fetched off the chain (a probe) brings its
children along. When the router keeps its affinity in this store
(:mod:`proxy.store.redis.affinity`), the same call brings the replica remembered for the
chain's deepest present keys, so placing the request needs no round trip of its own.
``fill`` returns False when every miss stayed absent: the plan made before it stands.
"""

from __future__ import annotations

from binascii import unhexlify
from collections.abc import Sequence
from typing import Any

from ...errors import StoreError
from ..base import StoreView
from .affinity import PREFETCH_DEPTH, RedisAffinity
from .cache import NodeCache, RedisCounters
from .codec import ReplyDecoder
from .layout import KeyLayout
from .link import RedisLink
from .scripts import FILL
from .view import CHILDREN_LIMIT, IDENTITY_LIMIT, FillRequest, RedisView

__all__ = ["UNNAMED", "RedisReads"]

UNNAMED = "the request's tenant was not named: the shared secret was unknown when it arrived (redis had not answered)"
"""Why a view or turn of :data:`~proxy.edge.tenancy.UNKNOWN_TENANT` is refused: nothing is read or
written under a root that names no tenant."""


class RedisReads:
    """Views and fills of one store."""

    def __init__(
        self, link: RedisLink, layout: KeyLayout, cache: NodeCache, counters: RedisCounters, decoder: ReplyDecoder
    ) -> None:
        self._link = link
        self._layout = layout
        self._cache = cache
        self._counters = counters
        self._decoder = decoder
        self.affinity: RedisAffinity | None = None
        """The routing affinity kept in this store, if the router uses it: fills bring its entries."""

    def view(self, tenant: bytes | None) -> RedisView:
        return RedisView(self, self._cache, self._counters, tenant)

    async def fill(self, view: StoreView) -> bool:
        """Fetch what the view missed, and the chain it wants, in one round trip (one per
        tenant). True when a lookup the planner missed came back non-empty: only then can
        planning again give another answer (every miss was planned as absent)."""
        if not isinstance(view, RedisView) or view.owner is not self:
            raise TypeError("RedisStore.fill takes a view of this store")
        request = view.take()
        if not request:
            return False
        tenant = view.tenant
        if tenant is None:
            raise StoreError("a redis view needs the request's tenant root: call store.view(root)")
        if not tenant:
            raise StoreError(UNNAMED)
        by_tenant: dict[bytes, list[bytes]] = {}
        for t, ident in request.identities:
            by_tenant.setdefault(t, []).append(ident)
        own = by_tenant.pop(tenant, [])
        ops: list[tuple[Any, ...]] = [(FILL, [self._layout.sessions(tenant)], self._own_args(tenant, request, own))]
        others = list(by_tenant.items())
        for t, idents in others:
            ops.append((FILL, [self._layout.sessions(t)], self._args(t, "", (), (), (), idents)))
        self._counters.fills += 1
        self._counters.misses += len(request.chain) + len(request.keys) + len(request.parents) + len(request.identities)
        results = await self._link.run("fill", ops)
        self._absorb(view, tenant, results[0])
        for (t, _), result in zip(others, results[1:], strict=True):
            self._absorb(view, t, result)
        return view.answered(request)

    def _own_args(self, tenant: bytes, request: FillRequest, identities: Sequence[bytes]) -> list[Any]:
        parent = request.parent.hex() if request.chain else ""
        depth = PREFETCH_DEPTH if self.affinity is not None else 0
        known = request.known[-depth:] if depth else ()
        return self._args(tenant, parent, request.chain, request.keys, request.parents, identities, depth, known)

    def _args(
        self,
        tenant: bytes,
        parent: str,
        chain_keys: Sequence[bytes],
        keys: Sequence[bytes],
        parents: Sequence[bytes],
        identities: Sequence[bytes],
        affinity_depth: int = 0,
        known: Sequence[bytes] = (),
    ) -> list[Any]:
        return [
            self._layout.base(tenant),
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
            affinity_depth,
            len(known),
            *(k.hex() for k in known),
        ]

    def _absorb(self, view: RedisView, tenant: bytes, reply: Any) -> None:
        recs, blobs, absent, lists, routes, damaged = reply
        self._counters.corrupt += damaged
        nodes = self._decoder.nodes(tenant, recs, blobs)
        view.found(list(nodes.values()), [unhexlify(h) for h in absent])
        for kind, ident, members in lists:
            found = tuple(nodes[m] for m in members if m in nodes)
            if kind == b"c":
                view.found_children(unhexlify(ident), found)
            else:
                view.found_identity(tenant, unhexlify(ident), found)
        if routes and self.affinity is not None:
            self.affinity.prefetched(routes)
