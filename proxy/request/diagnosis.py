"""Provider diagnostics: ask the provider whether it lost a prompt's cache, and hear its verdict.

A cache miss is the client's (it drifted: kvwarm's own diagnosis, ``x-kvwarm-break`` and
``kvwarm_prefix_breaks_total``, says where and why) or the provider's (its TTL elapsed, it evicted
the prefix, the request went to a machine that never held it). Only the provider knows the
second, and says so when a request names an earlier response to compare with
(:mod:`proxy.core.provider_misses` reads its answer).

With ``upstream.provider_diagnostics = true`` (off by default: it adds a member to the bytes the
client sent) kvwarm names that response where the client named none:

* **which**: the request's own ``previous_response_id`` when it has one; else the response whose
  reply is the deepest part of the request's matched prefix -- for a session that goes on, its
  previous turn's (after a break, the last one before the break; none when the match ends before
  every recorded reply). Response ids are kept here by the chain key of the node that recorded the
  reply's last item, the :data:`REMEMBERED` most recently used: keys are tenant-rooted, so a
  request only ever names its own tenant's responses. Per process: with several workers or
  replicas, a turn served by another process than the turn before it goes without a comparison;
* **how**: spliced into the bytes as they go upstream (:func:`asked`), as
  :mod:`proxy.routing.cache_key` splices ``prompt_cache_key``, by the wire API's own function
  (:data:`ASKERS`); a client's own comparison is never replaced, and a request the splice would
  make invalid (``prompt_cache_retention`` beside new options) goes as it came;
* **the verdict**: the wire's observer reads the response's ``id`` and the provider's verdict
  (attributes ``response_id`` and ``verdict``, :func:`verdict_of`), whoever asked for it. It
  arrives with the response, after kvwarm's own ``x-kvwarm-*`` headers went out: it is reported
  in the metrics (``kvwarm_provider_cache_diagnoses_total{verdict}``,
  ``kvwarm_provider_cache_misses_total{side,reason}``), the log line (``provider=``) and the
  live page, beside kvwarm's own break; the client has it in the response itself
  (``prompt_cache_diagnostics``).

Only the Responses API asks today. The Messages API's seam (Anthropic: ``diagnostics:
{"previous_message_id": id}`` with the beta header ``anthropic-beta: cache-diagnosis-2026-04-07``,
the verdict in the response's ``diagnostics``, :func:`~proxy.core.provider_misses.anthropic_verdict`):
its wire adds a splice function to :data:`ASKERS`, the pipeline adds the beta header to the
request's headers when it asks, and its observer sets ``response_id`` (the message ``id``) and
``verdict``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ..core.plan import TurnPlan
from ..core.provider_misses import CacheVerdict
from ..wire.responses import with_comparison

__all__ = ["ASKERS", "REMEMBERED", "ProviderDiagnosis", "asked", "verdict_of"]

REMEMBERED = 32768
"""Response ids kept (about 8 MiB at most): the least recently used are forgotten first."""

ASKERS: Mapping[str, Callable[[bytes, Mapping[str, Any], str], bytes]] = {"responses": with_comparison}
"""Per wire API (:attr:`~proxy.wire.base.Wire.name`), how a comparison is spliced into its bytes."""


class ProviderDiagnosis:
    """Which earlier response each request is compared with; the response ids it may name."""

    __slots__ = ("_ids", "capacity", "enabled")

    def __init__(self, enabled: bool, capacity: int = REMEMBERED) -> None:
        self.enabled = enabled
        """``upstream.provider_diagnostics``: kvwarm names comparisons (the verdicts of comparisons
        a client asked for itself are read either way)."""
        self.capacity = max(1, capacity)
        self._ids: OrderedDict[bytes, str] = OrderedDict()
        """Chain key of a reply's last recorded node -> that response's id."""

    def comparison(self, api: str, body: Mapping[str, Any], plan: TurnPlan | None) -> str | None:
        """The response the request of wire API ``api`` is to be compared with; None: none."""
        if not self.enabled or api not in ASKERS:
            return None
        previous = body.get("previous_response_id")
        if isinstance(previous, str) and previous:
            return previous
        match = plan.match if plan is not None else None
        if match is None:
            return None
        ids = self._ids
        for key in reversed(match.keys[: match.matched]):
            found = ids.get(key)
            if found is not None:
                ids.move_to_end(key)
                return found
        return None

    def remember(self, leaf: bytes, observer: object) -> None:
        """Keep the id of the response ``observer`` read, under ``leaf``: the chain key of the node
        that recorded the turn's last element (its reply's last item)."""
        if not self.enabled:
            return
        found = getattr(observer, "response_id", None)
        if not isinstance(found, str) or not found:
            return
        ids = self._ids
        ids[leaf] = found
        ids.move_to_end(leaf)
        while len(ids) > self.capacity:
            ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)


def asked(api: str, raw: bytes, body: Mapping[str, Any], response_id: str) -> bytes:
    """``raw`` (the bytes about to go upstream) naming ``response_id`` as the comparison, as wire API
    ``api`` says it; ``raw`` itself when that API cannot ask, or the request cannot take it."""
    ask = ASKERS.get(api)
    return raw if ask is None else ask(raw, body, response_id)


def verdict_of(observer: object) -> CacheVerdict | None:
    """The provider's verdict an observer read (an observer that reads none has no ``verdict``)."""
    found = getattr(observer, "verdict", None)
    return found if isinstance(found, CacheVerdict) else None
