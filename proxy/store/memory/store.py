"""The in-memory transcript store: the hot index every local backend keeps, and the ``memory`` backend.

:class:`MemoryStore` is the :class:`~proxy.store.base.TranscriptStore` whose whole index is
in this process, made of these parts, each in its own module:

``index``      the node tables (by key, by parent, by identity, last use, the leaves LRU,
               interned tenants and bodies), the bytes they hold, and every change to them:
               insert-if-absent, uses, token counts filled in, a backend's load
``sessions``   the session totals at each session's leaf
``eviction``   which nodes go: LRU leaves first, by TTL and by the byte budget
``costs``      what each of those costs in bytes (the accounting)

The store itself keeps the budget, tells a backend of every change, and answers the contract.

**The byte budget.** ``StoreStats.bytes`` is what the process holds for the store, kept
current on every change, and ``max_bytes`` holds *at all times*: an insert or a session
update that goes over the budget evicts least-recently-used leaves at once. A parent is
never evicted before its children. Unused-for-``ttl`` nodes are evicted only by
:meth:`MemoryStore.evict` (a timer).

Persistent backends subclass :class:`MemoryStore`, load through :meth:`MemoryStore._load_node`
and :meth:`MemoryStore._load_totals`, and override the ``_on_*`` hooks, which report every
change of the index (see :mod:`proxy.store.sqlite.store`).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from mypy_extensions import mypyc_attr

from ..base import Node, SessionInfo, SessionTotals, StoreStats
from .costs import (
    BLOB_HASH_SIZE,
    BLOB_OVERHEAD,
    DICT_ENTRY,
    IDENTITY_ENTRY,
    INDEX_ENTRY,
    LEAF_ENTRY,
    NODE_OVERHEAD,
    SESSION_OVERHEAD,
    Blob,
    blob_cost,
    blob_hash,
    held,
    list_cost,
    node_cost,
    session_cost,
)
from .eviction import LOW_WATER_MAX, LOW_WATER_SHARE, evict_leaves, low_water
from .index import NodeIndex, entries
from .sessions import SessionTable, copy_totals

__all__ = [
    "BLOB_HASH_SIZE",
    "BLOB_OVERHEAD",
    "DICT_ENTRY",
    "IDENTITY_ENTRY",
    "INDEX_ENTRY",
    "LEAF_ENTRY",
    "LOW_WATER_MAX",
    "LOW_WATER_SHARE",
    "NODE_OVERHEAD",
    "SESSION_OVERHEAD",
    "MemoryStore",
    "blob_cost",
    "blob_hash",
    "held",
    "list_cost",
    "node_cost",
    "session_cost",
]

_NEVER = float("-inf")


@mypyc_attr(allow_interpreted_subclasses=True)  # SqliteStore and the tests subclass it (proxy/native.py)
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
        self._index = NodeIndex()
        self._sessions = SessionTable()
        self._corrupt = 0
        self._evicted = 0
        self._touch_hook = None if type(self)._on_touch is MemoryStore._on_touch else self._on_touch
        """The backend's ``_on_touch`` (None: nothing to call for each node of each request's path)."""

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
        return self._index.nodes.get(key)

    def children(self, key: bytes) -> Sequence[Node]:
        """Children of ``key``, oldest first. The sequence is read-only by contract."""
        return entries(self._index.children.get(key))

    def by_identity(self, tenant: bytes, identity: bytes) -> Sequence[Node]:
        return entries(self._index.by_identity.get((tenant, identity)))

    def path(self, leaf: bytes) -> list[Node]:
        return self._index.path(leaf)

    def totals(self, leaf: bytes) -> SessionTotals | None:
        return self._sessions.get(leaf)

    def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        return self._sessions.listing(self._index.nodes, tenant)

    def stats(self) -> StoreStats:
        index = self._index
        index.settle()
        return StoreStats(
            nodes=len(index.nodes),
            bytes=self._bytes,
            blobs=len(index.blobs),
            sessions=len(self._sessions.totals),
            corrupt=self._corrupt,
            evicted=self._evicted,
        )

    # -- writes ---------------------------------------------------------------------------

    def insert(self, nodes: Sequence[Node], *, tight: bool = False) -> int:
        """Insert-if-absent, parents first; over the budget, LRU leaves go after each node.
        ``tight``: every body is an exact-size copy already (a turn's new nodes), kept as it is."""
        index = self._index  # (its method called on it: a bound method kept aside is a Python call)
        index.settle()
        now = self._clock()
        added = 0
        for node in nodes:
            stored = index.add(node, now, tight=tight)
            if stored is not None:
                added += 1
                self._on_insert(stored[0], stored[1], stored[2])
                if self._bytes > self._max_bytes:
                    self._evict(low_water(self._max_bytes), _NEVER)
        return added

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """``keys`` were used at ``now``. Touching the deepest node of a path is enough: a parent
        is evicted only after its children, and takes the latest use of theirs as they go."""
        self._index.touch(keys, now, self._touch_hook)

    @property
    def fills_tokens(self) -> bool:
        """Nodes may be stored uncounted and their token counts filled in when read
        (:meth:`fill_tokens`): this store keeps them (memory), or persists the fill (a backend
        that implements ``_on_tokens``)."""
        return type(self) is MemoryStore or type(self)._on_tokens is not MemoryStore._on_tokens

    def fill_tokens(self, counts: Mapping[bytes, int]) -> int:
        """Give stored nodes written uncounted (``tokens < 0``) their token counts: each is
        replaced, in every index, by the same node with its count. Returns how many were filled."""
        index = self._index
        filled = 0
        for key, tokens in counts.items():
            if index.fill_tokens(key, tokens):
                self._on_tokens(key, tokens)
                filled += 1
        return filled

    def last_session(self, keys: Sequence[bytes]) -> bytes | None:
        """The deepest of ``keys`` that is a session's leaf (holds totals), without copying them."""
        return self._sessions.last_leaf(keys)

    def add_turn(self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals) -> SessionTotals:
        """Add one turn to the session ending at ``leaf``; ``totals.turns`` counts as at least 1.

        Totals held at ``parent_leaf`` move to ``leaf`` (merged with any already there).
        When ``leaf`` is not stored, the combined totals are returned and nothing is kept.
        """
        combined, kept = self.count_turn(leaf, parent_leaf, totals)
        return copy_totals(combined) if kept else combined

    def count_turn(self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals) -> tuple[SessionTotals, bool]:
        """:meth:`add_turn` without the copy: the combined totals (the table's own object when
        kept: read only) and whether they were kept. The request path's write, which reads nothing back."""
        self._index.settle()
        stored = leaf in self._index.nodes
        combined, moved_from = self._sessions.add(leaf, parent_leaf, totals, self._clock(), keep=stored)
        if not stored:
            return combined, False
        if moved_from is not None:
            self._on_totals(moved_from, None)
        self._on_totals(leaf, combined)
        if self._bytes > self._max_bytes:
            self._evict(low_water(self._max_bytes), _NEVER)
        return combined, True

    def evict(self, now: float) -> int:
        """Drop nodes unused for ``ttl`` and, over the budget, least-recently-used leaves.

        Leaves only: a parent becomes a candidate when its last child goes (a parent is never
        evicted before its children). Returns how many nodes went.
        """
        self._index.settle()
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

    def _on_tokens(self, key: bytes, tokens: int) -> None:
        """Node ``key``, stored uncounted, has its token count now (see :attr:`fills_tokens`)."""

    # -- loading, for persistent backends (the hooks are not called) ----------------------

    def _load_node(self, node: Node, used: float, digest: bytes) -> bool:
        """Add a persisted node (parents first; ``digest`` its verified body hash). False when it
        cannot be stored (its parent is missing). The leaves are put in order of use before the
        store is next used."""
        return self._index.load(node, used, digest)

    def _load_totals(self, leaf: bytes, totals: SessionTotals) -> bool:
        """Set persisted totals (oldest first); False when their leaf is not stored."""
        if leaf not in self._index.nodes:
            return False
        self._sessions.put(leaf, totals)
        return True

    # -- internals ------------------------------------------------------------------------

    @property
    def _bytes(self) -> int:
        return self._index.bytes + self._sessions.bytes

    def _evict(self, target: int, cutoff: float) -> int:
        count = evict_leaves(self._index, self._sessions, target, cutoff, self._gone, self._touch_hook)
        self._evicted += count
        return count

    def _gone(self, key: bytes, freed_blob: bytes | None, had_totals: bool) -> None:
        if had_totals:
            self._on_totals(key, None)
        self._on_drop(key, freed_blob)

    # The tables by their own names: tests check the index against them.

    @property
    def _nodes(self) -> dict[bytes, Node]:
        return self._index.nodes

    @property
    def _children(self) -> dict[bytes, Node | list[Node]]:
        return self._index.children

    @property
    def _by_identity(self) -> dict[tuple[bytes, bytes], Node | list[Node]]:
        return self._index.by_identity

    @property
    def _used(self) -> dict[bytes, float]:
        return self._index.used

    @property
    def _leaves(self) -> OrderedDict[bytes, None]:
        return self._index.leaves

    @property
    def _tenants(self) -> dict[bytes, bytes]:
        return self._index.tenants

    @property
    def _blobs(self) -> dict[bytes, Blob]:
        return self._index.blobs

    @property
    def _totals(self) -> dict[bytes, SessionTotals]:
        return self._sessions.totals
