""":class:`LocalStore`: a memory or sqlite :class:`~proxy.store.base.TranscriptStore` as an :class:`~proxy.store.base.AsyncStore`.

A local store holds its whole index in memory, so its view is the store itself
(complete: nothing is ever missing) and every call completes without waiting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from mypy_extensions import mypyc_attr

from .base import (
    Lookups,
    Node,
    SessionInfo,
    SessionTotals,
    StoreStats,
    StoreView,
    TranscriptStore,
    TurnWrite,
)
from .memory.store import MemoryStore
from .tokens import TokenCounter, TokenCounts

__all__ = ["LocalStore"]


class _CompleteView:
    """A local store's view: reads go straight to its in-memory index."""

    __slots__ = ("by_identity", "children", "get", "missing")

    def __init__(self, store: TranscriptStore) -> None:
        self.get = store.get
        self.children = store.children
        self.by_identity = store.by_identity
        self.missing = Lookups()

    def want(self, keys: Sequence[bytes], identities: Sequence[bytes] = ()) -> None:
        return None


@mypyc_attr(allow_interpreted_subclasses=True)  # the fail-open tests subclass it (proxy/native.py)
class LocalStore:
    """Adapts a synchronous in-memory-indexed store to the awaitable store contract."""

    shared = False

    def __init__(self, store: TranscriptStore) -> None:
        self.local = store
        """The wrapped store (tests and the CLI read it directly)."""
        self._view = _CompleteView(store)
        self.fills_tokens = isinstance(store, MemoryStore) and store.fills_tokens
        """Nodes may be written uncounted and their token counts filled in when read
        (:meth:`fill_tokens`): the memory backend, or one that persists the fill (sqlite)."""
        self._tight = isinstance(store, MemoryStore) and type(store).insert is MemoryStore.insert
        """A turn's nodes (whose bodies are tight copies) are kept as they are (``insert(tight=True)``)."""

    async def open(self) -> None:
        await self.local.open()

    async def close(self) -> None:
        await self.local.close()

    async def flush(self) -> None:
        await self.local.flush()

    def view(self, tenant: bytes | None = None) -> StoreView:
        return self._view

    async def fill(self, view: StoreView) -> bool:
        return False

    async def write_turn(self, turn: TurnWrite) -> None:
        self.write_turn_now(turn)

    def write_turn_now(self, turn: TurnWrite) -> None:
        store = self.local
        if turn.nodes:
            if self._tight:
                cast(MemoryStore, store).insert(turn.nodes, tight=True)
            else:
                store.insert(turn.nodes)
        store.touch(turn.path[-1:], turn.now)  # the deepest node: its parents' use follows it (MemoryStore.touch)
        if isinstance(store, MemoryStore):  # memory and sqlite: a lookup per key, no copies
            previous = store.last_session(turn.path)
            store.count_turn(turn.leaf, previous if previous != turn.leaf else None, turn.totals)
        else:
            previous = next((k for k in reversed(turn.path) if store.totals(k) is not None), None)
            store.add_turn(turn.leaf, previous if previous != turn.leaf else None, turn.totals)

    def token_counts(self, counter: TokenCounter) -> TokenCounts:
        """A turn's nodes are written uncounted and counted when read, the counts kept
        (:meth:`fill_tokens`); a store that cannot keep them has them counted before the write."""
        return TokenCounts(counter, self.view, self.fill_tokens if self.fills_tokens else None)

    def fill_tokens(self, counts: Mapping[bytes, int]) -> int:
        """Token counts of nodes written uncounted (see :attr:`fills_tokens`); 0 when unsupported."""
        store = self.local
        return store.fill_tokens(counts) if isinstance(store, MemoryStore) and self.fills_tokens else 0

    async def insert(self, nodes: Sequence[Node]) -> int:
        return self.local.insert(nodes)

    async def path(self, leaf: bytes, tenant: bytes | None = None) -> list[Node]:
        return self.local.path(leaf)

    async def totals(self, leaf: bytes, tenant: bytes | None = None) -> SessionTotals | None:
        return self.local.totals(leaf)

    async def add_turn(
        self, leaf: bytes, parent_leaf: bytes | None, totals: SessionTotals, tenant: bytes | None = None
    ) -> SessionTotals:
        return self.local.add_turn(leaf, parent_leaf, totals)

    async def sessions(self, tenant: bytes | None = None) -> list[SessionInfo]:
        return self.local.sessions(tenant)

    def evict(self, now: float) -> int:
        return self.local.evict(now)

    def stats(self) -> StoreStats:
        return self.local.stats()

    def secret(self) -> bytes:
        return self.local.secret()

    def health(self) -> str:
        return "ok"
