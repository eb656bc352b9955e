""":class:`ProxyMetrics`: the observations the pipeline makes, over the families of
:class:`~proxy.metrics.families.Families`. A finished request is summed into the series of its
(model, status class, stream), which a read of the registry applies (:mod:`proxy.metrics`,
"Batches"); labels are bounded here. Compiled (:mod:`proxy.native`): on every request's path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from mypy_extensions import mypyc_attr
from prometheus_client import CollectorRegistry

from proxy.core.breakpoints import KINDS as BREAKPOINT_KINDS
from proxy.core.pricing import Cost
from proxy.core.provider_misses import SIDES, VERDICTS
from proxy.core.usage import UNKNOWN_TTL, WRITE_TTLS, Usage

from .batch import Series
from .families import Families
from .table import DIALECTS, ERROR_STAGES, KEEPALIVE_OUTCOMES

__all__ = ["OTHER", "UNKNOWN_MODEL", "ProxyMetrics"]

OTHER = "other"
UNKNOWN_MODEL = "unknown"

_MAX_LABEL_LEN = 100
_MAX_VOCABULARY = 50
"""Cap on distinct ``kind`` / ``reason`` values: they are kvwarm's own words, but never unbounded."""
_RAW_SERIES = 1024
"""Most (model string, status, stream) values the request series are cached under."""
LISTED = 256
"""Most observations a request series lists before they go to the batch's histogram buckets."""


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


@mypyc_attr(allow_interpreted_subclasses=True)  # the fail-open tests subclass it (proxy/native.py)
class ProxyMetrics(Families):
    """kvwarm's metrics: the helpers the pipeline calls to observe a request, and (from
    :class:`Families`) the families they count in."""

    def __init__(self, registry: CollectorRegistry, max_models: int = 20) -> None:
        super().__init__(registry)
        self._models = _BoundedLabel(max(0, max_models))
        self._kinds = _BoundedLabel(_MAX_VOCABULARY)
        self._reasons = _BoundedLabel(_MAX_VOCABULARY)
        self._request_series: dict[tuple[str, str, bool], Series] = {}
        self._raw_series: dict[tuple[str, int | None, bool], Series] = {}
        """The same series by a request's own model string and status (see :meth:`_series_for`)."""
        self._upstreams: frozenset[str] = frozenset()
        self._decisions: frozenset[str] = frozenset()

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
            _count_usage(counts, values, usage)
        if cost is not None:
            _count_cost(
                counts, cost, usage.cached_tokens if usage is not None else None, rescued_tokens,
                "saved_breakpoint" if breakpoint_reads else "saved_cache",
                "premium_breakpoint" if breakpoint_writes else "write_premium",
            )
        if len(durations) >= LISTED:  # the lists stay bounded between two reads of the registry
            kids.fold_values(self._batch)

    def _series_for(self, model: str, status: int | None, stream: bool) -> Series:
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

    def _series_of(self, label: str, status_class: str, stream: bool) -> Series:
        streamed = "true" if stream else "false"
        one = (label,)
        return Series(self._child, {
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


_WRITE_SERIES = {ttl: f"cache_write_{ttl}" for ttl in (*WRITE_TTLS, UNKNOWN_TTL)}
"""The request series' name of the written tokens of each TTL bucket (a bounded set)."""


def _count_usage(counts: defaultdict[str, float], values: defaultdict[str, list[float]], usage: Usage) -> None:
    """Add a response's usage block to a request series' ``counts`` (tokens, writes by TTL, the
    hit ratio's numerator and denominator) and its hit ratio to the series' ``values``."""
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
