"""A ring of per-minute snapshots of kvwarm's counters: the page's "over the last hours".

:class:`History` keeps, for each minute in which it was given a reading, the cumulative
:class:`~proxy.web.counters.Totals` at the last reading of that minute (24 h by default:
1 442 entries of 17 floats, about 400 kB). Any window's numbers are then one subtraction
of two snapshots, exact to the counter (``today = now - the last snapshot before
midnight``), and a minute's numbers are the difference of its snapshot and the one
before it.

Readings come from the app's sampler once a minute (so the ring fills while nobody
watches) and from every page read (so the current minute is always live). Before the
first snapshot the counters are taken as zero: the first reading is taken at start-up,
when the process has counted nothing yet.

Pure: times are passed in (Unix seconds); no clock, no I/O. Per process: each worker
or replica keeps its own ring of its own counters.
"""

from __future__ import annotations

from collections import deque

from .counters import ZERO, Totals

__all__ = ["DAY_MINUTES", "History"]

DAY_MINUTES = 24 * 60


class History:
    """Cumulative totals at the end of each sampled minute, oldest first, bounded."""

    __slots__ = ("_dropped", "_ring", "capacity", "started")

    def __init__(self, started: float, capacity_minutes: int = DAY_MINUTES) -> None:
        self.started = started
        """When the process started counting (Unix time)."""
        self.capacity = max(2, capacity_minutes + 2)
        """Entries kept: the window plus the snapshot just before it (and one to spare)."""
        self._ring: deque[tuple[int, Totals]] = deque(maxlen=self.capacity)
        self._dropped = False

    def __len__(self) -> int:
        return len(self._ring)

    def record(self, totals: Totals, now: float) -> None:
        """Keep ``totals`` as the latest reading of the minute holding ``now``."""
        minute = int(now // 60)
        ring = self._ring
        if ring and ring[-1][0] >= minute:
            # Same minute (or the clock stepped back): the newer reading replaces the older.
            ring[-1] = (ring[-1][0], totals)
            return
        if len(ring) == ring.maxlen:
            self._dropped = True
        ring.append((minute, totals))

    def at(self, minute: int) -> Totals:
        """The cumulative totals at the end of ``minute``: the latest snapshot at or before it."""
        found: Totals | None = None
        for m, totals in reversed(self._ring):
            if m <= minute:
                found = totals
                break
        if found is not None:
            return found
        if self._dropped and self._ring:
            return self._ring[0][1]  # older than the ring: count nothing before its oldest entry
        return ZERO

    def since(self, t: float, current: Totals) -> Totals:
        """What was counted from the minute holding ``t`` until ``current`` (a live reading)."""
        return current.minus(self.at(int(t // 60) - 1))

    def minutes(self, now: float, count: int, current: Totals | None = None) -> list[Totals]:
        """The numbers of each of the ``count`` minutes ending with the one holding ``now``, oldest first.

        ``current`` (a live reading) stands for the current minute's end when given.
        Minutes nobody sampled count nothing; traffic between two samples is counted in
        the minute of the later one.
        """
        last = int(now // 60)
        first = last - count + 1
        snapshots = [(m, t) for m, t in self._ring if first <= m <= last]
        if current is not None:
            if snapshots and snapshots[-1][0] == last:
                snapshots[-1] = (last, current)
            else:
                snapshots.append((last, current))
        out: list[Totals] = []
        previous = self.at(first - 1)
        index = 0
        for minute in range(first, last + 1):
            if index < len(snapshots) and snapshots[index][0] == minute:
                totals = snapshots[index][1]
                index += 1
                out.append(totals.minus(previous))
                previous = totals
            else:
                out.append(ZERO)
        return out
