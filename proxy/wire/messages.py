"""``/v1/messages``: Anthropic's Messages API front-end and its response observer. Pure.

What Claude Code and the ``anthropic`` SDKs speak. A POST to a path ending in ``/messages``
whose body is a JSON object with a ``messages`` list is a turn (``/v1/messages/count_tokens``
and anything else pass untouched).

Front-end: the request is planned on its chat-shaped view (:mod:`proxy.wire.messages_view`:
``system``, then a message per user or assistant message, a tool message per ``tool_result``
block), so identity, repair and break diagnosis are the shared core's; a repair is written back
into the client's own blocks (:mod:`proxy.wire.messages_edits`) and spliced into the client's
bytes (:mod:`proxy.core.splice`): every other byte is the client's, ``cache_control`` markers
where the client put them. Where that cannot be guaranteed the request is forwarded (and
recorded) as sent and the refusal counted. Positions in ``x-kvwarm-prefix`` / ``x-kvwarm-break``
count view elements: the tools, the system, then each message (a user message holding tool
results counts one per result block, and one per run of other blocks).

A body re-sent byte for byte (Claude Code sends its whole history every turn) is parsed only
past what it shares with the tenant's previous body (:mod:`proxy.core.prefix`, on the
``messages`` array), and its view takes over the previous view's messages made of shared
messages: a no-drift turn costs in proportion to its new messages.

Observer: the reply as generated, from a JSON body (its ``content`` blocks, each ``tool_use``
input read from the body's bytes) or from the stream's events (each block from its
``content_block_start`` and the deltas after it: text, thinking and signature concatenated,
citations gathered, a ``tool_use`` input as the JSON text its ``input_json_delta`` pieces make);
a cut stream is recorded as delivered. The usage: ``message_start`` carries the input counts,
``message_delta`` the final counts (cumulative, and it may repeat the input ones): they are one
block, merged key by key, read once (:func:`~proxy.core.usage.extract_usage`: the prompt is Anthropic's
``input_tokens`` + ``cache_creation_input_tokens`` + ``cache_read_input_tokens``, the writes
with their 5-minute / hour split).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from ..core.guard import Guard
from ..core.identity import IdentityMemo
from ..core.model import NodeReader
from ..core.plan import TurnPlan
from ..core.policy import Policy
from ..core.prefix import Recalled
from ..core.record import Reply
from ..core.repair import NO_REPAIR
from ..core.splice import skip_space
from ..core.sse import SSEEvent, load_data
from ..core.usage import Usage, extract_usage
from ..transport.traits import UpstreamTraits
from .base import KEEP, BodyBuffer, Outgoing, Verdict, body_json, json_turn, plan_on_view
from .json_spans import compact_json
from .messages_edits import message_edits
from .messages_view import (
    MessagesView,
    assistant_view,
    continued_view,
    message_inputs,
    messages_view,
    parsed_input_text,
    tool_input_texts,
)

__all__ = ["MessagesObserver", "MessagesWire"]

PATH_SUFFIX: Final = "/messages"
TERMINAL: Final = frozenset(("message_stop", "error"))


class MessagesWire:
    """Anthropic's Messages API."""

    name = "messages"
    resends: str | None = "messages"
    """The array a client re-sends every turn (:mod:`proxy.core.prefix`)."""

    def parse(self, method: str, path: str, raw: bytes) -> dict[str, Any] | None:
        return json_turn(method, path, PATH_SUFFIX, raw, "messages")

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
        """Planned on the view; a repair mapped onto the client's blocks and spliced into its bytes.
        ``recalled``: how the body was rebuilt from the tenant's previous one."""
        try:
            view = _view(raw, body, recalled)
        except Exception as exc:  # the view is kvwarm's: forward the client's bytes, unplanned
            guard.fail("identify", exc)
            return TurnPlan(root=root, match=None, repair=NO_REPAIR, brk=None, forwarded=body, messages=0)
        chat: dict[str, Any] = {"messages": view.messages}
        if "tools" in body:
            chat["tools"] = body["tools"]
        return plan_on_view(
            raw, chat, view, root, reader, policy, memo, guard, recalled, lambda edits: message_edits(body, view, edits)
        )

    def outgoing(self, raw: bytes, body: Mapping[str, Any], plan: TurnPlan, traits: UpstreamTraits) -> Outgoing:
        """The client's bytes, with the repair spliced in: every other byte as the client sent it."""
        return Outgoing(body=plan.spliced if plan.spliced is not None else raw, usage_injected=False)

    def observer(self, outgoing: Outgoing, traits: UpstreamTraits, guard: Guard, *, success: bool) -> MessagesObserver:
        return MessagesObserver(guard, success=success)


def _view(raw: bytes, body: Mapping[str, Any], recalled: Recalled | None) -> MessagesView:
    """The body's view: taken over from the previous body's where it was rebuilt from one."""
    if recalled is not None and recalled.body is body:
        view = continued_view(body, recalled, tool_input_texts(raw, body, recalled.shared, recalled.cut))
        if view is not None:
            return view
    messages = body.get("messages")
    return messages_view(body.get("system"), messages if type(messages) is list else [], tool_input_texts(raw, body))


class MessagesObserver:
    """One Messages API response on its way to the client: usage and the reply, as generated."""

    __slots__ = (
        "_blocks", "_body", "_citations", "_done", "_guard", "_model", "_pieces", "_stop", "_stopped", "_success", "_terminal",
        "_usage", "usage",
    )

    def __init__(self, guard: Guard, *, success: bool) -> None:
        self._guard = guard
        self._success = success
        self._body = BodyBuffer()
        self._blocks: dict[int, dict[str, Any]] = {}
        """Content blocks by ``index``, as ``content_block_start`` gave them."""
        self._pieces: dict[tuple[int, str], list[str]] = {}
        """Per (index, field): the deltas so far (``text``, ``thinking``, ``signature``, ``input``)."""
        self._stopped: set[int] = set()
        self._citations: dict[int, list[Any]] = {}
        """Per text block index: the citations its ``citations_delta`` events added."""
        self._usage: dict[str, Any] = {}
        """The usage block: ``message_start``'s, updated key by key by ``message_delta``'s."""
        self._stop: str | None = None
        self._model: str | None = None
        self._terminal = False
        """The event just observed closes the stream."""
        self._done = False
        """``message_stop`` came: the message is complete."""
        self.usage: Usage | None = None

    # -- streams -----------------------------------------------------------------------

    def on_event(self, event: SSEEvent) -> Verdict:
        data = event.payload
        self._terminal = event.event in TERMINAL
        if data is None:
            return KEEP
        try:  # not ``with guard``: every event comes here (proxy/core/guard.py)
            self._read_event(load_data(data))
        except Exception as exc:
            self._guard.fail("usage", exc)
        return KEEP

    def _read_event(self, data: Any) -> None:
        if type(data) is not dict:
            return
        kind = data.get("type")
        if kind == "content_block_delta":
            self._delta(data.get("index"), data.get("delta"))
        elif kind == "content_block_start":
            index, block = data.get("index"), data.get("content_block")
            if type(index) is int and type(block) is dict:
                self._blocks[index] = block
        elif kind == "content_block_stop":
            index = data.get("index")
            if type(index) is int:
                self._stopped.add(index)
        elif kind == "message_start":
            message = data.get("message")
            if type(message) is dict:
                model = message.get("model")
                self._model = model if isinstance(model, str) else None
                self._add_usage(message.get("usage"))
        elif kind == "message_delta":
            delta = data.get("delta")
            if type(delta) is dict and isinstance(delta.get("stop_reason"), str):
                self._stop = delta["stop_reason"]
            self._add_usage(data.get("usage"))
        elif kind in TERMINAL:
            self._terminal = True
            self._done = self._done or kind == "message_stop"

    def _delta(self, index: Any, delta: Any) -> None:
        if type(index) is not int or type(delta) is not dict:
            return
        kind = delta.get("type")
        if kind == "citations_delta":
            citation = delta.get("citation")
            if citation is not None:
                self._citations.setdefault(index, []).append(citation)
            return
        spec = _DELTA_FIELDS.get(kind) if isinstance(kind, str) else None
        if spec is None:
            return
        value = delta.get(spec[1])
        if isinstance(value, str):
            self._pieces.setdefault((index, spec[0]), []).append(value)

    def _add_usage(self, usage: Any) -> None:
        """Cumulative counts: a later block's known values replace the earlier ones, never add."""
        if type(usage) is not dict:
            return
        for key, value in usage.items():
            if value is not None:
                self._usage[key] = value
        self.usage = extract_usage({"usage": self._usage})

    def is_terminal(self, event: SSEEvent) -> bool:
        """Called right after :meth:`on_event` for the same event."""
        return self._terminal

    # -- plain bodies --------------------------------------------------------------------

    def on_body(self, chunk: bytes) -> None:
        if self._success:
            self._body.add(chunk)

    def end(self, *, client_gone: bool) -> Reply | None:
        data = self._body.take()
        if data is not None:
            with self._guard("usage"):
                return self._from_body(data)
            return None
        try:
            return self._assembled(client_gone)
        except Exception as exc:
            self._guard.fail("record", exc)
            return None

    def _from_body(self, data: bytes) -> Reply | None:
        payload = body_json(data)
        if type(payload) is not dict:
            return None
        self.usage = extract_usage(payload)
        content = payload.get("content")
        if type(content) is not list:
            return None
        inputs = message_inputs(data, skip_space(data, 0), payload)
        stop = payload.get("stop_reason")
        model = payload.get("model")
        return Reply(
            message=assistant_view(content, inputs),
            finish_reason=stop if isinstance(stop, str) else None,
            partial=False,
            model=model if isinstance(model, str) else None,
        )

    def _assembled(self, client_gone: bool) -> Reply | None:
        """The reply of a stream: its blocks as delivered (the one in flight with its deltas so far)."""
        if not self._blocks:
            return None
        blocks: list[Any] = []
        inputs: dict[int, str] = {}
        for index in sorted(self._blocks):
            block = dict(self._blocks[index])
            for field in ("text", "thinking", "signature"):
                pieces = self._pieces.get((index, field))
                if pieces:
                    start = block.get(field)
                    block[field] = (start if isinstance(start, str) else "") + "".join(pieces)
            citations = self._citations.get(index)
            if citations:
                start = block.get("citations")
                block["citations"] = [*(start if type(start) is list else ()), *citations]
            kind = block.get("type")
            if kind == "tool_use":
                inputs[len(blocks)] = self._input_text(index, block)
            elif kind == "server_tool_use" and (index, "input") in self._pieces:
                # A block the client sends back as it is: its input parsed, as the SDK parses it.
                block["input"] = orjson.loads(self._input_text(index, block))
            blocks.append(block)
        return Reply(
            message=assistant_view(blocks, inputs),
            finish_reason=self._stop,
            partial=client_gone or not self._done,
            model=self._model,
        )

    def _input_text(self, index: int, block: Mapping[str, Any]) -> str:
        """A ``tool_use`` input as generated: the JSON text of its pieces (compacted once whole)."""
        pieces = self._pieces.get((index, "input"))
        if not pieces:
            return parsed_input_text(block.get("input"))
        text = "".join(pieces)
        if not text:
            return "{}"
        return compact_json(text.encode()) if index in self._stopped else text


_DELTA_FIELDS: Final = {
    "text_delta": ("text", "text"),
    "thinking_delta": ("thinking", "thinking"),
    "signature_delta": ("signature", "signature"),
    "input_json_delta": ("input", "partial_json"),
}
"""Delta type -> (the block field it extends, the delta's key holding the piece)."""
