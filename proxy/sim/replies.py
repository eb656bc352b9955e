"""The reference upstream's replies: deterministic assistant messages and their stream deltas.

Everything here is pure: a reply is a function of the request and a seed (the
hash of the rendered prompt), so the same request always gets the same reply.

- The last message is from the user and the request has function tools (and
  ``tool_choice`` is not ``"none"``): tool calls. Two parallel calls to the
  first two tools (one when there is one tool, when ``parallel_tool_calls`` is
  false, or when ``tool_choice`` names a function), ids ``call_<hex>``, argument
  strings as compact JSON with non-ASCII text, built from each tool's JSON
  schema in its property order.
- Otherwise: a text reply of a few sentences, about ``reply_tokens`` tokens,
  that ends with a newline — the raw material of whitespace drift.
- ``reasoning=True`` adds ``reasoning_content``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .render import count_tokens

logger = logging.getLogger(__name__)

DEFAULT_REPLY_TOKENS = 40

SAMPLE_STRING = "北京 café"
"""Value of every string argument: non-ASCII on purpose, so ``ensure_ascii`` drift shows."""
SAMPLE_INTEGER = 1
SAMPLE_NUMBER = 2.5
SAMPLE_BOOLEAN = True

_SENTENCES = (
    "The cache only helps when the prefix is byte for byte the same.",
    "I checked the configuration and the values look consistent.",
    "Here is a short summary of what I found in the repository.",
    "The tests pass locally, but the benchmark needs another run.",
    "Voilà — the function now returns early when the input is empty.",
    "A second look at the logs shows the retry happened twice.",
    "Let me know if you want the change split into smaller commits.",
    "The upstream answered in time, so the timeout was not the cause.",
    "I renamed the helper and kept the old name as an alias.",
    "Caching the encoder saves a few milliseconds per request.",
    "The weather in Zürich is mild today, with a light breeze.",
    "Nothing else needs to change for this to work.",
)
_REASONING = (
    "The user wants an answer, so I should look at the conversation so far.",
    "The earlier tool results already contain what is needed.",
    "I will keep the reply short and concrete.",
)
_WORD = re.compile(r"\S+\s*|\s+")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """One generated tool call."""

    id: str
    name: str
    arguments: str
    """The argument string exactly as generated (compact JSON)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """One generated assistant message."""

    content: str | None
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    """``"stop"`` or ``"tool_calls"``."""

    def message(self) -> dict[str, Any]:
        """The assistant message as a chat completion returns it (OpenAI's extra null fields included)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        message["refusal"] = None
        message["annotations"] = []
        return message


def make_reply(
    request: Mapping[str, Any],
    seed: bytes,
    *,
    reply_tokens: int = DEFAULT_REPLY_TOKENS,
    reasoning: bool = False,
) -> Reply:
    """The reply to a parsed chat request; ``seed`` makes it deterministic (hash of the prompt)."""
    rng = random.Random(hashlib.sha256(seed).digest())
    reasoning_content = reasoning_text(rng) if reasoning else None
    tools = _callable_tools(request)
    if tools:
        calls = tuple(
            ToolCall(
                id="call_" + hashlib.sha256(seed + b"/call/%d" % index).hexdigest()[:24],
                name=name,
                arguments=json.dumps(
                    sample_arguments(parameters), separators=(",", ":"), ensure_ascii=False
                ),
            )
            for index, (name, parameters) in enumerate(tools)
        )
        return Reply(content=None, reasoning_content=reasoning_content, tool_calls=calls, finish_reason="tool_calls")
    return Reply(content=reply_text(rng, reply_tokens), reasoning_content=reasoning_content, tool_calls=(), finish_reason="stop")


def sample_arguments(schema: Any) -> dict[str, Any]:
    """Arguments for a JSON-schema ``object``: one value per property, in the schema's order."""
    value = sample_value(schema)
    return value if isinstance(value, dict) else {}


def sample_value(schema: Any) -> Any:
    """A value fitting a JSON-schema fragment (first enum value, or by type)."""
    if not isinstance(schema, Mapping):
        return SAMPLE_STRING
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if isinstance(schema.get("properties"), Mapping) else "string"
    if kind == "object":
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            return {}
        return {name: sample_value(sub) for name, sub in properties.items()}
    if kind == "array":
        items = schema.get("items")
        return [sample_value(items)] if isinstance(items, Mapping) else []
    return {
        "string": SAMPLE_STRING,
        "integer": SAMPLE_INTEGER,
        "number": SAMPLE_NUMBER,
        "boolean": SAMPLE_BOOLEAN,
        "null": None,
    }.get(kind, SAMPLE_STRING)


def reply_deltas(
    reply: Reply, *, words_per_delta: int = 3, argument_chars: int = 8
) -> list[dict[str, Any]]:
    """The ``delta`` objects that stream ``reply``, role delta first (finish chunk not included).

    Concatenating the fragments gives back the reply's strings exactly.
    """
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": "" if reply.content is not None else None, "refusal": None}
    ]
    if reply.reasoning_content:
        deltas += (
            {"reasoning_content": fragment}
            for fragment in _word_fragments(reply.reasoning_content, words_per_delta)
        )
    if reply.content:
        deltas += (
            {"content": fragment} for fragment in _word_fragments(reply.content, words_per_delta)
        )
    for index, call in enumerate(reply.tool_calls):
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                ]
            }
        )
        for start in range(0, len(call.arguments), argument_chars):
            fragment = call.arguments[start : start + argument_chars]
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
    return deltas


def _callable_tools(request: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(name, parameters)`` of the tools to call, or ``[]`` for a text reply."""
    messages = request.get("messages")
    if not isinstance(messages, Sequence) or not messages:
        return []
    last = messages[-1]
    if not isinstance(last, Mapping) or last.get("role") != "user":
        return []
    choice = request.get("tool_choice")
    if choice == "none":
        return []
    tools: list[tuple[str, Any]] = []
    for tool in request.get("tools") or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            tools.append((function["name"], function.get("parameters")))
    if isinstance(choice, Mapping):
        forced = choice.get("function")
        forced_name = forced.get("name") if isinstance(forced, Mapping) else None
        return [tool for tool in tools if tool[0] == forced_name][:1]
    width = 1 if request.get("parallel_tool_calls") is False else 2
    return tools[:width]


def reply_text(rng: random.Random, reply_tokens: int) -> str:
    """A text reply of whole sentences, about ``reply_tokens`` tokens, ending with a newline."""
    sentences: list[str] = []
    tokens = 0
    while tokens < max(reply_tokens - 1, 1):  # the final newline is a token of its own
        sentence = rng.choice(_SENTENCES)
        sentences.append(sentence)
        tokens += count_tokens(" " + sentence)
    return " ".join(sentences) + "\n"


def reasoning_text(rng: random.Random) -> str:
    """One or two sentences of reasoning."""
    first = rng.choice(_REASONING)
    return f"{first} {_REASONING[-1]}" if first != _REASONING[-1] else first


def _word_fragments(text: str, words: int) -> list[str]:
    pieces = _WORD.findall(text)
    return ["".join(pieces[i : i + words]) for i in range(0, len(pieces), words)]
