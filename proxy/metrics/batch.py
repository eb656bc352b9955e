"""The observations of :class:`~proxy.metrics.ProxyMetrics` not applied to the registry yet:
:class:`Batch` (counter increments summed per child, histogram observations counted per bucket),
:class:`Series` (the children one request observes, with its own pending sums) and
:class:`FlushOnRead` (the collector that applies the batch before any read of the registry).
See :mod:`proxy.metrics`, "Batches". Compiled (:mod:`proxy.native`): on every request's path.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Batch", "FlushOnRead", "Series"]


class Batch:
    """Observations not applied yet: increments summed per counter child, and per histogram child
    the sum and the count of each bucket (bounded by the label sets, however many requests)."""

    __slots__ = ("counts", "histograms", "series")

    def __init__(self) -> None:
        self.counts: dict[Any, float] = {}
        self.histograms: dict[Any, list[float]] = {}
        self.series: list[Series] = []
        """Request series holding counter increments of their own (:attr:`Series.pending`)."""

    def __bool__(self) -> bool:
        return bool(self.counts or self.histograms or self.series)

    def inc(self, child: Any, amount: float = 1.0) -> None:
        counts = self.counts
        counts[child] = counts.get(child, 0.0) + amount

    def observe(self, child: Any, value: float) -> None:
        self.observe_all(child, (value,))

    def observe_all(self, child: Any, values: Iterable[float]) -> None:
        slots = self.histograms.get(child)
        if slots is None:
            # [sum, one count per bucket]: Histogram.observe adds to the first bucket whose
            # upper bound is >= the value (its buckets are not cumulative until collected).
            slots = self.histograms[child] = [0.0] * (len(child._upper_bounds) + 1)
        bounds = child._upper_bounds
        for value in values:
            slots[0] += value
            if value == value:  # NaN is in no bucket
                slots[1 + bisect_left(bounds, value)] += 1

    def apply(self) -> None:
        series, self.series = self.series, []
        for kids in series:
            kids.fold(self)
        counts, histograms = self.counts, self.histograms
        self.counts, self.histograms = {}, {}
        for child, amount in counts.items():
            child.inc(amount)
        for child, slots in histograms.items():
            child._sum.inc(slots[0])
            buckets = child._buckets
            for i, n in enumerate(slots[1:]):
                if n:
                    buckets[i].inc(n)


class Series:
    """The children one request observes, for one (model, status class, stream), by name: each
    looked up once, when first observed (a series no request observed is not exported)."""

    __slots__ = ("_child", "_kids", "_table", "pending", "success", "values")

    def __init__(
        self, child: Callable[..., Any], table: dict[str, tuple[Any, tuple[str, ...]]], *, success: bool = False
    ) -> None:
        self._child = child
        self._table = table
        """name -> (metric, its label values for this series)."""
        self.success = success
        """The series of 2xx responses (those count a missing usage block)."""
        self._kids: dict[str, Any] = {}
        self.pending: defaultdict[str, float] | None = None
        """Counter increments by name not added to the batch yet (None: none); see :meth:`fold`."""
        self.values: defaultdict[str, list[float]] = defaultdict(list)
        """Histogram observations by name not added to the batch yet (while ``pending`` is set)."""

    def __call__(self, name: str) -> Any:
        kid = self._kids.get(name)
        if kid is None:
            metric, values = self._table[name]
            kid = self._kids[name] = self._child(metric, *values)
        return kid

    def fold(self, batch: Batch) -> None:
        """Add the pending increments and observations to ``batch`` (a child is made, and
        exported, even for 0)."""
        pending, self.pending = self.pending, None
        if pending:
            for name, amount in pending.items():
                batch.inc(self(name), amount)
        self.fold_values(batch)

    def fold_values(self, batch: Batch) -> None:
        """Add the listed histogram observations to ``batch``'s buckets."""
        values = self.values
        if values:
            for name, observed in values.items():
                batch.observe_all(self(name), observed)
            values.clear()


class FlushOnRead:
    """A collector with no metrics of its own, registered first: every read of the registry
    applies the pending observations before the metrics are collected."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self._flush()
        return []

