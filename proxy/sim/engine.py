"""The emulated engine's prefill and KV reuse: what a prompt costs and what stays cached.

- :func:`prefill` reads the prompt's cached prefix and caches what the mode
  caches: in the block modes every full block of the prompt (the block cache,
  :mod:`.cache`); in the breakpoint modes the prefixes its plan writes (the
  breakpoint cache, :mod:`.breakpoint_cache`; the plan is :mod:`.markers`'),
  counting the tokens written, and, when the request asked for them, the
  prompt-cache diagnostics (:mod:`.diagnostics`);
- :func:`time_to_first_token` grows with the uncached tokens;
- :func:`keep_generated` caches the prompt plus the generated reply, rendered
  as the reply will be echoed in the next request's history (vLLM mode only: a
  local engine keeps the KV of what it generated, a hosted API caches prompts
  only).

Every endpoint shares one cache: one engine serves chat, Responses and Messages alike.
Every TTL runs on the state's clock (:mod:`.clock`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .breakpoint_cache import BreakpointCache, prefix_digests
from .diagnostics import Fingerprint, diagnose
from .markers import CachePlan, Write
from .prompt import Prompt
from .render import Segment, encode_segments
from .state import SimConfig, SimState


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheUse:
    """What one prompt read from and wrote to the cache."""

    cached: int
    """Leading prompt tokens read from the cache."""
    written: int = 0
    """Prompt tokens written to the cache (breakpoint modes; the block modes write for free)."""
    written_long: int = 0
    """Of ``written``, the tokens held for the long TTL (``12h``, ``1h``)."""
    diagnostics: Mapping[str, Any] | None = None
    """``prompt_cache_diagnostics``, when the request asked for them."""
    fingerprint: Fingerprint | None = None
    """What a later request's diagnostics compare with (openai-breakpoints, Responses)."""


def prefill(state: SimState, prompt: Prompt) -> CacheUse:
    """Read the prompt's cached prefix (touching it), then cache what the mode caches."""
    now = state.clock()
    if prompt.plan is not None:
        return _prefill_breakpoints(state, prompt.plan, now)
    cached = state.cache.lookup(prompt.tokens, now, prompt.hashes)
    state.cache.insert(prompt.tokens, now, prompt.hashes)
    return CacheUse(cached=cached)


def time_to_first_token(config: SimConfig, prompt_tokens: int, cached_tokens: int) -> float:
    """Seconds before the first token: a base plus a cost per uncached prompt token."""
    return config.ttft_base + config.ttft_per_uncached_token * (prompt_tokens - cached_tokens)


async def wait_first_token(config: SimConfig, prompt: Prompt, use: CacheUse) -> None:
    """Wait the time to the first token of an answer to ``prompt`` (its cache use ``use``)."""
    ttft = time_to_first_token(config, len(prompt.tokens), use.cached)
    if ttft:
        await asyncio.sleep(ttft)


def keep_generated(state: SimState, prompt: Prompt, reply_tail: Sequence[Segment]) -> None:
    """vLLM mode: cache the prompt followed by the reply's segments (no-op in the other modes)."""
    if state.config.cache_mode != "vllm":
        return
    generated = prompt.tokens + encode_segments(reply_tail)
    hashes = state.cache.block_hashes(generated, known=prompt.hashes)
    state.cache.insert(generated, state.clock(), hashes)


def _prefill_breakpoints(state: SimState, plan: CachePlan, now: float) -> CacheUse:
    store = state.breakpoints
    reads = store.recent(plan.key, now) if plan.reads is None else plan.reads
    reads = [length for length in reads if length < plan.length]
    boundaries = plan.boundaries if plan.settings is not None else ()
    digests = prefix_digests(
        plan.data, [*reads, *(write.offset for write in plan.writes), *boundaries]
    )
    cached = store.read(plan.key, {length: digests[length] for length in reads}, now)
    diagnostics = None
    if plan.comparison_id is not None and plan.settings is not None:
        # Before this prompt's writes: they may rewrite the very prefix that went missing.
        comparison = state.fingerprints.get(plan.comparison_id)
        key = comparison.key if comparison is not None else plan.key
        diagnostics = diagnose(
            plan.settings,
            plan.data,
            cached,
            comparison,
            lambda digest: store.fate(key, digest, now),
        )
    written, written_long = _write(store, plan, digests, cached, now)
    fingerprint = None
    if plan.settings is not None:
        ends = sorted({*boundaries, *(write.offset for write in plan.writes)})
        fingerprint = Fingerprint(
            key=plan.key,
            settings=plan.settings,
            boundaries=tuple((offset, digests[offset]) for offset in ends),
            written=tuple((write.offset, digests[write.offset]) for write in plan.writes),
        )
    return CacheUse(cached=cached, written=written, written_long=written_long, diagnostics=diagnostics, fingerprint=fingerprint)


def _write(
    store: BreakpointCache, plan: CachePlan, digests: Mapping[int, bytes], cached: int, now: float
) -> tuple[int, int]:
    """Write the plan's prefixes; returns the tokens written, and how many of them for the
    long TTL. Only tokens past what was read are written, each once, held as long as the
    longest-lived new prefix that contains it."""
    new: list[Write] = [
        write
        for write in plan.writes
        if store.write(plan.key, write.offset, digests[write.offset], write.ttl, now)
    ]
    written = written_long = 0
    done = cached
    for index, write in enumerate(new):
        if write.offset <= done:
            continue
        span = write.offset - done
        written += span
        if any(later.long for later in new[index:]):
            written_long += span
        done = write.offset
    return written, written_long
