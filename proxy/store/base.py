"""The transcript store's contract: :class:`Node`, :class:`SessionTotals` and the :class:`TranscriptStore` Protocol.

A transcript is a path in a tree. Element 0 of every request is the ``tools``
array (a pseudo-message with role ``"tools"``, present even when the request
has no tools), elements 1.. are the messages. Each element's node is keyed by
its chain hash ``c_i = H(c_{i-1} || identity_i)``; ``c_{-1}`` is the tenant
root (an HMAC of the credential), so tenants never share nodes.

Reads (``get``, ``children``, ``path``) are synchronous and served from memory:
every backend keeps a hot in-memory index, so the request path does no I/O.
Persistence (sqlite, later redis) happens off the event loop, in batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

ROLE_TOOLS = "tools"
"""Role of the pseudo-element 0 that holds a request's ``tools`` array."""


@dataclass(frozen=True, slots=True)
class Node:
    """One element of a stored transcript, in the canonical form the provider first saw."""

    key: bytes
    """Chain hash of this element (16 bytes)."""
    parent: bytes
    """Chain hash of the previous element; the tenant root for element 0."""
    tenant: bytes
    """The tenant root (keyed hash of the credential; never the raw credential)."""
    depth: int
    """Position in the request: 0 = the tools pseudo-element, 1.. = messages[depth - 1]."""
    role: str
    """``"tools"`` or the message role."""
    identity: bytes
    """Identity of the element (16 bytes): ``key == chain(parent, identity)``."""
    body: bytes
    """Canonical JSON (orjson) of the element as forwarded upstream, or as generated:
    the message object, or for role ``"tools"`` the tools array (``[]`` when absent)."""
    tokens: int = 0
    """Token count of ``body`` (tiktoken cl100k), computed once when the node is created."""
    generated: bool = False
    """An assistant reply kvwarm observed from the upstream (its body is the generated strings)."""
    partial: bool = False
    """A generated reply whose stream ended before completion (what the client was delivered)."""
    created: float = 0.0
    """Unix time of creation."""


@dataclass(slots=True)
class SessionTotals:
    """Running totals of one session (a leaf path); they move down to the new leaf as a path grows."""

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Only from responses that reported a cached count; see ``unknown_cache_turns``."""
    completion_tokens: int = 0
    unknown_cache_turns: int = 0
    """Turns whose response did not say how many prompt tokens were cached."""
    cost_usd: float = 0.0
    billed: bool = False
    """True when any of the cost was billed by the provider rather than estimated."""
    repaired: int = 0
    last_break: str = ""
    model: str = ""
    created: float = 0.0
    updated: float = 0.0


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session as listed by the admin API: its leaf, totals and depth."""

    leaf: bytes
    tenant: bytes
    depth: int
    totals: SessionTotals = field(default_factory=SessionTotals)


@dataclass(frozen=True, slots=True)
class StoreStats:
    nodes: int
    bytes: int
    """Approximate bytes held: node bodies counted once per distinct blob, plus per-node overhead."""
    blobs: int
    sessions: int
    corrupt: int
    """Entries that failed to decode or verify since start (each one a counted miss)."""
    evicted: int


@runtime_checkable
class NodeReader(Protocol):
    """The read side the pure core needs. Synchronous: served from memory."""

    def get(self, key: bytes) -> Node | None: ...

    def children(self, key: bytes) -> Sequence[Node]:
        """Stored children of ``key`` (a node key or a tenant root), oldest first."""
        ...

    def by_identity(self, tenant: bytes, identity: bytes) -> Sequence[Node]:
        """Stored nodes of ``tenant`` whose element identity is ``identity`` (any depth)."""
        ...


@runtime_checkable
class TranscriptStore(NodeReader, Protocol):
    """A tree of transcript nodes. Insert-if-absent: concurrent writers converge."""

    async def open(self) -> None:
        """Load persisted state (off the event loop) and start background writers."""
        ...

    async def close(self) -> None:
        """Flush pending writes and release resources."""
        ...

    async def flush(self) -> None:
        """Persist every pending write now."""
        ...

    def insert(self, nodes: Sequence[Node]) -> int:
        """Insert nodes whose key is absent (parents before children); returns how many were new.

        A node whose parent is neither stored nor earlier in ``nodes`` (and is not a tenant
        root, i.e. ``depth > 0``) is skipped.
        """
        ...

    def touch(self, keys: Sequence[bytes], now: float) -> None:
        """Mark nodes as used (TTL and LRU are measured from the last use)."""
        ...

    def path(self, leaf: bytes) -> list[Node]:
        """The nodes from element 0 down to ``leaf``; empty when any is missing."""
        ...

    def add_turn(self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals) -> SessionTotals:
        """Add one turn's numbers to the session ending at ``leaf``.

        ``parent_leaf`` is the deepest previously stored node of the request path; if it
        holds totals (it was a session's leaf), they move to ``leaf`` first. Returns the new totals.
        """
        ...

    def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        """Sessions (leaves holding totals), optionally of one tenant, most recently updated first."""
        ...

    def totals(self, leaf: bytes) -> SessionTotals | None: ...

    def evict(self, now: float) -> int:
        """Drop nodes unused for ``ttl`` and, over the byte budget, LRU leaves first. Returns count."""
        ...

    def stats(self) -> StoreStats: ...

    def secret(self) -> bytes:
        """The server secret keying tenant roots (configured, or generated once and persisted)."""
        ...
