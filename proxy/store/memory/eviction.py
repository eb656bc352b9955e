"""Eviction from a memory store: least recently used leaves first, so a parent never goes before its children.

Two triggers. The byte budget holds *at all times*: an insert or a session update that
goes over ``max_bytes`` evicts at once, down to a low-water mark a little under it
(:func:`low_water`, so a full store does not evict on every insert). Nodes unused for
``ttl`` go only when the store's ``evict`` is called (a timer). Either way the victims are
taken from the front of the leaves LRU (:class:`~proxy.store.memory.index.NodeIndex`):
a parent becomes a candidate when its last child goes.
"""

from __future__ import annotations

from collections.abc import Callable

from .index import NodeIndex, Removal
from .sessions import SessionTable

__all__ = ["LOW_WATER_MAX", "LOW_WATER_SHARE", "evict_leaves", "low_water"]

LOW_WATER_SHARE = 16
"""An eviction triggered by an insert frees ``max_bytes // LOW_WATER_SHARE`` (at most
``LOW_WATER_MAX``) below the budget, so a full store does not evict on every insert."""
LOW_WATER_MAX = 4 * 1024 * 1024
"""Cap of the eviction margin: one eviction's pause stays a few milliseconds."""


def low_water(budget: int) -> int:
    """The bytes an eviction triggered by going over ``budget`` brings the store down to."""
    return budget - max(1, min(budget // LOW_WATER_SHARE, LOW_WATER_MAX))


def evict_leaves(
    index: NodeIndex,
    sessions: SessionTable,
    target: int,
    cutoff: float,
    gone: Callable[[bytes, bytes | None, bool], None],
    raised: Callable[[bytes, float], None] | None = None,
) -> int:
    """Evict LRU leaves while the store holds over ``target`` bytes or while the LRU leaf was
    last used at or before ``cutoff``. ``gone(key, freed_blob, had_totals)`` is told of each
    node removed (with its session totals); ``raised(key, used)`` of each stored node whose last
    use was raised to that of a removed child. Returns how many went."""
    leaves, used = index.leaves, index.used
    removal = Removal(index)
    count = 0
    try:
        while leaves:
            key = next(iter(leaves))
            if index.bytes + sessions.bytes <= target and used[key] > cutoff:
                break
            freed = removal.remove(key)
            had_totals = sessions.pop(key)
            count += 1
            gone(key, freed, had_totals)
    finally:
        removal.finish()
        if raised is not None:
            for key, when in removal.raised.items():
                if key in index.nodes:
                    raised(key, when)
    return count
