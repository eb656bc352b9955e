"""kvwarm's metric families as data: :data:`FAMILIES`, one :class:`Family` a row, in the order
the registry exports them (each family's meaning: :mod:`proxy.metrics`).

:class:`~proxy.metrics.families.Families` builds every row with :func:`build` into the
attribute the row names: the names, help texts, label sets and buckets are read here, in one
place, and the code that observes a family reads a plain attribute (never a lookup by name on a
request's path). A plain module: it runs once per registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from proxy.core.breakpoints import CACHE_CONTROL, OPENAI
from proxy.core.breakpoints import KINDS as BREAKPOINT_KINDS
from proxy.core.provider_misses import VERDICTS

__all__ = [
    "DIALECTS",
    "ERROR_STAGES",
    "FAMILIES",
    "KEEPALIVE_OUTCOMES",
    "KEEPALIVE_TOKENS",
    "LATENCY_BUCKETS",
    "RATIO_BUCKETS",
    "Family",
    "build",
]

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
    "sent",
    "missed",
    "failed",
    "skipped_unprofitable",
    "budget_exhausted",
    "max_age",
    "unpriced",
    "unsupported",
)
"""The ``outcome`` values of ``kvwarm_keepalive_requests_total``."""
KEEPALIVE_TOKENS = ("cached", "written", "uncached", "output")
"""The ``kind`` values of ``kvwarm_keepalive_tokens_total``."""
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


GaugeMode = Literal[
    "all",
    "liveall",
    "min",
    "livemin",
    "max",
    "livemax",
    "sum",
    "livesum",
    "mostrecent",
    "livemostrecent",
]
"""prometheus-client's ``multiprocess_mode`` values."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """One metric family: what prometheus-client declares, and where ``ProxyMetrics`` keeps it."""

    kind: Literal["counter", "gauge", "histogram"]
    attr: str
    """The attribute of ``ProxyMetrics`` that holds it (declared, typed, on ``Families``)."""
    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    """A histogram's upper bounds (prometheus-client adds ``+Inf``)."""
    mode: GaugeMode = "all"
    """A gauge's ``multiprocess_mode``: how several workers' values add up (:mod:`proxy.metrics`,
    "Several workers"); one process ignores it."""
    start: tuple[tuple[str, ...], ...] = ()
    """Label values whose series are exported from the start, at 0, so ``rate()`` and
    absent-series alerts work from the first scrape."""


def _each(values: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Every value of a one-label family, as :attr:`Family.start`."""
    return tuple((value,) for value in values)


FAMILIES: tuple[Family, ...] = (
    Family(
        kind="counter",
        attr="requests",
        name="kvwarm_requests_total",
        help="Requests served, by status class.",
        labels=("model", "status", "stream"),
    ),
    Family(
        kind="counter",
        attr="prompt_tokens",
        name="kvwarm_prompt_tokens_total",
        help="Prompt tokens, cached ones included.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="cached_prompt_tokens",
        name="kvwarm_cached_prompt_tokens_total",
        help="Prompt tokens served from the provider's cache.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="cache_known_prompt_tokens",
        name="kvwarm_cache_known_prompt_tokens_total",
        help="Prompt tokens of responses that reported a cached count (hit-ratio denominator).",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="cache_write_tokens",
        name="kvwarm_cache_write_tokens_total",
        help="Prompt tokens written to the provider's cache, by the TTL written for.",
        labels=("model", "ttl"),
    ),
    Family(
        kind="counter",
        attr="completion_tokens",
        name="kvwarm_completion_tokens_total",
        help="Completion tokens, reasoning included.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="reasoning_tokens",
        name="kvwarm_reasoning_tokens_total",
        help="Reasoning part of the completion tokens.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="usage_unknown_cache",
        name="kvwarm_usage_unknown_cache_total",
        help="Responses whose usage did not report a cached token count.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="usage_missing",
        name="kvwarm_usage_missing_total",
        help="Successful responses that carried no usage.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="cost_usd",
        name="kvwarm_cost_usd_total",
        help="Cost in USD, billed by the provider or estimated.",
        labels=("model", "source"),
    ),
    Family(
        kind="counter",
        attr="unpriced_requests",
        name="kvwarm_unpriced_requests_total",
        help="Responses whose cost is unknown.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="cache_savings_usd",
        name="kvwarm_cache_savings_usd_total",
        help="USD the provider's cache reads saved against uncached input, by who earned it.",
        labels=("model", "by"),
    ),
    Family(
        kind="counter",
        attr="cache_write_premium_usd",
        name="kvwarm_cache_write_premium_usd_total",
        help="USD the provider's cache writes cost above uncached input.",
        labels=("model", "by"),
    ),
    Family(
        kind="counter",
        attr="breakpoints",
        name="kvwarm_breakpoints_total",
        help="Cache markers kvwarm added to requests, by dialect and kind.",
        labels=("dialect", "kind"),
        start=tuple(product(DIALECTS, BREAKPOINT_KINDS)),
    ),
    Family(
        kind="counter",
        attr="breakpoints_refused",
        name="kvwarm_breakpoints_refused_total",
        help="Requests sent without the cache markers chosen for them, by reason.",
        labels=("reason",),
    ),
    Family(
        kind="counter",
        attr="keepalive_requests",
        name="kvwarm_keepalive_requests_total",
        help="Keep-alive pings that fell due, by what became of them.",
        labels=("outcome",),
        start=_each(KEEPALIVE_OUTCOMES),
    ),
    Family(
        kind="counter",
        attr="keepalive_tokens",
        name="kvwarm_keepalive_tokens_total",
        help="Tokens of the keep-alive pings, by kind.",
        labels=("kind",),
        start=_each(KEEPALIVE_TOKENS),
    ),
    Family(
        kind="counter",
        attr="keepalive_saved_usd",
        name="kvwarm_keepalive_saved_usd_total",
        help="USD of cache writes the keep-alive pings avoided.",
    ),
    Family(
        kind="counter",
        attr="keepalive_lost_usd",
        name="kvwarm_keepalive_lost_usd_total",
        help="USD of keep-alive pings for sessions they did not save.",
    ),
    Family(
        kind="histogram",
        attr="cache_hit_ratio",
        name="kvwarm_request_cache_hit_ratio",
        help="Per response: cached prompt tokens / prompt tokens.",
        labels=("model",),
        buckets=RATIO_BUCKETS,
    ),
    Family(
        kind="counter",
        attr="repair_rescued_tokens",
        name="kvwarm_repair_rescued_tokens_total",
        help="Prompt tokens kept cacheable by a repair.",
        labels=("model",),
    ),
    Family(
        kind="counter",
        attr="repairs",
        name="kvwarm_repairs_total",
        help="Repairs applied, by drift kind.",
        labels=("kind",),
    ),
    Family(
        kind="counter",
        attr="repairs_refused",
        name="kvwarm_repairs_refused_total",
        help="Requests forwarded unrepaired because the repair could not be spliced into the client's bytes.",
        labels=("reason",),
    ),
    Family(
        kind="counter",
        attr="prefix_breaks",
        name="kvwarm_prefix_breaks_total",
        help="Requests that left the stored transcript, by reason.",
        labels=("reason",),
    ),
    Family(
        kind="counter",
        attr="provider_diagnoses",
        name="kvwarm_provider_cache_diagnoses_total",
        help="Responses carrying the provider's verdict on their cache use, by verdict.",
        labels=("verdict",),
        start=_each(VERDICTS),
    ),
    Family(
        kind="counter",
        attr="provider_misses",
        name="kvwarm_provider_cache_misses_total",
        help="Cache misses the provider diagnosed, by side (client: the request changed; provider: it lost the prefix) and reason.",
        labels=("side", "reason"),
        start=(
            ("client", "input_changed"),
            ("provider", "unavailable"),
        ),  # each side's generic reason
    ),
    Family(
        kind="counter",
        attr="matched_messages",
        name="kvwarm_matched_messages_total",
        help="Request messages inside the matched stored prefix.",
    ),
    Family(
        kind="counter",
        attr="request_messages",
        name="kvwarm_request_messages_total",
        help="Request messages seen.",
    ),
    Family(
        kind="histogram",
        attr="request_duration",
        name="kvwarm_request_duration_seconds",
        help="Time from receiving a request to its last byte relayed.",
        labels=("model", "stream"),
        buckets=LATENCY_BUCKETS,
    ),
    Family(
        kind="histogram",
        attr="upstream_ttfb",
        name="kvwarm_upstream_ttfb_seconds",
        help="Time from sending a request upstream to the first response byte.",
        labels=("model", "stream"),
        buckets=LATENCY_BUCKETS,
    ),
    Family(
        kind="gauge",
        attr="inflight_requests",
        name="kvwarm_inflight_requests",
        help="Requests being served now.",
        mode="livesum",
    ),
    Family(
        kind="gauge",
        attr="store_nodes",
        name="kvwarm_store_nodes",
        help="Nodes in the transcript store.",
        mode="livesum",
    ),
    Family(
        kind="gauge",
        attr="store_bytes",
        name="kvwarm_store_bytes",
        help="Approximate bytes held by the transcript store.",
        mode="livesum",
    ),
    Family(
        kind="gauge",
        attr="store_sessions",
        name="kvwarm_store_sessions",
        help="Sessions (leaves with totals) in the store.",
        mode="livemostrecent",
    ),
    Family(
        kind="gauge",
        attr="store_corrupt_entries",
        name="kvwarm_store_corrupt_entries",
        help="Store entries that failed to decode or verify since start.",
        mode="sum",
    ),
    Family(
        kind="counter",
        attr="errors",
        name="kvwarm_errors_total",
        help="Errors by pipeline stage.",
        labels=("stage",),
        start=_each(ERROR_STAGES),
    ),
    Family(
        kind="counter",
        attr="upstream_requests",
        name="kvwarm_upstream_requests_total",
        help="Requests sent to each upstream replica.",
        labels=("upstream",),
    ),
    Family(
        kind="gauge",
        attr="upstream_inflight",
        name="kvwarm_upstream_inflight",
        help="Requests in flight on each upstream replica.",
        labels=("upstream",),
        mode="livesum",
    ),
    Family(
        kind="counter",
        attr="upstream_ejections",
        name="kvwarm_upstream_ejections_total",
        help="Times each upstream replica was ejected.",
        labels=("upstream",),
    ),
    Family(
        kind="counter",
        attr="routing_decisions",
        name="kvwarm_routing_decisions_total",
        help="Placements on the upstream pool, by how they were decided.",
        labels=("kind",),
    ),
    Family(
        kind="gauge",
        attr="build_info",
        name="kvwarm_build_info",
        help="Always 1; the running kvwarm version, and whether its request path is compiled.",
        labels=("version", "native"),
        mode="livemax",
    ),
)
"""Every family, in the registry's order (the exposition's)."""


def build(family: Family, registry: CollectorRegistry) -> MetricWrapperBase:
    """Declare ``family`` on ``registry``, with its :attr:`~Family.start` series at 0."""
    metric: MetricWrapperBase
    if family.kind == "histogram":
        metric = Histogram(
            family.name, family.help, family.labels, registry=registry, buckets=family.buckets
        )
    elif family.kind == "gauge":
        metric = Gauge(
            family.name,
            family.help,
            family.labels,
            registry=registry,
            multiprocess_mode=family.mode,
        )
    else:
        metric = Counter(family.name, family.help, family.labels, registry=registry)
    for values in family.start:
        metric.labels(*values)
    return metric
