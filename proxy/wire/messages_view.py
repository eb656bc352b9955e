"""The Messages API's content blocks as the shared core's chat-shaped elements. Pure.

The core (match, repair, breaks, store) works on elements: the tools array, then chat-shaped
messages. A Messages request is mapped onto that *view*, keeping for each view message the
content blocks it was made of (:attr:`MessagesView.spans`), so that a repair planned on the view
can be written back into the client's own blocks (:mod:`proxy.wire.messages_edits`). The view
follows what a template renders (the reference upstream's, :mod:`proxy.sim.content_blocks`):

- ``system`` -> a ``system`` message: a string, or its text blocks as text parts (one text block
  is then the same as the string, as it renders the same);
- a ``user`` message -> a ``user`` message (a string, or its blocks as parts), except that each
  ``tool_result`` block is a ``tool`` message of its own, in its place (its ``content`` a string
  or parts; ``is_error: true`` kept): a run of them after an assistant's ``tool_use`` blocks is
  a tool-result group, atomic and order-restorable, as chat's tool messages are;
- an ``assistant`` message -> one ``assistant`` message: its text blocks as ``content`` parts,
  each ``tool_use`` as a tool call whose ``arguments`` are its ``input`` as compact JSON text in
  the key order sent (:func:`tool_input_texts`: from the client's own bytes, so that repeated
  keys and integers beyond 64 bits are seen as sent), its ``thinking`` / ``redacted_thinking``
  blocks as ``thinking_blocks`` (opaque: compared byte for byte, never repaired, so a dropped or
  changed one is a ``reasoning_changed`` break; one after other blocks says how many), and
  ``layout`` naming the order of text and tool use when text follows a tool use;
- a text part is ``{"type": "text", "text": ...}`` plus the block's other non-empty keys
  (``citations``); an empty text block renders nothing and is left out; any other block
  (``image``, ``document``, ...) is a part as sent. ``cache_control`` is nowhere in the view: a
  marker is no token, and clients move theirs every turn.

Keys are written in one order (sorted, where the client's order could vary), so that a block
re-sent re-serialized (the ``anthropic`` SDK's ``model_dump``) gives the same view bytes as the
reply kvwarm recorded.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from ..core.prefix import Recalled
from ..core.splice import skip_space
from .json_spans import (
    Malformed,
    compact_json,
    element_spans,
    member_spans,
    next_element,
    value_end,
)

__all__ = [
    "SYSTEM",
    "MessagesView",
    "assistant_view",
    "content_parts",
    "continued_view",
    "message_inputs",
    "messages_view",
    "parsed_input_text",
    "part_view",
    "tool_input_texts",
]

SYSTEM: Final = -1
"""The message index in the span of the view message made from ``system``."""
MARKER: Final = "cache_control"
THINKING: Final = frozenset(("thinking", "redacted_thinking"))
_TEXT_KEYS: Final = frozenset(("type", "text", MARKER))
_RESULT_KEYS: Final = frozenset(("type", "tool_use_id", "content", "is_error", MARKER))
_CALL_KEYS: Final = frozenset(("type", "id", "name", "input", MARKER))
_SORT: Final = orjson.OPT_SORT_KEYS
InputTexts = dict[int, dict[int, str]]
"""Per message index, per content block index: a ``tool_use`` input's compact JSON text."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesView:
    """A Messages request as chat-shaped elements, and where each came from."""

    messages: list[dict[str, Any]]
    spans: list[tuple[int, ...]]
    """Per view message: ``(message index, block indices...)`` (``SYSTEM`` for the system; no block
    index when the content is a string)."""
    reused: int = 0
    """Leading messages taken over from the view of the body this one was rebuilt from (the very
    objects: :func:`continued_view`)."""


# -- blocks ------------------------------------------------------------------------------------


def part_view(block: Any) -> Any:
    """A content block as a chat content part; None for an empty text block (it renders nothing)."""
    if type(block) is not dict:
        return block
    text = block.get("text")
    if block.get("type") == "text" and type(text) is str:
        if not text:
            return None
        part: dict[str, Any] = {"type": "text", "text": text}
        for key in sorted(block):
            value = block[key]
            if key not in _TEXT_KEYS and not _empty(value):
                part[key] = _tidy(value)
        return part
    return _tidy(block)


def _tidy(value: Any) -> Any:
    """A block (or a value inside one) as sent, but for markers and ``None`` fields (what an SDK's
    ``model_dump()`` adds), keys sorted at every level: what identity ignores, so that the same
    block re-serialized has the same view bytes."""
    if type(value) is dict:
        return {key: _tidy(value[key]) for key in sorted(value) if key != MARKER and value[key] is not None}
    if type(value) is list:
        return [_tidy(item) for item in value]
    return value


def content_parts(blocks: Sequence[Any]) -> list[tuple[int, Any]]:
    """``(block index, part)`` of the blocks that are content parts (empty text blocks are not)."""
    out: list[tuple[int, Any]] = []
    for j, block in enumerate(blocks):
        part = part_view(block)
        if part is not None:
            out.append((j, part))
    return out


def _content_view(content: Any) -> Any:
    """A string as it is, blocks as their parts, anything else as opaque text."""
    if content is None or type(content) is str:
        return content
    if type(content) is list:
        return [part for _, part in content_parts(content)]
    return _opaque(content)


def _empty(value: Any) -> bool:
    return value is None or ((type(value) is str or type(value) is list or type(value) is dict) and not value)


def _opaque(value: Any) -> str:
    """Sorted-key JSON: compared byte for byte."""
    try:
        return orjson.dumps(value, option=_SORT).decode()
    except TypeError:
        return repr(value)


def _extra(source: Mapping[str, Any], known: frozenset[str]) -> str | None:
    """The keys the view does not model (meaning: any change is one), as opaque text."""
    rest = {k: v for k, v in source.items() if k not in known and not _empty(v)}
    return _opaque(rest) if rest else None


def assistant_view(blocks: Sequence[Any], inputs: Mapping[int, str]) -> dict[str, Any]:
    """The view message of an assistant message's content blocks (``inputs``: each ``tool_use``
    block's input text by block index; a block without one: its parsed ``input``, compacted).

    The order of the blocks renders. A thinking block after others (interleaved thinking) says
    how many came before it (``after``); text after a tool use is a ``layout`` of the others. So
    the thinking blocks alone carry everything about thinking: dropped, the message is the same
    but for its reasoning (a ``reasoning_changed`` break)."""
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    thinking: list[dict[str, Any]] = []
    kinds: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if type(block) is dict else None
        if kind == "tool_use":
            calls.append(_call_view(block, inputs.get(j)))
            kinds.append("tool_use")
        elif kind in THINKING:
            seen = _tidy(block)
            thinking.append({"after": len(kinds), **seen} if kinds else seen)
        else:
            part = part_view(block)
            if part is not None:
                parts.append(part)
                kinds.append("text")
    view: dict[str, Any] = {"role": "assistant", "content": parts or None}
    if calls:
        view["tool_calls"] = calls
    if thinking:
        view["thinking_blocks"] = thinking
    if calls and "text" in kinds[kinds.index("tool_use") + 1 :]:
        view["layout"] = ",".join(kinds)  # text after a tool use: the order renders
    return view


def _call_view(block: Mapping[str, Any], text: str | None) -> dict[str, Any]:
    if text is None:
        text = parsed_input_text(block.get("input"))
    call: dict[str, Any] = {
        "id": block.get("id"),
        "type": "function",
        "function": {"name": block.get("name"), "arguments": text},
    }
    extra = _extra(block, _CALL_KEYS)
    if extra is not None:
        call["extra"] = extra
    return call


def parsed_input_text(value: Any) -> str:
    """A parsed ``tool_use`` input as its compact text (an absent input renders as ``{}``)."""
    if value is None:
        return "{}"
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return _opaque(value)


def _tool_view(block: Mapping[str, Any]) -> dict[str, Any]:
    view: dict[str, Any] = {
        "role": "tool",
        "tool_call_id": block.get("tool_use_id"),
        "content": _content_view(block.get("content")),
    }
    error = block.get("is_error")
    if error is not None and error is not False:
        view["is_error"] = error
    extra = _extra(block, _RESULT_KEYS)
    if extra is not None:
        view["extra"] = extra
    return view


def _is_result(block: Any) -> bool:
    return type(block) is dict and block.get("type") == "tool_result"


# -- messages ----------------------------------------------------------------------------------


def message_views(i: int, message: Any, inputs: Mapping[int, str]) -> list[tuple[dict[str, Any], tuple[int, ...]]]:
    """The view messages of message ``i``, each with its span."""
    if type(message) is not dict:
        return [({"role": "item", "content": _opaque(message)}, (i,))]
    role = message.get("role")
    content = message.get("content")
    if role == "user" and type(content) is list and content:
        views = _user_views(i, content)
    elif role == "assistant" and type(content) is list:
        views = [(assistant_view(content, inputs), (i, *range(len(content))))]
    elif role == "user" or role == "assistant":
        views = [({"role": role, "content": _content_view(content)}, (i,))]
    else:
        return [({"role": role if isinstance(role, str) and role else "item", "content": _opaque(message)}, (i,))]
    extra = _extra(message, frozenset(("role", "content")))
    if extra is not None:
        views[0][0]["extra"] = extra
    return views


def _user_views(i: int, blocks: list[Any]) -> list[tuple[dict[str, Any], tuple[int, ...]]]:
    """A tool message per ``tool_result`` block; a user message per run of other blocks."""
    views: list[tuple[dict[str, Any], tuple[int, ...]]] = []
    run: list[int] = []
    for j, block in enumerate(blocks):
        if _is_result(block):
            if run:
                views.append(_user_run(i, blocks, run))
                run = []
            views.append((_tool_view(block), (i, j)))
        else:
            run.append(j)
    if run:
        views.append(_user_run(i, blocks, run))
    return views


def _user_run(i: int, blocks: list[Any], run: list[int]) -> tuple[dict[str, Any], tuple[int, ...]]:
    parts = [part for part in (part_view(blocks[j]) for j in run) if part is not None]
    return {"role": "user", "content": parts}, (i, *run)


def system_view(system: Any) -> tuple[dict[str, Any], tuple[int, ...]] | None:
    if system is None or ((type(system) is str or type(system) is list) and not system):
        return None
    if type(system) is str:
        return {"role": "system", "content": system}, (SYSTEM,)
    if type(system) is list:
        return {"role": "system", "content": _content_view(system)}, (SYSTEM, *range(len(system)))
    return {"role": "system", "content": _opaque(system)}, (SYSTEM,)


def messages_view(system: Any, messages: Sequence[Any], inputs: InputTexts) -> MessagesView:
    view = MessagesView(messages=[], spans=[])
    head = system_view(system)
    if head is not None:
        view.messages.append(head[0])
        view.spans.append(head[1])
    _add_views(view, messages, 0, inputs)
    return view


def _add_views(view: MessagesView, messages: Sequence[Any], start: int, inputs: InputTexts) -> None:
    empty: dict[int, str] = {}
    for i in range(start, len(messages)):
        for message, span in message_views(i, messages[i], inputs.get(i, empty)):
            view.messages.append(message)
            view.spans.append(span)


def continued_view(body: Mapping[str, Any], recalled: Recalled, inputs: InputTexts) -> MessagesView | None:
    """The view of a body rebuilt from a remembered one: the remembered view's messages made of
    shared messages are taken over (the very objects, so the identity memo knows them), the
    others made anew. None: make it whole (nothing to take over, or no Messages view before).

    The system's message is taken over when the system is equal; when it changed it is made anew
    and the messages' views are still taken over, though not as a leading run (``reused`` 0)."""
    source = recalled.source
    spans, old = source.spans, source.messages
    if spans is None or len(spans) != len(old) or not all(type(s) is tuple and s for s in spans):
        return None
    j = bisect.bisect_left(spans, recalled.shared, key=_first)
    messages = body.get("messages")
    if type(messages) is not list:
        return None
    first = 1 if spans and spans[0][0] == SYSTEM else 0
    if body.get("system") == source.top.get("system"):
        if j == 0:
            return None
        view = MessagesView(messages=list(old[:j]), spans=list(spans[:j]), reused=j)
    else:
        if j <= first:
            return None
        view = MessagesView(messages=[], spans=[])
        head = system_view(body.get("system"))
        if head is not None:
            view.messages.append(head[0])
            view.spans.append(head[1])
        view.messages.extend(old[first:j])
        view.spans.extend(spans[first:j])
    _add_views(view, messages, recalled.shared, inputs)
    return view


def _first(span: tuple[int, ...]) -> int:
    return span[0]


# -- tool_use inputs, from the client's bytes ------------------------------------------------------


def _uses(message: Any) -> bool:
    """An assistant message with a ``tool_use`` block whose input is not empty."""
    if type(message) is not dict or message.get("role") != "assistant":
        return False
    content = message.get("content")
    return type(content) is list and any(
        type(b) is dict and b.get("type") == "tool_use" and b.get("input") for b in content
    )


def tool_input_texts(raw: bytes, body: Mapping[str, Any], start: int = 0, at: int = -1) -> InputTexts:
    """The input text of every ``tool_use`` block of ``body``'s messages from ``start`` on, as the
    client wrote it (:func:`~proxy.wire.json_spans.compact_json`). ``at``: where message ``start``
    ends in ``raw`` (a rebuilt body's shared messages end there), -1: find the array.

    A message whose bytes are its ``orjson.dumps`` (compact clients: the ``anthropic`` SDK,
    ``JSON.stringify``) lost nothing to the parse: its inputs are dumped, not scanned for. Raises
    :class:`~proxy.wire.json_spans.Malformed` where the bytes are not the body."""
    messages = body.get("messages")
    if type(messages) is not list:
        return {}
    wanted = [i for i in range(start, len(messages)) if _uses(messages[i])]
    if not wanted:
        return {}
    if at < 0 and start == 0 and _dumps(body) == raw:
        return {i: _parsed_inputs(messages[i]) for i in wanted}
    if at < 0:
        pos = _messages_array(raw)
        spans = element_spans(raw, pos, wanted[-1])
        starts = [s for s, _ in spans]
    else:
        starts = _starts_after(raw, at, messages, start, wanted[-1])
    if len(starts) <= wanted[-1] - (0 if at < 0 else start):
        raise Malformed("fewer messages than parsed")
    offset = 0 if at < 0 else start
    return {i: message_inputs(raw, starts[i - offset], messages[i]) for i in wanted}


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:
        return b""


def _messages_array(raw: bytes) -> int:
    start = member_spans(raw, skip_space(raw, 0)).get("messages")
    if start is None:
        raise Malformed("no messages")
    return start[0]


def _starts_after(raw: bytes, end: int, messages: Sequence[Any], start: int, last: int) -> list[int]:
    """Where messages ``start .. last`` begin, the one before ending at ``end``."""
    starts: list[int] = []
    for i in range(start, last + 1):
        pos = next_element(raw, end)
        if pos < 0:
            raise Malformed("the array ended")
        starts.append(pos)
        dumped = _dumps(messages[i])
        if dumped and raw.startswith(dumped, pos):
            end = pos + len(dumped)
        else:
            end = value_end(raw, pos)
    return starts


def _parsed_inputs(message: Mapping[str, Any]) -> dict[int, str]:
    content = message.get("content")
    return {
        j: parsed_input_text(b.get("input"))
        for j, b in enumerate(content if type(content) is list else ())
        if type(b) is dict and b.get("type") == "tool_use"
    }


def message_inputs(raw: bytes, pos: int, message: Mapping[str, Any]) -> dict[int, str]:
    """The input texts of the message (or response ``message`` object) whose bytes start at
    ``pos``, by block index: dumped when its bytes are its dump, else read from its bytes."""
    dumped = _dumps(message)
    if dumped and raw.startswith(dumped, pos):
        return _parsed_inputs(message)
    blocks = message.get("content")
    if type(blocks) is not list:
        return {}
    content = member_spans(raw, pos).get("content")
    if content is None:
        raise Malformed("no content")
    spans = element_spans(raw, content[0])
    if len(spans) != len(blocks):
        raise Malformed("not the parsed content")
    out: dict[int, str] = {}
    for j, block in enumerate(blocks):
        if type(block) is dict and block.get("type") == "tool_use":
            found = member_spans(raw, spans[j][0]).get("input")
            out[j] = compact_json(raw[found[0] : found[1]]) if found is not None else "{}"
    return out
