"""The Messages script: what the emulated model does with a Messages request, as content blocks.

Deterministic (a function of the request and a seed, the hash of the rendered
prompt), so that agent loops run and re-runs match. It follows the Responses
script (:mod:`.script`) so that a real agent (Claude Code, an ``anthropic`` SDK
loop) runs one tool and finishes:

- **Call a tool** when the request offers a tool, ``tool_choice`` is not
  ``{"type": "none"}``, and the last message is not a user message answering
  tool calls (holding a ``tool_result``): ONE ``tool_use`` (``x-sim-tool-calls:
  N`` asks for N, capped at 1 by ``tool_choice.disable_parallel_tool_use``).
  ``tool_choice`` ``{"type": "any"}`` or ``{"type": "tool", "name": ...}`` forces
  a call even then, as it forces the real model. Which tool: the one
  ``tool_choice`` names, else Claude Code's ``Bash``, else a Codex command tool
  (:data:`.script.COMMAND_TOOLS`), else the tools in their order. Its ``input``
  fits the tool's ``input_schema`` (:func:`.script.harmless_arguments`: required
  properties only, a ``command`` as ``"echo kvwarm"``). ``stop_reason``:
  ``"tool_use"``.
- **Answer with text** otherwise: a few sentences of about
  ``x-sim-reply-tokens`` tokens ending with a newline, as chat writes them.
  ``stop_reason``: ``"end_turn"``.
- **Think first** when ``thinking`` is ``{"type": "enabled", ...}`` (or
  ``"adaptive"``) or ``x-sim-reasoning: 1``: a ``thinking`` block, signed with
  the thinking sealed (:mod:`.sealed`), so the same thinking always has the same
  signature and :mod:`.content_blocks` can check it when it comes back.

Tool-use ids (``toolu_...``) are deterministic too; they render nothing.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from .replies import DEFAULT_REPLY_TOKENS, reasoning_text, reply_text
from .script import COMMAND_TOOLS, Call, Turn, harmless_arguments
from .sealed import seal

MESSAGE_COMMAND_TOOLS = ("Bash", *COMMAND_TOOLS)
"""Command tools, preferred in this order: Claude Code's, then the Codex CLI's."""
THINKING_TYPES = ("enabled", "adaptive")
"""``thinking.type`` values that make the model think."""


def plan_message_turn(
    request: Mapping[str, Any],
    seed: bytes,
    *,
    reply_tokens: int = DEFAULT_REPLY_TOKENS,
    reasoning: bool = False,
    tool_calls: int = 1,
) -> Turn:
    """The turn the model generates for the Messages ``request``."""
    rng = random.Random(hashlib.sha256(seed).digest())
    thought = reasoning_text(rng) if reasoning or wants_thinking(request) else None
    calls = _calls(request, seed, tool_calls)
    if calls:
        return Turn(reasoning=thought, summary=None, text=None, calls=calls)
    return Turn(reasoning=thought, summary=None, text=reply_text(rng, reply_tokens), calls=())


def wants_thinking(request: Mapping[str, Any]) -> bool:
    """Whether the ``thinking`` parameter asks for thinking."""
    thinking = request.get("thinking")
    return isinstance(thinking, Mapping) and thinking.get("type") in THINKING_TYPES


def content_blocks(turn: Turn) -> list[dict[str, Any]]:
    """The turn as the ``content`` of a Messages response: thinking, text, then tool uses."""
    blocks: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        blocks.append(
            {"type": "thinking", "thinking": turn.reasoning, "signature": seal(turn.reasoning)}
        )
    if turn.text is not None:
        blocks.append({"type": "text", "text": turn.text})
    for call in turn.calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call.call_id,
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    return blocks


def stop_reason(turn: Turn) -> str:
    """``"tool_use"`` when the turn calls tools, else ``"end_turn"``."""
    return "tool_use" if turn.calls else "end_turn"


def _calls(request: Mapping[str, Any], seed: bytes, width: int) -> tuple[Call, ...]:
    choice = request.get("tool_choice")
    choice = choice if isinstance(choice, Mapping) else {}
    kind = choice.get("type", "auto")
    forced = kind in ("any", "tool")
    if kind == "none" or width == 0 or (not forced and _answering(request.get("messages"))):
        return ()
    if choice.get("disable_parallel_tool_use") is True:
        width = 1
    tools = _custom_tools(request.get("tools"))
    if kind == "tool":
        tools = [tool for tool in tools if tool[0] == choice.get("name")][:1]
    return tuple(
        Call(
            kind="function_call",
            call_id=_tool_use_id(seed, index),
            name=name,
            arguments=_compact(harmless_arguments(name, schema)),
        )
        for index, (name, schema) in enumerate(tools[:width])
    )


def _answering(messages: Any) -> bool:
    """Whether the last message is a user message holding tool results."""
    if not isinstance(messages, Sequence) or not messages:
        return False
    last = messages[-1]
    if not isinstance(last, Mapping) or last.get("role") != "user":
        return False
    content = last.get("content")
    return isinstance(content, list) and any(
        isinstance(block, Mapping) and block.get("type") == "tool_result" for block in content
    )


def _custom_tools(tools: Any) -> list[tuple[str, Any]]:
    """``(name, input_schema)`` of the client's own tools (not server tools), preferred first."""
    found = [
        (tool["name"], tool.get("input_schema"))
        for tool in tools or ()
        if isinstance(tool, Mapping)
        and tool.get("type") in (None, "custom")
        and isinstance(tool.get("name"), str)
    ]
    preferred = [tool for name in MESSAGE_COMMAND_TOOLS for tool in found if tool[0] == name]
    return preferred + [tool for tool in found if tool[0] not in MESSAGE_COMMAND_TOOLS]


def _tool_use_id(seed: bytes, index: int) -> str:
    return "toolu_" + hashlib.sha256(seed + b"/tool_use/%d" % index).hexdigest()[:24]


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
