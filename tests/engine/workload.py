"""Drifting agents against a real engine (llama.cpp), direct or through kvwarm: the measured workload.

Shared by the ``engine`` tests and ``make bench-engine``. Each run starts on a
fresh engine slot (its KV erased), streams every turn (time to first token is
measured at the first content or tool-call delta), and reads the engine's own
account of reuse: ``timings.cache_n`` (prompt tokens taken from the slot's KV)
and ``timings.prompt_n`` (tokens it had to prefill).

The history starts with a realistic earlier exchange (a tool call with compact
non-ASCII arguments, its result, a reply ending in a newline), so drifts that
re-serialize arguments or reorder tool results have material even if the small
model answers in plain text.

The same agent speaks Anthropic's Messages API too (llama.cpp's own ``/v1/messages``,
:func:`run_messages_workload`): the same system prompt, tools and seed exchange as
content blocks, Anthropic's stream (time to first token at the first
``content_block_delta``) and usage (``cache_read_input_tokens`` beside ``input_tokens``,
llama.cpp's ``cache_n`` and ``prompt_n``), the drifts of :mod:`tests.messages.agents`.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tests.agents import (
    TOOLS,
    Agent,
    Drift,
    args_keys_reordered,
    args_python_dumps,
    content_as_parts,
    no_drift,
    schema_keys_shuffled,
    tools_reordered,
)
from tests.messages.agents import Drift as MessagesDrift
from tests.messages.agents import input_keys_reordered
from tests.messages.agents import no_drift as messages_no_drift
from tests.messages.agents import tools_reordered as messages_tools_reordered

SYSTEM = (
    "You are a coding agent. Answer in one short sentence. Use the tools when you need files.\n"
    + "\n".join(f"- Rule {i}: keep module_{i} small and test case {i * 3}." for i in range(1, 25))
)
SEED_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Where is the cache key computed?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a1", "type": "function", "function": {"name": "search", "arguments": '{"query":"cache key 北京","regex":false,"max_results":5}'}},
        {"id": "call_a2", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"src/cache.py","start_line":1,"end_line":40}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_a1", "content": "src/cache.py:12: def cache_key(req):\n"},
    {"role": "tool", "tool_call_id": "call_a2", "content": "def cache_key(req):\n    return hash(req.prefix)\n"},
    {"role": "assistant", "content": "It is computed in src/cache.py by cache_key().\n"},
    {"role": "user", "content": "Add a docstring to it."},
]
QUESTIONS = ["Now add a test.", "Rename it to compute_key.", "Check the callers.", "Summarise the change.", "Anything else?"]
MAX_TOKENS = 24


def timestamp_drift(msgs: list[dict[str, Any]], tools: list[dict[str, Any]], turn: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The semantic control: the system prompt carries the current time, new every turn."""
    stamp = f"2026-11-22T10:{turn:02d}:{(turn * 17) % 60:02d}Z"
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = f"Current time: {stamp}\n" + msgs[0]["content"].split("\n", 1)[1]
    return msgs, tools


def resumed(msgs: list[dict[str, Any]], tools: list[dict[str, Any]], turn: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """From turn 2 on, the history comes back through another serializer: arguments by Python's
    json.dumps, texts as one-part lists. (The generic resume drift also adds ``"name": null``,
    which llama.cpp rejects with a 400 whether kvwarm is there or not.)"""
    if turn < 2:
        return msgs, tools
    for fn in (args_python_dumps, content_as_parts):
        msgs, tools = fn(msgs, tools, turn)
    return msgs, tools


def _stamped_history() -> list[dict[str, Any]]:
    history = copy.deepcopy(SEED_HISTORY)
    history[0]["content"] = "Current time: 2026-11-22T10:00:00Z\n" + history[0]["content"]
    return history


@dataclass(frozen=True)
class Workload:
    name: str
    drift: Drift
    history: Callable[[], list[dict[str, Any]]] = lambda: copy.deepcopy(SEED_HISTORY)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("no drift", no_drift),
        Workload("tools reordered", tools_reordered),
        Workload("schema key order", schema_keys_shuffled),
        Workload("argument keys reordered", args_keys_reordered),
        Workload("history re-serialized (resume)", resumed),
        Workload("timestamp in system prompt", timestamp_drift, _stamped_history),
    ]
}


MESSAGES_TOOLS: list[dict[str, Any]] = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (tool["function"] for tool in TOOLS)
]
"""The chat agent's tools as Anthropic declares them (llama.cpp renders both alike)."""
MESSAGES_SEED: list[dict[str, Any]] = [
    {"role": "user", "content": "Where is the cache key computed?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a1", "name": "search", "input": {"query": "cache key 北京", "regex": False, "max_results": 5}},
        {"type": "tool_use", "id": "toolu_a2", "name": "read_file", "input": {"path": "src/cache.py", "start_line": 1, "end_line": 40}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_a1", "content": "src/cache.py:12: def cache_key(req):\n"},
        {"type": "tool_result", "tool_use_id": "toolu_a2", "content": "def cache_key(req):\n    return hash(req.prefix)\n"},
    ]},
    {"role": "assistant", "content": [{"type": "text", "text": "It is computed in src/cache.py by cache_key().\n"}]},
    {"role": "user", "content": "Add a docstring to it."},
]
"""SEED_HISTORY in Messages form (the system prompt goes in ``system``): llama.cpp renders each
``tool_use`` input as JSON in the key order sent, so reordered input keys change the tokens."""


@dataclass(frozen=True)
class MessagesWorkload:
    name: str
    drift: MessagesDrift


MESSAGES_WORKLOADS: dict[str, MessagesWorkload] = {
    w.name: w
    for w in [
        MessagesWorkload("no drift", messages_no_drift),
        MessagesWorkload("tools reordered", messages_tools_reordered),
        MessagesWorkload("tool_use input keys reordered", input_keys_reordered),
    ]
}


@dataclass
class TurnStats:
    ttft: float
    """Seconds from sending the request to the first generated delta."""
    prompt_tokens: int
    cached: int
    """Prompt tokens the engine reused from its KV (``timings.cache_n``; on ``/v1/messages``,
    ``cache_read_input_tokens``, the same count)."""
    prefilled: int
    """Prompt tokens the engine computed (``timings.prompt_n``; on ``/v1/messages``, ``input_tokens``:
    llama.cpp reports the prompt less ``cache_read_input_tokens``)."""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    workload: str
    via: str
    turns: list[TurnStats]

    @property
    def cached(self) -> int:
        return sum(t.cached for t in self.turns[1:])

    @property
    def prefilled(self) -> int:
        return sum(t.prefilled for t in self.turns[1:])

    @property
    def ttft_p50(self) -> float:
        return statistics.median(t.ttft for t in self.turns[1:])


async def _sse_data(url: str, body: dict[str, Any], headers: dict[str, str], seen: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
    """POST ``body`` to ``url`` as a stream and yield the JSON of every SSE ``data:`` line as it
    arrives (chat's ``[DONE]`` skipped); the response headers, lower-cased, go into ``seen``."""
    async with aiohttp.ClientSession() as s, s.post(
        url, data=orjson.dumps(body), headers={**headers, "Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=600),
    ) as r:
        if r.status != 200:
            raise AssertionError(f"HTTP {r.status}: {(await r.text())[:500]}")
        seen.update((k.lower(), v) for k, v in r.headers.items())
        buffer = b""
        async for chunk in r.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.splitlines():
                    if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                        yield orjson.loads(line[5:])


def streaming_post(base_url: str, stats: list[TurnStats], key: str) -> Callable[[dict[str, Any]], Any]:
    """An Agent ``post`` that streams, times the first delta and rebuilds the message and usage."""

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 7}
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        headers: dict[str, str] = {}
        ttft = None
        started = time.perf_counter()
        async for data in _sse_data(f"{base_url}/chat/completions", body, {"Authorization": f"Bearer {key}"}, headers):
            usage = data.get("usage") or usage
            timings = data.get("timings") or timings
            for choice in data.get("choices") or []:
                delta = choice.get("delta") or {}
                if (delta.get("content") or delta.get("tool_calls")) and ttft is None:
                    ttft = time.perf_counter() - started
                content.append(delta.get("content") or "")
                for d in delta.get("tool_calls") or []:
                    call = calls.setdefault(d.get("index", 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    call["id"] = d.get("id") or call["id"]
                    fn = d.get("function") or {}
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        cached = int(timings.get("cache_n") or (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        stats.append(TurnStats(
            ttft=ttft if ttft is not None else time.perf_counter() - started,
            prompt_tokens=int(usage.get("prompt_tokens") or 0) or cached + int(timings.get("prompt_n") or 0),
            cached=cached,
            prefilled=int(timings.get("prompt_n") or 0),
            headers=headers,
        ))
        return {"choices": [{"message": message}], "usage": usage, "_headers": headers}

    return post


_DELTA_FIELD = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}
"""A Messages ``content_block_delta``'s delta type -> its field, which extends the block's field of that name."""


def messages_streaming_post(base_url: str, stats: list[TurnStats], key: str) -> Callable[[dict[str, Any]], Any]:
    """The Messages twin of :func:`streaming_post`: ``POST /messages`` with ``"stream": true``, timed at
    the first ``content_block_delta``; returns the reply as the non-streamed response would carry it
    (``content`` blocks, ``usage`` merged from ``message_start`` and ``message_delta``)."""

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0}
        blocks: dict[int, dict[str, Any]] = {}
        inputs: dict[int, str] = {}
        usage: dict[str, Any] = {}
        headers: dict[str, str] = {}
        ttft = None
        started = time.perf_counter()
        sent = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        async for data in _sse_data(f"{base_url}/messages", body, sent, headers):
            kind = data.get("type")
            if kind in ("message_start", "message_delta"):
                usage.update((data.get("message") or data).get("usage") or {})
            elif kind == "content_block_start":
                blocks[data["index"]] = dict(data["content_block"])
            elif kind == "content_block_delta":
                ttft = ttft if ttft is not None else time.perf_counter() - started
                delta, block = data["delta"], blocks.setdefault(data["index"], {"type": "text", "text": ""})
                if delta["type"] == "input_json_delta":
                    inputs[data["index"]] = inputs.get(data["index"], "") + delta["partial_json"]
                elif name := _DELTA_FIELD.get(delta["type"]):
                    block[name] = block.get(name, "") + delta[name]
        for index, text in inputs.items():
            blocks[index]["input"] = _json_or_empty(text)
        stats.append(TurnStats(
            ttft=ttft if ttft is not None else time.perf_counter() - started,
            prompt_tokens=sum(int(usage.get(k) or 0) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")),
            cached=int(usage.get("cache_read_input_tokens") or 0),
            prefilled=int(usage.get("input_tokens") or 0),
            headers=headers,
        ))
        return {"role": "assistant", "content": [blocks[i] for i in sorted(blocks)], "usage": usage}

    return post


def _json_or_empty(text: str) -> Any:
    """A streamed ``tool_use`` input; ``{}`` when ``max_tokens`` cut it short (as llama.cpp does)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}


async def run_workload(base_url: str, workload: Workload, via: str, turns: int, key: str = "sk-engine") -> Run:
    """One agent, ``turns`` turns, on ``base_url`` (the engine or kvwarm in front of it)."""
    stats: list[TurnStats] = []
    agent = Agent(streaming_post(base_url, stats, key), drift=workload.drift, history=workload.history(),
                  user_turns=list(QUESTIONS), tools=copy.deepcopy(TOOLS))
    agent.user_turns = list(QUESTIONS)
    random.seed(0)
    await agent.run(turns)
    return Run(workload.name, via, stats)


async def run_messages_workload(base_url: str, workload: MessagesWorkload, via: str, turns: int, key: str = "sk-engine") -> Run:
    """One Messages agent, ``turns`` turns, on ``base_url``: the seed exchange, then a new user
    question after each text reply, a ``tool_result`` after each ``tool_use``. Before every turn
    but the first, the re-sent part of the history (and the tools) passes through the drift."""
    stats: list[TurnStats] = []
    post = messages_streaming_post(base_url, stats, key)
    history, sent = copy.deepcopy(MESSAGES_SEED), 0
    for turn in range(turns):
        resent, fresh = copy.deepcopy(history[:sent]), copy.deepcopy(history[sent:])
        system: Any = SYSTEM
        tools = copy.deepcopy(MESSAGES_TOOLS)
        if turn:
            resent, system, tools = workload.drift(resent, system, tools, turn)
        reply = await post({"model": "smollm2", "system": system, "tools": tools, "messages": resent + fresh})
        history.append({"role": "assistant", "content": reply["content"]})
        sent = len(history)
        uses = [b for b in reply["content"] if b.get("type") == "tool_use"]
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b["id"], "content": f"{b['name']} -> ok, 3 matches in src/cache.py\n"}
            for b in uses
        ] or QUESTIONS[turn % len(QUESTIONS)]})
    return Run(workload.name, via, stats)
