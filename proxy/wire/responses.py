"""``/v1/responses``: the Responses API front-end and its response observer. Pure.

The shared core (match, repair, breaks, store) works on *elements*: the tools array,
then chat-shaped messages. A Responses request is mapped onto that view, item by item,
keeping for each view message the input items it came from:

- ``instructions`` -> a ``system`` message (the first one when present; instructions given as
  a list of items are one opaque element, compared by value and never rewritten);
- a ``message`` item (or an item with a ``role`` and no ``type``) -> a message of that
  role; ``input_text`` / ``output_text`` parts become text parts without their empty
  keys (``annotations: []``, ``logprobs: []``, nulls: no template renders them), so a
  string and one text part are the same, as the reference upstream renders them;
- ``function_call`` -> an assistant message with that one tool call (``call_id`` as its
  id): arguments compared as parsed JSON and restored as stored bytes, as for chat;
- ``function_call_output`` -> a ``tool`` message; a run of them after function calls is
  a tool-result group, atomic and order-restorable;
- ``reasoning`` items are opaque: they ride along the next item, whose view gets an
  ``encrypted_content`` field holding their values (sorted-key JSON, without ``id``,
  ``status`` and empty fields such as the ``content: null`` an SDK's ``model_dump()``
  adds). Compared byte for byte, never rewritten; dropping or changing one is a
  ``reasoning_changed`` break;
- any other item (``custom_tool_call``, ``additional_tools``, ``web_search_call``,
  ``item_reference`` ...) -> an opaque element compared by value;
- ``tools`` in the Responses shape (built-in tools included) -> the tools element.

Item ``id`` and ``status`` are identity-neutral: no template renders them (the reference
upstream documents and tests this), and the Codex CLI makes new ids in every session. So are
cache markers (``cache_control``, ``prompt_cache_breakpoint``) wherever they sit.
A repair is planned on this view by the shared core, then mapped onto the client's items
(:func:`item_edits`) and spliced into the client's bytes (:mod:`proxy.core.splice`): it
sets only strings inside the client's items (the instructions, a content text or text
part's ``text``, ``arguments``, a tool output), the order of a tool-result group (whole
items), and the tools array; every other byte is the client's. Where that cannot be
guaranteed, the request is forwarded (and recorded) as sent, and the refusal counted.

Positions in ``x-kvwarm-prefix`` / ``x-kvwarm-break`` count these elements: the
instructions first, then one per input item, a reasoning item counted with the item it
precedes.

A conversation re-sent byte for byte (the Codex CLI sends its whole history every turn, with
``store: false``) is parsed only past what it shares with the tenant's previous body
(:mod:`proxy.core.prefix`, on the ``input`` array), and its view takes over the previous view's
messages made of shared items: identifying and matching them is a lookup each, so a no-drift
turn costs in proportion to its new items.

Requests with ``previous_response_id`` keep their prefix at the provider (and requests
without ``input`` have none): they are forwarded unchanged and only their usage is read.

Observer: the output items of a JSON body or of ``response.completed``; when the stream
ends early (the client left, or ``response.failed`` / ``response.incomplete``), the items
as delivered: the finished ones whole, the one in flight with the text, arguments or
custom-tool input its deltas carried so far. Also the response's ``id`` and, when the request
named a ``comparison_response_id``, the provider's verdict on its cache use
(``prompt_cache_diagnostics``, :mod:`proxy.core.provider_misses`).

Provider diagnostics (``upstream.provider_diagnostics``, :mod:`proxy.request.diagnosis`):
:func:`with_comparison` names the earlier response the provider compares a request with, inside
the client's bytes, where the client named none.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..core.guard import Guard
from ..core.identity import IdentityMemo
from ..core.model import NodeReader
from ..core.plan import TurnPlan
from ..core.policy import Policy
from ..core.prefix import Recalled
from ..core.provider_misses import CacheVerdict, openai_verdict
from ..core.record import Reply
from ..core.repair import NO_REPAIR
from ..core.splice import Edit, Insert, Refusal, Reorder, Replace, try_splice
from ..core.sse import SSEEvent, load_data
from ..core.usage import Usage, extract_usage
from ..transport.traits import UpstreamTraits
from .base import KEEP, BodyBuffer, Outgoing, Verdict, body_json, json_post, plan_on_view
from .cache_marks import ResponsesElements, item_positions, with_breakpoints

__all__ = ["ResponsesObserver", "ResponsesWire", "item_edits", "items_view", "with_comparison"]

PATH_SUFFIX = "/responses"
TEXT_PARTS = frozenset(("input_text", "output_text"))
_TEXT_TYPES = TEXT_PARTS | {"text"}
"""Parts whose ``text`` a repair may restore (a chat-style ``text`` part is one as it is)."""
TERMINAL = frozenset(("response.completed", "response.failed", "response.incomplete"))
_DELTAS = frozenset(
    ("response.output_text.delta", "response.function_call_arguments.delta", "response.custom_tool_call_input.delta")
)
"""Stream events whose ``delta`` extends the in-flight output item's text, arguments or input."""
_ITEM_EVENTS = _DELTAS | {"response.output_item.added", "response.output_item.done"}
"""The events an output cut short is assembled from (:meth:`ResponsesObserver._assembled`)."""
_NEUTRAL = frozenset(("id", "status", "cache_control", "prompt_cache_breakpoint"))
"""Keys of an opaque item no template renders: ids, status, cache markers."""
_SORT = orjson.OPT_SORT_KEYS
INSTRUCTIONS = -1
"""The span of the view message made from ``instructions``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemsView:
    """A Responses input as chat-shaped elements, and where each came from."""

    messages: list[dict[str, Any]]
    spans: list[tuple[int, ...]]
    """Per view message: the input item indices it holds (reasoning items first, then the item);
    ``(INSTRUCTIONS,)`` for the instructions."""
    reused: int = 0
    """Leading messages taken over from the view of the body this one was rebuilt from (the very
    objects: :func:`continued_view`)."""


def items_view(instructions: Any, items: Sequence[Any]) -> ItemsView:
    messages: list[dict[str, Any]] = []
    spans: list[tuple[int, ...]] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
        spans.append((INSTRUCTIONS,))
    elif instructions:
        # Instructions as a list of items: compared whole, never rewritten.
        messages.append({"role": "system", "content": _opaque(instructions)})
        spans.append((INSTRUCTIONS,))
    _view_items(items, 0, messages, spans)
    return ItemsView(messages=messages, spans=spans)


def _view_items(items: Sequence[Any], start: int, messages: list[dict[str, Any]], spans: list[tuple[int, ...]]) -> None:
    """Append the view messages of ``items[start:]`` (a reasoning item rides along the item after it)."""
    pending: list[int] = []
    for k in range(start, len(items)):
        item = items[k]
        if _kind(item) == "reasoning":
            pending.append(k)
            continue
        view = item_view(item)
        if pending:
            view["encrypted_content"] = _opaque_reasoning([items[r] for r in pending])
        messages.append(view)
        spans.append((*pending, k))
        pending = []
    if pending:
        messages.append({"role": "assistant", "content": None, "encrypted_content": _opaque_reasoning([items[r] for r in pending])})
        spans.append(tuple(pending))


def continued_view(body: Mapping[str, Any], items: list[Any], recalled: Recalled) -> ItemsView | None:
    """The view of a body rebuilt from a remembered one (``recalled``): the remembered view's
    messages made of shared items only are taken over (the very objects, so the identity memo
    knows them), the others made anew. None: make it whole (nothing to take over, or the
    remembered body was no Responses body).

    A view message is taken over when every item it holds is shared (``items[:shared]`` are the
    remembered body's own objects). A trailing run of reasoning items is not: in the new body it
    rides along the item that now follows it. The instructions' message is taken over when they
    are equal; when they changed (they may come after the items in the bytes, as the OpenAI SDK
    sends them), it is made anew and the items' messages are still taken over, though not as a
    leading run (``reused`` is then 0: the match starts over, with every shared item known).
    """
    source = recalled.source
    spans, old = source.spans, source.messages
    if spans is None or len(spans) != len(old):
        return None
    # Spans hold increasing item indices: the view messages made of shared items are a prefix.
    j = bisect.bisect_left(spans, recalled.shared, key=_last)
    if j == len(spans) and j and _kind(source.elements[spans[-1][-1]]) == "reasoning":
        j -= 1  # the trailing reasoning run: it rides along what follows it now
    instructions = body.get("instructions")
    if instructions == source.top.get("instructions"):
        if j == 0:
            return None
        messages, kept, reused = old[:j], list(spans[:j]), j
    else:
        first = 1 if spans and spans[0] == (INSTRUCTIONS,) else 0
        if j <= first:
            return None
        head = items_view(instructions, ())
        messages, kept, reused = head.messages + old[first:j], head.spans + list(spans[first:j]), 0
    _view_items(items, kept[-1][-1] + 1, messages, kept)
    return ItemsView(messages=messages, spans=kept, reused=reused)


def _last(span: tuple[int, ...]) -> int:
    return span[-1]


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
    """``content`` (or a tool output) with its ``input_text`` / ``output_text`` parts as chat text parts.

    A text part's empty keys (``annotations: []``, ``logprobs: []``, ``null``s) are left out: no
    template renders them, and without them one text part is the same as a string."""
    if type(content) is not list:
        return content
    return [_text_part_view(p) if type(p) is dict and p.get("type") in TEXT_PARTS else p for p in content]


def _text_part_view(part: dict[str, Any]) -> dict[str, Any]:
    view = {k: v for k, v in part.items() if k == "text" or not _empty(v)}
    view["type"] = "text"
    return view


def _empty(value: Any) -> bool:
    return value is None or ((type(value) is str or type(value) is list or type(value) is dict) and not value)


def _opaque(value: Any) -> str:
    """Sorted-key JSON of an item minus its identity-neutral keys: compared byte for byte."""
    if type(value) is dict:
        value = {k: v for k, v in value.items() if k not in _NEUTRAL}
    return _dumps(value)


def _opaque_reasoning(items: Sequence[Any]) -> str:
    """Reasoning items compared byte for byte, but for what their rendering ignores: ``id``,
    ``status``, and empty fields (``content: null``, ``summary: []``: a reasoning item renders its
    ``encrypted_content``, else its content or summary texts, and an empty one renders nothing)."""
    return _dumps(
        [{k: v for k, v in x.items() if k not in _NEUTRAL and not _empty(v)} if type(x) is dict else x for x in items]
    )


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value, option=_SORT).decode()
    except TypeError:
        return repr(value)


def _chat_body(body: Mapping[str, Any], recalled: Recalled | None = None) -> tuple[dict[str, Any], ItemsView]:
    items = body.get("input")
    view = None
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif recalled is not None and type(items) is list:
        view = continued_view(body, items, recalled)
    if view is None:
        view = items_view(body.get("instructions"), items if type(items) is list else [])
    chat: dict[str, Any] = {"messages": view.messages}
    if "tools" in body:
        chat["tools"] = body["tools"]
    return chat, view


class ResponsesWire:
    """The Responses API."""

    name = "responses"
    resends: str | None = "input"
    """The array a client re-sends every turn (:mod:`proxy.core.prefix`)."""

    def parse(self, method: str, path: str, raw: bytes) -> dict[str, Any] | None:
        body = json_post(method, path, PATH_SUFFIX, raw)
        if body is None:
            return None
        items = body.get("input")
        if not (items is None or isinstance(items, str) or type(items) is list):
            return None
        return body

    def plan(
        self,
        raw: bytes,
        body: Mapping[str, Any],
        root: bytes,
        reader: NodeReader,
        policy: Policy,
        memo: IdentityMemo | None,
        guard: Guard,
        recalled: Recalled | None = None,
    ) -> TurnPlan:
        """``recalled``: how the body was rebuilt from the tenant's previous one (its view and match
        are taken over where they still hold)."""
        if body.get("previous_response_id") or body.get("input") is None:
            # The prefix lives at the provider (or there is no input to speak of): nothing to
            # match, nothing to repair; the response is still observed for its usage.
            chat, view = _chat_body(body)
            return TurnPlan(
                root=root, match=None, repair=NO_REPAIR, brk=None, forwarded=chat, messages=len(chat["messages"])
            )
        chat, view = _chat_body(body, recalled)
        # Planned on the view (its bytes are not the client's); the repair is then mapped onto
        # the client's items and spliced into the client's bytes.
        return plan_on_view(
            raw, chat, view, root, reader, policy, memo, guard, recalled, lambda edits: item_edits(body, view, edits)
        )

    def outgoing(self, raw: bytes, body: Mapping[str, Any], plan: TurnPlan, traits: UpstreamTraits) -> Outgoing:
        """The client's bytes, with the repair spliced in and kvwarm's cache markers
        (:mod:`proxy.wire.cache_marks`): every other byte as the client sent it."""
        base = plan.spliced if plan.spliced is not None else raw
        view = plan.view
        if plan.tree is None or not isinstance(view, ItemsView):
            return Outgoing(body=base, usage_injected=False)
        positions = None
        if plan.spliced is not None:  # a repair may have put a tool-result group back in order
            edits = item_edits(body, view, plan.repair.edits)
            positions = item_positions(edits) if edits is not None else None
        spans = view.spans
        base, marks = with_breakpoints(
            base, body, plan, traits, lambda dialect: ResponsesElements(body, plan, spans, positions, dialect)
        )
        return Outgoing(body=base, usage_injected=False, marks=marks)

    def observer(self, outgoing: Outgoing, traits: UpstreamTraits, guard: Guard, *, success: bool) -> ResponsesObserver:
        return ResponsesObserver(guard, success=success)


def item_edits(body: Mapping[str, Any], view: ItemsView, edits: Sequence[Edit]) -> list[Edit] | None:
    """The repair's edits of the view, as edits of the client's Responses body; None when one has no
    place there (the request is then forwarded unrepaired).

    Paths name the client's own items (original indices): the tools array stays the tools array,
    a reordered view (a tool-result group put back in its stored order) reorders whole items (a
    reasoning item moves with the item it precedes), and a restored value lands on the string it
    came from: the instructions, a message's content (or one text part's ``text``), a call's
    ``arguments``, a tool output (or one of its text parts).
    """
    out: list[Edit] = []
    for edit in edits:
        path = edit.path
        if isinstance(edit, Replace) and path == ("tools",):
            out.append(edit)
        elif isinstance(edit, Reorder) and path == ("messages",):
            reorder = _item_order(body, view, edit.order)
            if reorder is None:
                return None
            out.append(reorder)
        elif isinstance(edit, Replace) and len(path) > 2 and path[0] == "messages" and type(path[1]) is int:
            mapped = _value_edits(body, view.spans[path[1]], path[2:], edit.value)
            if mapped is None:
                return None
            out.extend(mapped)
        else:
            return None
    return out


def _item_order(body: Mapping[str, Any], view: ItemsView, order: Sequence[int]) -> Reorder | None:
    if type(body.get("input")) is not list:
        return None
    instructions = [vi for vi, span in enumerate(view.spans) if span == (INSTRUCTIONS,)]
    if [vi for vi in order if vi in instructions] != instructions:
        return None  # the instructions are no item: they cannot move, nor be dropped
    items = tuple(k for vi in order if view.spans[vi] != (INSTRUCTIONS,) for k in view.spans[vi])
    return Reorder(path=("input",), order=items)


def _value_edits(body: Mapping[str, Any], span: tuple[int, ...], rest: tuple[str | int, ...], value: bytes) -> list[Edit] | None:
    """The edits setting the view value at ``rest`` (in the view message of ``span``) in the client's body."""
    if span == (INSTRUCTIONS,):
        ok = rest == ("content",) and isinstance(body.get("instructions"), str) and value[:1] == b'"'
        return [Replace(path=("instructions",), value=value)] if ok else None
    items = body.get("input")
    if isinstance(items, str):  # the whole input is one user message's text
        item: Any = {"role": "user", "content": items}
        field_path: tuple[str | int, ...] = ("input",)
    else:
        item = items[span[-1]] if type(items) is list else None
        field_path = ("input", span[-1])
    kind = _kind(item)
    if kind == "function_call" and rest == ("tool_calls", 0, "function", "arguments"):
        return [Replace(path=(*field_path, "arguments"), value=value)]
    field = {"message": "content", "function_call_output": "output"}.get(kind)
    if field is None or rest != ("content",):
        return None
    if not isinstance(items, str):
        field_path = (*field_path, field)
    return _text_edits(item.get(field), orjson.loads(value), field_path)


def _text_edits(client: Any, restored: Any, path: tuple[str | int, ...]) -> list[Edit] | None:
    """Set the restored texts of a content value in the client's own form (a string, or each changed
    text part's ``text``: its other keys stay the client's bytes)."""
    if type(client) is str and type(restored) is str:
        return [Replace(path=path, value=orjson.dumps(restored))]
    if type(client) is not list or type(restored) is not list or len(client) != len(restored):
        return None
    out: list[Edit] = []
    for j, (c, r) in enumerate(zip(client, restored, strict=True)):
        if type(c) is dict and c.get("type") in _TEXT_TYPES and type(r) is dict and type(r.get("text")) is str:
            if r["text"] != c.get("text"):
                out.append(Replace(path=(*path, j, "text"), value=orjson.dumps(r["text"])))
        elif r != c:
            return None  # the view changed a part it has no client form for
    return out


OPTIONS = "prompt_cache_options"
COMPARISON = "comparison_response_id"
RETENTION = "prompt_cache_retention"
"""The deprecated form of ``prompt_cache_options.ttl``: a provider refuses a request with both."""


def with_comparison(raw: bytes, body: Mapping[str, Any], response_id: str) -> bytes:
    """``raw`` (the bytes about to go upstream; ``body``: the client's parse, whose top-level keys
    they share) asking the provider to compare this request's cache use with ``response_id``:
    ``"comparison_response_id"`` spliced in as the first member of the client's
    ``prompt_cache_options``, or ``"prompt_cache_options": {"comparison_response_id": ...}`` as the
    body's first member when it has none (mode and TTL stay the provider's defaults).

    ``raw`` as it is when the client named a comparison itself (never overridden), sent
    ``prompt_cache_retention`` (never both: a provider refuses them together), sent options that
    are no object, or when the splice cannot be made (:data:`~proxy.core.splice.REFUSALS`)."""
    if RETENTION in body:
        return raw
    value = orjson.dumps(response_id)
    if OPTIONS not in body:
        edit = Insert(path=(), key=OPTIONS, value=b'{"' + COMPARISON.encode() + b'":' + value + b"}")
    else:
        options = body[OPTIONS]
        if type(options) is not dict or COMPARISON in options:
            return raw
        edit = Insert(path=(OPTIONS,), key=COMPARISON, value=value)
    out = try_splice(raw, [edit])
    return raw if isinstance(out, Refusal) else out


class ResponsesObserver:
    """One Responses API response on its way to the client: usage and output items, as generated,
    the response's id and the provider's cache verdict."""

    __slots__ = (
        "_body", "_done", "_guard", "_items", "_partial", "_pending", "_success", "_terminal", "response_id", "usage",
        "verdict",
    )

    def __init__(self, guard: Guard, *, success: bool) -> None:
        self._guard = guard
        self._success = success
        self._body = BodyBuffer()
        self._items: dict[int, Any] = {}
        """Output items by ``output_index``: done items whole, in-flight ones as deltas so far."""
        self._partial: dict[int, list[str]] = {}
        self._done: list[Any] | None = None
        """The final output, from ``response.completed``."""
        self.usage: Usage | None = None
        self.response_id: str | None = None
        """The response's ``id`` (what a later request may be compared with)."""
        self.verdict: CacheVerdict | None = None
        """The provider's verdict on this response's cache use (``prompt_cache_diagnostics``)."""
        self._terminal = False
        """The event just observed closes the stream."""
        self._pending: list[bytes] = []
        """The data of the item and delta events named as such, unread: ``response.completed``
        carries the whole output, so they are parsed only when the stream ends without it."""

    def on_event(self, event: SSEEvent) -> Verdict:
        name = event.event
        self._terminal = name in TERMINAL
        data = event.payload
        if data is None:
            return KEEP
        if name is not None and not self._terminal and name.startswith("response."):
            # An event its ``event:`` line names, of the API's own: only the terminal ones are
            # read now (usage, the output). Parsing every delta cost a 26-event response more
            # than planning its 40 KiB request.
            if name in _ITEM_EVENTS:
                self._pending.append(data)
            return KEEP
        try:  # not ``with guard``: every event comes here (proxy/core/guard.py)
            self._read_event(load_data(data))
        except Exception as exc:
            self._guard.fail("usage", exc)
        if self._done is not None:
            self._pending.clear()
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
                self._read_report(response)
                output = response.get("output")
                if type(output) is list and kind == "response.completed":
                    self._done = output
        elif kind in ("response.output_item.added", "response.output_item.done") and isinstance(index, int):
            self._items[index] = data.get("item")
            if kind == "response.output_item.done":
                self._partial.pop(index, None)
        elif kind in _DELTAS and isinstance(index, int):
            delta = data.get("delta")
            if isinstance(delta, str):
                self._partial.setdefault(index, []).append(delta)

    def _read_report(self, response: dict[str, Any]) -> None:
        """The response's id, and the provider's verdict when the request asked for one."""
        found = response.get("id")
        if isinstance(found, str) and found:
            self.response_id = found
        diagnostics = response.get("prompt_cache_diagnostics")
        if diagnostics is not None:
            self.verdict = openai_verdict(diagnostics)

    def is_terminal(self, event: SSEEvent) -> bool:
        """Called right after :meth:`on_event` for the same event."""
        return self._terminal

    def on_body(self, chunk: bytes) -> None:
        if self._success:
            self._body.add(chunk)

    def end(self, *, client_gone: bool) -> Reply | None:
        output: list[Any] | None = None
        partial = False
        data = self._body.take()
        with self._guard("usage"):
            if data is not None:
                payload = body_json(data)
                if type(payload) is dict:
                    self.usage = extract_usage(payload)
                    self._read_report(payload)
                    got = payload.get("output")
                    output = got if type(got) is list else None
            elif self._done is not None:
                output = self._done
            else:
                for pending in self._pending:  # in the order they came; a broken one loses only itself
                    try:
                        self._read_event(load_data(pending))
                    except Exception as exc:
                        self._guard.fail("usage", exc)
                self._pending.clear()
                if self._items:
                    output, partial = self._assembled(), True
        if not output:
            return None
        view = items_view(None, output)
        first, *rest = view.messages
        return Reply(
            message=first, finish_reason=None, partial=partial or client_gone, model=None, following=tuple(rest)
        )

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
                kind = _kind(item)
                if kind == "function_call":
                    item = {**item, "arguments": text}
                elif kind == "custom_tool_call":
                    item = {**item, "input": text}
                else:
                    item = {**item, "content": [{"type": "output_text", "text": text}]}
            out.append(item)
        return out

