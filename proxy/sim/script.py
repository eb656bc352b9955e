"""The reference upstream's Responses script: what the emulated model does with a Responses request.

Deterministic (a function of the request and a seed, the hash of the rendered
prompt), so that agent loops run and re-runs match. The default script makes a
real agent (the Codex CLI, the openai-agents SDK) run one tool and finish:

- **Call a tool** when the request offers a function tool, ``tool_choice`` is
  not ``"none"``, and the current turn — the items after the last ``user``
  message — holds no tool output yet: ONE ``function_call`` (``x-sim-tool-calls:
  N`` asks for N parallel calls, capped at 1 by ``parallel_tool_calls: false``).
  Which tool: the one ``tool_choice`` names, else the Codex CLI's command tool
  (``exec_command``, then ``shell``, then ``shell_command``), else the tools in
  their order. Arguments are harmless and fit the tool's JSON schema: its
  required properties only, a command property (``cmd`` / ``command``) as
  ``"echo kvwarm"`` or ``["echo", "kvwarm"]`` as its type asks, other values as
  :func:`.replies.sample_value` builds them; without a schema, ``exec_command``
  gets ``{"cmd": "echo kvwarm"}`` and ``shell`` ``{"command": ["echo",
  "kvwarm"]}``. Offered no function tool at top level but the Codex CLI's
  code-mode ``exec`` (a ``custom`` tool, in ``tools`` or in an
  ``additional_tools`` item, namespaces included), the model makes one
  ``custom_tool_call`` whose JavaScript runs ``echo kvwarm`` through
  ``tools.exec_command``; offered only the built-in ``local_shell`` tool, one
  ``local_shell_call`` of ``echo kvwarm``.
- **Answer with text** otherwise — in particular once a tool output came back:
  a few sentences of about ``x-sim-reply-tokens`` tokens ending with a newline,
  as the chat endpoint writes them; with ``text.format`` of type
  ``json_schema``, a compact JSON value fitting the schema instead.
- **Reason first** when the request has a ``reasoning`` parameter (other than
  ``effort: "none"``) or ``x-sim-reasoning: 1``: a reasoning text, and with
  ``reasoning.summary`` set, a summary that differs from the reasoning (a
  title and its first sentence).

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .items import TOOL_OUTPUT_TYPES, assistant_message, item_type
from .replies import DEFAULT_REPLY_TOKENS, reasoning_text, reply_text, sample_value

COMMAND_TOOLS = ("exec_command", "shell", "shell_command")
"""The Codex CLI's command tools, preferred in this order."""
HARMLESS_COMMAND = ("echo", "kvwarm")
CODE_MODE_SOURCE = 'const r = await tools.exec_command({cmd: "echo kvwarm"});\ntext(r);\n'
"""What the script runs with the Codex CLI's code-mode ``exec`` tool (JavaScript calling its command tool)."""
_COMMAND_PROPERTIES = ("cmd", "command")
_SUMMARY_MODES = frozenset({"auto", "concise", "detailed"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    """One tool call the model makes."""

    kind: str
    """``"function_call"``, ``"custom_tool_call"`` or ``"local_shell_call"``."""
    call_id: str
    name: str
    """The tool's name (``"local_shell"`` for a ``local_shell_call``)."""
    arguments: str
    """The argument string as generated (compact JSON); a custom tool's ``input``; a local
    shell call's ``action``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """What the model generates for one Responses request."""

    reasoning: str | None
    summary: str | None
    text: str | None
    calls: tuple[Call, ...]

    def message(self) -> dict[str, Any]:
        """The generated turn as the template's assistant message (:func:`.items.assistant_message`)."""
        return assistant_message(
            self.reasoning, self.text, [(call.name, call.arguments) for call in self.calls]
        )


def plan_turn(
    request: Mapping[str, Any],
    items: Sequence[Mapping[str, Any]],
    seed: bytes,
    *,
    reply_tokens: int = DEFAULT_REPLY_TOKENS,
    reasoning: bool = False,
    tool_calls: int = 1,
) -> Turn:
    """The turn the model generates for ``request`` whose effective input is ``items``."""
    rng = random.Random(hashlib.sha256(seed).digest())
    thought = summary = None
    if reasoning or wants_reasoning(request):
        thought = reasoning_text(rng)
        if wants_summary(request):
            summary = "**Thinking it through**\n\n" + thought.split(". ")[0].rstrip(".") + "."
    calls = _calls(request, items, seed, tool_calls)
    if calls:
        return Turn(reasoning=thought, summary=summary, text=None, calls=calls)
    return Turn(reasoning=thought, summary=summary, text=_text(request, rng, reply_tokens), calls=())


def wants_reasoning(request: Mapping[str, Any]) -> bool:
    """Whether the ``reasoning`` parameter asks for reasoning."""
    config = request.get("reasoning")
    return isinstance(config, Mapping) and config.get("effort") != "none"


def wants_summary(request: Mapping[str, Any]) -> bool:
    """Whether ``reasoning.summary`` asks for a summary."""
    config = request.get("reasoning")
    return isinstance(config, Mapping) and config.get("summary") in _SUMMARY_MODES


def turn_has_tool_output(items: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a tool output came back after the last ``user`` message."""
    for item in reversed(items):
        kind = item_type(item)
        if kind in TOOL_OUTPUT_TYPES:
            return True
        if kind == "message" and item.get("role") == "user":
            return False
    return False


def harmless_arguments(name: str, parameters: Any) -> dict[str, Any]:
    """Arguments for tool ``name`` fitting its schema ``parameters`` (see the module docstring)."""
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    if not isinstance(properties, Mapping) or not properties:
        if name == "exec_command":
            return {"cmd": " ".join(HARMLESS_COMMAND)}
        if name in ("shell", "shell_command"):
            return {"command": list(HARMLESS_COMMAND)}
        return {}
    required = parameters.get("required") if isinstance(parameters, Mapping) else None
    names = [key for key in properties if isinstance(required, list) and key in required]
    return {key: _harmless_value(key, properties[key]) for key in names}


def _harmless_value(name: str, schema: Any) -> Any:
    if name in _COMMAND_PROPERTIES and isinstance(schema, Mapping):
        kind = schema.get("type")
        if kind == "array" or (isinstance(kind, list) and "array" in kind):
            return list(HARMLESS_COMMAND)
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return " ".join(HARMLESS_COMMAND)
    return sample_value(schema)


def _calls(
    request: Mapping[str, Any], items: Sequence[Mapping[str, Any]], seed: bytes, width: int
) -> tuple[Call, ...]:
    choice = request.get("tool_choice")
    if choice == "none" or width == 0 or turn_has_tool_output(items):
        return ()
    if request.get("parallel_tool_calls") is False:
        width = 1
    tools = _function_tools(request.get("tools"), choice)
    if tools:
        return tuple(
            Call(
                kind="function_call",
                call_id=_call_id(seed, index),
                name=name,
                arguments=_compact(harmless_arguments(name, parameters)),
            )
            for index, (name, parameters) in enumerate(tools[:width])
        )
    offered = _offered_tools(request, items)
    if any(tool.get("type") == "custom" and tool.get("name") == "exec" for tool in offered):
        return (Call(kind="custom_tool_call", call_id=_call_id(seed, 0), name="exec", arguments=CODE_MODE_SOURCE),)
    if any(tool.get("type") == "local_shell" for tool in offered):
        action = {"type": "exec", "command": list(HARMLESS_COMMAND), "env": {}}
        return (Call(kind="local_shell_call", call_id=_call_id(seed, 0), name="local_shell", arguments=_compact(action)),)
    return ()


def _offered_tools(
    request: Mapping[str, Any], items: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """Every tool on offer: ``tools``, ``additional_tools`` items, inside namespaces too."""
    pending: list[Any] = list(request.get("tools") or ())
    for item in items:
        if item.get("type") == "additional_tools" and isinstance(item.get("tools"), list):
            pending += item["tools"]
    found: list[Mapping[str, Any]] = []
    while pending:
        tool = pending.pop(0)
        if not isinstance(tool, Mapping):
            continue
        found.append(tool)
        if tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            pending += tool["tools"]
    return found


def _function_tools(tools: Any, choice: Any) -> list[tuple[str, Any]]:
    """``(name, parameters)`` of the function tools, in the order the script prefers them."""
    found = [
        (tool["name"], tool.get("parameters"))
        for tool in tools or ()
        if isinstance(tool, Mapping)
        and tool.get("type") == "function"
        and isinstance(tool.get("name"), str)
    ]
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return [tool for tool in found if tool[0] == choice.get("name")][:1]
    preferred = [tool for name in COMMAND_TOOLS for tool in found if tool[0] == name]
    return preferred + [tool for tool in found if tool[0] not in COMMAND_TOOLS]


def _text(request: Mapping[str, Any], rng: random.Random, reply_tokens: int) -> str:
    text = request.get("text")
    form = text.get("format") if isinstance(text, Mapping) else None
    if isinstance(form, Mapping) and form.get("type") == "json_schema":
        return _compact(sample_value(form.get("schema")))
    return reply_text(rng, reply_tokens)


def _call_id(seed: bytes, index: int) -> str:
    return "call_" + hashlib.sha256(seed + b"/call/%d" % index).hexdigest()[:24]


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
