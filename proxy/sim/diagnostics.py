"""Prompt-cache diagnostics (openai-breakpoints mode, Responses API): why a prefix was not reused.

A Responses request whose ``prompt_cache_options.comparison_response_id`` names
an earlier response gets ``prompt_cache_diagnostics`` beside its ``usage``, in
the shape of OpenAI's Responses API (the ``openai`` SDK's
``Response.prompt_cache_diagnostics``):

- ``{"type": "cache_hit"}``: it read at least the longest prefix the compared
  response wrote;
- ``{"type": "cache_miss", "reason": R, "cache_missed_tokens": N,
  "comparison_reusable_tokens": M}``: ``M`` is the longest prefix the compared
  response wrote, ``N`` the prompt tokens after the first divergence (after
  what was read, when the prompt did not diverge). ``R`` is the first that
  applies of OpenAI's reasons ``model_changed``, ``prompt_cache_key_changed``,
  ``service_tier_changed``, ``tools_changed``, ``text_format_changed``,
  ``reasoning_effort_changed``, ``verbosity_changed`` (that setting differs) or
  ``input_changed`` (the prompt diverges before the end of that prefix);
- ``{"type": "comparison_response_not_found"}``: no such response, or forgotten;
- ``{"type": "unavailable", "sim_reason": R, "cache_missed_tokens": N,
  "comparison_reusable_tokens": M}``: a miss OpenAI's reasons do not name, with
  the emulator's own explanation in ``sim_reason`` (a field of the emulator's,
  not OpenAI's: the SDK's models keep unknown fields, and would warn about an
  unknown ``reason``): ``not_written`` (the compared response wrote no prefix:
  under 1024 tokens, or explicit mode without breakpoints), ``expired`` or
  ``evicted`` (its prefix was written and is gone), ``unknown``.

Divergence is located at message boundaries and at the written prefixes (an
estimate, as OpenAI's is). The fingerprints of the last
:data:`FINGERPRINTS_KEPT` responses are kept, stored or not. Only the settings'
values are compared: in the emulator the text format, reasoning effort and
verbosity do not change the tokens, so they explain a miss but never cause one.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .breakpoint_cache import prefix_digests

FINGERPRINTS_KEPT = 1000
_TOKEN_BYTES = 8

Settings = tuple[tuple[str, str], ...]
"""``(reason, value)`` pairs: the reason a miss is put down to when that value changed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    """What a later request is compared with: one response's cache-relevant facts."""

    key: bytes
    """The cache key its prefixes were written under."""
    settings: Settings
    boundaries: tuple[tuple[int, bytes], ...]
    """``(offset, digest of the prompt up to it)`` at each message end and written prefix."""
    written: tuple[tuple[int, bytes], ...]
    """The prefixes it wrote (or refreshed), ``(length, digest)``."""

    @property
    def reusable(self) -> tuple[int, bytes] | None:
        """Its longest written prefix, ``(length, digest)``."""
        return max(self.written, default=None)


class Fingerprints:
    """Fingerprints by response id; beyond ``capacity`` the oldest are forgotten."""

    __slots__ = ("_kept", "capacity")

    def __init__(self, capacity: int = FINGERPRINTS_KEPT) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Fingerprint] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> Fingerprint | None:
        return self._kept.get(response_id)

    def put(self, response_id: str, fingerprint: Fingerprint) -> None:
        self._kept[response_id] = fingerprint
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        self._kept.clear()


def cache_settings(request: Mapping[str, Any], model: str, tools_text: str) -> Settings:
    """The request's settings a cache depends on, each under the reason its change is given."""
    text = _mapping(request.get("text"))
    reasoning = _mapping(request.get("reasoning"))
    return (
        ("model_changed", model),
        ("prompt_cache_key_changed", _canonical(request.get("prompt_cache_key"))),
        ("service_tier_changed", _canonical(request.get("service_tier"))),
        ("tools_changed", hashlib.blake2b(tools_text.encode(), digest_size=16).hexdigest()),
        ("text_format_changed", _canonical(text.get("format"))),
        ("reasoning_effort_changed", _canonical(reasoning.get("effort"))),
        ("verbosity_changed", _canonical(text.get("verbosity"))),
    )


def diagnose(
    settings: Settings,
    data: bytes,
    cached: int,
    comparison: Fingerprint | None,
    fate: Callable[[bytes], str | None],
) -> dict[str, Any]:
    """``prompt_cache_diagnostics`` of a prompt (its ``settings``, its tokens' bytes ``data``,
    ``cached`` tokens read) against ``comparison``. ``fate``: what became of one of the
    comparison's prefixes, by digest (:meth:`.breakpoint_cache.BreakpointCache.fate`)."""
    if comparison is None:
        return {"type": "comparison_response_not_found"}
    length = len(data) // _TOKEN_BYTES
    reusable = comparison.reusable
    if reusable is not None and cached >= reusable[0]:
        return {"type": "cache_hit"}
    reusable_tokens = reusable[0] if reusable is not None else 0
    for (reason, value), (_, before) in zip(settings, comparison.settings, strict=True):
        if value != before:
            return _miss("cache_miss", reason, length - cached, reusable_tokens)
    if reusable is None:
        return _miss("unavailable", "not_written", length - cached, 0)
    matched = _matched(data, comparison.boundaries)
    if matched < reusable[0]:
        return _miss("cache_miss", "input_changed", length - matched, reusable_tokens)
    gone = fate(reusable[1])
    reason = gone if gone in ("expired", "evicted") else "unknown"
    return _miss("unavailable", reason, length - cached, reusable_tokens)


def _matched(data: bytes, boundaries: tuple[tuple[int, bytes], ...]) -> int:
    """The longest of ``boundaries`` the prompt ``data`` agrees with up to."""
    length = len(data) // _TOKEN_BYTES
    theirs = dict(boundaries)
    ours = prefix_digests(data, [offset for offset in theirs if offset <= length])
    return max((offset for offset, digest in ours.items() if theirs[offset] == digest), default=0)


def _miss(kind: str, reason: str, missed: int, reusable: int) -> dict[str, Any]:
    return {
        "type": kind,
        "reason" if kind == "cache_miss" else "sim_reason": reason,
        "cache_missed_tokens": missed,
        "comparison_reusable_tokens": reusable,
    }


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
