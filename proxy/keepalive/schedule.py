"""The watched sessions, by key and by due time.

A session's next turn finds its watch by key (the chain key of the watched turn's last request
element), the background finds the first watch due by time. :class:`Schedule` keeps both: an
ordered dict of the watches (oldest turn first: the first evicted when full) and a heap of
``(due, tie-breaker, watch)`` entries. A watch that falls due again, or stops being watched, is
not looked for in the heap: its old entry goes stale (its time no longer the watch's ``due``, or
the watch no longer the one under its key) and is skipped when it comes up; the heap is rebuilt
when stale entries outnumber current ones, so each push stays amortized O(1).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import OrderedDict

from .watch import Watch

__all__ = ["Schedule"]


class Schedule:
    """The watched sessions by key, and when each falls due (module docstring)."""

    def __init__(self) -> None:
        self.watches: OrderedDict[bytes, Watch] = OrderedDict()
        """Watched sessions by the key of their last request's last element, oldest turn first."""
        self.wake = asyncio.Event()
        """Set when a watch is pushed that falls due before every other: the background looks again."""
        self._due: list[tuple[float, int, Watch]] = []
        """(time, tie-breaker, watch): a heap; an entry whose watch moved on or ended is stale."""
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.watches)

    def watched(self, watch: Watch) -> bool:
        """``watch`` is the one watched under its key (its session has not come back, nor ended)."""
        return self.watches.get(watch.key) is watch

    def pop(self, key: bytes) -> Watch | None:
        """The watch under ``key``, no longer watched; None: none is."""
        return self.watches.pop(key, None)

    def pop_oldest(self) -> Watch:
        """The watch of the oldest turn, no longer watched."""
        return self.watches.popitem(last=False)[1]

    def add(self, watch: Watch) -> None:
        """Watch ``watch`` under its key, due at ``watch.due``."""
        self.watches[watch.key] = watch
        self.push(watch)

    def push(self, watch: Watch) -> None:
        """``watch`` falls due at ``watch.due`` (its earlier entries go stale)."""
        heap = self._due
        heapq.heappush(heap, (watch.due, next(self._seq), watch))
        if len(heap) > 2 * len(self.watches) + 64:  # mostly stale: rebuilt, amortized O(1) a push
            heap[:] = [(w.due, next(self._seq), w) for w in self.watches.values()]
            heapq.heapify(heap)
        if heap[0][2] is watch:
            self.wake.set()

    def next_due(self) -> float | None:
        """When the first watch falls due; None: nothing is watched."""
        heap = self._due
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def take_due(self, now: float) -> list[Watch]:
        """Every watch due by ``now``, in order, its entry taken off the heap (it stays watched)."""
        heap, due = self._due, []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._current(entry):
                due.append(entry[2])
        return due

    def _current(self, entry: tuple[float, int, Watch]) -> bool:
        watch = entry[2]
        return watch.due == entry[0] and self.watched(watch)

    def clear(self) -> list[Watch]:
        """Watch nothing: the watches there were."""
        watches = list(self.watches.values())
        self.watches.clear()
        self._due.clear()
        return watches
