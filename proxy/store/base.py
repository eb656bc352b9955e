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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..core.model import ROLE_TOOLS, Node, NodeReader, SessionTotals, TurnWrite

if TYPE_CHECKING:
    from .tokens import TokenCounter, TokenCounts

__all__ = [
    "ROLE_TOOLS",
    "AsyncStore",
    "Lookups",
    "Node",
    "NodeReader",
    "SessionInfo",
    "SessionTotals",
    "StoreStats",
    "StoreView",
    "TranscriptStore",
    "TurnWrite",
]

@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    """A session as listed by the admin API: its leaf, totals and depth."""

    leaf: bytes
    tenant: bytes
    depth: int
    totals: SessionTotals = field(default_factory=SessionTotals)


@dataclass(frozen=True, slots=True, kw_only=True)
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


# -- the request path's view of a store: local or shared ------------------------------------


@dataclass(slots=True, kw_only=True)
class Lookups:
    """What a plan asked a :class:`StoreView` for that the view could not answer from memory."""

    keys: set[bytes] = field(default_factory=set)
    """Nodes by key."""
    children: set[bytes] = field(default_factory=set)
    """Children lists, by parent key (a node key or a tenant root)."""
    identities: set[tuple[bytes, bytes]] = field(default_factory=set)
    """``by_identity`` lists, by (tenant, identity)."""

    def __bool__(self) -> bool:
        return bool(self.keys or self.children or self.identities)

    def clear(self) -> None:
        self.keys.clear()
        self.children.clear()
        self.identities.clear()


@runtime_checkable
class StoreView(NodeReader, Protocol):
    """One request's read view of a store, handed to the pure planner.

    A local store answers every read from memory: its view is complete and ``missing``
    stays empty. A shared store (Redis) answers from a per-process cache of immutable
    nodes plus what this view fetched; a read it cannot answer returns "absent" and is
    recorded in ``missing``, the request path awaits :meth:`AsyncStore.fill` and plans
    again (a bounded number of rounds, within ``store.timeout``).
    """

    missing: Lookups

    def want(self, keys: Sequence[bytes], identities: Sequence[bytes] = ()) -> None:
        """Ask for these nodes (and their children lists) on the next fill, unread yet: the chain
        keys of a request are known before any of them is looked up. ``identities`` (the elements'
        identities, same order) let the store answer the planner's permutation and diagnosis
        probes in the same round."""
        ...


@runtime_checkable
class AsyncStore(Protocol):
    """The store as the request path, the admin API and the CLI use it: awaitable, local or shared.

    :class:`LocalStore` adapts any :class:`TranscriptStore` (memory, sqlite); a shared
    backend (``proxy.store.redis.store``) implements this directly. Every call may be slow or
    fail on a shared store: callers bound it (``store.timeout``) and fail open.
    """

    shared: bool
    """True when other processes write the same store (nodes may appear at any time)."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def flush(self) -> None: ...

    def view(self, tenant: bytes | None = None) -> StoreView:
        """A fresh read view for one request of ``tenant`` (a shared store keys its data by tenant)."""
        ...

    async def fill(self, view: StoreView) -> bool:
        """Fetch what ``view.missing`` names into the view; True when the plan made before may change
        (something the planner missed exists): plan again. False: the plan stands."""
        ...

    async def write_turn(self, turn: TurnWrite) -> None:
        """Insert the turn's nodes (insert-if-absent), touch its path, add its totals. Durable
        enough that the next request on any process sees it once this returns (shared stores)."""
        ...

    def token_counts(self, counter: TokenCounter) -> TokenCounts:
        """How this store's nodes get their token counts (:mod:`proxy.store.tokens`): written uncounted
        and counted when read, the counts kept (a local store that can keep them), or counted
        before they are written (a shared store: every process reads them)."""
        ...

    async def insert(self, nodes: Sequence[Node]) -> int: ...

    async def path(self, leaf: bytes, tenant: bytes | None = None) -> list[Node]: ...

    async def totals(self, leaf: bytes, tenant: bytes | None = None) -> SessionTotals | None: ...

    async def add_turn(
        self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals, tenant: bytes | None = None
    ) -> SessionTotals: ...

    async def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]: ...

    def evict(self, now: float) -> int:
        """Local stores: TTL and budget eviction. Shared stores: nothing (the server expires keys)."""
        ...

    def stats(self) -> StoreStats: ...

    def secret(self) -> bytes: ...

    def health(self) -> str:
        """``"ok"``, or ``"degraded: <why>"`` (a shared store that is unreachable right now)."""
        ...
