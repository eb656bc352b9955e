"""What kvwarm has learned about one upstream: its *traits*.

Traits belong to one upstream (one base URL, one replica of a pool) and change
how requests to that upstream are planned, never requests to another.

``reports_timings``
    The upstream answered with llama.cpp's ``timings`` block (``cache_n`` /
    ``prompt_n``). Such a server reports cached and prefilled tokens in every
    stream's finish chunk, and moves ``timings`` into the usage chunk when
    ``stream_options.include_usage`` is set: kvwarm then stops adding
    ``include_usage`` on the client's behalf (the usage chunk it would hide would
    take ``timings`` with it).
``cache_breakpoints``
    The cache-marker rule of this upstream (:func:`proxy.core.breakpoints.host_rule`): set from
    ``upstream.cache_breakpoints`` and the upstream's host when the app starts, not learned;
    each request's model then decides its dialect (``auto`` on api.openai.com, openrouter.ai).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpstreamTraits"]


@dataclass(slots=True, kw_only=True)
class UpstreamTraits:
    """Learned from responses (the marker rule: configured); read by the planner of the next
    request to the same upstream."""

    reports_timings: bool = False
    cache_breakpoints: str = "off"
    """``off``, ``openai``, ``cache_control``, or an ``auto:`` rule by host (see above)."""
