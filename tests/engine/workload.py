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
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Callable
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


@dataclass
class TurnStats:
    ttft: float
    """Seconds from sending the request to the first generated delta."""
    prompt_tokens: int
    cached: int
    """Prompt tokens the engine reused from its KV (``timings.cache_n``)."""
    prefilled: int
    """Prompt tokens the engine computed (``timings.prompt_n``)."""
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


def streaming_post(base_url: str, stats: list[TurnStats], key: str) -> Callable[[dict[str, Any]], Any]:
    """An Agent ``post`` that streams, times the first delta and rebuilds the message and usage."""

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 7}
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        ttft = None
        started = time.perf_counter()
        async with aiohttp.ClientSession() as s, s.post(
            f"{base_url}/chat/completions", data=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=600),
        ) as r:
            if r.status != 200:
                raise AssertionError(f"HTTP {r.status}: {(await r.text())[:500]}")
            headers = dict(r.headers)
            buffer = b""
            async for chunk in r.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.splitlines():
                        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                            continue
                        data = orjson.loads(line[5:])
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


async def run_workload(base_url: str, workload: Workload, via: str, turns: int, key: str = "sk-engine") -> Run:
    """One agent, ``turns`` turns, on ``base_url`` (the engine or kvwarm in front of it)."""
    stats: list[TurnStats] = []
    agent = Agent(streaming_post(base_url, stats, key), drift=workload.drift, history=workload.history(),
                  user_turns=list(QUESTIONS), tools=copy.deepcopy(TOOLS))
    agent.user_turns = list(QUESTIONS)
    random.seed(0)
    await agent.run(turns)
    return Run(workload.name, via, stats)
