"""``/v1/responses``: the Responses API front-end and its response observer. Pure.

The shared core (match, repair, breaks, store) works on *elements*: the tools array,
then chat-shaped messages. A Responses request is mapped onto that view, item by item,
keeping for each view message the input items it came from:

- ``instructions`` -> a ``system`` message (element 1 when present);
- a ``message`` item (or an item with a ``role`` and no ``type``) -> a message of that
  role; ``input_text`` / ``output_text`` parts become text parts, so a string and one
  text part are the same, as the reference upstream renders them;
- ``function_call`` -> an assistant message with that one tool call (``call_id`` as its
  id): arguments compared as parsed JSON and restored as stored bytes, as for chat;
- ``function_call_output`` -> a ``tool`` message; a run of them after function calls is
  a tool-result group, atomic and order-restorable;
- ``reasoning`` items are opaque: they ride along the next item, whose view gets an
  ``encrypted_content`` field holding their exact values (sorted-key JSON). Compared
  byte for byte, never rewritten; dropping one is a ``reasoning_changed`` break;
- any other item (``custom_tool_call``, ``additional_tools``, ``web_search_call``,
  ``item_reference`` ...) -> an opaque element compared by value;
- ``tools`` in the Responses shape (built-in tools included) -> the tools element.

Item ``id`` and ``status`` are identity-neutral: no template renders them (the reference
upstream documents and tests this), and the Codex CLI makes new ids in every session.
A repair rewrites only values inside the client's items (content texts, arguments,
outputs), the order of a tool-result group, and the tools array; every other key of
every item stays as the client sent it.

Requests with ``previous_response_id`` keep their prefix at the provider: they are
forwarded unchanged and only their usage is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..core.guard import Guard
from ..core.identity import IdentityMemo
from ..core.model import NodeReader
from ..core.plan import TurnPlan, plan_turn
from ..core.policy import Policy
from ..core.record import Reply
from ..core.repair import NO_REPAIR
from ..core.sse import SSEEvent
from ..core.usage import Usage, extract_usage
from ..traits import UpstreamTraits
from .base import KEEP, Outgoing, Verdict
from .chat import BODY_LIMIT

__all__ = ["ResponsesObserver", "ResponsesWire", "items_view"]

PATH_SUFFIX = "/responses"
TEXT_PARTS = frozenset(("input_text", "output_text"))
TERMINAL = frozenset(("response.completed", "response.failed", "response.incomplete"))
_NEUTRAL = frozenset(("id", "status"))
_SORT = orjson.OPT_SORT_KEYS
INSTRUCTIONS = -1
"""The span of the view message made from ``instructions``."""


@dataclass(frozen=True, slots=True)
class ItemsView:
    """A Responses input as chat-shaped elements, and where each came from."""

    messages: list[dict[str, Any]]
    spans: list[tuple[int, ...]]
    """Per view message: the input item indices it holds (reasoning items first, then the item);
    ``(INSTRUCTIONS,)`` for the instructions."""


def items_view(instructions: Any, items: Sequence[Any]) -> ItemsView:
    messages: list[dict[str, Any]] = []
    spans: list[tuple[int, ...]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
        spans.append((INSTRUCTIONS,))
    pending: list[int] = []
    for k, item in enumerate(items):
        if _kind(item) == "reasoning":
            pending.append(k)
            continue
        view = item_view(item)
        if pending:
            view["encrypted_content"] = _opaque([items[r] for r in pending])
        messages.append(view)
        spans.append((*pending, k))
        pending = []
    if pending:
        messages.append({"role": "assistant", "content": None, "encrypted_content": _opaque([items[r] for r in pending])})
        spans.append(tuple(pending))
    return ItemsView(messages, spans)


def item_view(item: Any) -> dict[str, Any]:
    """The chat-shaped element of one (non-reasoning) input or output item."""
    kind = _kind(item)
    if kind == "message":
        return {"role": item.get("role"), "content": _content_view(item.get("content"))}
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": _content_view(item.get("output"))}
    return {"role": kind or "item", "content": _opaque(item)}


def _kind(item: Any) -> str:
    if type(item) is not dict:
        return ""
    kind = item.get("type")
    if isinstance(kind, str):
        return kind
    return "message" if "role" in item else ""


def _content_view(content: Any) -> Any:
    if type(content) is not list:
        return content
    return [{**p, "type": "text"} if type(p) is dict and p.get("type") in TEXT_PARTS else p for p in content]


def _content_back(client: Any, repaired: Any) -> Any:
    """The repaired view content in the client's part types."""
    if type(client) is not list or type(repaired) is not list or len(client) != len(repaired):
        return repaired
    return [
        {**r, "type": c["type"]} if type(c) is dict and type(r) is dict and c.get("type") in TEXT_PARTS else r
        for c, r in zip(client, repaired, strict=True)
    ]


def _opaque(value: Any) -> str:
    """Sorted-key JSON of an item (or items) minus its identity-neutral keys: compared byte for byte."""
    if type(value) is dict:
        value = {k: v for k, v in value.items() if k not in _NEUTRAL}
    elif type(value) is list:
        value = [{k: v for k, v in x.items() if k not in _NEUTRAL} if type(x) is dict else x for x in value]
    try:
        return orjson.dumps(value, option=_SORT).decode()
    except TypeError:
        return repr(value)


def _item_back(item: Any, view: Mapping[str, Any], repaired: Mapping[str, Any]) -> Any:
    """``item`` with the values the repair restored; every other key as the client sent it."""
    if repaired is view or type(item) is not dict:
        return item
    kind = _kind(item)
    if kind == "message" and repaired.get("content") is not view.get("content"):
        return {**item, "content": _content_back(item.get("content"), repaired.get("content"))}
    if kind == "function_call":
        calls = repaired.get("tool_calls")
        if type(calls) is list and calls and type(calls[0]) is dict:
            fn = calls[0].get("function")
            if type(fn) is dict and fn.get("arguments") is not item.get("arguments"):
                return {**item, "arguments": fn.get("arguments")}
    if kind == "function_call_output" and repaired.get("content") is not view.get("content"):
        return {**item, "output": _content_back(item.get("output"), repaired.get("content"))}
    return item


def _chat_body(body: Mapping[str, Any]) -> tuple[dict[str, Any], ItemsView]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    view = items_view(body.get("instructions"), items if type(items) is list else [])
    chat: dict[str, Any] = {"messages": view.messages}
    if "tools" in body:
        chat["tools"] = body["tools"]
    return chat, view


class ResponsesWire:
    """The Responses API."""

    name = "responses"

    def parse(self, method: str, path: str, raw: bytes) -> dict[str, Any] | None:
        if method != "POST" or not path.endswith(PATH_SUFFIX) or not raw:
            return None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if type(body) is not dict:
            return None
        items = body.get("input")
        if not (isinstance(items, str) or type(items) is list):
            return None
        return body

    def plan(
        self,
        body: Mapping[str, Any],
        root: bytes,
        reader: NodeReader,
        policy: Policy,
        memo: IdentityMemo | None,
        guard: Guard,
    ) -> TurnPlan:
        chat, _ = _chat_body(body)
        if body.get("previous_response_id"):
            # The prefix lives at the provider: nothing to match, nothing to repair.
            return TurnPlan(root, None, NO_REPAIR, None, chat, len(chat["messages"]))
        return plan_turn(chat, root, reader, policy, memo, guard)

    def outgoing(self, raw: bytes, body: Mapping[str, Any], plan: TurnPlan, traits: UpstreamTraits) -> Outgoing:
        repaired = plan.repair.body
        if repaired is None or plan.match is None:
            return Outgoing(raw, False)
        return Outgoing(orjson.dumps(responses_body(body, plan)), False)

    def observer(self, outgoing: Outgoing, traits: UpstreamTraits, guard: Guard, *, success: bool) -> ResponsesObserver:
        return ResponsesObserver(guard, success=success)


def responses_body(body: Mapping[str, Any], plan: TurnPlan) -> dict[str, Any]:
    """The client's body with the plan's repairs mapped back onto its items, instructions and tools."""
    assert plan.match is not None and plan.repair.body is not None
    view = _chat_body(body)[1]
    repaired = plan.repair.body
    out = dict(body)
    if "tools" in repaired:
        out["tools"] = repaired["tools"]
    items = body.get("input")
    source: list[Any] = items if type(items) is list else [{"role": "user", "content": items}]
    new_items: list[Any] = []
    for pos, vi in enumerate(plan.match.order):
        fixed = repaired["messages"][pos]
        span = view.spans[vi]
        if span == (INSTRUCTIONS,):
            out["instructions"] = fixed.get("content")
            continue
        new_items.extend(source[k] for k in span[:-1])
        new_items.append(_item_back(source[span[-1]], view.messages[vi], fixed))
    if type(items) is list:
        out["input"] = new_items
    elif new_items and type(new_items[0]) is dict:
        out["input"] = new_items[0].get("content")
    return out


class ResponsesObserver:
    """One Responses API response on its way to the client: usage and output items, as generated."""

    __slots__ = ("_body", "_done", "_guard", "_items", "_overflow", "_partial", "_success", "_terminal", "usage")

    def __init__(self, guard: Guard, *, success: bool) -> None:
        self._guard = guard
        self._success = success
        self._body: list[bytes] = []
        self._overflow = False
        self._items: dict[int, Any] = {}
        """Output items by ``output_index``: done items whole, in-flight ones as deltas so far."""
        self._partial: dict[int, list[str]] = {}
        self._done: list[Any] | None = None
        """The final output, from ``response.completed``."""
        self.usage: Usage | None = None
        self._terminal = False
        """The event just observed closes the stream."""

    def on_event(self, event: SSEEvent) -> Verdict:
        self._terminal = event.event in TERMINAL
        if event.data is None:
            return KEEP
        with self._guard("usage"):
            self._read_event(orjson.loads(event.data))
        return KEEP

    def _read_event(self, data: Any) -> None:
        if type(data) is not dict:
            return
        kind = data.get("type")
        index = data.get("output_index")
        if kind in TERMINAL:
            self._terminal = True
            response = data.get("response")
            if type(response) is dict:
                self.usage = extract_usage(response) or self.usage
                output = response.get("output")
                if type(output) is list and kind == "response.completed":
                    self._done = output
        elif kind in ("response.output_item.added", "response.output_item.done") and isinstance(index, int):
            self._items[index] = data.get("item")
            if kind == "response.output_item.done":
                self._partial.pop(index, None)
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta") and isinstance(index, int):
            delta = data.get("delta")
            if isinstance(delta, str):
                self._partial.setdefault(index, []).append(delta)

    def is_terminal(self, event: SSEEvent) -> bool:
        """Called right after :meth:`on_event` for the same event."""
        return self._terminal

    def on_body(self, chunk: bytes) -> None:
        if self._overflow or not self._success:
            return
        self._body.append(chunk)
        if sum(map(len, self._body)) > BODY_LIMIT:
            self._overflow = True
            self._body.clear()

    def end(self, *, client_gone: bool) -> Reply | None:
        output: list[Any] | None = None
        partial = False
        with self._guard("usage"):
            if self._body:
                payload = orjson.loads(b"".join(self._body))
                self._body.clear()
                if type(payload) is dict:
                    self.usage = extract_usage(payload)
                    got = payload.get("output")
                    output = got if type(got) is list else None
            elif self._done is not None:
                output = self._done
            elif self._items:
                output, partial = self._assembled(), True
        if not output:
            return None
        view = items_view(None, output)
        first, *rest = view.messages
        return Reply(first, None, partial or client_gone, None, tuple(rest))

    def _assembled(self) -> list[Any]:
        """The output as delivered so far: done items whole, the in-flight one with its deltas."""
        out: list[Any] = []
        for index in sorted(self._items):
            item = self._items[index]
            if type(item) is not dict:
                continue
            pieces = self._partial.get(index)
            if pieces:
                text = "".join(pieces)
                if _kind(item) == "function_call":
                    item = {**item, "arguments": text}
                else:
                    item = {**item, "content": [{"type": "output_text", "text": text}]}
            out.append(item)
        return out

