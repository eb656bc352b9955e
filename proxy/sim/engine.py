"""The emulated engine's prefill and KV reuse: what a prompt costs and what stays cached.

- :func:`prefill` looks the prompt up in the prefix cache (the cached leading
  tokens are what ``cached_tokens`` reports) and caches its blocks;
- :func:`time_to_first_token` grows with the uncached tokens;
- :func:`keep_generated` caches the prompt plus the generated reply, rendered
  as the reply will be echoed in the next request (vLLM mode only: a local
  engine keeps the KV of what it generated, a hosted API caches prompts only).

Both endpoints share one cache: one engine serves chat and Responses alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from .prompt import Prompt
from .render import Segment, encode_segments
from .state import SimConfig, SimState


def prefill(state: SimState, prompt: Prompt) -> int:
    """Cached leading tokens of the prompt (touched); the prompt's blocks are cached after."""
    now = state.clock()
    cached = state.cache.lookup(prompt.tokens, now, prompt.hashes)
    state.cache.insert(prompt.tokens, now, prompt.hashes)
    return cached


def time_to_first_token(config: SimConfig, prompt_tokens: int, cached_tokens: int) -> float:
    """Seconds before the first token: a base plus a cost per uncached prompt token."""
    return config.ttft_base + config.ttft_per_uncached_token * (prompt_tokens - cached_tokens)


def keep_generated(state: SimState, prompt: Prompt, reply_tail: Sequence[Segment]) -> None:
    """vLLM mode: cache the prompt followed by the reply's segments (no-op in OpenAI mode)."""
    if state.config.cache_mode != "vllm":
        return
    generated = prompt.tokens + encode_segments(reply_tail)
    hashes = state.cache.block_hashes(generated, known=prompt.hashes)
    state.cache.insert(generated, state.clock(), hashes)
