"""The Messages API's response: the ``message`` object and its streaming events.

:func:`message_object` is the non-streaming body (every field the ``anthropic``
SDK's ``Message`` requires). :func:`message_events` streams it as Anthropic does,
``event: <type>\\ndata: <json>\\n\\n`` blocks in this order:

``message_start`` (the message with no content, ``stop_reason`` null, and its
usage: the input counts, ``output_tokens`` 1), then per content block
``content_block_start`` (the block as it starts: empty ``text`` / ``thinking``
and ``signature``, a ``tool_use`` with ``input`` ``{}``), ``ping`` after the
first one, ``content_block_delta`` events (``text_delta``; ``thinking_delta``
then one ``signature_delta``; ``input_json_delta``, an empty ``partial_json``
first, as Anthropic sends it), ``content_block_stop``; then ``message_delta``
(``stop_reason``, ``stop_sequence`` and the final usage, cumulative) and
``message_stop``. Concatenated deltas give back the blocks exactly: the partial
JSON of a ``tool_use`` is its ``input`` as compact JSON in its key order.

Pure: values in, bytes out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

from .content_blocks import tool_input_text
from .events import ARGUMENT_CHARS, WORDS_PER_DELTA, split_chars, split_words

_DELTA_USAGE = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)
"""The usage fields a ``message_delta`` carries (Anthropic's ``MessageDeltaUsage``)."""


def message_object(
    *,
    message_id: str,
    model: str,
    content: Sequence[Mapping[str, Any]],
    stop_reason: str | None,
    usage: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``message`` object a Messages request is answered with."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": list(content),
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": dict(usage),
    }


def message_events(message: Mapping[str, Any]) -> list[bytes]:
    """The SSE events streaming ``message`` (a :func:`message_object`)."""
    usage: Mapping[str, Any] = message["usage"]
    started = {
        **message,
        "content": [],
        "stop_reason": None,
        "usage": {**usage, "output_tokens": min(1, usage["output_tokens"])},
    }
    payloads: list[dict[str, Any]] = [{"type": "message_start", "message": started}]
    content: Sequence[Mapping[str, Any]] = message["content"]
    for index, block in enumerate(content):
        payloads.append(
            {"type": "content_block_start", "index": index, "content_block": _started(block)}
        )
        if index == 0:
            payloads.append({"type": "ping"})
        payloads += (
            {"type": "content_block_delta", "index": index, "delta": d} for d in _deltas(block)
        )
        payloads.append({"type": "content_block_stop", "index": index})
    if not content:
        payloads.append({"type": "ping"})
    payloads.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {name: usage[name] for name in _DELTA_USAGE},
        }
    )
    payloads.append({"type": "message_stop"})
    return [_encode(payload) for payload in payloads]


def _encode(payload: Mapping[str, Any]) -> bytes:
    kind: str = payload["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _started(block: Mapping[str, Any]) -> dict[str, Any]:
    """The block as ``content_block_start`` shows it: nothing generated yet."""
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": ""}
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if kind == "tool_use":
        return {**block, "input": {}}
    return dict(block)


def _deltas(block: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    kind = block["type"]
    if kind == "text":
        for fragment in split_words(block["text"], WORDS_PER_DELTA):
            yield {"type": "text_delta", "text": fragment}
    elif kind == "thinking":
        for fragment in split_words(block["thinking"], WORDS_PER_DELTA):
            yield {"type": "thinking_delta", "thinking": fragment}
        yield {"type": "signature_delta", "signature": block["signature"]}
    elif kind == "tool_use":
        yield {"type": "input_json_delta", "partial_json": ""}
        for fragment in split_chars(tool_input_text(block["input"]), ARGUMENT_CHARS):
            yield {"type": "input_json_delta", "partial_json": fragment}
