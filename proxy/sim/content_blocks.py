"""The Messages API's template: ``system``, content blocks and ``tools`` -> chat messages.

An engine serving Anthropic's Messages API (vLLM's ``/v1/messages``, for one)
turns a request into chat messages and applies the model's chat template; so
does the reference upstream, with the template of :mod:`.render`. A Messages
prompt therefore caches as a chat prompt does, in every cache mode:

- ``tools``: the tools block, one compact JSON line per tool exactly as sent
  (``name``, ``description``, ``input_schema``, server tools alike): tool order,
  key order and every value change the tokens;
- ``system``: a ``system`` message first; a string and a list of ``text``
  blocks render their texts;
- a ``user`` message: its ``text`` blocks, ``image`` blocks (an image
  placeholder) and ``document`` blocks (a file placeholder); a string
  ``content`` and one ``text`` block render the same. Each ``tool_result``
  block is a ``tool`` message of its own, in its place: its ``content`` (a
  string, or blocks rendered as a user's are), inside ``<tool_error>`` tags
  when ``is_error`` is true;
- an ``assistant`` message: ``thinking`` blocks (their ``thinking`` text) and
  ``redacted_thinking`` blocks (their ``data`` opened, :mod:`.sealed`, when it
  is the reference upstream's own; as it is otherwise) render inside
  ``<think>``, then the ``text`` blocks, then each ``tool_use`` as a
  ``<tool_call>`` whose arguments are its ``input`` as compact JSON in the key
  order sent. A ``thinking`` block after text or a tool call starts the next
  assistant message, so the order of interleaved thinking renders. The blocks
  the reference upstream generates, echoed back, render to exactly the
  generated tokens (:func:`assistant_messages` builds both);
- any other block (``search_result``, server tool blocks, ...): its compact
  JSON, as text.

Decisions (each tested):

- **``cache_control`` renders nothing** wherever it sits; it stays on the blocks
  (and is carried to the messages made of ``tool_result`` blocks, from the
  block or from the last of its own blocks) for :mod:`.markers`.
- **Ids never render**: neither ``tool_use.id`` nor ``tool_result.tool_use_id``
  (as chat's tool-call ids and the Responses API's ``call_id`` do not), so ids
  regenerated between turns cost no cache, while a changed input does.
- **A thinking block's ``signature`` renders nothing and is checked**: the
  reference upstream signs what it generates (the thinking sealed, :mod:`.sealed`);
  a signature of its own that does not match its block's ``thinking`` is refused
  as Anthropic refuses it. A foreign signature is accepted unchecked (fixtures).
- **Tool use and results must pair** as the API demands: every ``tool_result``
  answers a ``tool_use`` of the previous message, and every ``tool_use`` of a
  message that is followed by another is answered in that next message. Either
  orphan is refused with Anthropic's message: a client bug, not a cache miss.

Pure: no I/O; refusals are :class:`.items.InputError` (the endpoint answers 400
``invalid_request_error``), their messages in Anthropic's words and paths
(``messages.1.content.0``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .items import InputError
from .render import MARKER_KEYS, render_content
from .sealed import open_sealed

CACHE_CONTROL = "cache_control"
ROLES = ("user", "assistant")
_USER_PART_TYPES = frozenset({"text", "image"})
"""Blocks a user message renders as chat content parts, unchanged."""
_THINKING_TYPES = frozenset({"thinking", "redacted_thinking"})


def check_tools(tools: Any) -> list[Mapping[str, Any]]:
    """The request's ``tools``, validated as the API does (every tool has a ``name``)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InputError("tools: Input should be a valid list", "tools")
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InputError(f"tools.{index}: Input should be an object", f"tools.{index}")
        if not isinstance(tool.get("name"), str):
            raise InputError(f"tools.{index}.name: Field required", f"tools.{index}.name")
    return tools


def to_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """The chat messages the template renders for ``system`` and ``messages``."""
    chat = _system(system)
    if not isinstance(messages, list) or not messages:
        raise InputError("messages: Input should be a non-empty list", "messages")
    asked: set[str] = set()  # the previous message's tool_use ids: this one must answer them
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        role, content = _role_and_content(message, where)
        if role == "user":
            answered = _add_user(chat, content, where, asked)
        else:
            answered = set()
        if asked - answered:
            missing = ", ".join(sorted(asked - answered))
            raise InputError(
                f"messages.{index - 1}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {missing}. Each `tool_use` block must have a corresponding "
                "`tool_result` block in the next message.",
                f"messages.{index - 1}",
            )
        asked = _add_assistant(chat, content, where) if role == "assistant" else set()
    return chat


def assistant_messages(
    blocks: Sequence[Mapping[str, Any]], where: str = ""
) -> list[dict[str, Any]]:
    """The chat assistant messages of one assistant turn's content blocks (one, unless a
    thinking block follows text or a tool call)."""
    turns = _AssistantTurns()
    for index, block in enumerate(blocks):
        turns.add(block, f"{where}.content.{index}")
    return turns.finish()


def tool_input_text(value: Any) -> str:
    """A ``tool_use`` input as it renders: compact JSON, the key order sent, non-ASCII as is
    (the stdlib encoder keeps integers beyond 64 bits exact)."""
    return json.dumps({} if value is None else value, ensure_ascii=False, separators=(",", ":"))


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise InputError(
            "system: Input should be a valid string or a list of text blocks", "system"
        )
    for index, block in enumerate(system):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise InputError(f"system.{index}.type: Input should be 'text'", f"system.{index}")
        if not isinstance(block.get("text"), str):
            raise InputError(f"system.{index}.text: Field required", f"system.{index}.text")
    return [{"role": "system", "content": system}] if system else []


def _role_and_content(message: Any, where: str) -> tuple[str, str | list[Mapping[str, Any]]]:
    if not isinstance(message, Mapping):
        raise InputError(f"{where}: Input should be an object", where)
    role = message.get("role")
    if role not in ROLES:
        raise InputError(f"{where}.role: Input should be 'user' or 'assistant'", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return role, content
    if not isinstance(content, list):
        raise InputError(f"{where}.content: Field required", f"{where}.content")
    for index, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise InputError(
                f"{where}.content.{index}.type: Field required", f"{where}.content.{index}"
            )
    return role, content


def _add_user(
    chat: list[dict[str, Any]], content: str | list[Mapping[str, Any]], where: str, asked: set[str]
) -> set[str]:
    """Append a user message's chat messages; returns the ``tool_use`` ids it answers."""
    if isinstance(content, str):
        chat.append({"role": "user", "content": content})
        return set()
    answered: set[str] = set()
    parts: list[Mapping[str, Any]] = []
    for index, block in enumerate(content):
        if block["type"] != "tool_result":
            parts.append(_user_part(block))
            continue
        if parts:
            chat.append({"role": "user", "content": parts})
            parts = []
        chat.append(_tool_message(block, f"{where}.content.{index}", asked))
        answered.add(block["tool_use_id"])
    if parts or not content:
        chat.append({"role": "user", "content": parts})
    return answered


def _user_part(block: Mapping[str, Any]) -> Mapping[str, Any]:
    kind = block["type"]
    if kind in _USER_PART_TYPES:
        return block
    if kind == "document":
        return _with_marker({"type": "file"}, block)
    return _with_marker({"type": "text", "text": _compact_block(block)}, block)


def _tool_message(block: Mapping[str, Any], where: str, asked: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in asked:
        raise InputError(
            f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {call_id}. "
            "Each `tool_result` block must have a corresponding `tool_use` block in the "
            "previous message.",
            where,
        )
    content = block.get("content")
    marker = block.get(CACHE_CONTROL)
    if isinstance(content, list):
        parts = [_user_part(part) for part in content if isinstance(part, Mapping)]
        if marker is None:
            inner = [part.get(CACHE_CONTROL) for part in content if isinstance(part, Mapping)]
            marker = next((found for found in reversed(inner) if found is not None), None)
        text = render_content(parts)
    elif content is None or isinstance(content, str):
        text = content or ""
    else:
        raise InputError(f"{where}.content: Input should be a string or a list of blocks", where)
    if block.get("is_error") is True:
        text = f"<tool_error>\n{text}\n</tool_error>"
    message: dict[str, Any] = {"role": "tool", "content": text}
    if marker is not None:
        message[CACHE_CONTROL] = marker
    return message


def _add_assistant(
    chat: list[dict[str, Any]], content: str | list[Mapping[str, Any]], where: str
) -> set[str]:
    """Append an assistant message's chat messages; returns its ``tool_use`` ids."""
    if isinstance(content, str):
        chat.append({"role": "assistant", "content": content})
        return set()
    chat += assistant_messages(content, where)
    return {
        block["id"]
        for block in content
        if block["type"] == "tool_use" and isinstance(block.get("id"), str)
    }


class _AssistantTurns:
    """Chat assistant messages being built from content blocks; a thinking block after text or
    a tool call starts the next one."""

    __slots__ = ("_calls", "_messages", "_parts", "_reasoning")

    def __init__(self) -> None:
        self._messages: list[dict[str, Any]] = []
        self._reasoning: list[str] = []
        self._parts: list[Mapping[str, Any]] = []
        self._calls: list[dict[str, Any]] = []

    def add(self, block: Mapping[str, Any], where: str) -> None:
        kind = block["type"]
        if kind in _THINKING_TYPES:
            if self._parts or self._calls:
                self._close()
            self._reasoning.append(_thinking_text(block, where))
        elif kind == "text":
            self._parts.append(block)
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str):
                raise InputError(f"{where}.name: Field required", f"{where}.name")
            arguments = tool_input_text(block.get("input"))
            call = {"type": "function", "function": {"name": name, "arguments": arguments}}
            self._calls.append(_with_marker(call, block))
        else:
            self._parts.append(_with_marker({"type": "text", "text": _compact_block(block)}, block))

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        return self._messages or [{"role": "assistant", "content": None}]

    def _close(self) -> None:
        if not (self._reasoning or self._parts or self._calls):
            return
        message: dict[str, Any] = {"role": "assistant", "content": self._parts or None}
        if self._reasoning:
            message["reasoning_content"] = "\n\n".join(self._reasoning)
        if self._calls:
            message["tool_calls"] = self._calls
        self._messages.append(message)
        self._reasoning, self._parts, self._calls = [], [], []


def _thinking_text(block: Mapping[str, Any], where: str) -> str:
    """What a ``thinking`` or ``redacted_thinking`` block puts into the prompt."""
    if block["type"] == "redacted_thinking":
        data = block.get("data")
        if not isinstance(data, str):
            raise InputError(f"{where}.data: Field required", f"{where}.data")
        opened = open_sealed(data)
        return opened if opened is not None else data
    thinking, signature = block.get("thinking"), block.get("signature")
    if not isinstance(thinking, str):
        raise InputError(f"{where}.thinking: Field required", f"{where}.thinking")
    if not isinstance(signature, str):
        raise InputError(f"{where}.signature: Field required", f"{where}.signature")
    signed = open_sealed(signature)
    if signed is not None and signed != thinking:
        raise InputError(f"{where}: Invalid `signature` in `thinking` block", where)
    return thinking


def _with_marker(converted: dict[str, Any], block: Mapping[str, Any]) -> dict[str, Any]:
    """``converted`` carrying ``block``'s cache marker (:mod:`.markers` reads it there)."""
    if CACHE_CONTROL in block:
        converted[CACHE_CONTROL] = block[CACHE_CONTROL]
    return converted


def _compact_block(block: Mapping[str, Any]) -> str:
    shown = {key: value for key, value in block.items() if key not in MARKER_KEYS}
    return json.dumps(shown, ensure_ascii=False, separators=(",", ":"))
