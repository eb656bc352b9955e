"""The registry's side of :class:`~proxy.metrics.ProxyMetrics`: :class:`Families` holds every
metric family of :data:`~proxy.metrics.table.FAMILIES` as a typed attribute, the batch that
observations wait in until a read of the registry applies it, the gauges (set at once, or read
at scrape time) and what ``/metrics`` serves with one worker or several. Compiled
(:mod:`proxy.native`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from mypy_extensions import mypyc_attr
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

import proxy

from ..native import native_label
from .batch import Batch, FlushOnRead
from .table import FAMILIES, build

__all__ = ["Families", "StoreStatsLike"]


class StoreStatsLike(Protocol):
    """What :meth:`Families.set_store` reads (``proxy.store.base.StoreStats`` fits)."""

    @property
    def nodes(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def sessions(self) -> int: ...
    @property
    def corrupt(self) -> int: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # ProxyMetrics, which the fail-open tests subclass
class Families:
    """The metric families on an injected registry, and the plumbing every observation uses."""

    # One attribute per row of FAMILIES (its ``attr``), set from the table by __init__; typed
    # here so that compiled code reads each one natively (tests check the two agree).
    requests: Counter
    prompt_tokens: Counter
    cached_prompt_tokens: Counter
    cache_known_prompt_tokens: Counter
    cache_write_tokens: Counter
    completion_tokens: Counter
    reasoning_tokens: Counter
    usage_unknown_cache: Counter
    usage_missing: Counter
    cost_usd: Counter
    unpriced_requests: Counter
    cache_savings_usd: Counter
    cache_write_premium_usd: Counter
    breakpoints: Counter
    breakpoints_refused: Counter
    keepalive_requests: Counter
    keepalive_tokens: Counter
    keepalive_saved_usd: Counter
    keepalive_lost_usd: Counter
    cache_hit_ratio: Histogram
    repair_rescued_tokens: Counter
    repairs: Counter
    repairs_refused: Counter
    prefix_breaks: Counter
    provider_diagnoses: Counter
    provider_misses: Counter
    matched_messages: Counter
    request_messages: Counter
    request_duration: Histogram
    upstream_ttfb: Histogram
    inflight_requests: Gauge
    store_nodes: Gauge
    store_bytes: Gauge
    store_sessions: Gauge
    store_corrupt_entries: Gauge
    errors: Counter
    upstream_requests: Counter
    upstream_inflight: Gauge
    upstream_ejections: Counter
    routing_decisions: Counter
    build_info: Gauge

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._batch = Batch()
        self._before_flush: list[Callable[[], None]] = []
        self._flush_scheduled = False
        self._flush_each_iteration = self.multiprocess
        # Ahead of every metric in the registry's order: collected (and so flushed) first.
        registry.register(FlushOnRead(self.flush))  # type: ignore[arg-type]
        # labels() validates and locks on every call; the label sets are bounded, so the
        # children are looked up once and kept (this is on every request's path).
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        for family in FAMILIES:
            setattr(self, family.attr, build(family, registry))
        self.build_info.labels(version=proxy.__version__, native=native_label()).set(1)
        # Multiprocess mode: the readers refresh_gauges() sets the scrape-time gauges from.
        self._store_stats: Callable[[], StoreStatsLike] | None = None
        self._upstream_reads: dict[str, tuple[Any, Callable[[], float]]] = {}
        self.serving = 0
        """Requests being served now (``kvwarm_inflight_requests``, read at scrape time in one
        process: a counter bump per request instead of a locked gauge update)."""
        if not self.multiprocess:
            self.inflight_requests.set_function(lambda: float(self.serving))
        self._merged: CollectorRegistry | None = None

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    # -- the batch ------------------------------------------------------------------------------

    def before_flush(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` first whenever the batch is applied (the reporter's pending requests)."""
        self._before_flush.append(callback)

    def flush(self) -> None:
        """Apply every pending observation (run by any read of the registry)."""
        self._flush_scheduled = False
        for callback in self._before_flush:
            callback()
        if self._batch:
            self._batch.apply()

    def _pending(self) -> Batch:
        """The batch to add to. With several workers, one flush per event-loop iteration is
        scheduled: their scrapes read the files, not this process's batch."""
        if self._flush_each_iteration and not self._flush_scheduled:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._flush_scheduled = True
            except RuntimeError:  # no event loop (a tool, a test): the caller flushes or a read does
                pass
        return self._batch

    # -- the gauges -----------------------------------------------------------------------------

    def request_began(self) -> None:
        """A request is being served (until :meth:`request_ended`)."""
        self.serving += 1
        if self.multiprocess:  # every worker's file holds its own count, added up at scrape time
            self.inflight_requests.inc()

    def request_ended(self) -> None:
        self.serving -= 1
        if self.multiprocess:
            self.inflight_requests.dec()

    @contextmanager
    def inflight(self) -> Iterator[None]:
        """``with metrics.inflight():`` around serving one request."""
        self.request_began()
        try:
            yield
        finally:
            self.request_ended()

    def set_store(self, stats: StoreStatsLike) -> None:
        """Set the store gauges from a ``StoreStats``."""
        self.store_nodes.set(stats.nodes)
        self.store_bytes.set(stats.bytes)
        self.store_sessions.set(stats.sessions)
        self.store_corrupt_entries.set(stats.corrupt)

    def track_store(self, stats: Callable[[], StoreStatsLike]) -> None:
        """Read the store gauges at scrape time from ``stats()`` (e.g. ``store.stats``); in
        multiprocess mode, whenever :meth:`refresh_gauges` runs."""
        if self.multiprocess:
            self._store_stats = stats
            self.refresh_gauges()
            return
        self.store_nodes.set_function(lambda: float(stats().nodes))
        self.store_bytes.set_function(lambda: float(stats().bytes))
        self.store_sessions.set_function(lambda: float(stats().sessions))
        self.store_corrupt_entries.set_function(lambda: float(stats().corrupt))

    # -- several workers ------------------------------------------------------------------------

    @property
    def multiprocess(self) -> bool:
        """True when prometheus-client keeps values in ``PROMETHEUS_MULTIPROC_DIR`` files (it
        decides once, when first imported): the gauges read at scrape time then need
        :meth:`refresh_gauges`, and ``/metrics`` serves :meth:`exposition`."""
        return bool(getattr(values.ValueClass, "_multiprocess", False))

    def refresh_gauges(self) -> None:
        """Multiprocess mode: set the scrape-time gauges (store, replica in-flight) from their
        readers, so every worker's file holds its current values. One process: nothing to do."""
        stats = self._store_stats
        if stats is not None:
            self.set_store(stats())
        for child, read in self._upstream_reads.values():
            child.set(read())

    def exposition(self) -> CollectorRegistry:
        """What ``/metrics`` serves: this registry, or in multiprocess mode one that adds up every
        worker's files (prometheus-client's ``MultiProcessCollector``)."""
        if not self.multiprocess:
            return self.registry  # collecting it flushes (see FlushOnRead)
        self.flush()
        if self._merged is None:
            merged = CollectorRegistry()
            MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
            self._merged = merged
        return self._merged
