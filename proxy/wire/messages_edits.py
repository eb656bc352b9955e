"""A repair planned on the Messages view, as edits of the client's own Messages body. Pure.

The shared core plans a repair on the chat-shaped view (:mod:`proxy.wire.messages_view`) and
says it as edits of that view. :func:`message_edits` says the same in the client's body, for
:mod:`proxy.core.splice` to write into its bytes; every byte outside the edited values stays the
client's. What maps, and where:

- the tools array -> the ``tools`` value: the stored definitions in the stored order, the
  client's ``cache_control`` markers at the positions where the client put them (a marker
  after the last tool marks the end of the tools, whatever tool is last);
- a restored text -> the string it came from: ``system`` (or a text block's ``text``), a
  message's string content or a text block's ``text``, a ``tool_result``'s content (or one of
  its text blocks' ``text``);
- restored arguments -> the ``tool_use`` block's ``input``: the stored JSON text, the key order
  the provider first saw;
- a tool-result group put back in its stored order (or tool calls) -> the message's blocks in
  that order. The markers stay where the client put them: when a moved block carries one, each
  moved block is written whole with the marker of the position it lands on; else the blocks
  move as the client's bytes (a :class:`~proxy.core.splice.Reorder`);
- a message dropped whole (``collapse_duplicates``) -> a reorder of ``messages`` without it.

Anything else (a view message moved across messages, a part the view changed that has no place
in the client's blocks) has no place: None, and the request is forwarded as sent.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from ..core.splice import Edit, Path, Reorder, Replace
from .messages_view import MARKER, SYSTEM, THINKING, MessagesView, content_parts

__all__ = ["message_edits"]

_Relative = tuple[tuple[str | int, ...], bytes]
"""A value edit inside one content block: its path from the block, the new value."""


class _Plan:
    """The client edits being gathered: whole-body ones, and per message its blocks' new order
    and the value edits inside each block (kept apart until the order is known)."""

    def __init__(self) -> None:
        self.edits: list[Edit] = []
        self.orders: dict[int, list[int]] = {}
        self.inside: dict[tuple[int, int], list[_Relative]] = {}

    def set_in_block(self, i: int, j: int, path: tuple[str | int, ...], value: bytes) -> None:
        self.inside.setdefault((i, j), []).append((path, value))


def message_edits(body: Mapping[str, Any], view: MessagesView, edits: Sequence[Edit]) -> list[Edit] | None:
    """The view's ``edits`` as edits of the client's ``body``; None when one has no place there."""
    plan = _Plan()
    messages = body.get("messages")
    if type(messages) is not list:
        return None
    for edit in edits:
        path = edit.path
        if isinstance(edit, Replace) and path == ("tools",):
            tools = _tools_value(body.get("tools"), edit.value)
            if tools is None:
                return None
            plan.edits.append(Replace(path=("tools",), value=tools))
        elif isinstance(edit, Reorder) and path == ("messages",):
            if not _message_order(view, messages, edit.order, plan):
                return None
        elif len(path) >= 3 and path[0] == "messages" and type(path[1]) is int and path[1] < len(view.spans):
            if not _message_edit(body, view.spans[path[1]], path[2:], edit, plan):
                return None
        else:
            return None
    return _finish(messages, plan)


# -- the tools ---------------------------------------------------------------------------------


def _tools_value(client: Any, value: bytes) -> bytes | None:
    """The stored tools with the client's markers where the client put them."""
    stored = orjson.loads(value)
    if type(client) is not list or type(stored) is not list or len(client) != len(stored):
        return None
    out: list[Any] = []
    for restored, sent in zip(stored, client, strict=True):
        if type(restored) is dict:
            restored = {k: v for k, v in restored.items() if k != MARKER}
            if type(sent) is dict and MARKER in sent:
                restored[MARKER] = sent[MARKER]
        out.append(restored)
    return orjson.dumps(out)


# -- the order of messages and blocks -------------------------------------------------------------


def _message_order(view: MessagesView, messages: list[Any], order: Sequence[int], plan: _Plan) -> bool:
    """A view order (client view indices, in forwarded order) as the order of the client's messages
    and of their blocks. False: a view message moved out of its message, or a message lost only
    some of its view messages."""
    spans = view.spans
    runs: list[tuple[int, list[int]]] = []
    for vi in order:
        m = spans[vi][0]
        if runs and runs[-1][0] == m:
            runs[-1][1].append(vi)
        else:
            runs.append((m, [vi]))
    owned: dict[int, list[int]] = {}
    for vi, span in enumerate(spans):
        owned.setdefault(span[0], []).append(vi)
    seen: set[int] = set()
    for m, run in runs:
        if m in seen or sorted(run) != owned[m]:
            return False  # split, or partly dropped
        seen.add(m)
        if run != owned[m]:
            blocks = [j for vi in run for j in spans[vi][1:]]
            if m == SYSTEM or sorted(blocks) != list(range(len(messages[m]["content"]))):
                return False
            plan.orders[m] = blocks
    kept = [m for m, _ in runs if m != SYSTEM]
    if (SYSTEM in owned) != (bool(runs) and runs[0][0] == SYSTEM):
        return False  # the system is no message: it stays first, and stays
    if kept != list(range(len(messages))):
        plan.edits.append(Reorder(path=("messages",), order=tuple(kept)))
    return True


def _calls_order(message: Mapping[str, Any], picked: Sequence[int], plan: _Plan, i: int) -> bool:
    """The assistant's tool calls in another order, as its ``tool_use`` blocks in that order."""
    blocks = message["content"]
    uses = [j for j, b in enumerate(blocks) if type(b) is dict and b.get("type") == "tool_use"]
    if sorted(picked) != list(range(len(uses))) or i in plan.orders:
        return False
    new = list(range(len(blocks)))
    for k, ci in enumerate(picked):
        new[uses[k]] = uses[ci]
    plan.orders[i] = new
    return True


# -- restored values ------------------------------------------------------------------------------


def _message_edit(body: Mapping[str, Any], span: tuple[int, ...], rest: tuple[str | int, ...], edit: Edit, plan: _Plan) -> bool:
    """One edit inside view message ``span``, placed in the client's body."""
    i = span[0]
    if i == SYSTEM:
        if not isinstance(edit, Replace) or rest != ("content",):
            return False
        return _text_edits(body.get("system"), orjson.loads(edit.value), ("system",), plan, None)
    message = body["messages"][i]
    if type(message) is not dict:
        return False
    content = message.get("content")
    if isinstance(edit, Reorder):
        return rest == ("tool_calls",) and type(content) is list and _calls_order(message, edit.order, plan, i)
    if not isinstance(edit, Replace):
        return False
    if rest == ("content",):
        return _content_edit(message, span, orjson.loads(edit.value), plan)
    if len(rest) == 4 and rest[0] == "tool_calls" and type(rest[1]) is int and rest[2:] == ("function", "arguments"):
        return _input_edit(content, rest[1], orjson.loads(edit.value), plan, i)
    return False


def _content_edit(message: Mapping[str, Any], span: tuple[int, ...], restored: Any, plan: _Plan) -> bool:
    i = span[0]
    content = message.get("content")
    if type(content) is not list:
        return _text_edits(content, restored, ("messages", i, "content"), plan, None)
    blocks = span[1:]
    if len(blocks) == 1 and type(content[blocks[0]]) is dict and content[blocks[0]].get("type") == "tool_result":
        return _text_edits(content[blocks[0]].get("content"), restored, ("content",), plan, (i, blocks[0]))
    if message.get("role") == "assistant":
        blocks = tuple(j for j in blocks if not (type(content[j]) is dict and content[j].get("type") in _NOT_PARTS))
    return _parts_edits([(j, content[j]) for j in blocks], restored, plan, i)


_NOT_PARTS = THINKING | {"tool_use"}


def _text_edits(
    client: Any, restored: Any, path: Path, plan: _Plan, block: tuple[int, int] | None
) -> bool:
    """Set the restored texts of a content value in the client's own form: a string, or each
    changed text block's ``text`` (its other keys, its marker included, stay the client's)."""
    if type(client) is str and type(restored) is str:
        _set(plan, block, path, orjson.dumps(restored))
        return True
    if type(client) is not list or type(restored) is not list:
        return False
    parts = content_parts(client)
    if len(parts) != len(restored):
        return False
    for (j, part), new in zip(parts, restored, strict=True):
        if type(part) is dict and part.get("type") == "text" and type(new) is dict and type(new.get("text")) is str:
            if new["text"] != part["text"]:
                _set(plan, block, (*path, j, "text"), orjson.dumps(new["text"]))
        elif new != part:
            return False  # the view changed a part it has no client form for
    return True


def _parts_edits(blocks: list[tuple[int, Any]], restored: Any, plan: _Plan, i: int) -> bool:
    """The restored parts of a run of the message's blocks (``(block index, block)``)."""
    parts = content_parts([b for _, b in blocks])
    if type(restored) is str:
        restored = [{"type": "text", "text": restored}]
    if type(restored) is not list or len(parts) != len(restored):
        return False
    for (k, part), new in zip(parts, restored, strict=True):
        if type(part) is dict and part.get("type") == "text" and type(new) is dict and type(new.get("text")) is str:
            if new["text"] != part["text"]:
                plan.set_in_block(i, blocks[k][0], ("text",), orjson.dumps(new["text"]))
        elif new != part:
            return False
    return True


def _input_edit(content: Any, call: int, arguments: Any, plan: _Plan, i: int) -> bool:
    """The stored arguments text as the ``input`` value of the ``call``-th ``tool_use`` block."""
    if type(content) is not list or type(arguments) is not str:
        return False
    uses = [j for j, b in enumerate(content) if type(b) is dict and b.get("type") == "tool_use"]
    if call >= len(uses):
        return False
    value = arguments.encode()
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        return False  # stored arguments that are no JSON value cannot be an input
    plan.set_in_block(i, uses[call], ("input",), value)
    return True


def _set(plan: _Plan, block: tuple[int, int] | None, path: Path, value: bytes) -> None:
    if block is None:
        plan.edits.append(Replace(path=path, value=value))
    else:
        plan.set_in_block(block[0], block[1], path, value)


# -- together ---------------------------------------------------------------------------------------


def _finish(messages: list[Any], plan: _Plan) -> list[Edit] | None:
    """The gathered edits: each message's blocks reordered (whole, with the markers where the
    client put them, when a moved block carries one), and the value edits inside blocks."""
    out = plan.edits
    inside = dict(plan.inside)
    for i, order in plan.orders.items():
        blocks = messages[i]["content"]
        moved = [p for p, j in enumerate(order) if j != p]
        if not any(type(blocks[p]) is dict and MARKER in blocks[p] for p in moved):
            out.append(Reorder(path=("messages", i, "content"), order=tuple(order)))
            continue
        for p in moved:
            block = _edited(blocks[order[p]], inside.pop((i, order[p]), []))
            if block is None:
                return None
            if type(block) is dict:
                block.pop(MARKER, None)
                if type(blocks[p]) is dict and MARKER in blocks[p]:
                    block[MARKER] = blocks[p][MARKER]
            out.append(Replace(path=("messages", i, "content", p), value=orjson.dumps(block)))
    for (i, j), changes in inside.items():
        out.extend(Replace(path=("messages", i, "content", j, *path), value=value) for path, value in changes)
    return out


def _edited(block: Any, changes: list[_Relative]) -> Any:
    """A copy of ``block`` with ``changes`` set in it; None when a new value would not survive
    being parsed and written again (an integer beyond 64 bits, say)."""
    block = copy.deepcopy(block)
    for path, value in changes:
        parsed = orjson.loads(value)
        if orjson.dumps(parsed) != value:
            return None
        target = block
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = parsed
    return block
