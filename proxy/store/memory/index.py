"""The node tables of a memory store, and the bytes they hold: insert-if-absent, uses and the leaves LRU,
token counts filled in, removing leaves.

Indexes (dicts, so every read is O(1) whatever the number of sessions):

- ``nodes``: key -> Node;
- ``children``: parent -> children, oldest first (a tenant root is the parent of element 0);
- ``by_identity``: (tenant, identity) -> nodes;
  (both hold a lone Node, or a list once there are two: most parents have one child and
  most identities one node, and a list per entry would cost ~90 bytes);
- ``used``: key -> last use;
- ``leaves``: exactly the nodes without stored children, least recently used first: what
  eviction takes (:mod:`proxy.store.memory.eviction`), so it never walks past a parent and
  costs O(1) per evicted node. An OrderedDict: taking its first entry is O(1), where a
  plain dict's first entry is found by skipping every entry deleted before it;
- ``tenants``, ``blobs``: one interned object per tenant root and per distinct body, so a
  loaded or re-built Node does not carry copies of either, and a 20 kB system prompt shared
  by 10 000 sessions is held (and counted) once.

``bytes`` is kept current on every change, at the sizes of :mod:`proxy.store.memory.costs`.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from ...core.model import Node
from .costs import (
    IDENTITY_ENTRY,
    INDEX_ENTRY,
    LEAF_ENTRY,
    Blob,
    blob_cost,
    blob_hash,
    list_cost,
    node_cost,
)

__all__ = ["NodeIndex", "Removal", "entries"]

_NO_NODES: tuple[Node, ...] = ()
_K = TypeVar("_K", bytes, tuple[bytes, bytes])


def entries(entry: Node | list[Node] | None) -> Sequence[Node]:
    """An index value as a sequence (read-only by contract)."""
    if entry is None:
        return _NO_NODES
    if isinstance(entry, Node):
        return (entry,)
    return entry


class NodeIndex:
    """Every stored node, indexed for the planner's reads, with the bytes the tables hold."""

    __slots__ = ("blobs", "by_identity", "bytes", "children", "leaves", "loaded", "nodes", "tenants", "used")

    def __init__(self) -> None:
        self.nodes: dict[bytes, Node] = {}
        self.children: dict[bytes, Node | list[Node]] = {}
        self.by_identity: dict[tuple[bytes, bytes], Node | list[Node]] = {}
        self.used: dict[bytes, float] = {}
        self.leaves: OrderedDict[bytes, None] = OrderedDict()
        self.tenants: dict[bytes, bytes] = {}
        self.blobs: dict[bytes, Blob] = {}
        self.bytes = 0
        self.loaded = False
        """Nodes were added by :meth:`load` (in depth order, not in order of use) since :meth:`settle`."""

    def path(self, leaf: bytes) -> list[Node]:
        """The nodes from element 0 down to ``leaf``; empty when any is missing."""
        nodes = self.nodes
        node = nodes.get(leaf)
        out: list[Node] = []
        while node is not None:
            out.append(node)
            if node.depth == 0:
                out.reverse()
                return out
            node = nodes.get(node.parent)
        return []

    def add(
        self, node: Node, used: float, digest: bytes | None = None, *, tight: bool = False
    ) -> tuple[Node, bytes, bool] | None:
        """Store ``node`` if absent and its parent is present (a tenant root for element 0).

        Returns the stored node (holding the parent's key, the tenant and the body objects
        already held), its body's blob hash, and whether that body is new here; None when
        nothing was stored. ``digest``: the body's blob hash when the caller verified it already.
        ``tight``: the body is an exact-size copy already (:func:`~proxy.core.identity.tight`),
        held as it is; a node that holds its parent's key, its tenant and such a new body is
        stored itself, not rebuilt.
        """
        nodes = self.nodes
        if node.key in nodes:
            return None
        if node.depth == 0:
            if node.parent != node.tenant:
                return None
            tenant = self.tenants.get(node.tenant)
            if tenant is None:
                tenant = self.tenants[node.tenant] = node.tenant
                self.bytes += INDEX_ENTRY
            parent_key = tenant
        else:
            parent = nodes.get(node.parent)
            if parent is None or parent.depth != node.depth - 1 or parent.tenant != node.tenant:
                return None
            tenant = parent.tenant
            parent_key = parent.key
        if digest is None:
            digest = blob_hash(node.body)
        blob, new_blob = self._intern(node.body, digest, tight)
        if node.body is not blob.data or node.parent is not parent_key or node.tenant is not tenant:
            node = _holding(node, parent_key, tenant, blob.data)
        key = node.key
        nodes[key] = node
        self.used[key] = used
        leaves = self.leaves
        if leaves.pop(parent_key, self) is not self:
            self.bytes -= LEAF_ENTRY
        leaves[key] = None
        self.bytes += (
            node_cost(node)
            + LEAF_ENTRY
            + _index_add(self.children, parent_key, node, INDEX_ENTRY)
            + _index_add(self.by_identity, (tenant, node.identity), node, IDENTITY_ENTRY)
        )
        return node, digest, new_blob

    def _intern(self, body: bytes, digest: bytes, tight: bool = False) -> tuple[Blob, bool]:
        """The held copy of ``body`` (one more reference to it; ``tight``: ``body`` itself when
        new), and whether it is new."""
        blob = self.blobs.get(digest)
        if blob is not None:
            blob.refs += 1
            return blob, False
        # A tight copy: orjson's output (where bodies come from) keeps at least a 4 kB
        # buffer behind even a 60-byte message, and 8x the length of a long string.
        blob = self.blobs[digest] = Blob(data=body if tight else bytes(memoryview(body)), refs=1)
        self.bytes += blob_cost(len(blob.data))
        return blob, True

    def load(self, node: Node, used: float, digest: bytes) -> bool:
        """Add a persisted node (parents first; ``digest`` its verified body hash). False when it
        cannot be stored (its parent is missing). The leaves are put in order of use by :meth:`settle`."""
        if self.add(node, used, digest) is None:
            return False
        self.loaded = True
        return True

    def settle(self) -> None:
        """After a backend's load (nodes come in depth order): the leaves, and the last-use table,
        from the least recently used to the most."""
        if not self.loaded:
            return
        self.loaded = False
        used = self.used
        self.used = dict(sorted(used.items(), key=lambda item: item[1]))
        self.leaves = OrderedDict.fromkeys(sorted(self.leaves, key=used.__getitem__))

    def touch(self, keys: Sequence[bytes], now: float, hook: Callable[[bytes, float], None] | None) -> None:
        """``keys`` were used at ``now``: each stored one not used later already takes ``now`` as
        its last use (a leaf moves to the LRU's end), and ``hook(key, now)`` is told of it."""
        used, leaves = self.used, self.leaves
        for key in keys:
            last = used.get(key)
            if last is None or now < last:
                continue
            used[key] = now
            if key in leaves:
                leaves.move_to_end(key)
            if hook is not None:
                hook(key, now)

    def fill_tokens(self, key: bytes, tokens: int) -> bool:
        """Give the node ``key``, stored uncounted (``tokens < 0``), its token count: it is replaced,
        in every index, by the same node with its count. False when nothing changed (not stored,
        counted already, or ``tokens`` is no count)."""
        node = self.nodes.get(key)
        if node is None or node.tokens >= 0 or tokens < 0:
            return False
        counted = node.with_tokens(tokens)
        self.nodes[key] = counted
        _swap(self.children, node.parent, node, counted)
        _swap(self.by_identity, (node.tenant, node.identity), node, counted)
        self.bytes += node_cost(counted) - node_cost(node)
        return True


class Removal:
    """One run of leaf removals. Each node's bytes are accounted as it goes; the children and
    identity lists it was in are rebuilt once, in :meth:`finish`: O(1) per removed node."""

    __slots__ = ("_from_identity", "_from_parent", "_ids_left", "_index", "_kids_left", "raised")

    def __init__(self, index: NodeIndex) -> None:
        self._index = index
        self._kids_left: dict[bytes, int] = {}
        self._ids_left: dict[tuple[bytes, bytes], int] = {}
        self._from_parent: dict[bytes, set[bytes]] = {}
        self._from_identity: dict[tuple[bytes, bytes], set[bytes]] = {}
        self.raised: dict[bytes, float] = {}
        """Parents whose last use was raised to a removed child's (see :meth:`remove`)."""

    def remove(self, key: bytes) -> bytes | None:
        """Remove the leaf ``key``; returns the hash of the body it held last (freed), or None.
        A parent whose last child went becomes a leaf, older than every leaf still stored."""
        index = self._index
        del index.leaves[key]
        node = index.nodes.pop(key)
        last_used = index.used.pop(key)
        if node.depth > 0:
            # A request touches only the deepest node of its path (MemoryStore.touch): a parent's
            # last use is the latest of its own and its children's, carried up as they go, so it
            # is what touching every node of every path would have made it when it becomes a leaf.
            parent_used = index.used.get(node.parent)
            if parent_used is not None and parent_used < last_used:
                index.used[node.parent] = last_used
                self.raised[node.parent] = last_used
        freed: bytes | None = None
        digest = blob_hash(node.body)
        blob = index.blobs[digest]
        blob.refs -= 1
        cost = node_cost(node) + LEAF_ENTRY
        if blob.refs == 0:
            del index.blobs[digest]
            cost += blob_cost(len(blob.data))
            freed = digest
        ident = (node.tenant, node.identity)
        self._from_identity.setdefault(ident, set()).add(key)
        left = self._ids_left.get(ident)
        left = (len(entries(index.by_identity.get(ident))) if left is None else left) - 1
        self._ids_left[ident] = left
        cost += list_cost(left + 1) - list_cost(left) + (IDENTITY_ENTRY if left == 0 else 0)
        parent = node.parent
        self._from_parent.setdefault(parent, set()).add(key)
        left = self._kids_left.get(parent)
        left = (len(entries(index.children.get(parent))) if left is None else left) - 1
        self._kids_left[parent] = left
        cost += list_cost(left + 1) - list_cost(left)
        if left == 0:
            cost += INDEX_ENTRY
            if node.depth > 0:
                # Its last child went: it is a leaf now, and (used whenever a child was)
                # older than every leaf still stored.
                index.leaves[parent] = None
                index.leaves.move_to_end(parent, last=False)
                cost -= LEAF_ENTRY
            else:
                del index.tenants[parent]
                cost += INDEX_ENTRY
        index.bytes -= cost
        return freed

    def finish(self) -> None:
        """Rebuild the index lists the removed nodes were in."""
        for parent, gone in self._from_parent.items():
            _index_remove(self._index.children, parent, gone)
        for ident, gone_ids in self._from_identity.items():
            _index_remove(self._index.by_identity, ident, gone_ids)


def _holding(node: Node, parent_key: bytes, tenant: bytes, body: bytes) -> Node:
    """``node`` rebuilt to hold the index's own objects: its parent's key, its tenant and its body
    (interned), and its role interned."""
    # The constructor, not dataclasses.replace: this runs for every node loaded.
    return Node(
        key=node.key,
        parent=parent_key,
        tenant=tenant,
        depth=node.depth,
        role=sys.intern(node.role),
        identity=node.identity,
        body=body,
        tokens=node.tokens,
        generated=node.generated,
        partial=node.partial,
        created=node.created,
    )


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
    kept = [n for n in entries(index.get(key)) if n.key not in gone]
    if len(kept) > 1:
        index[key] = kept
    elif kept:
        index[key] = kept[0]
    else:
        index.pop(key, None)


def _swap(index: dict[_K, Node | list[Node]], key: _K, old: Node, new: Node) -> None:
    """Put ``new`` where ``old`` is in ``index[key]`` (a lone node, or a list searched from its
    newest end, where a node just written is)."""
    entry = index.get(key)
    if entry is old:
        index[key] = new
    elif isinstance(entry, list):
        for i in range(len(entry) - 1, -1, -1):
            if entry[i] is old:
                entry[i] = new
                return
