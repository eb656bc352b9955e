"""Prometheus metrics of kvwarm: :class:`ProxyMetrics`, built on an injected registry.

Every name has the ``kvwarm_`` prefix and base units (seconds, tokens, USD);
counters end in ``_total``. Label values are bounded: ``model`` keeps the
first ``max_models`` distinct names and counts the rest as ``"other"``;
``status`` is a class (``"2xx"``, ``"4xx"``, ``"5xx"``, ... or ``"error"``
when no response came back); ``stream`` is ``"true"``/``"false"``; ``stage``,
``kind`` and ``reason`` are kvwarm's own vocabularies, capped as well.

Requests
  ``kvwarm_requests_total{model,status,stream}``
      Requests answered (or failed), by status class.
  ``kvwarm_request_duration_seconds{model,stream}`` (histogram)
      From receiving the request to the last byte relayed to the client.
  ``kvwarm_upstream_ttfb_seconds{model,stream}`` (histogram)
      From sending the request upstream to its first response byte.
  ``kvwarm_inflight_requests`` (gauge)
      Requests being served now.
  ``kvwarm_errors_total{stage}``
      Failures by pipeline stage: parse, identify, match, repair, diagnose,
      record, usage, upstream, relay, store, report, routing, breakpoints, diagnostics, keepalive
      (fail-open errors included).

Usage (from each response's usage block)
  ``kvwarm_prompt_tokens_total{model}``
      Prompt tokens, cached ones included.
  ``kvwarm_cached_prompt_tokens_total{model}``
      Prompt tokens the provider served from its cache.
  ``kvwarm_cache_known_prompt_tokens_total{model}``
      Prompt tokens of the responses that reported a cached count: the
      denominator of the cache-hit ratio, so providers that do not report
      caching do not read as misses. Hit ratio:
      ``rate(kvwarm_cached_prompt_tokens_total[5m]) / rate(kvwarm_cache_known_prompt_tokens_total[5m])``.
  ``kvwarm_cache_write_tokens_total{model,ttl}``
      Prompt tokens written to the provider's cache (Anthropic cache creation, OpenAI GPT-5.6
      and OpenRouter cache writes), by how long they were written for: ``ttl`` is ``5m`` or
      ``1h`` (Anthropic), ``30m`` or ``12h`` (OpenAI), or ``unknown`` where the provider did not
      split its writes. Counted from responses that report writes (a reported 0 too); cache
      reads are ``kvwarm_cached_prompt_tokens_total``.
  ``kvwarm_completion_tokens_total{model}``
      Completion tokens, reasoning included.
  ``kvwarm_reasoning_tokens_total{model}``
      The reasoning part of the completion tokens.
  ``kvwarm_usage_unknown_cache_total{model}``
      Responses with usage but no cached count.
  ``kvwarm_usage_missing_total{model}``
      Successful (2xx) responses that carried no usage at all.
  ``kvwarm_request_cache_hit_ratio{model}`` (histogram, buckets 0, 0.1 ... 1)
      Per response: cached / prompt tokens (responses with a cached count and
      a non-zero prompt only).

Cost
  ``kvwarm_cost_usd_total{model,source}``
      USD spent; ``source`` is ``"billed"`` (the provider's bill) or
      ``"estimated"`` (the price table: cache reads at the cached price, cache writes at the
      write price of their TTL, premium included), or ``"keepalive"`` (the keep-alive pings,
      billed or estimated: below).
  ``kvwarm_unpriced_requests_total{model}``
      Responses whose cost is unknown (no bill, no price for the model).

Savings (what the provider's prompt cache saved, at the price table's list prices)
  ``kvwarm_cache_savings_usd_total{model,by}``
      USD the cache's reads saved against the uncached input price. ``by`` says who earned
      it: ``repair`` (the reads of prompt tokens a kvwarm repair rescued), ``breakpoint`` (the
      other reads of a request that could only have read at kvwarm's own cache markers:
      proxy/core/breakpoints.py says when that is sure), ``cache`` (every other read).
  ``kvwarm_cache_write_premium_usd_total{model,by}``
      USD the cache's writes cost above the uncached input price (``by``: ``breakpoint``, the
      writes of a request marked only by kvwarm on a ``cache_control`` upstream; ``cache``, the
      client's and the provider's writes).
  The headline, what the same prompt tokens would have cost uncached minus what they cost,
  is the difference of the two: ``sum(kvwarm_cache_savings_usd_total) -
  sum(kvwarm_cache_write_premium_usd_total)``. It is negative while writes are not repaid by
  reads; two counters rather than one that goes down keep ``rate`` and restarts right. Both
  are counted for a priced response that reports a cached or a write count (zeros too);
  a write price below the input price counts as a saving, never a negative increment.

Cache breakpoints (proxy/core/breakpoints.py)
  ``kvwarm_breakpoints_total{dialect,kind}``
      Cache markers kvwarm added to requests sent upstream: ``dialect`` ``openai`` or
      ``cache_control``, ``kind`` ``stem`` (a prefix sessions share), ``continuation`` (the
      request's last block, for the session's next turn), ``previous`` (where the session's
      previous turn ended), ``head`` (the end of the leading system and developer messages,
      where a request writes past it anyway).
  ``kvwarm_breakpoints_refused_total{reason}``
      Requests sent without the markers chosen for them: the markers could not be written into
      their bytes (a splice refusal reason) or placing them failed (``error``).

Keep-alive (proxy/keepalive/: pings that keep a paused session's cached prefix warm; never turns)
  ``kvwarm_keepalive_requests_total{outcome}``
      Each ping that fell due, by what became of it: ``sent`` (answered, the prefix read),
      ``missed`` (answered, but the provider had lost the prefix: the schedule stops),
      ``failed`` (no answer, or an error: never retried), ``skipped_unprofitable`` (the
      expected saving did not exceed its cost), ``budget_exhausted`` (its worst case did not
      fit ``keepalive.budget_usd_per_day``), ``max_age`` (quiet past
      ``keepalive.max_session_seconds``), ``unpriced`` (no price for the model),
      ``unsupported`` (no marker to cut the request at). All but ``sent`` end the session's pings.
  ``kvwarm_keepalive_tokens_total{kind}``
      The pings' tokens: ``cached`` (read), ``written``, ``uncached`` prompt tokens, ``output``.
      Not in the request series above (a ping is not a request of a client's).
  ``kvwarm_cost_usd_total{model,source="keepalive"}``
      What the pings cost (billed or at the price table): part of the total spend.
  ``kvwarm_keepalive_saved_usd_total``
      The cache writes avoided: a session that came back after its prefix would have expired,
      and read it because of the pings (at the list prices: the write less the read).
  ``kvwarm_keepalive_lost_usd_total``
      What the pings cost on sessions they did not save (never came back, or too late).

Repair and matching
  ``kvwarm_repairs_total{kind}``
      Messages (or the tools array) rewritten back to their stored form, by drift kind.
  ``kvwarm_repair_rescued_tokens_total{model}``
      Prompt tokens in front of which a repair restored the stored prefix:
      tokens that would have been re-prefilled without kvwarm.
  ``kvwarm_repairs_refused_total{reason}``
      Requests forwarded unrepaired because their repair could not be written into the
      client's bytes without changing another byte's meaning (``duplicate_key``,
      ``unsafe_number``, ...).
  ``kvwarm_prefix_breaks_total{reason}``
      Requests that left the stored transcript, by diagnosed reason.

Provider diagnostics (the provider's own verdict on a response's cache use, proxy/request/diagnosis.py)
  ``kvwarm_provider_cache_diagnoses_total{verdict}``
      Responses that carried one: ``hit``, ``client_miss`` (the request differed from the
      compared one), ``provider_miss`` (it matched, and the provider had lost the prefix: TTL,
      eviction, routing) or ``unknown`` (the compared response was forgotten or wrote nothing).
  ``kvwarm_provider_cache_misses_total{side,reason}``
      The misses among them: ``side`` ``client`` or ``provider``, ``reason`` the provider's
      (``input_changed``, ``tools_changed``, ``model_changed``, ... for the client's side;
      ``expired``, ``evicted``, ``unavailable``, ``not_reused`` for the provider's;
      proxy/core/provider_misses.py).
  ``kvwarm_matched_messages_total``, ``kvwarm_request_messages_total``
      Messages inside the matched prefix, and all request messages; their
      ratio is the share of each request kvwarm recognised.

Upstream pool (one ``upstream`` label value per configured replica: its ``host:port``)
  ``kvwarm_upstream_requests_total{upstream}``
      Requests sent to each replica (a request failed over counts on each replica it reached).
  ``kvwarm_upstream_inflight{upstream}`` (gauge)
      Requests in flight on each replica now.
  ``kvwarm_upstream_ejections_total{upstream}``
      Times a replica was ejected (connection refused, or a burst of 5xx / failures).
  ``kvwarm_routing_decisions_total{kind}``
      How each placement on a pool of several replicas was decided: ``affinity`` (the
      session's home), ``spill`` (home overloaded or ejected), ``new`` (rendezvous of the
      leading prefix), ``failover`` (the chosen replica was unreachable, or none is healthy
      and the one back soonest is tried),
      ``round_robin`` / ``least_inflight`` (those policies, and requests kvwarm does not read).

Store (gauges, set with :meth:`ProxyMetrics.set_store` or read at scrape time
after :meth:`ProxyMetrics.track_store`)
  ``kvwarm_store_nodes``, ``kvwarm_store_bytes``, ``kvwarm_store_sessions``,
  ``kvwarm_store_corrupt_entries`` (entries that failed to decode since start).

  ``kvwarm_build_info{version,native}`` (gauge)
      Always 1; the running version as a label, and ``native``: ``compiled`` when the request
      path runs compiled with mypyc, ``pure`` when it runs as plain Python (:mod:`proxy.native`).

Batches
  The request path's observations (every counter and histogram above but
  ``kvwarm_errors_total``) are summed per series, and histogram observations counted per
  bucket, in a batch that is applied when the registry is read: a scrape, the live page's
  counters or ``get_sample_value`` first run :meth:`ProxyMetrics.flush` (a collector
  registered ahead of every metric). So a read right after a response sees it, and a burst
  of requests costs one increment per series. With several workers the batch is applied at
  the end of the event loop's iteration instead (another worker's scrape cannot flush this
  one). Gauges (in flight, store) are set at once.

Several workers (``kvwarm serve --workers N``)
  The supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` before a worker imports prometheus-client,
  so each worker keeps its values in files there, and ``/metrics`` from any worker shows the
  totals of all of them (:meth:`ProxyMetrics.exposition`; counters of workers that died stay
  counted). Each gauge says how workers add up: in-flight counts are summed over the live
  workers; ``kvwarm_store_nodes`` / ``kvwarm_store_bytes`` too (a shared store's stats are the
  worker's own node cache: each holds its own copy, so the sum is the memory they use);
  ``kvwarm_store_sessions`` is the most recent reading (a shared store's count is the same
  for every worker); ``kvwarm_store_corrupt_entries`` is summed over every worker since start;
  ``kvwarm_build_info`` is 1. Gauges read at scrape time (``set_function``) cannot reach
  another process: there they are set by :meth:`ProxyMetrics.refresh_gauges` (each worker
  about once a second, and the scraped worker at the scrape). The live page keeps reading
  its own worker's registry.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from mypy_extensions import mypyc_attr
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

import proxy
from proxy.core.breakpoints import CACHE_CONTROL, OPENAI
from proxy.core.breakpoints import KINDS as BREAKPOINT_KINDS
from proxy.core.pricing import Cost
from proxy.core.provider_misses import SIDES, VERDICTS
from proxy.core.usage import UNKNOWN_TTL, WRITE_TTLS, Usage

from .native import native_label

__all__ = ["ERROR_STAGES", "ProxyMetrics"]

ERROR_STAGES = (
    "parse",
    "identify",
    "match",
    "repair",
    "diagnose",
    "record",
    "usage",
    "upstream",
    "relay",
    "store",
    "report",
    "routing",
    "breakpoints",
    "diagnostics",
    "keepalive",
)
"""The stages counted by ``kvwarm_errors_total``; any other name is counted as ``"other"``."""

OTHER = "other"
UNKNOWN_MODEL = "unknown"

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
"""Seconds: from a cache-hit first byte (ms) to a long reasoning generation (minutes)."""
DIALECTS = (OPENAI, CACHE_CONTROL)
"""The ``dialect`` values of ``kvwarm_breakpoints_total``."""
KEEPALIVE_OUTCOMES = (
    "sent", "missed", "failed", "skipped_unprofitable", "budget_exhausted", "max_age", "unpriced", "unsupported",
)
"""The ``outcome`` values of ``kvwarm_keepalive_requests_total``."""
KEEPALIVE_TOKENS = ("cached", "written", "uncached", "output")
"""The ``kind`` values of ``kvwarm_keepalive_tokens_total``."""
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

_MAX_LABEL_LEN = 100
_MAX_VOCABULARY = 50
"""Cap on distinct ``kind`` / ``reason`` values: they are kvwarm's own words, but never unbounded."""
_RAW_SERIES = 1024
"""Most (model string, status, stream) values the request series are cached under."""
_LISTED = 256
"""Most observations a request series lists before they go to the batch's histogram buckets."""


class StoreStatsLike(Protocol):
    """What :meth:`ProxyMetrics.set_store` reads (``proxy.store.base.StoreStats`` fits)."""

    @property
    def nodes(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def sessions(self) -> int: ...
    @property
    def corrupt(self) -> int: ...


class _BoundedLabel:
    """Keeps the first ``limit`` distinct values of a label; later ones become ``"other"``."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self._limit:
            self._seen.add(value)
            return value
        return OTHER


class _Batch:
    """Observations not applied yet: increments summed per counter child, and per histogram child
    the sum and the count of each bucket (bounded by the label sets, however many requests)."""

    __slots__ = ("counts", "histograms", "series")

    def __init__(self) -> None:
        self.counts: dict[Any, float] = {}
        self.histograms: dict[Any, list[float]] = {}
        self.series: list[_Series] = []
        """Request series holding counter increments of their own (:attr:`_Series.pending`)."""

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


class _Series:
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

    def fold(self, batch: _Batch) -> None:
        """Add the pending increments and observations to ``batch`` (a child is made, and
        exported, even for 0)."""
        pending, self.pending = self.pending, None
        if pending:
            for name, amount in pending.items():
                batch.inc(self(name), amount)
        self.fold_values(batch)

    def fold_values(self, batch: _Batch) -> None:
        """Add the listed histogram observations to ``batch``'s buckets."""
        values = self.values
        if values:
            for name, observed in values.items():
                batch.observe_all(self(name), observed)
            values.clear()


class _FlushOnRead:
    """A collector with no metrics of its own, registered first: every read of the registry
    applies the pending observations before the metrics are collected."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self._flush()
        return []


@mypyc_attr(allow_interpreted_subclasses=True)  # the fail-open tests subclass it (proxy/native.py)
class ProxyMetrics:
    """kvwarm's metric definitions and the helpers the pipeline calls to observe a request."""

    def __init__(self, registry: CollectorRegistry, max_models: int = 20) -> None:
        self.registry = registry
        self._batch = _Batch()
        self._before_flush: list[Callable[[], None]] = []
        self._flush_scheduled = False
        self._flush_each_iteration = self.multiprocess
        # Ahead of every metric in the registry's order: collected (and so flushed) first.
        registry.register(_FlushOnRead(self.flush))  # type: ignore[arg-type]
        self._models = _BoundedLabel(max(0, max_models))
        self._kinds = _BoundedLabel(_MAX_VOCABULARY)
        self._reasons = _BoundedLabel(_MAX_VOCABULARY)
        # labels() validates and locks on every call; the label sets are bounded, so the
        # children are looked up once and kept (this is on every request's path).
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._request_series: dict[tuple[str, str, bool], _Series] = {}
        self._raw_series: dict[tuple[str, int | None, bool], _Series] = {}
        """The same series by a request's own model string and status (see :meth:`_series_for`)."""

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.requests = counter(
            "kvwarm_requests_total",
            "Requests served, by status class.",
            ("model", "status", "stream"),
        )
        self.prompt_tokens = counter(
            "kvwarm_prompt_tokens_total", "Prompt tokens, cached ones included.", ("model",)
        )
        self.cached_prompt_tokens = counter(
            "kvwarm_cached_prompt_tokens_total",
            "Prompt tokens served from the provider's cache.",
            ("model",),
        )
        self.cache_known_prompt_tokens = counter(
            "kvwarm_cache_known_prompt_tokens_total",
            "Prompt tokens of responses that reported a cached count (hit-ratio denominator).",
            ("model",),
        )
        self.cache_write_tokens = counter(
            "kvwarm_cache_write_tokens_total",
            "Prompt tokens written to the provider's cache, by the TTL written for.",
            ("model", "ttl"),
        )
        self.completion_tokens = counter(
            "kvwarm_completion_tokens_total", "Completion tokens, reasoning included.", ("model",)
        )
        self.reasoning_tokens = counter(
            "kvwarm_reasoning_tokens_total", "Reasoning part of the completion tokens.", ("model",)
        )
        self.usage_unknown_cache = counter(
            "kvwarm_usage_unknown_cache_total",
            "Responses whose usage did not report a cached token count.",
            ("model",),
        )
        self.usage_missing = counter(
            "kvwarm_usage_missing_total", "Successful responses that carried no usage.", ("model",)
        )
        self.cost_usd = counter(
            "kvwarm_cost_usd_total",
            "Cost in USD, billed by the provider or estimated.",
            ("model", "source"),
        )
        self.unpriced_requests = counter(
            "kvwarm_unpriced_requests_total", "Responses whose cost is unknown.", ("model",)
        )
        self.cache_savings_usd = counter(
            "kvwarm_cache_savings_usd_total",
            "USD the provider's cache reads saved against uncached input, by who earned it.",
            ("model", "by"),
        )
        self.cache_write_premium_usd = counter(
            "kvwarm_cache_write_premium_usd_total",
            "USD the provider's cache writes cost above uncached input.",
            ("model", "by"),
        )
        self.breakpoints = counter(
            "kvwarm_breakpoints_total",
            "Cache markers kvwarm added to requests, by dialect and kind.",
            ("dialect", "kind"),
        )
        self.breakpoints_refused = counter(
            "kvwarm_breakpoints_refused_total",
            "Requests sent without the cache markers chosen for them, by reason.",
            ("reason",),
        )
        self.keepalive_requests = counter(
            "kvwarm_keepalive_requests_total",
            "Keep-alive pings that fell due, by what became of them.",
            ("outcome",),
        )
        self.keepalive_tokens = counter(
            "kvwarm_keepalive_tokens_total", "Tokens of the keep-alive pings, by kind.", ("kind",)
        )
        self.keepalive_saved_usd = counter(
            "kvwarm_keepalive_saved_usd_total", "USD of cache writes the keep-alive pings avoided."
        )
        self.keepalive_lost_usd = counter(
            "kvwarm_keepalive_lost_usd_total", "USD of keep-alive pings for sessions they did not save."
        )
        self.cache_hit_ratio = Histogram(
            "kvwarm_request_cache_hit_ratio",
            "Per response: cached prompt tokens / prompt tokens.",
            ("model",),
            buckets=RATIO_BUCKETS,
            registry=registry,
        )
        self.repair_rescued_tokens = counter(
            "kvwarm_repair_rescued_tokens_total",
            "Prompt tokens kept cacheable by a repair.",
            ("model",),
        )
        self.repairs = counter("kvwarm_repairs_total", "Repairs applied, by drift kind.", ("kind",))
        self.repairs_refused = counter(
            "kvwarm_repairs_refused_total",
            "Requests forwarded unrepaired because the repair could not be spliced into the client's bytes.",
            ("reason",),
        )
        self.prefix_breaks = counter(
            "kvwarm_prefix_breaks_total",
            "Requests that left the stored transcript, by reason.",
            ("reason",),
        )
        self.provider_diagnoses = counter(
            "kvwarm_provider_cache_diagnoses_total",
            "Responses carrying the provider's verdict on their cache use, by verdict.",
            ("verdict",),
        )
        self.provider_misses = counter(
            "kvwarm_provider_cache_misses_total",
            "Cache misses the provider diagnosed, by side (client: the request changed; provider: it lost the prefix) and reason.",
            ("side", "reason"),
        )
        self.matched_messages = counter(
            "kvwarm_matched_messages_total", "Request messages inside the matched stored prefix."
        )
        self.request_messages = counter("kvwarm_request_messages_total", "Request messages seen.")
        self.request_duration = Histogram(
            "kvwarm_request_duration_seconds",
            "Time from receiving a request to its last byte relayed.",
            ("model", "stream"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.upstream_ttfb = Histogram(
            "kvwarm_upstream_ttfb_seconds",
            "Time from sending a request upstream to the first response byte.",
            ("model", "stream"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # multiprocess_mode: how several workers' values add up (the module docstring); one
        # process ignores it.
        self.inflight_requests = Gauge(
            "kvwarm_inflight_requests", "Requests being served now.", registry=registry, multiprocess_mode="livesum"
        )
        self.store_nodes = Gauge(
            "kvwarm_store_nodes", "Nodes in the transcript store.", registry=registry, multiprocess_mode="livesum"
        )
        self.store_bytes = Gauge(
            "kvwarm_store_bytes",
            "Approximate bytes held by the transcript store.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.store_sessions = Gauge(
            "kvwarm_store_sessions",
            "Sessions (leaves with totals) in the store.",
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.store_corrupt_entries = Gauge(
            "kvwarm_store_corrupt_entries",
            "Store entries that failed to decode or verify since start.",
            registry=registry,
            multiprocess_mode="sum",
        )
        self.errors = counter("kvwarm_errors_total", "Errors by pipeline stage.", ("stage",))
        self.upstream_requests = counter(
            "kvwarm_upstream_requests_total", "Requests sent to each upstream replica.", ("upstream",)
        )
        self.upstream_inflight = Gauge(
            "kvwarm_upstream_inflight",
            "Requests in flight on each upstream replica.",
            ("upstream",),
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.upstream_ejections = counter(
            "kvwarm_upstream_ejections_total", "Times each upstream replica was ejected.", ("upstream",)
        )
        self.routing_decisions = counter(
            "kvwarm_routing_decisions_total", "Placements on the upstream pool, by how they were decided.", ("kind",)
        )
        self._upstreams: frozenset[str] = frozenset()
        self._decisions: frozenset[str] = frozenset()
        # Multiprocess mode: the readers refresh_gauges() sets the scrape-time gauges from.
        self._store_stats: Callable[[], StoreStatsLike] | None = None
        self._upstream_reads: dict[str, tuple[Any, Callable[[], float]]] = {}
        self.serving = 0
        """Requests being served now (``kvwarm_inflight_requests``, read at scrape time in one
        process: a counter bump per request instead of a locked gauge update)."""
        if not self.multiprocess:
            self.inflight_requests.set_function(lambda: float(self.serving))
        self._merged: CollectorRegistry | None = None
        self.build_info = Gauge(
            "kvwarm_build_info",
            "Always 1; the running kvwarm version, and whether its request path is compiled.",
            ("version", "native"),
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.build_info.labels(version=proxy.__version__, native=native_label()).set(1)
        # Start every known stage at 0 so rate() and absent-series alerts work from the first scrape.
        for stage in ERROR_STAGES:
            self.errors.labels(stage=stage)
        for dialect in DIALECTS:
            for kind in BREAKPOINT_KINDS:
                self.breakpoints.labels(dialect=dialect, kind=kind)
        for outcome in KEEPALIVE_OUTCOMES:
            self.keepalive_requests.labels(outcome=outcome)
        for kind in KEEPALIVE_TOKENS:
            self.keepalive_tokens.labels(kind=kind)
        for verdict in VERDICTS:
            self.provider_diagnoses.labels(verdict=verdict)
        for side, reason in (("client", "input_changed"), ("provider", "unavailable")):
            self.provider_misses.labels(side=side, reason=reason)  # each side's generic reason

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, cached."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def model_label(self, model: str | None) -> str:
        """The ``model`` label value: bounded to ``max_models`` names, the rest ``"other"``."""
        if not isinstance(model, str) or not model.strip():
            return UNKNOWN_MODEL
        return self._models(model.strip()[:_MAX_LABEL_LEN])

    def observe_request(
        self,
        *,
        model: str,
        status: int | None,
        stream: bool,
        duration: float,
        ttfb: float | None,
        usage: Usage | None,
        cost: Cost | None,
        rescued_tokens: int = 0,
        breakpoint_reads: bool = False,
        breakpoint_writes: bool = False,
    ) -> None:
        """Count one finished request: status, latencies, token usage, cost and what the cache
        saved (``rescued_tokens``: the prompt tokens a repair of this request rescued;
        ``breakpoint_reads`` / ``breakpoint_writes``: its other reads / its writes happened at
        cache markers kvwarm placed)."""
        kids = self._raw_series.get((model, status, stream))
        if kids is None:
            kids = self._series_for(model, status, stream)
        # Counters summed per series (a defaultdict: a counter added 0 is exported too) and
        # histogram observations listed per series, folded into the batch when it is applied.
        counts = kids.pending
        if counts is None:
            counts = kids.pending = defaultdict(float)
            self._pending().series.append(kids)
        values = kids.values
        counts["requests"] += 1
        durations = values["duration"]
        durations.append(duration if duration > 0.0 else 0.0)
        if ttfb is not None:
            values["ttfb"].append(ttfb if ttfb > 0.0 else 0.0)
        if usage is None:
            if kids.success:
                counts["usage_missing"] += 1
        else:
            prompt = usage.prompt_tokens
            if prompt and prompt > 0:
                counts["prompt"] += prompt
            completion = usage.completion_tokens
            if completion and completion > 0:
                counts["completion"] += completion
            if usage.reasoning_tokens and usage.reasoning_tokens > 0:
                counts["reasoning"] += usage.reasoning_tokens
            for ttl, written in usage.writes_by_ttl():  # none when the writes are unknown
                counts[_WRITE_SERIES[ttl]] += written
            cached = usage.cached_tokens
            if cached is None or prompt is None:
                # Without both numbers the response says nothing about the hit ratio.
                counts["unknown_cache"] += 1
            else:
                cached = min(max(cached, 0), max(prompt, 0))
                counts["cached"] += cached
                counts["cache_known"] += prompt
                if prompt > 0:
                    values["hit_ratio"].append(cached / prompt)
        if cost is not None:
            _count_cost(
                counts, cost, usage.cached_tokens if usage is not None else None, rescued_tokens,
                "saved_breakpoint" if breakpoint_reads else "saved_cache",
                "premium_breakpoint" if breakpoint_writes else "write_premium",
            )
        if len(durations) >= _LISTED:  # the lists stay bounded between two reads of the registry
            kids.fold_values(self._batch)

    def _series_for(self, model: str, status: int | None, stream: bool) -> _Series:
        """The series of a request of ``model`` answered ``status``; also cached under those very
        values while they are few (the model is the client's string: :data:`_RAW_SERIES`)."""
        label = self.model_label(model)
        status_class = _status_class(status)
        kids = self._request_series.get((label, status_class, stream))
        if kids is None:
            kids = self._request_series[(label, status_class, stream)] = self._series_of(label, status_class, stream)
        if len(self._raw_series) < _RAW_SERIES:
            self._raw_series[(model, status, stream)] = kids
        return kids

    def _series_of(self, label: str, status_class: str, stream: bool) -> _Series:
        streamed = "true" if stream else "false"
        one = (label,)
        return _Series(self._child, {
            "requests": (self.requests, (label, status_class, streamed)),
            "duration": (self.request_duration, (label, streamed)),
            "ttfb": (self.upstream_ttfb, (label, streamed)),
            "billed": (self.cost_usd, (label, "billed")),
            "estimated": (self.cost_usd, (label, "estimated")),
            "usage_missing": (self.usage_missing, one),
            "unpriced": (self.unpriced_requests, one),
            "prompt": (self.prompt_tokens, one),
            "completion": (self.completion_tokens, one),
            "reasoning": (self.reasoning_tokens, one),
            **{name: (self.cache_write_tokens, (label, ttl)) for ttl, name in _WRITE_SERIES.items()},
            "saved_cache": (self.cache_savings_usd, (label, "cache")),
            "saved_repair": (self.cache_savings_usd, (label, "repair")),
            "saved_breakpoint": (self.cache_savings_usd, (label, "breakpoint")),
            "write_premium": (self.cache_write_premium_usd, (label, "cache")),
            "premium_breakpoint": (self.cache_write_premium_usd, (label, "breakpoint")),
            "unknown_cache": (self.usage_unknown_cache, one),
            "cached": (self.cached_prompt_tokens, one),
            "cache_known": (self.cache_known_prompt_tokens, one),
            "hit_ratio": (self.cache_hit_ratio, one),
        }, success=status_class == "2xx")

    def observe_repairs(self, kinds: Iterable[str], rescued_tokens: int, model: str) -> None:
        """Count the repairs of one request (one per repaired element, by kind) and the tokens rescued."""
        batch = self._pending()
        for kind in kinds:
            batch.inc(self._child(self.repairs, self._kinds(str(kind)[:_MAX_LABEL_LEN])))
        if rescued_tokens > 0:
            batch.inc(self._child(self.repair_rescued_tokens, self.model_label(model)), rescued_tokens)

    def observe_breakpoints(self, dialect: str, kinds: Iterable[str], refused: str = "") -> None:
        """Count the cache markers kvwarm added to one request (by kind), or why none went."""
        batch = self._pending()
        dialect = dialect if dialect in DIALECTS else OTHER
        for kind in kinds:
            batch.inc(self._child(self.breakpoints, dialect, kind if kind in BREAKPOINT_KINDS else OTHER))
        if refused:
            batch.inc(self._child(self.breakpoints_refused, self._reasons(refused[:_MAX_LABEL_LEN])))

    def observe_keepalive(
        self, outcome: str, *, model: str = "", usage: Usage | None = None, cost: Cost | None = None
    ) -> None:
        """Count one keep-alive ping that fell due, by ``outcome`` (:data:`KEEPALIVE_OUTCOMES`),
        and, when it was sent, its tokens and its cost (``source="keepalive"``). Applied at once:
        pings are few, and never in a request's batch."""
        self._child(self.keepalive_requests, outcome if outcome in KEEPALIVE_OUTCOMES else OTHER).inc()
        if usage is not None:
            prompt = max(0, usage.prompt_tokens or 0)
            cached = min(max(0, usage.cached_tokens or 0), prompt)
            written = min(max(0, usage.cache_write_tokens or 0), prompt - cached)
            for kind, count in (
                ("cached", cached), ("written", written), ("uncached", prompt - cached - written),
                ("output", max(0, usage.completion_tokens or 0)),
            ):
                if count:
                    self._child(self.keepalive_tokens, kind).inc(count)
        if cost is not None and cost.usd is not None and cost.usd > 0:
            self._child(self.cost_usd, self.model_label(model), "keepalive").inc(cost.usd)

    def observe_keepalive_result(self, *, saved_usd: float = 0.0, lost_usd: float = 0.0) -> None:
        """What a session's keep-alive came to: the write it avoided, or the pings it lost."""
        if saved_usd > 0:
            self.keepalive_saved_usd.inc(saved_usd)
        if lost_usd > 0:
            self.keepalive_lost_usd.inc(lost_usd)

    def observe_refused(self, reason: str) -> None:
        """Count one repair that could not be spliced (a ``proxy.core.splice.REFUSALS`` reason)."""
        self._pending().inc(self._child(self.repairs_refused, self._reasons(str(reason)[:_MAX_LABEL_LEN])))

    def observe_break(self, reason: str) -> None:
        """Count one prefix break by its diagnosed reason."""
        self._pending().inc(self._child(self.prefix_breaks, self._reasons(str(reason)[:_MAX_LABEL_LEN])))

    def observe_provider_verdict(self, verdict: str, side: str, reason: str) -> None:
        """Count one verdict of the provider on a response's cache use, and the miss it names
        (``side`` non-empty)."""
        batch = self._pending()
        batch.inc(self._child(self.provider_diagnoses, verdict if verdict in VERDICTS else OTHER))
        if side:
            label = self._reasons(str(reason)[:_MAX_LABEL_LEN])
            batch.inc(self._child(self.provider_misses, side if side in SIDES else OTHER, label))

    def observe_match(self, matched: int, total: int) -> None:
        """Count a request's messages and how many of them were inside the matched prefix."""
        batch = self._pending()
        if total > 0:
            batch.inc(self.request_messages, total)
        if matched > 0:
            batch.inc(self.matched_messages, min(matched, max(total, 0)))

    def error(self, stage: str) -> None:
        """Count one error of a pipeline stage (see :data:`ERROR_STAGES`)."""
        self._child(self.errors, stage if stage in ERROR_STAGES else OTHER).inc()

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

    def _pending(self) -> _Batch:
        """The batch to add to. With several workers, one flush per event-loop iteration is
        scheduled: their scrapes read the files, not this process's batch."""
        if self._flush_each_iteration and not self._flush_scheduled:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
                self._flush_scheduled = True
            except RuntimeError:  # no event loop (a tool, a test): the caller flushes or a read does
                pass
        return self._batch

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

    def track_upstreams(self, inflight: Mapping[str, Callable[[], float]], decisions: Iterable[str]) -> None:
        """Declare the pool: replica label -> its in-flight count (read at scrape time), and the
        decision kinds. Every series starts at 0; labels outside these count as ``"other"``."""
        self._upstreams = frozenset(inflight)
        self._decisions = frozenset(decisions)
        for label, read in inflight.items():
            self._child(self.upstream_requests, label)
            self._child(self.upstream_ejections, label)
            if self.multiprocess:
                self._upstream_reads[label] = (self.upstream_inflight.labels(label), read)
            else:
                self.upstream_inflight.labels(label).set_function(read)
        self.refresh_gauges()
        for kind in self._decisions:
            self._child(self.routing_decisions, kind)

    def observe_upstream_request(self, upstream: str) -> None:
        """One request sent to replica ``upstream``."""
        self._pending().inc(self._child(self.upstream_requests, upstream if upstream in self._upstreams else OTHER))

    def observe_ejection(self, upstream: str) -> None:
        """Replica ``upstream`` was ejected."""
        self._child(self.upstream_ejections, upstream if upstream in self._upstreams else OTHER).inc()

    def observe_routing(self, kind: str) -> None:
        """One placement on the pool, by how it was decided."""
        self._pending().inc(self._child(self.routing_decisions, kind if kind in self._decisions else OTHER))

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
            return self.registry  # collecting it flushes (see _FlushOnRead)
        self.flush()
        if self._merged is None:
            merged = CollectorRegistry()
            MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
            self._merged = merged
        return self._merged


_WRITE_SERIES = {ttl: f"cache_write_{ttl}" for ttl in (*WRITE_TTLS, UNKNOWN_TTL)}
"""The request series' name of the written tokens of each TTL bucket (a bounded set)."""


def _count_cost(
    counts: defaultdict[str, float],
    cost: Cost,
    cached: int | None,
    rescued: int,
    reads: str = "saved_cache",
    writes: str = "write_premium",
) -> None:
    """Add a response's cost to a request series' ``counts``, and what the cache saved: the
    reads' saving split between the repair (the reads of the ``rescued`` tokens, at most the
    ``cached`` ones) and the rest (to ``reads``: by ``cache`` or ``breakpoint``), and the writes'
    premium (to ``writes``). A negative part (a price below the input price) moves to the other
    counter: counters never go down."""
    if cost.usd is None:
        counts["unpriced"] += 1
    else:
        counts["billed" if cost.billed else "estimated"] += max(0.0, cost.usd)
    if cost.read_saving_usd is None and cost.write_premium_usd is None:
        return
    saved = premium = repaired = 0.0
    read = cost.read_saving_usd
    if read is not None:
        if read >= 0.0:
            if rescued > 0 and cached:
                repaired = min(read, min(rescued, cached) * cost.saving_per_cached_token)
            saved = read - repaired
        else:
            premium = -read
    write = cost.write_premium_usd
    if write is not None:
        if write >= 0.0:
            premium += write
        else:
            saved -= write
    counts[reads] += saved
    counts["saved_repair"] += repaired
    counts[writes] += premium


def _status_class(status: int | None) -> str:
    if isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599:
        return f"{status // 100}xx"
    return "error"
