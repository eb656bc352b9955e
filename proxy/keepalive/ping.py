"""The bytes of a keep-alive ping: a session's last request, cut at its last cache breakpoint,
asking for the least output the API allows. Pure.

What keeps a prefix cached is a read of it, and a provider with breakpoints reads at a
breakpoint: the ping is the request kvwarm forwarded (its bytes: repaired values, kvwarm's
and the client's markers, the route's ``prompt_cache_key``), its re-sent array (chat's and the
Messages API's ``messages``, the Responses API's ``input``) cut after the last element that
ends a breakpoint:

- ``cache_control``: the last element holding a ``cache_control`` member anywhere inside it
  (a part, a block, a tool call, the message itself); a top-level ``cache_control`` marks the
  last block, so nothing is cut;
- ``openai``: the last element holding a ``prompt_cache_breakpoint``, or the implicit
  breakpoint's (the latest user or tool message; Responses: user message or tool output).

Every other element is kept byte for byte (:func:`~proxy.core.splice.try_splice` drops the rest
of the array; nothing is re-serialized). Then the top level: ``stream`` and its options and
every output limit are left out, and the smallest output is asked for: ``max_tokens: 1`` (chat,
or ``max_completion_tokens: 1`` where the request used it, as GPT-5 models require), the
Responses API's minimum ``max_output_tokens: 16`` with ``store: false`` (nothing is kept at the
provider), the Messages API's ``max_tokens: 1`` (with extended thinking on, its budget plus
one: the API refuses less, and turning thinking off would change the cached prefix). ``tools``
and ``tool_choice`` stay as sent: they are part of the prefix, and kvwarm runs no tool anyway.

None when the request cannot be cut so (no breakpoint in the array, a body that is not a JSON
object, duplicate top-level keys): no ping is sent for it.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..core.breakpoints import CACHE_CONTROL, OPENAI
from ..core.splice import Refusal, Refused, Reorder, skip_space, skip_value, try_splice

__all__ = ["CHAT", "MESSAGES", "OUTPUT_LIMITS", "RESPONSES", "api_of", "output_limit", "ping_body"]

CHAT, RESPONSES, MESSAGES = "chat", "responses", "messages"
OUTPUT_LIMITS = {CHAT: 1, RESPONSES: 16, MESSAGES: 1}
"""The least output each API lets a request ask for."""
_MARKER_KEYS = {CACHE_CONTROL: "cache_control", OPENAI: "prompt_cache_breakpoint"}
_DROPPED = {
    CHAT: frozenset(("stream", "stream_options", "max_tokens", "max_completion_tokens", "n")),
    RESPONSES: frozenset(("stream", "stream_options", "max_output_tokens", "background", "store")),
    MESSAGES: frozenset(("stream", "max_tokens")),
}
"""Top-level members a ping leaves out (it sets its own output limit instead)."""
_TOOL_OUTPUTS = frozenset(("function_call_output", "custom_tool_call_output"))


def api_of(path: str) -> str | None:
    """Which API a request path is (chat, Responses, Messages); None: one kvwarm does not ping."""
    path = path.rstrip("/")
    if path.endswith("/chat/completions"):
        return CHAT
    if path.endswith("/responses"):
        return RESPONSES
    if path.endswith("/messages"):
        return MESSAGES
    return None


def output_limit(api: str, raw: bytes) -> int:
    """The most output tokens the ping of ``raw`` may generate (what :func:`ping_body` asks for)."""
    if api != MESSAGES:
        return OUTPUT_LIMITS[api]
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return OUTPUT_LIMITS[api]
    return _messages_limit(body) if type(body) is dict else OUTPUT_LIMITS[api]


def ping_body(api: str, raw: bytes, dialect: str) -> bytes | None:
    """The ping of the request ``raw`` (the bytes forwarded) of ``api``, marked in ``dialect``;
    None when it cannot be made (module docstring)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(body) is not dict or dialect not in _MARKER_KEYS:
        return None
    array = "input" if api == RESPONSES else "messages"
    elements = body.get(array)
    cut_bytes = raw
    if type(elements) is list:
        automatic = dialect == CACHE_CONTROL and "cache_control" in body
        cut = len(elements) - 1 if automatic else _last_breakpoint(elements, api, dialect)
        if cut is None or cut < 0:
            return None
        if cut < len(elements) - 1:
            spliced = try_splice(raw, [Reorder(path=(array,), order=tuple(range(cut + 1)))])
            if isinstance(spliced, Refusal):
                return None
            cut_bytes = spliced
    elif not (api == RESPONSES and type(elements) is str):
        return None
    return _with_least_output(cut_bytes, api, body, dialect)


def _last_breakpoint(elements: list[Any], api: str, dialect: str) -> int | None:
    key = _MARKER_KEYS[dialect]
    for i in range(len(elements) - 1, -1, -1):
        element = elements[i]
        if _holds(element, key) or (dialect == OPENAI and _implicit(element, api)):
            return i
    return None


def _holds(value: Any, key: str) -> bool:
    """``value`` has an object with the member ``key`` somewhere inside it (itself included)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            if key in item:
                return True
            stack.extend(v for v in item.values() if type(v) is dict or type(v) is list)
        elif type(item) is list:
            stack.extend(v for v in item if type(v) is dict or type(v) is list)
    return False


def _implicit(element: Any, api: str) -> bool:
    """The element is where OpenAI's implicit breakpoint may sit: a user or tool message (a user
    message item or a tool output, for the Responses API)."""
    if type(element) is not dict:
        return False
    if api == RESPONSES:
        kind = element.get("type")
        if kind in _TOOL_OUTPUTS:
            return True
        return (kind is None or kind == "message") and element.get("role") == "user"
    return element.get("role") in ("user", "tool")


def _messages_limit(body: dict[str, Any]) -> int:
    thinking = body.get("thinking")
    if type(thinking) is dict and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if type(budget) is int and budget > 0:
            return budget + 1
    return OUTPUT_LIMITS[MESSAGES]


def _with_least_output(raw: bytes, api: str, body: dict[str, Any], dialect: str) -> bytes | None:
    """``raw`` with the top-level members :data:`_DROPPED` left out and the ping's output limit
    (and for Responses ``store: false``) added; every other member's bytes as they were."""
    members = _members(raw)
    if members is None:
        return None
    dropped = _DROPPED[api]
    kept = [raw[start:end] for key, start, end in members if key not in dropped]
    if api == CHAT:
        name = "max_completion_tokens" if "max_completion_tokens" in body or (
            dialect == OPENAI and "max_tokens" not in body
        ) else "max_tokens"
        kept.append(b'"' + name.encode() + b'":1')
    elif api == RESPONSES:
        kept.append(b'"max_output_tokens":%d,"store":false' % OUTPUT_LIMITS[RESPONSES])
    else:
        kept.append(b'"max_tokens":%d' % _messages_limit(body))
    return b"{" + b",".join(kept) + b"}"


def _members(raw: bytes) -> list[tuple[str, int, int]] | None:
    """The top-level object's members: (key, where its ``"key": value`` starts, where it ends);
    None when ``raw`` is not one JSON object or repeats a key."""
    try:
        pos = skip_space(raw, 0)
        if raw[pos : pos + 1] != b"{":
            return None
        pos = skip_space(raw, pos + 1)
        members: list[tuple[str, int, int]] = []
        if raw[pos : pos + 1] == b"}":
            return members
        while True:
            if raw[pos : pos + 1] != b'"':
                return None
            key_end = skip_value(raw, pos, ())
            key = orjson.loads(raw[pos:key_end])
            colon = skip_space(raw, key_end)
            if raw[colon : colon + 1] != b":":
                return None
            end = skip_value(raw, skip_space(raw, colon + 1), ())
            members.append((key, pos, end))
            pos = skip_space(raw, end)
            if raw[pos : pos + 1] == b"}":
                break
            if raw[pos : pos + 1] != b",":
                return None
            pos = skip_space(raw, pos + 1)
    except (Refused, IndexError, orjson.JSONDecodeError):
        return None
    keys = [key for key, _, _ in members]
    return members if len(set(keys)) == len(keys) else None
