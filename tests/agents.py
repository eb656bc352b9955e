"""Scripted agents for tests, the demo and benchmarks: a realistic tool-using loop plus drift functions.

An agent keeps its history in the form it received (the provider's JSON), and
before each request passes the *re-sent* part of it (everything an earlier
request or reply already carried) through a drift function: the way real
clients re-serialize their history (the drift classes of docs/ARCHITECTURE.md, "Identity"). New
messages are sent clean the first time, so the first form the provider sees
is the same for a drifting and a non-drifting agent.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

SYSTEM = "You are a careful coding agent working in a repository.\n" + "\n".join(
    f"{i}. Rule {i}: keep change {i * 7} small, name file_{i}.py precisely, and test edge case {i * 13}."
    for i in range(1, 110)
)

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the root"},
            "start_line": {"type": "integer", "description": "First line"},
            "end_line": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the code for a pattern.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "regex": {"type": "boolean"},
            "max_results": {"type": "integer", "minimum": 1}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, optionally a subset.",
        "parameters": {"type": "object", "properties": {
            "selector": {"type": "string"}, "timeout": {"type": "number"}}}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file's content.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}},
]

USER_TURNS = [
    "Find where the cache key is computed and explain it.",
    "Now add a test for the empty-input case.",
    "Rename the helper to compute_key and update callers.",
    "Run the tests and summarise failures.",
    "Great. Write a short changelog entry.",
    "One more: check the README mentions the new name.",
]

Drift = Callable[[list[dict[str, Any]], list[dict[str, Any]], int], tuple[list[dict[str, Any]], list[dict[str, Any]]]]
"""(re-sent messages, tools, turn) -> (drifted re-sent messages, drifted tools); turn 0 is never drifted."""

Post = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


# -- drift functions: safe classes -------------------------------------------------------

def no_drift(msgs: list[dict[str, Any]], tools: list[dict[str, Any]], turn: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return msgs, tools


def _each_call(msgs: list[dict[str, Any]], fn: Callable[[dict[str, Any]], None]) -> None:
    for m in msgs:
        for call in m.get("tool_calls") or []:
            fn(call)


def args_python_dumps(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """Arguments re-serialized with Python's json.dumps defaults: spaces and \\u escapes."""
    def redo(call: dict[str, Any]) -> None:
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]))
    _each_call(msgs, redo)
    return msgs, tools


def args_keys_reordered(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """Argument keys in another order (a map iteration), compact."""
    def redo(call: dict[str, Any]) -> None:
        value = json.loads(call["function"]["arguments"])
        keys = list(value)
        random.Random(turn).shuffle(keys)
        if keys == list(value):
            keys.reverse()
        call["function"]["arguments"] = json.dumps({k: value[k] for k in keys}, separators=(",", ":"), ensure_ascii=False)
    _each_call(msgs, redo)
    return msgs, tools


def tools_reordered(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """The tools array in a different order every turn (Go maps, MCP servers)."""
    k = turn % len(tools)
    return msgs, tools[k:] + tools[:k] if k else list(reversed(tools))


def _shuffled(obj: Any, rng: random.Random) -> Any:
    if isinstance(obj, dict):
        keys = list(obj)
        rng.shuffle(keys)
        return {k: _shuffled(obj[k], rng) for k in keys}
    if isinstance(obj, list):
        return [_shuffled(v, rng) for v in obj]
    return obj


def schema_keys_shuffled(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """Tool definitions with their keys (and schema keys) in another order each turn."""
    return msgs, _shuffled(tools, random.Random(turn))


def content_as_parts(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """String content <-> one text part, with a cache_control marker that moves each turn."""
    texts = [m for m in msgs if isinstance(m.get("content"), str) and m["role"] in {"system", "user", "tool"}]
    for i, m in enumerate(texts):
        part: dict[str, Any] = {"type": "text", "text": m["content"]}
        if i == len(texts) - 1 - (turn % 2):
            part["cache_control"] = {"type": "ephemeral"}
        if (i + turn) % 2 == 0:
            m["content"] = [part]
    return msgs, tools


def null_fields(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """SDK-style empties: refusal/annotations/audio/function_call, tool_calls index, "" content with tool calls."""
    for m in msgs:
        if m["role"] == "assistant":
            m.update(refusal=None, annotations=[], audio=None, function_call=None)
            if m.get("tool_calls"):
                m["content"] = "" if turn % 2 else None
                for i, call in enumerate(m["tool_calls"]):
                    call["index"] = i
            else:
                m["tool_calls"] = None if turn % 2 else []
        elif m["role"] == "user":
            m["name"] = None
    return msgs, tools


def whitespace_stripped(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """Assistant text trimmed of its trailing newline (and user text of edge blanks)."""
    for m in msgs:
        if m["role"] in {"assistant", "user"} and isinstance(m.get("content"), str):
            m["content"] = m["content"].strip()
    return msgs, tools


def tool_results_reordered(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """The results of one parallel tool-call group in another order."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(msgs):
        if msgs[i]["role"] == "tool":
            j = i
            while j < len(msgs) and msgs[j]["role"] == "tool":
                j += 1
            out.extend(reversed(msgs[i:j]))
            i = j
        else:
            out.append(msgs[i])
            i += 1
    return out, tools


def tool_calls_reordered(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """The tool calls inside an assistant message in another order."""
    for m in msgs:
        if m.get("tool_calls") and len(m["tool_calls"]) > 1:
            m["tool_calls"] = list(reversed(m["tool_calls"]))
    return msgs, tools


def resumed(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """From turn 2 on, the history comes back through another serializer (a resume)."""
    if turn < 2:
        return msgs, tools
    for fn in (args_python_dumps, content_as_parts, null_fields):
        msgs, tools = fn(msgs, tools, turn)
    return msgs, tools


def varying(msgs, tools, turn):  # type: ignore[no-untyped-def]
    """A different mix of safe drifts every turn."""
    rng = random.Random(1000 + turn)
    chosen = rng.sample(SAFE_DRIFTS_SIMPLE, 3)
    for fn in chosen:
        msgs, tools = fn(msgs, tools, turn)
    return msgs, tools


SAFE_DRIFTS_SIMPLE: list[Drift] = [
    args_python_dumps, args_keys_reordered, tools_reordered, schema_keys_shuffled, content_as_parts,
    null_fields, whitespace_stripped, tool_results_reordered, tool_calls_reordered,
]
SAFE_DRIFTS: dict[str, Drift] = {fn.__name__: fn for fn in [*SAFE_DRIFTS_SIMPLE, resumed, varying]}


# -- the agent loop ----------------------------------------------------------------------------

@dataclass
class Turn:
    request: dict[str, Any]
    response: dict[str, Any]
    resent: int = 0
    """How many leading messages of the request an earlier request or reply already carried."""

    PROMPT: ClassVar[str] = "prompt_tokens"
    """The usage member with the prompt's tokens (the Responses API says ``input_tokens``)."""
    DETAILS: ClassVar[str] = "prompt_tokens_details"

    @property
    def usage(self) -> dict[str, Any]:
        return self.response.get("usage") or {}

    @property
    def cached(self) -> int:
        return int((self.usage.get(self.DETAILS) or {}).get("cached_tokens") or 0)

    @property
    def prompt(self) -> int:
        return int(self.usage.get(self.PROMPT) or 0)


@dataclass
class Agent:
    """A tool-using agent loop; ``post`` sends one chat request and returns the response JSON."""

    post: Post
    drift: Drift = no_drift
    system: str = SYSTEM
    tools: list[dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(TOOLS))
    model: str = "kvwarm-sim"
    user_turns: list[str] = field(default_factory=lambda: list(USER_TURNS))
    history: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    sent: int = 0
    """How many history messages an earlier request or reply already carried."""

    def __post_init__(self) -> None:
        if not self.history:
            self.history = [{"role": "system", "content": self.system}, {"role": "user", "content": self.user_turns[0]}]

    def next_request(self) -> dict[str, Any]:
        turn = len(self.turns)
        resent = copy.deepcopy(self.history[: self.sent])
        fresh = copy.deepcopy(self.history[self.sent :])
        tools = copy.deepcopy(self.tools)
        if turn > 0:
            resent, tools = self.drift(resent, tools, turn)
        return {"model": self.model, "messages": resent + fresh, "tools": tools}

    async def step(self) -> Turn:
        request = self.next_request()
        resent = self.sent
        response = await self.post(request)
        self.sent = len(self.history) + 1
        message = response["choices"][0]["message"]
        reply = {k: v for k, v in message.items() if v is not None or k == "content"}
        self.history.append(reply)
        if reply.get("tool_calls"):
            for call in reply["tool_calls"]:
                self.history.append({
                    "role": "tool", "tool_call_id": call["id"],
                    "content": f"{call['function']['name']} -> ok, 3 matches in src/cache.py (line {len(self.history) * 11})\n",
                })
        else:
            user_turns = sum(1 for m in self.history if m["role"] == "user")
            self.history.append({"role": "user", "content": self.user_turns[user_turns % len(self.user_turns)]})
        turn = Turn(request, response, resent)
        self.turns.append(turn)
        return turn

    async def run(self, turns: int) -> list[Turn]:
        for _ in range(turns):
            await self.step()
        return self.turns
