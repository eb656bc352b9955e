"""A scripted Messages API agent for tests, on the official ``anthropic`` SDK, plus drift functions.

The Messages twin of ``tests/responses/agents.py``. The agent keeps its history as the SDK
returns it: each assistant reply's content blocks as the SDK's objects (``keep="objects"``,
what ``messages.append({"role": "assistant", "content": message.content})`` gives) or as dicts
(``keep="dicts"``: ``model_dump``, what an agent that stores JSON re-sends), and before each
request passes the *re-sent* part of it (every message an earlier request or response carried)
through a drift function: the ways real clients re-serialize a Messages history. New messages
are sent clean the first time, so the first form the provider sees is the same for a drifting
and a non-drifting agent.

The loop follows the reference upstream's script (``proxy/sim/message_script.py``): a user turn
is answered with ``tool_use`` blocks (two with ``parallel=True``, through ``x-sim-tool-calls``),
the agent answers them with ``tool_result`` blocks in one user message, the upstream then
answers with text, and the agent adds the next user message. With ``markers=True`` the agent
marks its prompt as Claude Code does for Anthropic's cache: the system's last block, the last
tool, and the last block of its last message (``cache_control``), so the reference upstream's
``anthropic`` mode caches it.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import orjson

from proxy.sim.content_blocks import check_tools, to_messages
from proxy.sim.render import render_tokens
from proxy.sim.steering import TOOL_CALLS_HEADER

SYSTEM = "You are a careful coding agent working in a repository. Follow every rule below.\n" + "\n".join(
    f"{i}. Rule {i}: keep change {i * 7} small, name file_{i}.py precisely, test edge case {i * 13}, "
    f"and never touch module_{i * 3}."
    for i in range(1, 70)
)
"""About 2 200 tokens: above the 1 024 a cached prefix needs."""

TOOLS: list[dict[str, Any]] = [
    {"name": "read_file", "description": "Read a file of the repository.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "Path relative to the root"},
         "start_line": {"type": "integer", "description": "First line"},
         "encoding": {"type": "string"}},
         "required": ["path", "start_line", "encoding"], "additionalProperties": False}},
    {"name": "search", "description": "Search the code for a pattern.",
     "input_schema": {"type": "object", "properties": {
         "query": {"type": "string"}, "regex": {"type": "boolean"},
         "max_results": {"type": "integer", "minimum": 1}},
         "required": ["query", "regex", "max_results"], "additionalProperties": False}},
    {"name": "write_file", "description": "Replace a file's content.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}},
]
"""Tools whose generated ``input`` has several keys (every required property), so their key order
renders. No ``Bash``: the reference upstream would pick it whatever the order."""

USER_TURNS = [
    "Find where the cache key is computed and explain it.",
    "Now add a test for the empty-input case.",
    "Rename the helper to compute_key and update callers.",
    "Run the tests and summarise failures.",
]
MODEL = "claude-sonnet-4-6"
EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]]
Drift = Callable[[Messages, Any, Tools, int], tuple[Messages, Any, Tools]]
"""(re-sent messages, system, tools, request number) -> the drifted ones; request 0 is never drifted."""


def as_dict(block: Any) -> Any:
    """A content block as a client that stores JSON keeps it."""
    return block if isinstance(block, dict) else block.model_dump(exclude_none=True)


def _blocks(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = content = [as_dict(b) for b in content]
        return content
    return []


# -- drift functions: the safe classes ---------------------------------------------------------


def no_drift(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    return messages, system, tools


def tools_reordered(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """The tool definitions in another order every request (a map iteration)."""
    order = list(tools)
    if turn % 2:
        order.reverse()
    else:
        random.Random(turn).shuffle(order)
        if order == tools:
            order = order[1:] + order[:1]
    return messages, system, order


def _keys_reversed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _keys_reversed(value[k]) for k in reversed(value)}
    if isinstance(value, list):
        return [_keys_reversed(v) for v in value]
    return value


def schema_keys_shuffled(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """Every ``input_schema`` with its keys (at every level) in reverse order: a serializer that
    does not keep insertion order."""
    return messages, system, [{**t, "input_schema": _keys_reversed(t["input_schema"])} for t in tools]


def input_keys_reordered(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """Each re-sent ``tool_use`` input with its keys in another order (reversed, or shuffled)."""
    for message in messages:
        for block in _blocks(message):
            if block.get("type") == "tool_use":
                keys = list(block["input"])
                if turn % 2:
                    keys.reverse()
                else:
                    random.Random(turn).shuffle(keys)
                block["input"] = {k: block["input"][k] for k in keys}
    return messages, system, tools


def content_as_block(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """String content <-> one text block (claude-code#93490: on ``--resume`` a message first sent
    as one text block comes back as a string), for user texts, tool results and assistant text;
    which messages flip alternates by request."""
    for i, message in enumerate(messages):
        if (i + turn) % 2:
            continue
        content = message["content"]
        if isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
            continue
        blocks = _blocks(message)
        if len(blocks) == 1 and blocks[0].get("type") == "text":
            message["content"] = blocks[0]["text"]
        for block in blocks:
            if block.get("type") == "tool_result" and isinstance(block.get("content"), str):
                block["content"] = [{"type": "text", "text": block["content"]}]
    return messages, system, tools


def system_as_block(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """The system prompt as a string on odd requests, one text block on even ones."""
    text = system if isinstance(system, str) else system[0]["text"]
    return messages, (text if turn % 2 else [{"type": "text", "text": text}]), tools


def tool_results_reordered(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """The results of one parallel ``tool_use`` group in another order (needs ``parallel=True``)."""
    for message in messages:
        blocks = _blocks(message)
        results = [b for b in blocks if b.get("type") == "tool_result"]
        if len(results) > 1:
            others = [b for b in blocks if b.get("type") != "tool_result"]
            message["content"] = results[::-1] + others
    return messages, system, tools


def whitespace_stripped(messages: Messages, system: Any, tools: Tools, turn: int) -> tuple[Messages, Any, Tools]:
    """The echoed assistant text trimmed of its trailing newline."""
    for message in messages:
        if message["role"] == "assistant":
            for block in _blocks(message):
                if block.get("type") == "text":
                    block["text"] = block["text"].strip()
    return messages, system, tools


SAFE_DRIFTS: dict[str, Drift] = {
    fn.__name__: fn
    for fn in (
        tools_reordered, schema_keys_shuffled, input_keys_reordered, content_as_block, system_as_block,
        tool_results_reordered, whitespace_stripped,
    )
}
PARALLEL = frozenset({"tool_results_reordered"})
"""Drifts that need parallel tool calls (``x-sim-tool-calls: 2``)."""


# -- the agent loop ------------------------------------------------------------------------------


@dataclass
class Turn:
    """One request of the agent: what it sent, what came back."""

    request: dict[str, Any]
    message: anthropic.types.Message
    headers: dict[str, str]
    resent: int
    """Leading messages an earlier request or response carried."""

    @property
    def cached(self) -> int:
        return self.message.usage.cache_read_input_tokens or 0

    @property
    def prompt(self) -> int:
        usage = self.message.usage
        return usage.input_tokens + (usage.cache_creation_input_tokens or 0) + (usage.cache_read_input_tokens or 0)

    def prefix(self) -> dict[str, str]:
        """The ``x-kvwarm-prefix`` header as a dict (``matched``, ``repaired``, ``break``...)."""
        header = self.headers.get("x-kvwarm-prefix", "")
        return dict(p.split("=", 1) for p in header.split("; ") if "=" in p)


def tool_result(block: Any, position: int) -> str:
    return f"{block.name} -> ok, 3 matches in src/cache.py (line {position * 11})\n"


@dataclass
class MessagesAgent:
    """A tool-using Messages loop through ``client``."""

    client: anthropic.AsyncAnthropic
    drift: Drift = no_drift
    keep: str = "dicts"
    """``objects``: assistant content as the SDK's block objects; ``dicts``: as
    ``model_dump(exclude_none=True)`` dicts; ``model_dump``: with their ``None`` fields."""
    stream: bool | None = None
    """Stream every request (True), none (False), or every other one (None)."""
    parallel: bool = False
    thinking: bool = False
    markers: bool = False
    system: Any = SYSTEM
    tools: Tools = field(default_factory=lambda: copy.deepcopy(TOOLS))
    user_turns: list[str] = field(default_factory=lambda: list(USER_TURNS))
    history: Messages = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    sent: int = 0

    def __post_init__(self) -> None:
        if not self.history:
            self.history = [{"role": "user", "content": self.user_turns[0]}]

    def next_request(self) -> dict[str, Any]:
        turn = len(self.turns)
        resent = copy.deepcopy(self.history[: self.sent])
        fresh = copy.deepcopy(self.history[self.sent :])
        system, tools = copy.deepcopy(self.system), copy.deepcopy(self.tools)
        if turn > 0:
            resent, system, tools = self.drift(resent, system, tools, turn)
        messages = resent + fresh
        if self.markers:
            system, tools, messages = mark(system, tools, messages)
        body: dict[str, Any] = {
            "model": MODEL, "max_tokens": 1024, "system": system, "tools": tools, "messages": messages,
        }
        if self.thinking:
            body["thinking"] = {"type": "enabled", "budget_tokens": 512}
        return body

    async def step(self) -> Turn:
        request = self.next_request()
        resent = self.sent
        streamed = self.stream if self.stream is not None else len(self.turns) % 2 == 1
        extra = {TOOL_CALLS_HEADER: "2"} if self.parallel else {}
        if streamed:
            async with self.client.messages.stream(**request, extra_headers=extra) as events:
                message = await events.get_final_message()
                headers = dict(events.response.headers)
        else:
            raw = await self.client.messages.with_raw_response.create(**request, extra_headers=extra)
            message = await raw.parse()
            headers = dict(raw.headers)
        if self.keep == "objects":
            content: list[Any] = list(message.content)
        elif self.keep == "model_dump":
            content = [b.model_dump() for b in message.content]  # None fields and all
        else:
            content = [as_dict(b) for b in message.content]
        self.history.append({"role": "assistant", "content": content})
        self.sent = len(self.history)
        uses = [b for b in message.content if b.type == "tool_use"]
        if uses:
            self.history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": tool_result(b, len(self.history) + k)}
                for k, b in enumerate(uses)
            ]})
        else:
            users = sum(1 for m in self.history if m["role"] == "user")
            self.history.append({"role": "user", "content": self.user_turns[users % len(self.user_turns)]})
        turn = Turn(request, message, {k.lower(): v for k, v in headers.items()}, resent)
        self.turns.append(turn)
        return turn

    async def run(self, turns: int) -> list[Turn]:
        for _ in range(turns):
            await self.step()
        return self.turns


def mark(system: Any, tools: Tools, messages: Messages) -> tuple[Any, Tools, Messages]:
    """Claude Code's markers: the system's last block, the last tool, the last message's last block
    (a marker already there is kept)."""
    if isinstance(system, list) and system:
        system = [*system[:-1], {"cache_control": EPHEMERAL, **as_dict(system[-1])}]
    if tools:
        tools = [*tools[:-1], {"cache_control": EPHEMERAL, **tools[-1]}]
    last = dict(messages[-1])
    content = last["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else [as_dict(b) for b in content]
    blocks[-1] = {**blocks[-1], "cache_control": EPHEMERAL}
    last["content"] = blocks
    return system, tools, [*messages[:-1], last]


def rendered(body: dict[str, Any]) -> list[int]:
    """The tokens the reference upstream renders for a Messages request body."""
    return render_tokens(to_messages(body.get("system"), body["messages"]), check_tools(body.get("tools")))


def sdk_client(base_url: str, key: str = "sk-ant-test", **kwargs: Any) -> anthropic.AsyncAnthropic:
    """A strict ``anthropic`` SDK client of ``base_url`` (a server's root, no ``/v1``)."""
    return anthropic.AsyncAnthropic(
        base_url=base_url, api_key=key, max_retries=0, timeout=20, _strict_response_validation=True, **kwargs
    )


async def post_messages(
    server: Any, body: dict[str, Any] | bytes, *, key: str = "sk-ant-test", headers: dict[str, str] | None = None,
    path: str = "/v1/messages",
) -> tuple[int, dict[str, str], bytes]:
    """One ``POST`` of ``body`` (the bytes as given, or compact JSON) to ``server`` as Claude Code
    sends it: ``x-api-key``, ``anthropic-version``. ``(status, headers lower-cased, body)``."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    sent = {"x-api-key": key, "anthropic-version": "2023-06-01", "content-type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession() as session, session.post(server.make_url(path), data=data, headers=sent) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def prefix_of(headers: dict[str, str]) -> dict[str, str]:
    """The ``x-kvwarm-prefix`` header as a dict."""
    header = headers.get("x-kvwarm-prefix", "")
    return dict(p.split("=", 1) for p in header.split("; ") if "=" in p)
