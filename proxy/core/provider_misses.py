"""The provider's own word on a cache miss, read into one :class:`CacheVerdict`. Pure.

A prompt-cache miss has two causes. The *client drifted*: the request no longer starts as the
cached one did. kvwarm sees that itself, before the request goes out (a prefix break,
:mod:`proxy.core.breaks`), and repairs it where the change is only formatting. Or the
*provider lost the prefix*: its TTL elapsed, it was evicted, the request went to a machine that
never held it. Only the provider can tell that, and some do when asked to compare a request with
an earlier response:

* **OpenAI** (Responses API; ``prompt_cache_options.comparison_response_id`` names the earlier
  response): ``prompt_cache_diagnostics`` beside the response's ``usage``, one of
  ``{"type": "cache_hit"}``; ``{"type": "cache_miss", "reason": R, "cache_missed_tokens": N,
  "comparison_reusable_tokens": M}`` where ``R`` names what changed in the request
  (:data:`OPENAI_CHANGES`); ``{"type": "comparison_response_not_found"}``; ``{"type":
  "unavailable", ...}``, a miss none of those reasons explains: the provider lost the prefix
  (the reference upstream adds its own ``sim_reason``: ``expired``, ``evicted``, or
  ``not_written`` when the earlier response wrote no prefix at all);
* **Anthropic** (Messages API; ``diagnostics.previous_message_id``, beta header
  ``cache-diagnosis-2026-04-07``): a ``diagnostics`` object whose ``cache_miss_reason`` is
  ``{"type": R, "cache_missed_input_tokens": N}`` with ``R`` one of :data:`ANTHROPIC_CHANGES`,
  ``previous_message_not_found`` or ``unavailable``; ``null`` while the comparison still runs.
  No ``diagnostics`` at all means no divergence was found: read with the usage, a prompt that
  read nothing from the cache then lost it at the provider.

Each is read into a verdict (:data:`VERDICTS`): ``hit``; ``client_miss`` (the request differed
from the compared one: the client's doing, or kvwarm's when its own ``prompt_cache_key`` shard
moved); ``provider_miss`` (the request matched and the provider no longer had the prefix);
``unknown`` (the compared response was forgotten, wrote nothing, or the comparison is still
running). Reasons are a bounded vocabulary (:data:`REASONS`, ``other`` for anything else): they
become metric labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "ANTHROPIC_CHANGES",
    "CLIENT_MISS",
    "HIT",
    "OPENAI_CHANGES",
    "PROVIDER_MISS",
    "REASONS",
    "SIDES",
    "UNKNOWN",
    "VERDICTS",
    "CacheVerdict",
    "anthropic_verdict",
    "openai_verdict",
]

HIT: Final = "hit"
CLIENT_MISS: Final = "client_miss"
PROVIDER_MISS: Final = "provider_miss"
UNKNOWN: Final = "unknown"
VERDICTS: Final = (HIT, CLIENT_MISS, PROVIDER_MISS, UNKNOWN)
"""Every :attr:`CacheVerdict.verdict` (the ``verdict`` label of ``kvwarm_provider_cache_diagnoses_total``)."""

OPENAI_CHANGES: Final = (
    "model_changed",
    "prompt_cache_key_changed",
    "service_tier_changed",
    "tools_changed",
    "text_format_changed",
    "reasoning_effort_changed",
    "verbosity_changed",
    "input_changed",
)
"""OpenAI's ``cache_miss`` reasons: each names a difference of the request from the compared one."""
ANTHROPIC_CHANGES: Final = ("model_changed", "system_changed", "tools_changed", "messages_changed")
"""Anthropic's ``*_changed`` reasons."""
LOST: Final = ("expired", "evicted", "unavailable", "not_reused")
"""Why a provider-side miss happened: the TTL elapsed, the prefix was evicted (both named only by
the reference upstream), the provider did not say (OpenAI's ``unavailable``), or it found no
difference and read nothing (Anthropic)."""
UNKNOWNS: Final = ("comparison_not_found", "not_written", "pending", "unavailable")
REASONS: Final = frozenset((*OPENAI_CHANGES, *ANTHROPIC_CHANGES, *LOST, *UNKNOWNS, "other"))
"""Every :attr:`CacheVerdict.reason` but ``""`` (a hit's)."""

SIDES: Final = ("client", "provider")
"""Every :attr:`CacheVerdict.side` of a miss."""
_SIM_LOST = frozenset(("expired", "evicted"))
_SIDES = {CLIENT_MISS: SIDES[0], PROVIDER_MISS: SIDES[1]}


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheVerdict:
    """What the provider said of one response's cache use, compared with an earlier response."""

    verdict: str
    """One of :data:`VERDICTS`."""
    reason: str = ""
    """Why it missed (or why the verdict is unknown), one of :data:`REASONS`; ``""`` for a hit."""
    missed_tokens: int | None = None
    """Prompt tokens past the point of divergence (or past what was read), when the provider says."""

    @property
    def side(self) -> str:
        """``client`` or ``provider`` for a miss (the ``side`` label of
        ``kvwarm_provider_cache_misses_total``); ``""`` otherwise."""
        return _SIDES.get(self.verdict, "")

    @property
    def label(self) -> str:
        """The log line's ``provider=`` value: ``hit``, ``client:input_changed``,
        ``provider:expired``, ``unknown:comparison_not_found``."""
        if self.verdict == HIT:
            return HIT
        return f"{self.side or self.verdict}:{self.reason}"


_HIT: Final = CacheVerdict(verdict=HIT)


def openai_verdict(diagnostics: Any) -> CacheVerdict | None:
    """The verdict of OpenAI's ``prompt_cache_diagnostics`` (None: there are none, or they are
    not an object with a ``type``)."""
    if type(diagnostics) is not dict:
        return None
    kind = diagnostics.get("type")
    missed = _count(diagnostics.get("cache_missed_tokens"))
    if kind == "cache_hit":
        return _HIT
    if kind == "cache_miss":
        reason = _known(diagnostics.get("reason"), OPENAI_CHANGES)
        return CacheVerdict(verdict=CLIENT_MISS, reason=reason, missed_tokens=missed)
    if kind == "unavailable":
        detail = diagnostics.get("sim_reason")
        if detail == "not_written":
            return CacheVerdict(verdict=UNKNOWN, reason="not_written", missed_tokens=missed)
        reason = detail if isinstance(detail, str) and detail in _SIM_LOST else "unavailable"
        return CacheVerdict(verdict=PROVIDER_MISS, reason=reason, missed_tokens=missed)
    if kind == "comparison_response_not_found":
        return CacheVerdict(verdict=UNKNOWN, reason="comparison_not_found")
    if isinstance(kind, str):
        return CacheVerdict(verdict=UNKNOWN, reason="other")
    return None


def anthropic_verdict(
    diagnostics: Any, cached_tokens: int | None, *, prompt_tokens: int | None = None, min_tokens: int = 1024
) -> CacheVerdict | None:
    """The verdict of a Messages response to a request that named ``diagnostics.previous_message_id``.

    ``diagnostics``: the response's ``diagnostics`` (None when it has none: no divergence was
    found); ``cached_tokens`` / ``prompt_tokens``: its usage's read and whole prompt. A prompt of
    fewer than ``min_tokens`` could not have been cached: its reading nothing is no loss."""
    if type(diagnostics) is dict:
        found = diagnostics.get("cache_miss_reason")
        if found is None:
            return CacheVerdict(verdict=UNKNOWN, reason="pending")  # the comparison still runs
        if type(found) is not dict:
            return CacheVerdict(verdict=UNKNOWN, reason="other")
        kind = found.get("type")
        if kind == "previous_message_not_found":
            return CacheVerdict(verdict=UNKNOWN, reason="comparison_not_found")
        if kind == "unavailable":
            return CacheVerdict(verdict=UNKNOWN, reason="unavailable")
        missed = _count(found.get("cache_missed_input_tokens"))
        return CacheVerdict(verdict=CLIENT_MISS, reason=_known(kind, ANTHROPIC_CHANGES), missed_tokens=missed)
    if diagnostics is not None or cached_tokens is None:
        return None
    if cached_tokens > 0:
        return _HIT
    if prompt_tokens is not None and prompt_tokens < min_tokens:
        return CacheVerdict(verdict=UNKNOWN, reason="not_written")
    return CacheVerdict(verdict=PROVIDER_MISS, reason="not_reused", missed_tokens=prompt_tokens)


def _known(reason: Any, vocabulary: tuple[str, ...]) -> str:
    return reason if isinstance(reason, str) and reason in vocabulary else "other"


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None

