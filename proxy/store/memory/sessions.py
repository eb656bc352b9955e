"""Session totals of a memory store: leaf -> :class:`SessionTotals`, moved down the tree as a session grows.

A session is identified by its leaf: the deepest node its last turn stored. A turn that
continues a session (its path passes the previous leaf) moves the totals from the old
leaf to the new one and adds the turn's numbers. The table is kept in update order, so
ties on ``updated`` list the latest first; its ``bytes`` are counted at the sizes of
:mod:`proxy.store.memory.costs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ...core.model import Node, SessionTotals
from ..base import SessionInfo
from .costs import session_cost

__all__ = ["SessionTable", "combine"]


class SessionTable:
    """leaf -> totals, and the bytes they hold."""

    __slots__ = ("bytes", "totals")

    def __init__(self) -> None:
        self.totals: dict[bytes, SessionTotals] = {}
        self.bytes = 0

    def get(self, leaf: bytes) -> SessionTotals | None:
        """A copy of the totals at ``leaf`` (the table's own objects are never handed out)."""
        found = self.totals.get(leaf)
        return None if found is None else copy_totals(found)

    def listing(self, nodes: Mapping[bytes, Node], tenant: bytes | None) -> list[SessionInfo]:
        """Sessions (of ``tenant``, or all), most recently updated first."""
        out: list[SessionInfo] = []
        for leaf, totals in reversed(self.totals.items()):
            node = nodes[leaf]
            if tenant is None or node.tenant == tenant:
                out.append(SessionInfo(leaf=leaf, tenant=node.tenant, depth=node.depth, totals=copy_totals(totals)))
        out.sort(key=lambda info: info.totals.updated, reverse=True)
        return out

    def last_leaf(self, keys: Sequence[bytes]) -> bytes | None:
        """The deepest of ``keys`` that is a session's leaf (holds totals), without copying them."""
        totals = self.totals
        if not keys or keys[-1] in totals:  # an agent's next turn: its previous reply ends the path
            return keys[-1] if keys else None
        if totals.keys().isdisjoint(keys):  # a new turn under a shared prefix: none (one C loop)
            return None
        for key in reversed(keys):
            if key in totals:
                return key
        return None

    def add(
        self, leaf: bytes, parent_leaf: bytes | None, turn: SessionTotals, now: float, *, keep: bool
    ) -> tuple[SessionTotals, bytes | None]:
        """Add ``turn`` to the session ending at ``leaf``; totals held at ``parent_leaf`` move there first.
        ``turn`` counts as one turn at least, updated at ``now`` unless it says when.

        Returns the combined totals (the table's own object) and the leaf whose totals moved
        away (None: none did). With ``keep`` False (``leaf`` is not stored) nothing changes.
        """
        if turn.turns < 1 or not turn.updated:
            turn = replace(turn, turns=max(turn.turns, 1), updated=turn.updated or now)
        moved = None
        if parent_leaf is not None and parent_leaf != leaf:
            moved = self.totals.get(parent_leaf)
        current = self.totals.get(leaf)
        before = combine(moved, current) if moved is not None else current
        combined = combine(before, turn)
        if combined.created == 0.0:
            combined.created = now
        if not keep:
            return combined, None
        gone = None
        if moved is not None and parent_leaf is not None:
            del self.totals[parent_leaf]
            self.bytes -= session_cost(moved)
            gone = parent_leaf
        # A new object every time: a persistent backend may be encoding the previous one.
        if current is not None:
            del self.totals[leaf]
            self.bytes -= session_cost(current)
        self.totals[leaf] = combined
        self.bytes += session_cost(combined)
        return combined, gone

    def put(self, leaf: bytes, totals: SessionTotals) -> None:
        """Set the totals at ``leaf`` as loaded from a backend (in order of ``updated``)."""
        current = self.totals.pop(leaf, None)
        if current is not None:
            self.bytes -= session_cost(current)
        self.totals[leaf] = totals
        self.bytes += session_cost(totals)

    def pop(self, leaf: bytes) -> bool:
        """Drop the totals at ``leaf`` (its node is evicted); True when there were some."""
        totals = self.totals.pop(leaf, None)
        if totals is None:
            return False
        self.bytes -= session_cost(totals)
        return True


def combine(a: SessionTotals | None, b: SessionTotals | None) -> SessionTotals:
    """The totals of two runs of turns, ``b`` being the later one."""
    if a is None:
        return SessionTotals() if b is None else copy_totals(b)
    if b is None:
        return copy_totals(a)
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


def copy_totals(t: SessionTotals) -> SessionTotals:
    """A copy of ``t`` (``dataclasses.replace`` costs some 50 times the constructor)."""
    return SessionTotals(
        turns=t.turns, prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
        completion_tokens=t.completion_tokens, unknown_cache_turns=t.unknown_cache_turns, cost_usd=t.cost_usd,
        billed=t.billed, repaired=t.repaired, last_break=t.last_break, model=t.model, created=t.created,
        updated=t.updated,
    )
