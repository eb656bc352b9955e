"""The keep-alive budget: USD per rolling day, never exceeded. Pure: time is passed in.

Spend is kept per slot of :data:`SLOT_SECONDS` (15 minutes). Before a ping is sent its worst
case (the prefix written again) is :meth:`Budget.reserve`-d, and only when the spend of every
slot a 24-hour window ending now can touch (97 of them) plus that worst case fits; once the
ping's cost is known the reservation is :meth:`Budget.settle`-d to it. So the pings of any 24
hours cost at most the budget (at the prices the costs are reckoned in), with up to one slot's
spend counted longer than it needs to be.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DAY", "SLOT_SECONDS", "Budget"]

DAY = 86400.0
SLOT_SECONDS = 900.0
_SLOTS = int(DAY // SLOT_SECONDS) + 1
"""Slots a 24-hour window ending inside the current slot overlaps, the current one included."""


class Budget:
    """USD the pings may cost in any 24 hours, spent as they are sent."""

    __slots__ = ("_slots", "usd_per_day")

    def __init__(self, usd_per_day: float) -> None:
        self.usd_per_day = usd_per_day
        self._slots: deque[list[float]] = deque()
        """[slot number, USD spent in it], oldest first, none older than the window."""

    def spent(self, now: float) -> float:
        """USD counted against the window ending now."""
        self._drop_old(now)
        return sum(usd for _, usd in self._slots)

    def room(self, now: float) -> float:
        """USD a ping may still cost now."""
        return max(0.0, self.usd_per_day - self.spent(now))

    def reserve(self, now: float, usd: float) -> bool:
        """Hold ``usd`` (a ping's worst case) if it fits the window; False (nothing held) if not."""
        if usd > self.room(now):
            return False
        self._add(now, usd)
        return True

    def settle(self, at: float, reserved: float, usd: float) -> None:
        """A ping reserved at ``at`` cost ``usd`` instead of ``reserved`` (its slot is adjusted;
        one already out of the window is left alone: it no longer counts)."""
        slot = int(at // SLOT_SECONDS)
        for entry in self._slots:
            if entry[0] == slot:
                entry[1] = max(0.0, entry[1] - reserved + usd)
                return

    def _add(self, now: float, usd: float) -> None:
        slot = int(now // SLOT_SECONDS)
        if self._slots and self._slots[-1][0] == slot:
            self._slots[-1][1] += usd
        else:
            self._slots.append([float(slot), usd])

    def _drop_old(self, now: float) -> None:
        first = int(now // SLOT_SECONDS) - _SLOTS + 1
        while self._slots and self._slots[0][0] < first:
            self._slots.popleft()
