"""One request's read view of the Redis store: the process cache, plus what this view's fills fetched.

A :class:`RedisView` answers the pure planner synchronously. What it cannot answer it
records in ``missing`` and reports absent; the request path then awaits the store's fill
(:mod:`proxy.store.redis.reads`), which asks the view what to fetch (:meth:`RedisView.take`)
and hands the answers back (:meth:`RedisView.found`, ...). ``children`` and ``by_identity``
hold the newest :data:`CHILDREN_LIMIT` / :data:`IDENTITY_LIMIT` entries, oldest first: the
core reads no more than that.

Given the request's identities (:meth:`RedisView.want`), the view answers "absent" for
``chain(parent, identity)`` under every parent whose whole children list it holds, so the
planner's permutation and diagnosis probes rarely need a second round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...core.model import Node, chain
from ..base import Lookups
from .cache import NodeCache, RedisCounters

__all__ = ["CHILDREN_LIMIT", "IDENTITY_LIMIT", "FillRequest", "RedisView"]

CHILDREN_LIMIT = 32
"""Children returned per parent, the newest (``proxy.core.breaks`` compares at most 32)."""
IDENTITY_LIMIT = 256
"""Nodes returned per identity, the newest (``proxy.core.breaks`` examines at most 256)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FillRequest:
    """What one fill asks Redis for (the view's tenant unless said otherwise)."""

    parent: bytes
    """The parent of ``chain[0]``: the node before it, or the tenant root."""
    chain: tuple[bytes, ...]
    """The wanted chain from its first key this process does not know."""
    known: tuple[bytes, ...]
    """The wanted chain's keys before ``chain`` (known present): with the ones the walk finds,
    the keys whose routing affinity a fill may bring along."""
    keys: tuple[bytes, ...]
    """Nodes the planner missed off the chain (probes)."""
    parents: tuple[bytes, ...]
    """Children lists the planner missed."""
    identities: tuple[tuple[bytes, bytes], ...]
    """``by_identity`` lists the planner missed, by (tenant, identity)."""
    asked: tuple[tuple[bytes, ...], tuple[bytes, ...], tuple[tuple[bytes, bytes], ...]]
    """Everything the planner missed (keys, children, identities), answered or not."""

    def __bool__(self) -> bool:
        return bool(self.chain or self.keys or self.parents or self.identities)


class RedisView:
    """One request's read view: the process cache, plus what this view's fills fetched."""

    __slots__ = (
        "_absent",
        "_cache",
        "_children",
        "_counters",
        "_found",
        "_hints",
        "_identities",
        "_pending",
        "_wanted",
        "missing",
        "owner",
        "tenant",
    )

    def __init__(self, owner: object, cache: NodeCache, counters: RedisCounters, tenant: bytes | None) -> None:
        self.owner = owner
        """Whose fill may fill this view (the store's read side)."""
        self.tenant = tenant
        """The request's tenant root: every lookup of the view is in this tenant's slot."""
        self.missing = Lookups()
        self._cache = cache
        self._counters = counters
        self._found: dict[bytes, Node] = {}
        self._absent: set[bytes] = set()
        self._children: dict[bytes, tuple[Node, ...]] = {}
        self._identities: dict[tuple[bytes, bytes], tuple[Node, ...]] = {}
        self._wanted: tuple[bytes, ...] = ()
        self._hints: tuple[bytes, ...] = ()
        self._pending: list[tuple[bytes, tuple[Node, ...]]] = []

    # -- the planner's reads --------------------------------------------------------------

    def get(self, key: bytes) -> Node | None:
        node = self._found.get(key)
        if node is not None:
            return node
        node = self._cache.get(key)
        if node is not None:
            self._counters.hits += 1
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

    # -- the fill's side ------------------------------------------------------------------

    def take(self) -> FillRequest:
        """What the next fill must fetch; clears ``missing`` and the wanted chain."""
        missing, found, absent, cache = self.missing, self._found, self._absent, self._cache
        asked = (tuple(missing.keys), tuple(missing.children), tuple(missing.identities))
        wanted, self._wanted = self._wanted, ()
        start = next(
            (i for i, k in enumerate(wanted) if k not in found and k not in absent and cache.get(k) is None),
            len(wanted),
        )
        chain_keys = wanted[start:]
        request = FillRequest(
            parent=(wanted[start - 1] if start else self.tenant or b""),
            chain=chain_keys,
            known=tuple(k for k in wanted[:start] if k not in absent),
            keys=tuple(k for k in missing.keys if k not in found and k not in absent and k not in chain_keys),
            parents=tuple(p for p in missing.children if p not in self._children),
            identities=tuple(ti for ti in missing.identities if ti not in self._identities),
            asked=asked,
        )
        missing.clear()
        return request

    def found(self, nodes: Sequence[Node], absent: Sequence[bytes]) -> None:
        """Nodes a fill fetched, and keys it found absent."""
        self._found.update((n.key, n) for n in nodes)
        self._absent.update(absent)

    def found_children(self, parent: bytes, found: tuple[Node, ...]) -> None:
        self._children[parent] = found
        if self._hints and len(found) < CHILDREN_LIMIT:
            self._pending.append((parent, found))

    def found_identity(self, tenant: bytes, identity: bytes, found: tuple[Node, ...]) -> None:
        self._identities[(tenant, identity)] = found

    def answered(self, request: FillRequest) -> bool:
        """Whether something the planner missed before ``request`` came back non-empty: only
        then can planning again give another answer (every miss was planned as absent)."""
        keys, parents, identities = request.asked
        return (
            any(k in self._found for k in keys)
            or any(self._children.get(p) for p in parents)
            or any(self._identities.get(ti) for ti in identities)
        )

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
