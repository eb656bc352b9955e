"""The Responses API's template: ``instructions``, input items and ``tools`` -> the chat template's messages.

An engine serving the Responses API (vLLM's, for one) turns a request into
chat messages and applies the model's chat template; so does the reference
upstream, with the template of :mod:`.render`. The Responses prompt therefore
caches exactly as a chat prompt does (same tokens, same blocks), in both cache
modes:

- ``tools``: the tools block, one compact JSON line per tool, exactly as sent
  (flat function tools, built-in tools such as ``{"type": "web_search"}``,
  ``local_shell``, custom tools): tool order, key order and every value change
  the tokens;
- ``instructions``: a ``system`` message first (a list of items: those items);
- a ``message`` item (``type`` may be absent when there is a ``role``): a
  message of its role (``user``, ``system``, ``developer``; ``assistant`` see
  below); a string ``content`` and one ``input_text`` / ``output_text`` part
  render the same; ``refusal`` parts render their text, ``input_image`` an
  image placeholder;
- a run of assistant-side items — ``reasoning``, assistant ``message``,
  ``function_call`` (also ``custom_tool_call``, ``local_shell_call``) — is ONE
  assistant message: reasoning in ``<think>``, the text, then each call as a
  ``<tool_call>`` with its argument string raw (``{"a":1}`` and ``{"a": 1}``
  differ). A reasoning item after text or calls starts the next assistant
  message. This is what the engine generated, so the items the reference
  upstream returned, echoed back, render to exactly the generated tokens;
- ``function_call_output`` (and the other ``*_output`` items): a ``tool``
  message with the output (a string, or a list of parts rendered as content);
- any other item type: a message whose role is the type and whose body is the
  item's compact JSON without ``id`` and ``status``.

Decisions (each tested):

- **Item ``id`` and ``status`` never render**, nor do ``call_id`` and cache markers
  (``cache_control``, ``prompt_cache_breakpoint``: they stay on the messages and
  parts, for :mod:`.markers`, and render nothing): no real
  template renders them (chat's tool-call ids do not render either), so ids
  regenerated between turns cost no cache, while a changed text or argument
  string does. The one exception is resolution, not rendering: an
  ``item_reference``, or a ``reasoning`` item sent without its
  ``encrypted_content``, is looked up by id among stored responses first
  (:mod:`.response_store`), as the provider does.
- **A ``reasoning`` item renders the reasoning the model generated**: its
  ``encrypted_content`` opened (:mod:`.sealed`) when it is the reference
  upstream's own; foreign opaque bytes render as they are (a real provider
  rejects them; the emulator stays usable with hand-made fixtures); without
  ``encrypted_content``, its ``content`` reasoning texts, else its summary
  texts. Dropping ``encrypted_content`` therefore changes the tokens (the
  summary is not the reasoning), as it does on a real provider.
- ``null`` / absent fields render nothing.
- A ``function_call_output`` must follow a ``function_call`` with its
  ``call_id`` (likewise ``custom_tool_call_output``), or the request is refused
  as the real API refuses it: an orphaned tool output is a client bug.

Pure: no I/O; errors are :class:`InputError` naming the offending field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .render import MARKER_KEYS, Segment, render_content, render_segments
from .sealed import open_sealed

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
TOOL_OUTPUT_TYPES = frozenset(
    {"function_call_output", "custom_tool_call_output", "local_shell_call_output"}
)
"""Item types that carry a tool's result back to the model."""
_PAIRED_CALLS = {
    "function_call_output": "function_call",
    "custom_tool_call_output": "custom_tool_call",
}
_UNRENDERED_KEYS = frozenset({"id", "status", *MARKER_KEYS})


class InputError(ValueError):
    """A request the Responses API refuses; ``param`` names the field (as the API's error does)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def item_type(item: Mapping[str, Any]) -> str:
    """An item's type; an item with a ``role`` and no ``type`` is a ``message``."""
    kind = item.get("type")
    if kind is None and "role" in item:
        return "message"
    return kind if isinstance(kind, str) else ""


def input_items(value: Any) -> list[Mapping[str, Any]]:
    """The request's ``input`` as items: a string is one user message; absent is none."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InputError("'input' must be a string or a list of items", "input")
    for index, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise InputError(f"input[{index}] must be an object", f"input[{index}]")
    return value


def check_tools(tools: Any) -> list[Mapping[str, Any]]:
    """The request's ``tools``, validated as the API does (a function tool needs a ``name``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InputError("'tools' must be a list", "tools")
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type"), str):
            raise InputError(f"tools[{index}] must be an object with a 'type'", f"tools[{index}]")
        if tool["type"] in ("function", "custom") and not isinstance(tool.get("name"), str):
            raise InputError(
                f"Missing required parameter: 'tools[{index}].name'.", f"tools[{index}].name"
            )
    return tools


def render_response_segments(
    instructions: Any, items: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[Segment]:
    """The prompt of a Responses request: tools block, instructions, items, generation prompt."""
    return render_segments(to_messages(instructions, items), tools)


def to_messages(instructions: Any, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages the template renders for ``instructions`` and the (resolved) input items."""
    conversation = _Conversation()
    if isinstance(instructions, str):
        if instructions:
            conversation.add({"role": "system", "content": instructions})
    elif isinstance(instructions, list):
        for index, item in enumerate(instructions):
            if not isinstance(item, Mapping):
                raise InputError(f"instructions[{index}] must be an object", "instructions")
            conversation.add_item(item, f"instructions[{index}]")
    elif instructions is not None:
        raise InputError("'instructions' must be a string", "instructions")
    for index, item in enumerate(items):
        conversation.add_item(item, f"input[{index}]")
    return conversation.finish()


def reasoning_text(item: Mapping[str, Any]) -> str:
    """What a ``reasoning`` item puts into the prompt (see the module docstring)."""
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed:
        opened = open_sealed(sealed)
        return opened if opened is not None else sealed
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [
                part["text"]
                for part in parts
                if isinstance(part, Mapping)
                and part.get("type", part_type) == part_type
                and isinstance(part.get("text"), str)
            ]
            if texts:
                return "\n\n".join(texts)
    return ""


def assistant_message(
    reasoning: str | None, text: str | None, calls: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    """The chat assistant message of one assistant turn: reasoning, text, ``(name, arguments)`` calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls
        ]
    return message


class _Conversation:
    """Chat messages being built from items; an assistant turn stays open until a non-assistant item."""

    __slots__ = ("_call_ids", "_calls", "_messages", "_reasoning", "_texts")

    def __init__(self) -> None:
        self._messages: list[dict[str, Any]] = []
        self._reasoning: list[str] = []
        self._texts: list[str] = []
        self._calls: list[tuple[str, str]] = []
        self._call_ids: dict[str, set[str]] = {kind: set() for kind in _PAIRED_CALLS.values()}

    def add(self, message: dict[str, Any]) -> None:
        self._close_turn()
        self._messages.append(message)

    def add_item(self, item: Mapping[str, Any], where: str) -> None:
        kind = item_type(item)
        if kind == "message":
            self._add_message(item, where)
        elif kind == "reasoning":
            if self._texts or self._calls:
                self._close_turn()
            text = reasoning_text(item)
            if text:
                self._reasoning.append(text)
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            self._add_call(kind, item, where)
        elif kind in TOOL_OUTPUT_TYPES:
            self._add_output(kind, item, where)
        elif not kind:
            raise InputError(f"{where} has no 'type'", f"{where}.type")
        else:
            body = {k: v for k, v in item.items() if k not in _UNRENDERED_KEYS}
            self.add(_marked(item, {"role": kind, "content": _compact(body)}))

    def finish(self) -> list[dict[str, Any]]:
        self._close_turn()
        return self._messages

    def _add_message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise InputError(
                f"{where}.role must be one of {sorted(MESSAGE_ROLES)}, not {role!r}",
                f"{where}.role",
            )
        content = item.get("content")
        try:
            text = render_content(content)
        except ValueError as exc:
            raise InputError(f"{where}.content: {exc}", f"{where}.content") from None
        if role == "assistant":
            if self._calls:
                self._close_turn()
            if text:
                self._texts.append(text)
            return
        # The parts themselves (they render as ``text`` does) keep their cache markers.
        self.add(_marked(item, {"role": role, "content": content if text else text}))

    def _add_call(self, kind: str, item: Mapping[str, Any], where: str) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise InputError(f"{where}.call_id must be a string", f"{where}.call_id")
        if kind in self._call_ids:
            self._call_ids[kind].add(call_id)
        if kind == "local_shell_call":
            self._calls.append(("local_shell", _compact(item.get("action"))))
            return
        name = item.get("name")
        if not isinstance(name, str):
            raise InputError(f"{where}.name must be a string", f"{where}.name")
        field = "arguments" if kind == "function_call" else "input"
        arguments = item.get(field)
        if not isinstance(arguments, str):
            raise InputError(f"{where}.{field} must be a string", f"{where}.{field}")
        self._calls.append((name, arguments))

    def _add_output(self, kind: str, item: Mapping[str, Any], where: str) -> None:
        call_id = item.get("call_id")
        paired = _PAIRED_CALLS.get(kind)
        if paired is not None and call_id not in self._call_ids[paired]:
            raise InputError(
                f"No tool call found for {kind.replace('_', ' ')} with call_id {call_id}.", "input"
            )
        output = item.get("output")
        try:
            text = render_content(output)
        except ValueError:
            raise InputError(
                f"{where}.output must be a string or a list of parts", f"{where}.output"
            ) from None
        self.add(_marked(item, {"role": "tool", "content": output if text else text}))

    def _close_turn(self) -> None:
        if self._reasoning or self._texts or self._calls:
            text = "\n\n".join(self._texts) if self._texts else None
            reasoning = "\n\n".join(self._reasoning) if self._reasoning else None
            self._messages.append(assistant_message(reasoning, text, self._calls))
        self._reasoning, self._texts, self._calls = [], [], []


def _marked(item: Mapping[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with ``item``'s cache markers (they mark its last block, :mod:`.layout`)."""
    for key in MARKER_KEYS:
        if key in item:
            message[key] = item[key]
    return message


def _compact(value: Any) -> str:
    # The client's key order, non-ASCII as is; the stdlib keeps big integers exact.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
