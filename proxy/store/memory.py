"""The in-memory transcript store: the hot index every backend keeps, and the ``memory`` backend.

Indexes (all plain dicts, so every read is O(1) whatever the number of sessions):

- ``key -> Node``;
- ``parent -> children``, oldest first (a tenant root is the parent of element 0);
- ``(tenant, identity) -> nodes``;
  (both hold a lone Node, or a list once there are two);
- ``leaf -> SessionTotals``;
- ``key -> last use``, kept in least-recently-used order (a touch re-inserts the key
  at the end), which is what eviction walks.

Bodies are interned by content hash: nodes with equal bodies share one ``bytes``
object, so a 20 kB system prompt shared by 10 000 sessions is held once, and
:meth:`MemoryStore.stats` counts it once.

Persistent backends subclass :class:`MemoryStore` and override the ``_on_*``
hooks, which report every change of the index (see :mod:`proxy.store.sqlite`).
"""

from __future__ import annotations

import hashlib
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from .base import Node, SessionInfo, SessionTotals, StoreStats

NODE_OVERHEAD = 600
"""Estimated bytes per node beyond its body: the Node object, its key and identity, and
its share of the indexes (measured with tracemalloc on CPython 3.11, rounded up)."""

BLOB_HASH_SIZE = 32


def blob_hash(body: bytes) -> bytes:
    """Content hash under which a body is interned (and persisted)."""
    return hashlib.blake2b(body, digest_size=BLOB_HASH_SIZE).digest()


@dataclass(slots=True)
class _Blob:
    data: bytes
    refs: int


_NO_NODES: tuple[Node, ...] = ()
_K = TypeVar("_K", bytes, tuple[bytes, bytes])


class MemoryStore:
    """A :class:`~proxy.store.base.TranscriptStore` held entirely in memory.

    ``ttl_seconds``: a node unused for this long is evicted. ``max_bytes``: the budget
    :meth:`evict` enforces on :attr:`StoreStats.bytes`. ``secret``: keys tenant roots;
    ``None`` generates a random one for this instance. ``clock`` stamps inserts and
    session updates (injected by tests).
    """

    def __init__(
        self,
        ttl_seconds: float,
        max_bytes: int,
        secret: bytes | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ttl = ttl_seconds
        self._max_bytes = max_bytes
        self._secret = secret if secret else secrets.token_bytes(32)
        self._clock = clock
        self._nodes: dict[bytes, Node] = {}
        # Index values are a lone Node or a list of two or more: most parents have one
        # child and most identities one node, and a list per entry would cost ~90 bytes.
        self._children: dict[bytes, Node | list[Node]] = {}
        self._by_identity: dict[tuple[bytes, bytes], Node | list[Node]] = {}
        self._totals: dict[bytes, SessionTotals] = {}
        self._used: dict[bytes, float] = {}
        # Nodes hold the stored parent's key object and one interned tenant object,
        # so a loaded or re-built Node does not carry copies of either.
        self._tenants: dict[bytes, bytes] = {}
        self._blobs: dict[bytes, _Blob] = {}
        self._blob_bytes = 0
        self._corrupt = 0
        self._evicted = 0

    # -- lifecycle: nothing to load or flush ----------------------------------------------

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def flush(self) -> None:
        return None

    def secret(self) -> bytes:
        return self._secret

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: bytes) -> Node | None:
        return self._nodes.get(key)

    def children(self, key: bytes) -> Sequence[Node]:
        """Children of ``key``, oldest first. The sequence is read-only by contract."""
        return _view(self._children.get(key))

    def by_identity(self, tenant: bytes, identity: bytes) -> Sequence[Node]:
        return _view(self._by_identity.get((tenant, identity)))

    def path(self, leaf: bytes) -> list[Node]:
        nodes = self._nodes
        node = nodes.get(leaf)
        out: list[Node] = []
        while node is not None:
            out.append(node)
            if node.depth == 0:
                out.reverse()
                return out
            node = nodes.get(node.parent)
        return []

    def totals(self, leaf: bytes) -> SessionTotals | None:
        found = self._totals.get(leaf)
        return None if found is None else replace(found)

    def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        out: list[SessionInfo] = []
        # The dict is kept in update order, so ties on ``updated`` list the latest first.
        for leaf, totals in reversed(self._totals.items()):
            node = self._nodes[leaf]
            if tenant is None or node.tenant == tenant:
                out.append(SessionInfo(leaf=leaf, tenant=node.tenant, depth=node.depth, totals=replace(totals)))
        out.sort(key=lambda info: info.totals.updated, reverse=True)
        return out

    def stats(self) -> StoreStats:
        return StoreStats(
            nodes=len(self._nodes),
            bytes=self._blob_bytes + NODE_OVERHEAD * len(self._nodes),
            blobs=len(self._blobs),
            sessions=len(self._totals),
            corrupt=self._corrupt,
            evicted=self._evicted,
        )

    # -- writes ---------------------------------------------------------------------------

    def insert(self, nodes: Sequence[Node]) -> int:
        now = self._clock()
        added = 0
        for node in nodes:
            if self._add(node, now) is not None:
                added += 1
        return added

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        used = self._used
        for key in keys:
            last = used.get(key)
            if last is None or now < last:
                continue
            # Re-inserting moves the key to the most-recently-used end.
            del used[key]
            used[key] = now
            self._on_touch(key, now)

    def add_turn(self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals) -> SessionTotals:
        """Add one turn to the session ending at ``leaf``; ``totals.turns`` counts as at least 1.

        Totals held at ``parent_leaf`` move to ``leaf`` (merged with any already there).
        When ``leaf`` is not stored, the combined totals are returned and nothing is kept.
        """
        now = self._clock()
        turn = replace(totals, turns=max(totals.turns, 1), updated=totals.updated or now)
        moved = None
        if parent_leaf is not None and parent_leaf != leaf:
            moved = self._totals.get(parent_leaf)
        current = self._totals.get(leaf)
        combined = _combine(_combine(moved, current), turn)
        if combined.created == 0.0:
            combined.created = now
        if leaf not in self._nodes:
            return combined
        if moved is not None and parent_leaf is not None:
            del self._totals[parent_leaf]
            self._on_totals(parent_leaf, None)
        # A new object every time: a persistent backend may be encoding the previous one.
        self._totals.pop(leaf, None)
        self._totals[leaf] = combined
        self._on_totals(leaf, combined)
        return replace(combined)

    def evict(self, now: float) -> int:
        """Drop nodes unused for ``ttl``, then least-recently-used leaves while over budget.

        One walk in LRU order. A node with stored children is passed over (a parent never
        goes before its children); when its last child goes, it is taken at once if it
        was passed over already (it is older than everything still ahead) and qualifies.
        """
        cutoff = now - self._ttl
        over = self._blob_bytes + NODE_OVERHEAD * len(self._nodes) - self._max_bytes
        victims: list[tuple[Node, bytes]] = []
        kids_left: dict[bytes, int] = {}
        refs_left: dict[bytes, int] = {}
        passed: set[bytes] = set()
        nodes, used, children = self._nodes, self._used, self._children

        def remaining(key: bytes) -> int:
            n = kids_left.get(key)
            return len(_view(children.get(key))) if n is None else n

        for key, last in used.items():
            expired = last <= cutoff
            if not expired and over <= 0:
                break
            if remaining(key) > 0:
                passed.add(key)
                continue
            node = nodes[key]
            while True:
                digest = blob_hash(node.body)
                refs = refs_left.get(digest, self._blobs[digest].refs) - 1
                refs_left[digest] = refs
                over -= NODE_OVERHEAD + (len(node.body) if refs == 0 else 0)
                victims.append((node, digest))
                if node.depth == 0:
                    break
                parent = node.parent
                left = remaining(parent) - 1
                kids_left[parent] = left
                if left > 0 or parent not in passed:
                    break
                if not (used[parent] <= cutoff or over > 0):
                    break
                passed.discard(parent)
                node = nodes[parent]
        self._drop(victims)
        return len(victims)

    # -- hooks for persistent backends ----------------------------------------------------

    def _on_insert(self, node: Node, digest: bytes, new_blob: bool) -> None:
        """``node`` was stored; its body is blob ``digest`` (first reference when ``new_blob``)."""

    def _on_drop(self, key: bytes, freed_blob: bytes | None) -> None:
        """Node ``key`` (and its totals) left the index; ``freed_blob`` lost its last reference."""

    def _on_touch(self, key: bytes, now: float) -> None:
        """Node ``key`` was used at ``now``."""

    def _on_totals(self, leaf: bytes, totals: SessionTotals | None) -> None:
        """The totals of ``leaf`` changed (``None``: they moved away)."""

    # -- internals ------------------------------------------------------------------------

    def _add(
        self, node: Node, used: float, *, digest: bytes | None = None, notify: bool = True
    ) -> Node | None:
        """Store ``node`` if absent and its parent is present; returns the stored node.

        ``digest``: the body's blob hash when the caller verified it already.
        """
        if node.key in self._nodes:
            return None
        if node.depth == 0:
            if node.parent != node.tenant:
                return None
            tenant = self._tenants.setdefault(node.tenant, node.tenant)
            parent_key = tenant
        else:
            parent = self._nodes.get(node.parent)
            if parent is None or parent.depth != node.depth - 1 or parent.tenant != node.tenant:
                return None
            tenant = parent.tenant
            parent_key = parent.key
        if digest is None:
            digest = blob_hash(node.body)
        blob = self._blobs.get(digest)
        new_blob = blob is None
        if blob is None:
            # A tight copy: orjson's output (where bodies come from) keeps a 4 kB buffer
            # behind even a 60-byte message.
            blob = self._blobs[digest] = _Blob(bytes(memoryview(node.body)), 0)
            self._blob_bytes += len(node.body)
        blob.refs += 1
        if node.body is not blob.data or node.parent is not parent_key or node.tenant is not tenant:
            # The constructor, not dataclasses.replace: this runs for every node loaded.
            node = Node(
                key=node.key,
                parent=parent_key,
                tenant=tenant,
                depth=node.depth,
                role=sys.intern(node.role),
                identity=node.identity,
                body=blob.data,
                tokens=node.tokens,
                generated=node.generated,
                partial=node.partial,
                created=node.created,
            )
        self._nodes[node.key] = node
        _index_add(self._children, parent_key, node)
        _index_add(self._by_identity, (tenant, node.identity), node)
        self._used[node.key] = used
        if notify:
            self._on_insert(node, digest, new_blob)
        return node

    def _drop(self, victims: Iterable[tuple[Node, bytes]]) -> None:
        """Remove leaves (children before parents), batching list edits per index entry."""
        from_parent: dict[bytes, set[bytes]] = {}
        from_identity: dict[tuple[bytes, bytes], set[bytes]] = {}
        for node, digest in victims:
            key = node.key
            del self._nodes[key]
            del self._used[key]
            self._children.pop(key, None)
            from_parent.setdefault(node.parent, set()).add(key)
            from_identity.setdefault((node.tenant, node.identity), set()).add(key)
            if self._totals.pop(key, None) is not None:
                self._on_totals(key, None)
            blob = self._blobs[digest]
            blob.refs -= 1
            freed = None
            if blob.refs == 0:
                del self._blobs[digest]
                self._blob_bytes -= len(blob.data)
                freed = digest
            self._evicted += 1
            self._on_drop(key, freed)
        for parent, gone in from_parent.items():
            if not _index_remove(self._children, parent, gone) and parent in self._tenants:
                del self._tenants[parent]
        for ident, gone in from_identity.items():
            _index_remove(self._by_identity, ident, gone)


def _view(entry: Node | list[Node] | None) -> Sequence[Node]:
    if entry is None:
        return _NO_NODES
    if isinstance(entry, Node):
        return (entry,)
    return entry


def _index_add(index: dict[_K, Node | list[Node]], key: _K, node: Node) -> None:
    entry = index.get(key)
    if entry is None:
        index[key] = node
    elif isinstance(entry, Node):
        index[key] = [entry, node]
    else:
        entry.append(node)


def _index_remove(index: dict[_K, Node | list[Node]], key: _K, gone: set[bytes]) -> bool:
    """Remove the nodes keyed in ``gone`` from ``index[key]``; False when none is left."""
    # A new list rather than an edit in place: a caller may still hold the old sequence.
    kept = [n for n in _view(index.get(key)) if n.key not in gone]
    if len(kept) > 1:
        index[key] = kept
    elif kept:
        index[key] = kept[0]
    else:
        index.pop(key, None)
        return False
    return True


def _combine(a: SessionTotals | None, b: SessionTotals | None) -> SessionTotals:
    """The totals of two runs of turns, ``b`` being the later one."""
    if a is None:
        return SessionTotals() if b is None else replace(b)
    if b is None:
        return replace(a)
    created = [t for t in (a.created, b.created) if t]
    return SessionTotals(
        turns=a.turns + b.turns,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        cached_tokens=a.cached_tokens + b.cached_tokens,
        completion_tokens=a.completion_tokens + b.completion_tokens,
        unknown_cache_turns=a.unknown_cache_turns + b.unknown_cache_turns,
        cost_usd=a.cost_usd + b.cost_usd,
        billed=a.billed or b.billed,
        repaired=a.repaired + b.repaired,
        last_break=b.last_break or a.last_break,
        model=b.model or a.model,
        created=min(created) if created else 0.0,
        updated=max(a.updated, b.updated),
    )
