"""A scripted Responses API agent for tests: a tool-using loop plus drift functions.

The Responses twin of ``tests/agents.py``. The agent keeps its history as input
items in the form it received them (the provider's output items as JSON dicts,
its own ``function_call_output`` and user items), and before each request passes
the *re-sent* part of it (every item an earlier request or response already
carried) through a drift function: the ways real clients re-serialize a
Responses history. New items are sent clean the first time, so the first form the
provider sees is the same for a drifting and a non-drifting agent.

The loop follows the reference upstream's script (``proxy/sim/script.py``): a
user turn is answered with ``function_call`` items (two parallel ones with
``parallel=True``, through the ``x-sim-tool-calls`` header), the agent answers
each with a ``function_call_output``, the upstream then answers with a text
``message``, and the agent adds the next user message.
"""

from __future__ import annotations

import copy
import json
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from proxy.sim.items import check_tools, input_items, render_response_segments
from proxy.sim.render import encode_segments
from proxy.sim.steering import TOOL_CALLS_HEADER
from tests.agents import Turn as ChatTurn
from tests.agents import (  # the tools drift the same in both APIs
    schema_keys_shuffled,
    tools_reordered,
)

INSTRUCTIONS = "You are a careful coding agent working in a repository. Follow every rule below.\n" + "\n".join(
    f"{i}. Rule {i}: keep change {i * 7} small, name file_{i}.py precisely, test edge case {i * 13}, "
    f"and never touch module_{i * 3}."
    for i in range(1, 125)
)
"""About 4 000 tokens: well above the 1 024 a prompt-only (OpenAI-style) cache needs."""

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string", "description": "Path relative to the root"},
         "start_line": {"type": "integer", "description": "First line"},
         "encoding": {"type": "string"}},
         "required": ["path", "start_line", "encoding"], "additionalProperties": False},
     "strict": False},
    {"type": "function", "name": "search", "description": "Search the code for a pattern.",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string"}, "regex": {"type": "boolean"},
         "max_results": {"type": "integer", "minimum": 1}},
         "required": ["query", "regex", "max_results"], "additionalProperties": False},
     "strict": False},
    {"type": "function", "name": "run_tests", "description": "Run the test suite, optionally a subset.",
     "parameters": {"type": "object", "properties": {
         "selector": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["selector"]},
     "strict": False},
    {"type": "function", "name": "write_file", "description": "Replace a file's content.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]},
     "strict": False},
]
"""Four flat function tools. The upstream's arguments hold every required property (strings are
non-ASCII: ``北京 café``), so argument re-serialization changes tokens."""

USER_TURNS = [
    "Find where the cache key is computed and explain it.",
    "Now add a test for the empty-input case.",
    "Rename the helper to compute_key and update callers.",
    "Run the tests and summarise failures.",
    "Great. Write a short changelog entry.",
    "One more: check the README mentions the new name.",
]

Items = list[dict[str, Any]]
Tools = list[dict[str, Any]]
Drift = Callable[[Items, Tools, int], tuple[Items, Tools]]
"""(re-sent items, tools, request number) -> (drifted re-sent items, drifted tools); request 0 is never drifted."""
Post = Callable[[dict[str, Any], dict[str, str]], Awaitable[dict[str, Any]]]
"""(body, extra headers) -> the response JSON, its headers under ``"_headers"``."""


# -- drift functions: the safe classes ---------------------------------------------------------


def no_drift(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    return items, tools


def _kind(item: dict[str, Any]) -> str:
    return str(item.get("type") or ("message" if "role" in item else ""))


def _each_call(items: Items, fn: Callable[[dict[str, Any]], None]) -> None:
    for item in items:
        if _kind(item) == "function_call":
            fn(item)


def args_python_dumps(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """``arguments`` re-serialized with ``json.dumps`` defaults: spaces, and ``\\u`` escapes for non-ASCII."""
    def redo(call: dict[str, Any]) -> None:
        call["arguments"] = json.dumps(json.loads(call["arguments"]))
    _each_call(items, redo)
    return items, tools


def args_keys_reordered(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """``arguments`` keys in another order on odd requests (a map iteration), compact."""
    def redo(call: dict[str, Any]) -> None:
        value = json.loads(call["arguments"])
        keys = list(value)
        if turn % 2:
            keys.reverse()
        else:
            random.Random(turn).shuffle(keys)
        call["arguments"] = json.dumps({k: value[k] for k in keys}, separators=(",", ":"), ensure_ascii=False)
    _each_call(items, redo)
    return items, tools


def content_as_parts(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """String content <-> one text part: user text as ``input_text`` parts, assistant ``output_text``
    parts as a string, tool outputs as ``input_text`` parts; which items flip alternates by request."""
    for i, item in enumerate(items):
        if (i + turn) % 2:
            continue
        kind = _kind(item)
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        elif kind == "message" and isinstance(item.get("content"), list) and len(item["content"]) == 1:
            item["content"] = item["content"][0]["text"]
        elif kind == "function_call_output" and isinstance(item.get("output"), str):
            item["output"] = [{"type": "input_text", "text": item["output"]}]
    return items, tools


def null_fields(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """SDK-style empties: ``status: null``, ``id`` absent, ``annotations`` / ``logprobs`` absent or
    ``[]``, explicit ``type: "message"``, ``id: null`` on client items."""
    for item in items:
        kind = _kind(item)
        if "status" in item:
            item["status"] = None
        if turn % 2:
            item.pop("id", None)
        else:
            item.setdefault("id", None)
        if kind == "message":
            item["type"] = "message"
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                if part.get("type") == "output_text":
                    if turn % 2:
                        part.pop("annotations", None)
                        part.pop("logprobs", None)
                    else:
                        part["annotations"] = []
                        part["logprobs"] = None
        elif kind == "function_call_output":
            item["status"] = None
    return items, tools


def whitespace_stripped(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """The echoed assistant text trimmed of its trailing newline."""
    for item in items:
        if _kind(item) == "message" and item.get("role") == "assistant":
            content = item.get("content")
            if isinstance(content, str):
                item["content"] = content.strip()
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part.get("text"), str):
                        part["text"] = part["text"].strip()
    return items, tools


def tool_outputs_reordered(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """The outputs of one parallel call group in another order (needs ``parallel=True``)."""
    out: Items = []
    i = 0
    while i < len(items):
        if _kind(items[i]) == "function_call_output":
            j = i
            while j < len(items) and _kind(items[j]) == "function_call_output":
                j += 1
            out.extend(reversed(items[i:j]))
            i = j
        else:
            out.append(items[i])
            i += 1
    return out, tools


def ids_regenerated(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """Every item gets a new ``id`` on every request (the Codex CLI gives each session new ids)."""
    for item in items:
        kind = _kind(item)
        prefix = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}
        item["id"] = prefix.get(kind, "it_") + uuid.uuid4().hex
    return items, tools


def _keys_reversed(items: Items) -> Items:
    return [{k: item[k] for k in reversed(item)} for item in items]


def resumed(items: Items, tools: Tools, turn: int) -> tuple[Items, Tools]:
    """From request 2 on the history comes back through another serializer (a resume): arguments
    re-dumped, content forms flipped, null fields, new ids, every item's keys in another order."""
    if turn < 2:
        return items, tools
    for fn in (args_python_dumps, content_as_parts, null_fields, ids_regenerated):
        items, tools = fn(items, tools, turn)
    return _keys_reversed(items), tools


SAFE_DRIFTS: dict[str, Drift] = {
    fn.__name__: fn
    for fn in (
        tools_reordered, schema_keys_shuffled, args_python_dumps, args_keys_reordered, content_as_parts,
        null_fields, whitespace_stripped, tool_outputs_reordered, ids_regenerated, resumed,
    )
}
PARALLEL = frozenset({"tool_outputs_reordered"})
"""Drifts that need parallel calls (``x-sim-tool-calls: 2``)."""


# -- the agent loop ------------------------------------------------------------------------------


@dataclass
class Turn(ChatTurn):
    """A Responses turn (``resent``: leading input items an earlier request or response carried)."""

    PROMPT: ClassVar[str] = "input_tokens"
    DETAILS: ClassVar[str] = "input_tokens_details"

    @property
    def headers(self) -> dict[str, str]:
        return self.response.get("_headers") or {}

    def prefix(self) -> dict[str, str]:
        """The ``x-kvwarm-prefix`` header as a dict (``matched``, ``repaired``, ``break``...)."""
        header = self.headers.get("x-kvwarm-prefix", "")
        return dict(p.split("=", 1) for p in header.split("; ") if "=" in p)


def tool_output(call: dict[str, Any], position: int) -> str:
    return f"{call['name']} -> ok, 3 matches in src/cache.py (line {position * 11})\n"


@dataclass
class ResponsesAgent:
    """A tool-using Responses loop; ``post`` sends one request and returns the response JSON."""

    post: Post
    drift: Drift = no_drift
    instructions: str = INSTRUCTIONS
    tools: Tools = field(default_factory=lambda: copy.deepcopy(TOOLS))
    model: str = "kvwarm-sim"
    parallel: bool = False
    """Ask the upstream for two parallel calls per tool turn."""
    reasoning: bool = False
    """Ask for reasoning, kept client-side (``include: ["reasoning.encrypted_content"]``, as the Codex CLI does)."""
    user_turns: list[str] = field(default_factory=lambda: list(USER_TURNS))
    history: Items = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    sent: int = 0
    """How many history items an earlier request or response already carried."""

    def __post_init__(self) -> None:
        if not self.history:
            self.history = [{"role": "user", "content": self.user_turns[0]}]

    def next_request(self) -> dict[str, Any]:
        turn = len(self.turns)
        resent = copy.deepcopy(self.history[: self.sent])
        fresh = copy.deepcopy(self.history[self.sent :])
        tools = copy.deepcopy(self.tools)
        if turn > 0:
            resent, tools = self.drift(resent, tools, turn)
        body: dict[str, Any] = {
            "model": self.model, "instructions": self.instructions, "input": resent + fresh,
            "tools": tools, "store": False,
        }
        if self.reasoning:
            body["reasoning"] = {"effort": "low", "summary": "auto"}
            body["include"] = ["reasoning.encrypted_content"]
        return body

    def headers(self) -> dict[str, str]:
        return {TOOL_CALLS_HEADER: "2"} if self.parallel else {}

    async def step(self) -> Turn:
        request = self.next_request()
        resent = self.sent
        response = await self.post(request, self.headers())
        output: Items = response["output"]
        self.history.extend(copy.deepcopy(output))
        self.sent = len(self.history)
        calls = [item for item in output if item.get("type") == "function_call"]
        for call in calls:
            self.history.append({
                "type": "function_call_output", "call_id": call["call_id"],
                "output": tool_output(call, len(self.history)),
            })
        if not calls:
            users = sum(1 for item in self.history if item.get("role") == "user")
            self.history.append({"role": "user", "content": self.user_turns[users % len(self.user_turns)]})
        turn = Turn(request, response, resent)
        self.turns.append(turn)
        return turn

    async def run(self, turns: int) -> list[Turn]:
        for _ in range(turns):
            await self.step()
        return self.turns


# -- talking to a server ----------------------------------------------------------------------------


def poster(server: TestServer, key: str = "sk-alice", dumps: Callable[[Any], bytes] = orjson.dumps) -> Post:
    """An agent's ``post``: one ``POST /v1/responses`` to ``server``, the body serialized by ``dumps``;
    a non-200 status fails the test."""

    async def post(body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.post(
            server.make_url("/v1/responses"),
            data=dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers},
        ) as r:
            assert r.status == 200, await r.text()
            data: dict[str, Any] = await r.json()
            data["_headers"] = dict(r.headers)
            return data

    return post


def render_request(body: dict[str, Any]) -> list[int]:
    """The tokens the reference upstream renders for a (self-contained) Responses request body."""
    items = input_items(body.get("input"))
    segments = render_response_segments(body.get("instructions"), items, check_tools(body.get("tools")))
    return encode_segments(segments)
