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
      record, usage, upstream, relay, store, report, routing (fail-open errors included).

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
  ``kvwarm_cache_write_tokens_total{model}``
      Prompt tokens written to the cache (Anthropic-style cache creation).
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
      ``"estimated"`` (the price table).
  ``kvwarm_unpriced_requests_total{model}``
      Responses whose cost is unknown (no bill, no price for the model).

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

  ``kvwarm_build_info{version}`` (gauge)
      Always 1; the running version as a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import proxy
from proxy.core.pricing import Cost
from proxy.core.usage import Usage

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
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

_MAX_LABEL_LEN = 100
_MAX_VOCABULARY = 50
"""Cap on distinct ``kind`` / ``reason`` values: they are kvwarm's own words, but never unbounded."""


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


class ProxyMetrics:
    """kvwarm's metric definitions and the helpers the pipeline calls to observe a request."""

    def __init__(self, registry: CollectorRegistry, max_models: int = 20) -> None:
        self.registry = registry
        self._models = _BoundedLabel(max(0, max_models))
        self._kinds = _BoundedLabel(_MAX_VOCABULARY)
        self._reasons = _BoundedLabel(_MAX_VOCABULARY)
        # labels() validates and locks on every call; the label sets are bounded, so the
        # children are looked up once and kept (this is on every request's path).
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

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
            "Prompt tokens written to the provider's cache.",
            ("model",),
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
        self.inflight_requests = Gauge(
            "kvwarm_inflight_requests", "Requests being served now.", registry=registry
        )
        self.store_nodes = Gauge(
            "kvwarm_store_nodes", "Nodes in the transcript store.", registry=registry
        )
        self.store_bytes = Gauge(
            "kvwarm_store_bytes",
            "Approximate bytes held by the transcript store.",
            registry=registry,
        )
        self.store_sessions = Gauge(
            "kvwarm_store_sessions",
            "Sessions (leaves with totals) in the store.",
            registry=registry,
        )
        self.store_corrupt_entries = Gauge(
            "kvwarm_store_corrupt_entries",
            "Store entries that failed to decode or verify since start.",
            registry=registry,
        )
        self.errors = counter("kvwarm_errors_total", "Errors by pipeline stage.", ("stage",))
        self.upstream_requests = counter(
            "kvwarm_upstream_requests_total", "Requests sent to each upstream replica.", ("upstream",)
        )
        self.upstream_inflight = Gauge(
            "kvwarm_upstream_inflight", "Requests in flight on each upstream replica.", ("upstream",), registry=registry
        )
        self.upstream_ejections = counter(
            "kvwarm_upstream_ejections_total", "Times each upstream replica was ejected.", ("upstream",)
        )
        self.routing_decisions = counter(
            "kvwarm_routing_decisions_total", "Placements on the upstream pool, by how they were decided.", ("kind",)
        )
        self._upstreams: frozenset[str] = frozenset()
        self._decisions: frozenset[str] = frozenset()
        self.build_info = Gauge(
            "kvwarm_build_info",
            "Always 1; the running kvwarm version.",
            ("version",),
            registry=registry,
        )
        self.build_info.labels(version=proxy.__version__).set(1)
        # Start every known stage at 0 so rate() and absent-series alerts work from the first scrape.
        for stage in ERROR_STAGES:
            self.errors.labels(stage=stage)

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
    ) -> None:
        """Count one finished request: status, latencies, token usage and cost."""
        label = self.model_label(model)
        streamed = "true" if stream else "false"
        status_class = _status_class(status)
        self._child(self.requests, label, status_class, streamed).inc()
        self._child(self.request_duration, label, streamed).observe(max(0.0, duration))
        if ttfb is not None:
            self._child(self.upstream_ttfb, label, streamed).observe(max(0.0, ttfb))
        if usage is None:
            if status_class == "2xx":
                self._child(self.usage_missing, label).inc()
        else:
            self._observe_usage(label, usage)
        if cost is not None:
            if cost.usd is None:
                self._child(self.unpriced_requests, label).inc()
            else:
                source = "billed" if cost.billed else "estimated"
                self._child(self.cost_usd, label, source).inc(max(0.0, cost.usd))

    def _observe_usage(self, label: str, usage: Usage) -> None:
        prompt = usage.prompt_tokens
        if prompt and prompt > 0:
            self._child(self.prompt_tokens, label).inc(prompt)
        if usage.completion_tokens and usage.completion_tokens > 0:
            self._child(self.completion_tokens, label).inc(usage.completion_tokens)
        if usage.reasoning_tokens and usage.reasoning_tokens > 0:
            self._child(self.reasoning_tokens, label).inc(usage.reasoning_tokens)
        if usage.cache_write_tokens and usage.cache_write_tokens > 0:
            self._child(self.cache_write_tokens, label).inc(usage.cache_write_tokens)
        cached = usage.cached_tokens
        if cached is None or prompt is None:
            # Without both numbers the response says nothing about the hit ratio.
            self._child(self.usage_unknown_cache, label).inc()
            return
        cached = min(max(cached, 0), max(prompt, 0))
        self._child(self.cached_prompt_tokens, label).inc(cached)
        self._child(self.cache_known_prompt_tokens, label).inc(prompt)
        if prompt > 0:
            self._child(self.cache_hit_ratio, label).observe(cached / prompt)

    def observe_repairs(self, kinds: Iterable[str], rescued_tokens: int, model: str) -> None:
        """Count the repairs of one request (one per repaired element, by kind) and the tokens rescued."""
        for kind in kinds:
            self._child(self.repairs, self._kinds(str(kind)[:_MAX_LABEL_LEN])).inc()
        if rescued_tokens > 0:
            self._child(self.repair_rescued_tokens, self.model_label(model)).inc(rescued_tokens)

    def observe_refused(self, reason: str) -> None:
        """Count one repair that could not be spliced (a ``proxy.core.splice.REFUSALS`` reason)."""
        self._child(self.repairs_refused, self._reasons(str(reason)[:_MAX_LABEL_LEN])).inc()

    def observe_break(self, reason: str) -> None:
        """Count one prefix break by its diagnosed reason."""
        self._child(self.prefix_breaks, self._reasons(str(reason)[:_MAX_LABEL_LEN])).inc()

    def observe_match(self, matched: int, total: int) -> None:
        """Count a request's messages and how many of them were inside the matched prefix."""
        if total > 0:
            self.request_messages.inc(total)
        if matched > 0:
            self.matched_messages.inc(min(matched, max(total, 0)))

    def error(self, stage: str) -> None:
        """Count one error of a pipeline stage (see :data:`ERROR_STAGES`)."""
        self._child(self.errors, stage if stage in ERROR_STAGES else OTHER).inc()

    @contextmanager
    def inflight(self) -> Iterator[None]:
        """``with metrics.inflight():`` around serving one request."""
        self.inflight_requests.inc()
        try:
            yield
        finally:
            self.inflight_requests.dec()

    def track_upstreams(self, inflight: Mapping[str, Callable[[], float]], decisions: Iterable[str]) -> None:
        """Declare the pool: replica label -> its in-flight count (read at scrape time), and the
        decision kinds. Every series starts at 0; labels outside these count as ``"other"``."""
        self._upstreams = frozenset(inflight)
        self._decisions = frozenset(decisions)
        for label, read in inflight.items():
            self._child(self.upstream_requests, label)
            self._child(self.upstream_ejections, label)
            self.upstream_inflight.labels(label).set_function(read)
        for kind in self._decisions:
            self._child(self.routing_decisions, kind)

    def observe_upstream_request(self, upstream: str) -> None:
        """One request sent to replica ``upstream``."""
        self._child(self.upstream_requests, upstream if upstream in self._upstreams else OTHER).inc()

    def observe_ejection(self, upstream: str) -> None:
        """Replica ``upstream`` was ejected."""
        self._child(self.upstream_ejections, upstream if upstream in self._upstreams else OTHER).inc()

    def observe_routing(self, kind: str) -> None:
        """One placement on the pool, by how it was decided."""
        self._child(self.routing_decisions, kind if kind in self._decisions else OTHER).inc()

    def set_store(self, stats: StoreStatsLike) -> None:
        """Set the store gauges from a ``StoreStats``."""
        self.store_nodes.set(stats.nodes)
        self.store_bytes.set(stats.bytes)
        self.store_sessions.set(stats.sessions)
        self.store_corrupt_entries.set(stats.corrupt)

    def track_store(self, stats: Callable[[], StoreStatsLike]) -> None:
        """Read the store gauges at scrape time from ``stats()`` (e.g. ``store.stats``)."""
        self.store_nodes.set_function(lambda: float(stats().nodes))
        self.store_bytes.set_function(lambda: float(stats().bytes))
        self.store_sessions.set_function(lambda: float(stats().sessions))
        self.store_corrupt_entries.set_function(lambda: float(stats().corrupt))


def _status_class(status: int | None) -> str:
    if isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599:
        return f"{status // 100}xx"
    return "error"
