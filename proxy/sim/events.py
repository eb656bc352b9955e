"""The Responses API's streaming events: a response as ``event: <type>\\ndata: <json>\\n\\n`` blocks.

The sequence a real provider sends, each event with its ``type`` and a
``sequence_number`` counting from 0:

``response.created``, ``response.in_progress`` (the response, ``in_progress``,
no output yet), then per output item ``response.output_item.added`` (the item
as it starts: a message with no content, a call with empty ``arguments``),

- reasoning with a summary: ``response.reasoning_summary_part.added``,
  ``response.reasoning_summary_text.delta`` (several),
  ``response.reasoning_summary_text.done``, ``response.reasoning_summary_part.done``;
- message: ``response.content_part.added``, ``response.output_text.delta``
  (several), ``response.output_text.done``, ``response.content_part.done``;
- function call: ``response.function_call_arguments.delta`` (several),
  ``response.function_call_arguments.done`` (a custom tool call:
  ``response.custom_tool_call_input.delta`` / ``.done``);

then ``response.output_item.done`` (the finished item), and last
``response.completed`` with the whole response and its usage. No ``[DONE]``
sentinel: the Responses API does not send one. Concatenated deltas give back
the finished strings exactly.

Pure: values in, bytes out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

_WORD = re.compile(r"\S+\s*|\s+")
WORDS_PER_DELTA = 3
ARGUMENT_CHARS = 8
_CALL_EVENTS = {
    "function_call": ("response.function_call_arguments", "arguments"),
    "custom_tool_call": ("response.custom_tool_call_input", "input"),
}
"""Call item type -> (event type prefix, field the deltas stream)."""


def response_events(in_progress: Mapping[str, Any], completed: Mapping[str, Any]) -> list[bytes]:
    """The SSE events streaming ``completed`` (``in_progress``: the same response as it starts)."""
    payloads: list[dict[str, Any]] = [
        {"type": "response.created", "response": in_progress},
        {"type": "response.in_progress", "response": in_progress},
    ]
    for index, item in enumerate(completed["output"]):
        payloads += _item_events(index, item)
    payloads.append({"type": "response.completed", "response": completed})
    return [_encode(number, payload) for number, payload in enumerate(payloads)]


def _encode(number: int, payload: dict[str, Any]) -> bytes:
    kind: str = payload["type"]
    data = orjson.dumps({"type": kind, "sequence_number": number, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def _item_events(index: int, item: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    kind = item["type"]
    yield {"type": "response.output_item.added", "output_index": index, "item": _started(item)}
    where = {"item_id": item["id"], "output_index": index}
    if kind == "reasoning":
        yield from _summary_events(where, item)
    elif kind == "message":
        yield from _text_events(where, item)
    elif kind in _CALL_EVENTS:
        event, field = _CALL_EVENTS[kind]
        for fragment in split_chars(item[field], ARGUMENT_CHARS):
            yield {"type": f"{event}.delta", **where, "delta": fragment}
        yield {"type": f"{event}.done", **where, field: item[field]}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def _started(item: Mapping[str, Any]) -> dict[str, Any]:
    """The item as ``response.output_item.added`` shows it: nothing generated yet."""
    started = dict(item)
    kind = item["type"]
    if kind == "message":
        started["content"] = []
    elif kind in _CALL_EVENTS:
        started[_CALL_EVENTS[kind][1]] = ""
    elif kind == "reasoning":
        started["summary"] = []
        started.pop("encrypted_content", None)
    if "status" in started:
        started["status"] = "in_progress"
    return started


def _text_events(where: dict[str, Any], item: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for content_index, part in enumerate(item["content"]):
        at = {**where, "content_index": content_index}
        text = part["text"]
        yield {"type": "response.content_part.added", **at, "part": {**part, "text": ""}}
        for fragment in split_words(text, WORDS_PER_DELTA):
            yield {"type": "response.output_text.delta", **at, "delta": fragment, "logprobs": []}
        yield {"type": "response.output_text.done", **at, "text": text, "logprobs": []}
        yield {"type": "response.content_part.done", **at, "part": part}


def _summary_events(where: dict[str, Any], item: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for summary_index, part in enumerate(item["summary"]):
        at = {**where, "summary_index": summary_index}
        text = part["text"]
        yield {
            "type": "response.reasoning_summary_part.added",
            **at,
            "part": {"type": "summary_text", "text": ""},
        }
        for fragment in split_words(text, WORDS_PER_DELTA):
            yield {"type": "response.reasoning_summary_text.delta", **at, "delta": fragment}
        yield {"type": "response.reasoning_summary_text.done", **at, "text": text}
        yield {"type": "response.reasoning_summary_part.done", **at, "part": part}


def split_words(text: str, words: int) -> list[str]:
    """``text`` in fragments of ``words`` words each (whitespace kept): they join back to it."""
    pieces = _WORD.findall(text)
    return ["".join(pieces[i : i + words]) for i in range(0, len(pieces), words)]


def split_chars(text: str, size: int) -> list[str]:
    """``text`` in fragments of ``size`` characters: they join back to it."""
    return [text[i : i + size] for i in range(0, len(text), size)]
