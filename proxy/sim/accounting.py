"""Token counts of one exchange, and the usage blocks each API reports them in.

The same counts serve both endpoints: chat's ``usage`` (``prompt_tokens``,
``prompt_tokens_details.cached_tokens``, ...), the Responses API's ``usage``
(``input_tokens``, ``input_tokens_details.cached_tokens``, ...), and the
``openhuman`` block (usage plus the amount charged at the configured prices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .state import SimConfig


@dataclass(frozen=True, slots=True)
class Accounting:
    """Token counts of one exchange."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    """Everything generated, reasoning included."""
    reasoning_tokens: int

    def usage(self) -> dict[str, Any]:
        """The chat completions ``usage`` block."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": self.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }

    def response_usage(self) -> dict[str, Any]:
        """The Responses API ``usage`` block.

        ``cache_write_tokens`` is 0: implicit prompt caching writes for free.
        """
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": self.cached_tokens,
                "cache_write_tokens": 0,
            },
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def openhuman(self, config: SimConfig) -> dict[str, Any]:
        """The ``openhuman`` block: usage and the amount charged at the configured prices."""
        uncached = self.prompt_tokens - self.cached_tokens
        charged = (
            uncached * config.price_input
            + self.cached_tokens * config.price_cached_input
            + self.completion_tokens * config.price_output
        ) / 1_000_000
        return {
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "cached_input_tokens": self.cached_tokens,
            },
            "billing": {"charged_amount_usd": charged, "currency": "USD"},
        }
