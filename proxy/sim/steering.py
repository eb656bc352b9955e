"""The ``x-sim-*`` request headers that steer one request, parsed once into :class:`Steering`.

- ``x-sim-fault: k=v,...`` — faults (:mod:`.faults`);
- ``x-sim-reply-tokens: N`` — size of a text reply (default 40);
- ``x-sim-reasoning: 1`` — generate reasoning (chat: ``reasoning_content``;
  Responses: a ``reasoning`` item, as a ``reasoning`` parameter does; Messages:
  a ``thinking`` block, as ``thinking: {"type": "enabled"}`` does);
- ``x-sim-tool-calls: N`` — Responses and Messages: how many ``function_call``
  items (``tool_use`` blocks) a turn that calls tools makes (default 1; ``0``:
  always answer with text; ``parallel_tool_calls: false``, or
  ``tool_choice.disable_parallel_tool_use``, caps it at 1);
- ``x-sim-compress: gzip`` — gzip a non-streaming body.

A malformed value is a ``ValueError`` naming the header (the endpoint answers 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .faults import FAULT_HEADER, Faults
from .replies import DEFAULT_REPLY_TOKENS

REPLY_TOKENS_HEADER = "x-sim-reply-tokens"
REASONING_HEADER = "x-sim-reasoning"
TOOL_CALLS_HEADER = "x-sim-tool-calls"
COMPRESS_HEADER = "x-sim-compress"

MAX_REPLY_TOKENS = 100_000
MAX_TOOL_CALLS = 16
DEFAULT_TOOL_CALLS = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Steering:
    """What one request's ``x-sim-*`` headers asked for."""

    faults: Faults
    reply_tokens: int = DEFAULT_REPLY_TOKENS
    reasoning: bool = False
    tool_calls: int = DEFAULT_TOOL_CALLS
    gzip: bool = False

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Steering:
        """Parse the steering headers of a request; ``ValueError`` names a bad one."""
        return cls(
            faults=Faults.parse(headers.get(FAULT_HEADER)),
            reply_tokens=_bounded(
                headers.get(REPLY_TOKENS_HEADER),
                REPLY_TOKENS_HEADER,
                1,
                MAX_REPLY_TOKENS,
                DEFAULT_REPLY_TOKENS,
            ),
            reasoning=headers.get(REASONING_HEADER, "").strip().lower() in ("1", "true", "yes"),
            tool_calls=_bounded(
                headers.get(TOOL_CALLS_HEADER),
                TOOL_CALLS_HEADER,
                0,
                MAX_TOOL_CALLS,
                DEFAULT_TOOL_CALLS,
            ),
            gzip=headers.get(COMPRESS_HEADER, "").strip().lower() == "gzip",
        )


def _bounded(header: str | None, name: str, low: int, high: int, default: int) -> int:
    if header is None or not header.strip():
        return default
    try:
        value = int(header)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {header!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}")
    return value
