"""The in-memory transcript store: the hot index every backend keeps, and the ``memory`` backend.

Indexes (dicts, so every read is O(1) whatever the number of sessions):

- ``key -> Node``;
- ``parent -> children``, oldest first (a tenant root is the parent of element 0);
- ``(tenant, identity) -> nodes``;
  (both hold a lone Node, or a list once there are two);
- ``leaf -> SessionTotals``;
- ``key -> last use``;
- the leaves (nodes without stored children), least recently used first: what eviction
  takes, so it never walks past a parent and costs O(1) per evicted node.

Bodies are interned by content hash: nodes with equal bodies share one ``bytes``
object, so a 20 kB system prompt shared by 10 000 sessions is held once, and
:meth:`MemoryStore.stats` counts it once.

**The byte budget.** ``StoreStats.bytes`` is what the process holds for the store: every
Node with its key and identity, each distinct body once, and every index entry, each at
its measured size (see the constants below). It is kept current on every change, and
``max_bytes`` holds *at all times*: an insert or a session update that goes over the
budget evicts least-recently-used leaves at once, down to a low-water mark a little under
it (so a full store does not evict on every insert). A parent is never evicted before its
children. Unused-for-``ttl`` nodes are evicted only by :meth:`MemoryStore.evict` (a timer).

Persistent backends subclass :class:`MemoryStore` and override the ``_on_*``
hooks, which report every change of the index (see :mod:`proxy.store.sqlite`).
"""

from __future__ import annotations

import hashlib
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from .base import Node, SessionInfo, SessionTotals, StoreStats


def held(size: int) -> int:
    """Bytes that an object of ``sys.getsizeof`` ``size`` really occupies on CPython: pymalloc
    serves up to 512 bytes in 16-byte classes; larger blocks come from malloc (an 8-byte
    header, 16-byte alignment)."""
    return (size + 15) & ~15 if size <= 512 else (size + 8 + 15) & ~15


@dataclass(slots=True)
class _Blob:
    data: bytes
    refs: int


# Sizes measured on CPython 3.11 (x86-64): objects by ``sys.getsizeof`` on this interpreter,
# rounded by :func:`held`; dict entries with tracemalloc (tests/bench/store_flood.py
# re-measures the whole: accounted bytes against tracemalloc and RSS).
_KEY = held(sys.getsizeof(bytes(16)))
"""A 16-byte key or identity (64)."""
_NUMBER = max(held(sys.getsizeof(2**40)), held(sys.getsizeof(0.5)))
"""An int above 256 (small ints are shared) or a float (32)."""
_TUPLE2 = held(sys.getsizeof((b"", b"")))
"""The ``(tenant, identity)`` key of the by-identity index (64)."""
DICT_ENTRY = 96
"""One entry of a large dict. CPython keeps 2**k slots, at least 3 per live entry after a
resize, and every insert (deletions leave tombstones) uses one up: with 4-byte slot indices and
24-byte entries, a dict under churn costs 60-120 bytes per live entry (87 on average);
tracemalloc: 59-117 measured."""
LEAF_ENTRY = DICT_ENTRY + 72
"""One entry of the LRU of leaves, an OrderedDict: its dict entry, a 32-byte link node and
a slot of its node table (8 bytes per dict slot); tracemalloc: 117-195 measured under churn."""
NODE_OVERHEAD = held(sys.getsizeof(Node(b"", b"", b"", 0, "", b"", b""))) + 2 * _KEY + 2 * _NUMBER + 2 * DICT_ENTRY
"""Bytes per node beyond its body and its index entries: the Node (128), its key and identity,
its ``created`` and last-use floats (shared within one request, counted per node: a loaded
store has one each), and its entries in ``key -> Node`` and ``key -> last use`` (512 in all)."""
INDEX_ENTRY = DICT_ENTRY
"""A ``parent -> children`` or ``tenant root`` entry."""
IDENTITY_ENTRY = DICT_ENTRY + _TUPLE2
"""A ``(tenant, identity) -> nodes`` entry with its tuple key."""
BLOB_HASH_SIZE = 32
BLOB_OVERHEAD = held(sys.getsizeof(bytes(BLOB_HASH_SIZE))) + held(sys.getsizeof(_Blob(b"", 0))) + _NUMBER + DICT_ENTRY
"""Bytes per distinct body beyond :func:`held` of the ``bytes`` itself: its content hash, the
``_Blob`` record (48), its reference count and its dict entry (256)."""
SESSION_OVERHEAD = held(sys.getsizeof(SessionTotals())) + 7 * _NUMBER + DICT_ENTRY
"""Bytes per session beyond its ``model`` string: the SessionTotals (128), its seven
numbers that are not small ints, and its dict entry (448)."""
_LIST = sys.getsizeof([])
"""An empty list (56, with its GC header); each element adds a pointer."""

LOW_WATER_SHARE = 16
"""An eviction triggered by an insert frees ``max_bytes // LOW_WATER_SHARE`` (at most
``LOW_WATER_MAX``) below the budget, so a full store does not evict on every insert."""
LOW_WATER_MAX = 4 * 1024 * 1024
"""Cap of the eviction margin: one eviction's pause stays a few milliseconds."""


def blob_hash(body: bytes) -> bytes:
    """Content hash under which a body is interned (and persisted)."""
    return hashlib.blake2b(body, digest_size=BLOB_HASH_SIZE).digest()


def blob_cost(size: int) -> int:
    """Accounted bytes of one distinct body of ``size`` bytes."""
    return held(33 + size) + BLOB_OVERHEAD


def node_cost(node: Node) -> int:
    """Accounted bytes of one node, without its body and index entries."""
    cost = NODE_OVERHEAD
    if not -5 <= node.tokens <= 256:
        cost += _NUMBER
    if node.depth > 256:
        cost += _NUMBER
    return cost


def session_cost(totals: SessionTotals) -> int:
    """Accounted bytes of one session's totals."""
    return SESSION_OVERHEAD + (held(sys.getsizeof(totals.model)) if totals.model else 0)


def list_cost(length: int) -> int:
    """Accounted bytes of an index list of ``length`` nodes (0 for a lone Node): the list and,
    on average, the spare room ``list.append`` leaves (up to an eighth, plus 6 slots)."""
    return 0 if length < 2 else held(_LIST + 8 * (length + (length >> 4) + 3))


_NO_NODES: tuple[Node, ...] = ()
_K = TypeVar("_K", bytes, tuple[bytes, bytes])
_NEVER = float("-inf")


class MemoryStore:
    """A :class:`~proxy.store.base.TranscriptStore` held entirely in memory.

    ``ttl_seconds``: a node unused for this long is evicted (by :meth:`evict`). ``max_bytes``:
    the bound on :attr:`StoreStats.bytes`, kept after every insert and session update.
    ``secret``: keys tenant roots; ``None`` generates a random one for this instance.
    ``clock`` stamps inserts and session updates (injected by tests).
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
        # Exactly the nodes without stored children, least recently used first. An
        # OrderedDict: taking its first entry is O(1), where a plain dict's first entry is
        # found by skipping every entry deleted before it.
        self._leaves: OrderedDict[bytes, None] = OrderedDict()
        # Nodes hold the stored parent's key object and one interned tenant object,
        # so a loaded or re-built Node does not carry copies of either.
        self._tenants: dict[bytes, bytes] = {}
        self._blobs: dict[bytes, _Blob] = {}
        self._bytes = 0
        self._session_bytes = 0
        self._loaded = False
        """Nodes were added by a backend's load (in depth order, not in order of use)."""
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
        self._settle()
        return StoreStats(
            nodes=len(self._nodes),
            bytes=self._bytes,
            blobs=len(self._blobs),
            sessions=len(self._totals),
            corrupt=self._corrupt,
            evicted=self._evicted,
        )

    # -- writes ---------------------------------------------------------------------------

    def insert(self, nodes: Sequence[Node]) -> int:
        """Insert-if-absent, parents first; over the budget, LRU leaves go after each node."""
        self._settle()
        now = self._clock()
        added = 0
        for node in nodes:
            if self._add(node, now) is not None:
                added += 1
                if self._bytes > self._max_bytes:
                    self._evict(self._low_water(), _NEVER)
        return added

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        used, leaves = self._used, self._leaves
        for key in keys:
            last = used.get(key)
            if last is None or now < last:
                continue
            used[key] = now
            if key in leaves:
                leaves.move_to_end(key)
            self._on_touch(key, now)

    def add_turn(self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals) -> SessionTotals:
        """Add one turn to the session ending at ``leaf``; ``totals.turns`` counts as at least 1.

        Totals held at ``parent_leaf`` move to ``leaf`` (merged with any already there).
        When ``leaf`` is not stored, the combined totals are returned and nothing is kept.
        """
        self._settle()
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
            self._add_session_bytes(-session_cost(moved))
            self._on_totals(parent_leaf, None)
        # A new object every time: a persistent backend may be encoding the previous one.
        if current is not None:
            del self._totals[leaf]
            self._add_session_bytes(-session_cost(current))
        self._totals[leaf] = combined
        self._add_session_bytes(session_cost(combined))
        self._on_totals(leaf, combined)
        if self._bytes > self._max_bytes:
            self._evict(self._low_water(), _NEVER)
        return replace(combined)

    def evict(self, now: float) -> int:
        """Drop nodes unused for ``ttl`` and, over the budget, least-recently-used leaves.

        Leaves only: a parent becomes a candidate when its last child goes (a parent is never
        evicted before its children). Returns how many nodes went.
        """
        self._settle()
        return self._evict(self._max_bytes, now - self._ttl)

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

    def _low_water(self) -> int:
        budget = self._max_bytes
        return budget - max(1, min(budget // LOW_WATER_SHARE, LOW_WATER_MAX))

    def _add_session_bytes(self, delta: int) -> None:
        self._session_bytes += delta
        self._bytes += delta

    def _settle(self) -> None:
        """After a backend's load: order the leaves by last use and count the loaded totals."""
        if not self._loaded:
            return
        self._loaded = False
        used = self._used
        self._leaves = OrderedDict.fromkeys(sorted(self._leaves, key=used.__getitem__))
        counted = sum(session_cost(t) for t in self._totals.values())
        self._add_session_bytes(counted - self._session_bytes)

    def _add(
        self, node: Node, used: float, *, digest: bytes | None = None, notify: bool = True
    ) -> Node | None:
        """Store ``node`` if absent and its parent is present; returns the stored node.

        ``digest``: the body's blob hash when the caller verified it already. ``notify=False``
        is a backend's load: the hooks are not called, and the leaves are put in order of use
        (and the loaded totals counted) before the store is next used.
        """
        if node.key in self._nodes:
            return None
        if node.depth == 0:
            if node.parent != node.tenant:
                return None
            tenant = self._tenants.get(node.tenant)
            if tenant is None:
                tenant = self._tenants[node.tenant] = node.tenant
                self._bytes += INDEX_ENTRY
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
            # A tight copy: orjson's output (where bodies come from) keeps at least a 4 kB
            # buffer behind even a 60-byte message, and 8x the length of a long string.
            blob = self._blobs[digest] = _Blob(bytes(memoryview(node.body)), 0)
            self._bytes += blob_cost(len(blob.data))
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
        key = node.key
        self._nodes[key] = node
        self._used[key] = used
        leaves = self._leaves
        if leaves.pop(parent_key, self) is not self:
            self._bytes -= LEAF_ENTRY
        leaves[key] = None
        self._bytes += (
            node_cost(node)
            + LEAF_ENTRY
            + _index_add(self._children, parent_key, node, INDEX_ENTRY)
            + _index_add(self._by_identity, (tenant, node.identity), node, IDENTITY_ENTRY)
        )
        if notify:
            self._on_insert(node, digest, new_blob)
        else:
            self._loaded = True
        return node

    def _evict(self, target: int, cutoff: float) -> int:
        """Evict LRU leaves while over ``target`` bytes or while the LRU leaf was last used at or
        before ``cutoff``. O(1) per evicted node: the index lists are rebuilt once per run (and
        their bytes counted as each node goes)."""
        leaves, nodes, used, children = self._leaves, self._nodes, self._used, self._children
        by_identity, tenants = self._by_identity, self._tenants
        kids_left: dict[bytes, int] = {}
        ids_left: dict[tuple[bytes, bytes], int] = {}
        from_parent: dict[bytes, set[bytes]] = {}
        from_identity: dict[tuple[bytes, bytes], set[bytes]] = {}
        count = 0
        while leaves:
            key = next(iter(leaves))
            if self._bytes <= target and used[key] > cutoff:
                break
            del leaves[key]
            node = nodes.pop(key)
            del used[key]
            freed: bytes | None = None
            digest = blob_hash(node.body)
            blob = self._blobs[digest]
            blob.refs -= 1
            cost = node_cost(node) + LEAF_ENTRY
            if blob.refs == 0:
                del self._blobs[digest]
                cost += blob_cost(len(blob.data))
                freed = digest
            totals = self._totals.pop(key, None)
            if totals is not None:
                self._add_session_bytes(-session_cost(totals))
                self._on_totals(key, None)
            ident = (node.tenant, node.identity)
            from_identity.setdefault(ident, set()).add(key)
            left = ids_left.get(ident)
            left = (len(_view(by_identity.get(ident))) if left is None else left) - 1
            ids_left[ident] = left
            cost += list_cost(left + 1) - list_cost(left) + (IDENTITY_ENTRY if left == 0 else 0)
            parent = node.parent
            from_parent.setdefault(parent, set()).add(key)
            left = kids_left.get(parent)
            left = (len(_view(children.get(parent))) if left is None else left) - 1
            kids_left[parent] = left
            cost += list_cost(left + 1) - list_cost(left)
            if left == 0:
                cost += INDEX_ENTRY
                if node.depth > 0:
                    # Its last child went: it is a leaf now, and (used whenever a child was)
                    # older than every leaf still stored.
                    leaves[parent] = None
                    leaves.move_to_end(parent, last=False)
                    cost -= LEAF_ENTRY
                else:
                    del tenants[parent]
                    cost += INDEX_ENTRY
            self._bytes -= cost
            count += 1
            self._on_drop(key, freed)
        for parent, gone in from_parent.items():
            _index_remove(children, parent, gone)
        for ident, gone in from_identity.items():
            _index_remove(by_identity, ident, gone)
        self._evicted += count
        return count


def _view(entry: Node | list[Node] | None) -> Sequence[Node]:
    if entry is None:
        return _NO_NODES
    if isinstance(entry, Node):
        return (entry,)
    return entry


def _index_add(index: dict[_K, Node | list[Node]], key: _K, node: Node, entry_cost: int) -> int:
    """Add ``node`` under ``key``; returns the change of accounted bytes."""
    entry = index.get(key)
    if entry is None:
        index[key] = node
        return entry_cost
    if isinstance(entry, Node):
        index[key] = [entry, node]
        return list_cost(2)
    entry.append(node)
    n = len(entry)
    return list_cost(n) - list_cost(n - 1)


def _index_remove(index: dict[_K, Node | list[Node]], key: _K, gone: set[bytes]) -> None:
    """Remove the nodes keyed in ``gone`` from ``index[key]``."""
    # A new list rather than an edit in place: a caller may still hold the old sequence.
    kept = [n for n in _view(index.get(key)) if n.key not in gone]
    if len(kept) > 1:
        index[key] = kept
    elif kept:
        index[key] = kept[0]
    else:
        index.pop(key, None)


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
