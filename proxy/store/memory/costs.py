"""What a memory store's contents cost in bytes: the sizes behind ``StoreStats.bytes`` and ``max_bytes``.

``StoreStats.bytes`` is what the process holds for the store: every Node with its key and
identity, each distinct body once, and every index entry, each at its measured size. The
sizes are measured on CPython 3.11 (x86-64): objects by ``sys.getsizeof`` on this
interpreter, rounded by :func:`held`; dict entries with tracemalloc
(``tests/bench/store_flood.py`` re-measures the whole: accounted bytes against tracemalloc
and RSS). Bodies are interned by their content hash (:func:`blob_hash`), so a body shared by
many nodes is counted once.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

from ...core.model import Node, SessionTotals

__all__ = [
    "BLOB_HASH_SIZE",
    "BLOB_OVERHEAD",
    "DICT_ENTRY",
    "IDENTITY_ENTRY",
    "INDEX_ENTRY",
    "LEAF_ENTRY",
    "NODE_OVERHEAD",
    "SESSION_OVERHEAD",
    "Blob",
    "blob_cost",
    "blob_hash",
    "held",
    "list_cost",
    "node_cost",
    "session_cost",
]


def held(size: int) -> int:
    """Bytes that an object of ``sys.getsizeof`` ``size`` really occupies on CPython: pymalloc
    serves up to 512 bytes in 16-byte classes; larger blocks come from malloc (an 8-byte
    header, 16-byte alignment)."""
    return (size + 15) & ~15 if size <= 512 else (size + 8 + 15) & ~15


@dataclass(slots=True, kw_only=True)
class Blob:
    """One interned body and how many stored nodes hold it."""

    data: bytes
    refs: int


_KEY = held(sys.getsizeof(bytes(16)))
"""A 16-byte key or identity (64)."""
NUMBER = max(held(sys.getsizeof(2**40)), held(sys.getsizeof(0.5)))
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
_NODE = Node(key=b"", parent=b"", tenant=b"", depth=0, role="", identity=b"", body=b"")
NODE_OVERHEAD = held(sys.getsizeof(_NODE)) + 2 * _KEY + 2 * NUMBER + 2 * DICT_ENTRY
"""Bytes per node beyond its body and its index entries: the Node (128), its key and identity,
its ``created`` and last-use floats (shared within one request, counted per node: a loaded
store has one each), and its entries in ``key -> Node`` and ``key -> last use`` (512 in all)."""
INDEX_ENTRY = DICT_ENTRY
"""A ``parent -> children`` or ``tenant root`` entry."""
IDENTITY_ENTRY = DICT_ENTRY + _TUPLE2
"""A ``(tenant, identity) -> nodes`` entry with its tuple key."""
BLOB_HASH_SIZE = 32
BLOB_OVERHEAD = held(sys.getsizeof(bytes(BLOB_HASH_SIZE))) + held(sys.getsizeof(Blob(data=b"", refs=0))) + NUMBER + DICT_ENTRY
"""Bytes per distinct body beyond :func:`held` of the ``bytes`` itself: its content hash, the
:class:`Blob` record (48), its reference count and its dict entry (256)."""
SESSION_OVERHEAD = held(sys.getsizeof(SessionTotals())) + 7 * NUMBER + DICT_ENTRY
"""Bytes per session beyond its ``model`` string: the SessionTotals (128), its seven
numbers that are not small ints, and its dict entry (448)."""
_LIST = sys.getsizeof([])
"""An empty list (56, with its GC header); each element adds a pointer."""


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
        cost += NUMBER
    if node.depth > 256:
        cost += NUMBER
    return cost


def session_cost(totals: SessionTotals) -> int:
    """Accounted bytes of one session's totals."""
    return SESSION_OVERHEAD + (held(sys.getsizeof(totals.model)) if totals.model else 0)


def list_cost(length: int) -> int:
    """Accounted bytes of an index list of ``length`` nodes (0 for a lone Node): the list and,
    on average, the spare room ``list.append`` leaves (up to an eighth, plus 6 slots)."""
    return 0 if length < 2 else held(_LIST + 8 * (length + (length >> 4) + 3))
