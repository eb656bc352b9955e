"""kvwarm's own counters, read back from the app's Prometheus registry: :class:`Totals`.

The page and ``/metrics`` read the very same counters, so every "since start" number on
the page is what ``/metrics`` says at that moment. Sums are over all label values
(every model, stream, status class, TTL and ``by``); the per-reason break counts and the
repairs' share of the savings are kept apart as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry

__all__ = ["ZERO", "Reading", "Totals", "read_counters"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Totals:
    """Cumulative counter values of one process (since it started), or a difference of two."""

    requests: float = 0.0
    """``kvwarm_requests_total``, every status class."""
    requests_failed: float = 0.0
    """Requests whose status class is not 2xx (``error``: no response came back)."""
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    """``kvwarm_cached_prompt_tokens_total``."""
    cache_known_tokens: float = 0.0
    """``kvwarm_cache_known_prompt_tokens_total``: the hit ratio's denominator."""
    completion_tokens: float = 0.0
    rescued_tokens: float = 0.0
    """``kvwarm_repair_rescued_tokens_total``."""
    repairs: float = 0.0
    breaks: float = 0.0
    """``kvwarm_prefix_breaks_total``, every reason."""
    cost_billed_usd: float = 0.0
    """``kvwarm_cost_usd_total{source="billed"}``."""
    cost_estimated_usd: float = 0.0
    """``kvwarm_cost_usd_total{source="estimated"}``."""
    cost_keepalive_usd: float = 0.0
    """``kvwarm_cost_usd_total{source="keepalive"}``: the keep-alive pings (proxy/keepalive/)."""
    keepalive_pings: float = 0.0
    """``kvwarm_keepalive_requests_total{outcome="sent"|"missed"}``: pings the provider answered."""
    keepalive_saved_usd: float = 0.0
    """``kvwarm_keepalive_saved_usd_total``: cache writes the pings avoided."""
    keepalive_lost_usd: float = 0.0
    """``kvwarm_keepalive_lost_usd_total``: pings for sessions they did not save."""
    unpriced_requests: float = 0.0
    cache_write_tokens: float = 0.0
    """``kvwarm_cache_write_tokens_total``, every TTL (the reads are ``cached_tokens``)."""
    savings_usd: float = 0.0
    """``kvwarm_cache_savings_usd_total``: what the cache's reads saved, every ``by``."""
    repair_savings_usd: float = 0.0
    """Of ``savings_usd``, the repairs' (``by="repair"``)."""
    write_premium_usd: float = 0.0
    """``kvwarm_cache_write_premium_usd_total``: what the writes cost above the input price."""
    provider_verdicts: float = 0.0
    """``kvwarm_provider_cache_diagnoses_total``: responses carrying the provider's cache verdict."""
    provider_side_misses: float = 0.0
    """``kvwarm_provider_cache_misses_total{side="provider"}``: prefixes the provider lost."""
    client_side_misses: float = 0.0
    """``kvwarm_provider_cache_misses_total{side="client"}``: misses the provider put down to a
    changed request."""

    def minus(self, earlier: Totals) -> Totals:
        """What happened between ``earlier`` and this reading (never negative)."""
        return Totals(
            **{f.name: max(0.0, getattr(self, f.name) - getattr(earlier, f.name)) for f in fields(Totals)}
        )

    @property
    def hit_pct(self) -> float | None:
        """Cached share of the prompt tokens whose cached count is known, in percent."""
        if self.cache_known_tokens <= 0:
            return None
        return 100.0 * self.cached_tokens / self.cache_known_tokens

    @property
    def cost_usd(self) -> float:
        return self.cost_billed_usd + self.cost_estimated_usd + self.cost_keepalive_usd

    @property
    def net_savings_usd(self) -> float:
        """What the prompt tokens would have cost uncached minus what they cost: negative while
        the cache's writes are not repaid by its reads."""
        return self.savings_usd - self.write_premium_usd


ZERO = Totals()


@dataclass(frozen=True, slots=True, kw_only=True)
class Reading:
    """One read of the registry."""

    totals: Totals
    breaks_by_reason: Mapping[str, float]
    """``kvwarm_prefix_breaks_total`` by ``reason`` (reasons with a count only)."""


_SUMMED: Mapping[str, str] = {
    "kvwarm_requests_total": "requests",
    "kvwarm_prompt_tokens_total": "prompt_tokens",
    "kvwarm_cached_prompt_tokens_total": "cached_tokens",
    "kvwarm_cache_known_prompt_tokens_total": "cache_known_tokens",
    "kvwarm_completion_tokens_total": "completion_tokens",
    "kvwarm_repair_rescued_tokens_total": "rescued_tokens",
    "kvwarm_repairs_total": "repairs",
    "kvwarm_prefix_breaks_total": "breaks",
    "kvwarm_unpriced_requests_total": "unpriced_requests",
    "kvwarm_cache_write_tokens_total": "cache_write_tokens",
    "kvwarm_keepalive_saved_usd_total": "keepalive_saved_usd",
    "kvwarm_keepalive_lost_usd_total": "keepalive_lost_usd",
    "kvwarm_cache_savings_usd_total": "savings_usd",
    "kvwarm_cache_write_premium_usd_total": "write_premium_usd",
    "kvwarm_provider_cache_diagnoses_total": "provider_verdicts",
}
_COST = "kvwarm_cost_usd_total"
_COST_FIELDS = {"billed": "cost_billed_usd", "estimated": "cost_estimated_usd", "keepalive": "cost_keepalive_usd"}
_KEEPALIVE = "kvwarm_keepalive_requests_total"
_ANSWERED = frozenset(("sent", "missed"))
_SAVINGS = "kvwarm_cache_savings_usd_total"
_BREAKS = "kvwarm_prefix_breaks_total"
_REQUESTS = "kvwarm_requests_total"
_PROVIDER_MISSES = "kvwarm_provider_cache_misses_total"
_SIDE_FIELDS = {"provider": "provider_side_misses", "client": "client_side_misses"}


def read_counters(registry: CollectorRegistry) -> Reading:
    """Sum kvwarm's counters over their labels (one pass over the registry)."""
    values = dict.fromkeys((f.name for f in fields(Totals)), 0.0)
    reasons: dict[str, float] = {}
    for family in registry.collect():
        if not family.name.startswith("kvwarm_"):
            continue
        for sample in family.samples:
            name = sample.name
            if name == _COST:
                source = sample.labels.get("source", "")
                values[_COST_FIELDS.get(source, "cost_estimated_usd")] += sample.value
                continue
            if name == _KEEPALIVE:
                if sample.labels.get("outcome") in _ANSWERED:
                    values["keepalive_pings"] += sample.value
                continue
            if name == _PROVIDER_MISSES:
                side = _SIDE_FIELDS.get(sample.labels.get("side", ""))
                if side is not None:
                    values[side] += sample.value
                continue
            field_name = _SUMMED.get(name)
            if field_name is None:
                continue
            values[field_name] += sample.value
            if name == _REQUESTS and sample.labels.get("status") != "2xx":
                values["requests_failed"] += sample.value
            elif name == _SAVINGS and sample.labels.get("by") == "repair":
                values["repair_savings_usd"] += sample.value
            elif name == _BREAKS and sample.value > 0:
                reason = sample.labels.get("reason", "")
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return Reading(totals=Totals(**values), breaks_by_reason=reasons)
