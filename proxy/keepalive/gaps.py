"""How long a tenant's sessions pause between turns, how often they never come back, and what
a late one still reads. Pure.

A keep-alive ping is a bet on a paused session coming back while the ping keeps its prefix
cached. The odds are the tenant's own: :class:`Gaps` is a small histogram of the pauses its
sessions made (the time from a turn to the session's next turn), plus the sessions that did
not come back within the horizon kvwarm watched them for ("never"). From it,
:meth:`Gaps.beyond` gives how many pauses lasted longer than a time: the survival curve the
bet is priced on (:mod:`proxy.keepalive.bet`).

The stake is the tenant's own too. A session back after its prefix expired does not always
write all of it again: what other sessions keep warm (the tools and system prompt they share,
read by each of their turns) it reads. :attr:`Gaps.read_anyway` is the mean of what such late
returns, no ping having kept their prefix, still read of it: a ping avoids writing the rest.

Bounded: :data:`EDGES` bins (finer where TTLs end: 15 s up to 10 minutes, then a minute up to
40, then 5 minutes up to 2 hours, then coarser to a day) of one float each per tenant, and at
most :data:`MAX_TENANTS` tenants (the least recently seen forgotten first). Recent behaviour
weighs more: once a tenant's counts add up past :data:`MAX_WEIGHT`, they are all halved.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict

__all__ = ["EDGES", "MAX_TENANTS", "MAX_WEIGHT", "Gaps", "TenantGaps"]


def _edges() -> tuple[float, ...]:
    edges = [15.0 * i for i in range(1, 41)]  # to 10 min
    edges += [600.0 + 60.0 * i for i in range(1, 31)]  # to 40 min
    edges += [2400.0 + 300.0 * i for i in range(1, 17)]  # to 2 h
    edges += [3 * 3600.0, 4 * 3600.0, 6 * 3600.0, 8 * 3600.0, 12 * 3600.0, 24 * 3600.0]
    return tuple(edges)


EDGES = _edges()
"""Upper bounds (seconds) of the histogram's bins; bin ``i`` holds pauses in ``(EDGES[i-1], EDGES[i]]``
(bin 0 from 0). A pause longer than the last edge counts as never coming back."""
MAX_WEIGHT = 512.0
"""A tenant's observations add up to at most this much before they are all halved."""
MAX_TENANTS = 4096


class Gaps:
    """One tenant's pauses between turns (a histogram) and its sessions that never came back."""

    __slots__ = ("_counts", "_never", "_read", "_reads", "_total")

    def __init__(self) -> None:
        self._counts = array("d", bytes(8 * len(EDGES)))
        self._never = 0.0
        self._total = 0.0
        self._read = 0.0
        self._reads = 0.0

    @property
    def read_anyway(self) -> float:
        """Prompt tokens of its expired prefix a late return still read, on average (0: none seen)."""
        return self._read / self._reads if self._reads else 0.0

    def add_late_read(self, tokens: float) -> None:
        """A session came back after its prefix expired, no ping having kept it, and read ``tokens``
        of it all the same (kept warm by other sessions)."""
        self._read += max(0.0, tokens)
        self._reads += 1.0
        if self._reads > MAX_WEIGHT:
            self._read *= 0.5
            self._reads *= 0.5

    @property
    def observations(self) -> float:
        """The weight of everything observed (halved as :data:`MAX_WEIGHT` says)."""
        return self._total

    @property
    def never(self) -> float:
        """The weight of sessions that did not come back within their horizon."""
        return self._never

    def add(self, gap: float) -> None:
        """A session came back ``gap`` seconds after its previous turn."""
        if not gap >= 0.0:  # NaN too: the clock never goes back, but a bad value must not poison
            gap = 0.0
        i = bisect_left(EDGES, gap)
        if i == len(EDGES):
            self._never += 1.0
        else:
            self._counts[i] += 1.0
        self._grew()

    def add_never(self) -> None:
        """A session did not come back within the horizon it was watched for."""
        self._never += 1.0
        self._grew()

    def _grew(self) -> None:
        self._total += 1.0
        if self._total > MAX_WEIGHT:
            counts = self._counts
            for i in range(len(counts)):
                counts[i] *= 0.5
            self._never *= 0.5
            self._total *= 0.5

    def beyond(self, t: float) -> float:
        """The weight of pauses longer than ``t`` seconds, never-returned ones included (a pause
        inside a bin is taken as spread evenly over it)."""
        if t < 0.0:
            t = 0.0
        i = bisect_left(EDGES, t)
        if i == len(EDGES):
            return self._never
        counts = self._counts
        low = EDGES[i - 1] if i else 0.0
        within = counts[i] * (EDGES[i] - t) / (EDGES[i] - low)
        return within + sum(counts[i + 1 :]) + self._never


class TenantGaps:
    """Each tenant's :class:`Gaps`, by tenant root, the least recently seen forgotten first."""

    __slots__ = ("_by_root", "limit")

    def __init__(self, limit: int = MAX_TENANTS) -> None:
        self.limit = max(1, limit)
        self._by_root: OrderedDict[bytes, Gaps] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_root)

    def of(self, root: bytes) -> Gaps:
        """The tenant's histogram (a new, empty one for a tenant not seen, or forgotten)."""
        gaps = self._by_root.get(root)
        if gaps is None:
            gaps = self._by_root[root] = Gaps()
            if len(self._by_root) > self.limit:
                self._by_root.popitem(last=False)
        else:
            self._by_root.move_to_end(root)
        return gaps
