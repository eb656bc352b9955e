"""What one process keeps of the shared Redis store: a cache of immutable nodes, and its counters.

Nodes are content-addressed and immutable, so a node read once is correct for ever: the
cache answers a view's reads without a round trip whatever other processes write. It is
bounded by bytes (least recently used out first) and interns bodies by content hash, so a
system prompt shared by many sessions (or tenants) is held once per process. The counters
are this process's, read at scrape time, never from Redis.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ...core.model import Node

__all__ = ["CACHE_NODE_OVERHEAD", "NodeCache", "RedisCounters"]

CACHE_NODE_OVERHEAD = 600
"""Bytes a cached node costs beyond its body (the Node, its key, identity and LRU entry)."""


@dataclass(slots=True, kw_only=True)
class _Blob:
    data: bytes
    refs: int


class NodeCache:
    """A least-recently-used cache of immutable nodes, bounded by bytes; bodies interned by hash."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._nodes: OrderedDict[bytes, tuple[Node, bytes]] = OrderedDict()
        self._blobs: dict[bytes, _Blob] = {}
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def blobs(self) -> int:
        return len(self._blobs)

    def get(self, key: bytes) -> Node | None:
        entry = self._nodes.get(key)
        if entry is None:
            return None
        self._nodes.move_to_end(key)
        return entry[0]

    def blob(self, digest: bytes) -> bytes | None:
        entry = self._blobs.get(digest)
        return None if entry is None else entry.data

    def put(self, node: Node, digest: bytes) -> Node:
        """Cache ``node`` (whose body hashes to ``digest``); returns the cached node."""
        held = self._nodes.get(node.key)
        if held is not None:
            self._nodes.move_to_end(node.key)
            return held[0]
        if self.max_bytes <= 0:
            return node
        blob = self._blobs.get(digest)
        if blob is None:
            blob = self._blobs[digest] = _Blob(data=node.body, refs=0)
            self.bytes += len(node.body)
        blob.refs += 1
        if node.body is not blob.data:
            node = Node(
                key=node.key,
                parent=node.parent,
                tenant=node.tenant,
                depth=node.depth,
                role=node.role,
                identity=node.identity,
                body=blob.data,
                tokens=node.tokens,
                generated=node.generated,
                partial=node.partial,
                created=node.created,
            )
        self._nodes[node.key] = (node, digest)
        self.bytes += CACHE_NODE_OVERHEAD
        while self.bytes > self.max_bytes and len(self._nodes) > 1:
            _, (_, old_digest) = self._nodes.popitem(last=False)
            self.bytes -= CACHE_NODE_OVERHEAD
            entry = self._blobs[old_digest]
            entry.refs -= 1
            if entry.refs == 0:
                del self._blobs[old_digest]
                self.bytes -= len(entry.data)
            self.evicted += 1
        return node


@dataclass(slots=True, kw_only=True)
class RedisCounters:
    """Cheap local counters of one :class:`~proxy.store.redis.store.RedisStore` (read at scrape time)."""

    hits: int = 0
    """View reads answered by the process cache."""
    misses: int = 0
    """Lookups sent to Redis by fills (nodes, children lists, identity lists)."""
    fills: int = 0
    """Fill round trips."""
    writes: int = 0
    """Turn writes (and inserts, add_turns) that reached Redis."""
    healed: int = 0
    """Path nodes re-inserted from the process cache after Redis lost them."""
    corrupt: int = 0
    """Records or bodies that failed to decode or verify (each a miss)."""
    errors: int = 0
    """Calls that raised :class:`StoreError` (including those refused while degraded)."""
