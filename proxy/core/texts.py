"""The texts inside a message: what becomes tokens and what a person reads. Pure.

The token counter (:mod:`proxy.store.tokens`) and the readable Markdown transcript
(:mod:`proxy.core.transcript_md`) walk messages through these helpers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["REASONING_FIELDS", "calls", "content_parts", "token_texts"]

REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def content_parts(content: Any) -> Iterator[tuple[str, bool]]:
    """``(text, True)`` per text of a content (a string or a list of parts); ``(type, False)``
    for a part without text (an image, audio, ...)."""
    if isinstance(content, str):
        yield content, True
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"], True
            else:
                kind = part.get("type") if isinstance(part, dict) else None
                yield (kind if isinstance(kind, str) else "part"), False


def calls(message: Mapping[str, Any]) -> Iterator[tuple[Any, Any]]:
    """``(name, arguments)`` of each tool call, as sent (either may be any JSON value)."""
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                yield fn.get("name"), fn.get("arguments")


def token_texts(message: Mapping[str, Any]) -> list[str]:
    """The strings of a message that become tokens: texts, reasoning, name, call id, tool names and arguments."""
    out = [text for text, is_text in content_parts(message.get("content")) if is_text]
    for key in (*REASONING_FIELDS, "name", "tool_call_id"):
        value = message.get(key)
        if isinstance(value, str):
            out.append(value)
    for name, arguments in calls(message):
        out.extend(v for v in (name, arguments) if isinstance(v, str))
    return out
