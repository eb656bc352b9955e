"""Token counts of one exchange, and the usage blocks each API reports them in.

The same counts serve every endpoint: chat's ``usage`` (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``, ...), the Responses API's ``usage``
(``input_tokens``, ``input_tokens_details.cached_tokens``, ...), the Messages
API's ``usage`` (Anthropic's: ``input_tokens`` counts only the prompt tokens
neither read from nor written to the cache, so that ``input_tokens +
cache_creation_input_tokens + cache_read_input_tokens`` is the whole prompt;
``cache_creation`` splits the writes by TTL), and the ``openhuman`` block (usage
plus the amount charged at the configured prices).

In the breakpoint modes a prompt may also write to the cache, and that is
reported and billed: ``prompt_tokens_details.cache_write_tokens`` (chat, as
OpenAI and OpenRouter report it) and ``input_tokens_details.cache_write_tokens``
(Responses; openai-breakpoints also splits it by TTL in
``cache_write_tokens_details``), ``prompt_tokens`` / ``input_tokens`` staying
the whole prompt. With ``SimConfig.anthropic_usage`` chat ``usage`` also carries
Anthropic's ``cache_read_input_tokens`` and ``cache_creation_input_tokens``.
Billing there: a read costs a tenth of ``price_input``; a write costs
``price_input`` times 1.25 (OpenAI, either TTL; Anthropic for 5 minutes) or
2 (Anthropic for an hour). The block modes' usage and billing are unchanged:
no writes, reads at ``price_cached_input``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .engine import CacheUse
from .markers import ANTHROPIC, BREAKPOINT_MODES
from .prompt import Prompt
from .render import Segment, encode_segments
from .state import SimConfig

READ_PRICE = 0.1
"""A cache read, as a multiple of ``price_input`` (breakpoint modes)."""
WRITE_PRICE = 1.25
"""A cache write, as a multiple of ``price_input`` (breakpoint modes)."""
LONG_WRITE_PRICE = {ANTHROPIC: 2.0}
"""A write with the long TTL, as a multiple of ``price_input``, where it differs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Accounting:
    """Token counts of one exchange."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    """Everything generated, reasoning included."""
    reasoning_tokens: int
    cache_write_tokens: int = 0
    """Prompt tokens written to the cache (breakpoint modes)."""
    long_write_tokens: int = 0
    """Of ``cache_write_tokens``, those written for the long TTL (``12h``, ``1h``)."""
    cache_mode: str = "openai"
    """The emulator's cache mode: it decides which fields are reported and how writes bill."""
    anthropic_usage: bool = False
    """Add Anthropic's cache fields to chat ``usage``."""

    @classmethod
    def of(
        cls,
        config: SimConfig,
        use: CacheUse,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        reasoning_tokens: int,
    ) -> Accounting:
        """The counts of an exchange whose prompt used the cache as ``use`` says."""
        return cls(
            prompt_tokens=prompt_tokens,
            cached_tokens=use.cached,
            completion_tokens=completion_tokens,
            reasoning_tokens=reasoning_tokens,
            cache_write_tokens=use.written,
            long_write_tokens=use.written_long,
            cache_mode=config.cache_mode,
            anthropic_usage=config.anthropic_usage,
        )

    @classmethod
    def of_reply(
        cls,
        config: SimConfig,
        use: CacheUse,
        prompt: Prompt,
        reply_tail: Sequence[Segment],
        reasoning: str | None,
    ) -> Accounting:
        """The counts of an exchange that answered ``prompt`` (its cache use ``use``) with
        ``reply_tail`` (:func:`~proxy.sim.render.reply_segments`: the output tokens are its first
        segment, the generated body as it renders, counted alike on every endpoint) and
        ``reasoning``."""
        return cls.of(
            config,
            use,
            prompt_tokens=len(prompt.tokens),
            completion_tokens=len(encode_segments(reply_tail[:1])),
            reasoning_tokens=len(encode_segments([reasoning or ""])),
        )

    @property
    def writes(self) -> bool:
        """Cache writes are reported (a breakpoint mode)."""
        return self.cache_mode in BREAKPOINT_MODES

    def usage(self) -> dict[str, Any]:
        """The chat completions ``usage`` block."""
        details: dict[str, Any] = {"cached_tokens": self.cached_tokens}
        if self.writes:
            details["cache_write_tokens"] = self.cache_write_tokens
        details["audio_tokens"] = 0
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": details,
            "completion_tokens_details": {
                "reasoning_tokens": self.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }
        if self.anthropic_usage:
            usage["cache_read_input_tokens"] = self.cached_tokens
            usage["cache_creation_input_tokens"] = self.cache_write_tokens
        return usage

    def response_usage(self) -> dict[str, Any]:
        """The Responses API ``usage`` block.

        ``cache_write_tokens`` is 0 in the block modes: implicit prompt caching writes for free.
        """
        details: dict[str, Any] = {
            "cached_tokens": self.cached_tokens,
            "cache_write_tokens": self.cache_write_tokens,
        }
        if self.writes and self.cache_mode != ANTHROPIC:
            details["cache_write_tokens_details"] = {
                "ttl_30m_tokens": self.cache_write_tokens - self.long_write_tokens,
                "ttl_12h_tokens": self.long_write_tokens,
            }
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": details,
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def messages_usage(self) -> dict[str, Any]:
        """The Messages API ``usage`` block (Anthropic's).

        The block modes write for free: ``cache_creation_input_tokens`` is 0 and a
        prompt is read or uncached. The writes' split by TTL is the mode's short and
        long TTL (anthropic: 5 minutes and an hour).
        """
        written, long = self.cache_write_tokens, self.long_write_tokens
        return {
            "input_tokens": self.prompt_tokens - self.cached_tokens - written,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": written - long,
                "ephemeral_1h_input_tokens": long,
            },
            "output_tokens": self.completion_tokens,
            "service_tier": "standard",
        }

    def openhuman(self, config: SimConfig) -> dict[str, Any]:
        """The ``openhuman`` block: usage and the amount charged at the configured prices."""
        return {
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "cached_input_tokens": self.cached_tokens,
            },
            "billing": {"charged_amount_usd": self.charged(config), "currency": "USD"},
        }

    def charged(self, config: SimConfig) -> float:
        """USD charged for the exchange at ``config``'s prices."""
        output = self.completion_tokens * config.price_output
        if not self.writes:
            uncached = self.prompt_tokens - self.cached_tokens
            prompt = uncached * config.price_input + self.cached_tokens * config.price_cached_input
            return (prompt + output) / 1_000_000
        short = self.cache_write_tokens - self.long_write_tokens
        plain = self.prompt_tokens - self.cached_tokens - self.cache_write_tokens
        factor = (
            plain
            + self.cached_tokens * READ_PRICE
            + short * WRITE_PRICE
            + self.long_write_tokens * LONG_WRITE_PRICE.get(self.cache_mode, WRITE_PRICE)
        )
        return (factor * config.price_input + output) / 1_000_000
