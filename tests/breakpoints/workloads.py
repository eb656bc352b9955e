"""Breakpoint workloads, shared by the tests (tests/breakpoints/test_workloads.py) and the benchmark
(tests/bench/breakpoints.py): what clients send to an upstream that caches at breakpoints, and
what the upstream reported and billed for it.

Each workload drives the official openai SDK (Chat Completions) against one route: the reference
upstream directly, or kvwarm in front of one. A :class:`Ledger` keeps what each request read,
wrote and cost, from the usage the upstream returned, billed as the upstream bills it
(proxy/sim/accounting.py: a read 0.1 x input, a write 1.25 x).

- :func:`single_shot_tasks`: many one-request tasks sharing a long system prompt;
- :func:`agent`: a multi-turn tool-using session (two tasks, a tool round and an answer each);
- :func:`subagents`: parallel subagents handed one shared brief, each with its own part, in batches;
- the *static policy* (:func:`marked_last`): a marker on the system prompt and on the latest
  message every turn, as other proxies and agents inject them; a client that does this moves its
  markers every turn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import openai

from proxy.sim.accounting import Accounting
from proxy.sim.markers import OPENAI_BREAKPOINTS
from proxy.sim.state import SimConfig
from tests.sim.conftest import SEARCH_TOOL, WEATHER_TOOL, long_system_prompt

__all__ = [
    "CC",
    "INPUT",
    "MODEL",
    "SYSTEM",
    "TOOLS",
    "Ledger",
    "agent",
    "ask",
    "marked_last",
    "single_shot_tasks",
    "subagents",
]

MODEL = "sim-cache"
SYSTEM = long_system_prompt(160)
"""About 2000 tokens: a stable prefix the upstream caches (1024 tokens at least)."""
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]
CC = {"type": "ephemeral"}
BREAKPOINT = {"mode": "explicit"}
INPUT = SimConfig().price_input
BRIEF = " ".join(
    f"Step {i}: read module {i}, list what it exports, note every caller, and flag dead code." for i in range(90)
)
"""The shared brief parallel subagents are handed (about 2000 tokens)."""


@dataclass
class Ledger:
    """What one route's requests read, wrote and cost, as the upstream reported them."""

    mode: str
    prompts: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    usd: float = 0.0

    def add(self, usage: dict[str, Any]) -> None:
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        assert isinstance(prompt, int) and isinstance(completion, int)
        cached, written = details.get("cached_tokens") or 0, details.get("cache_write_tokens") or 0
        self.prompts.append(prompt)
        self.cached.append(cached)
        self.written.append(written)
        self.usd += Accounting(
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion, reasoning_tokens=0,
            cache_write_tokens=written, cache_mode=self.mode,
        ).charged(SimConfig(cache_mode=self.mode))

    @property
    def share(self) -> float:
        return sum(self.cached) / sum(self.prompts)

    def line(self, name: str) -> str:
        return (
            f"{name:<22} requests={len(self.prompts):>3} prompt={sum(self.prompts):>6} cached={sum(self.cached):>6} "
            f"({100 * self.share:5.1f}%) written={sum(self.written):>6} usd={self.usd * 1000:.4f}m"
        )


async def ask(client: openai.AsyncOpenAI, ledger: Ledger, messages: list[Any], **kwargs: Any) -> Any:
    response = await client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    assert response.usage is not None
    ledger.add(response.usage.model_dump())
    return response.choices[0].message


def single_shot_tasks(n: int) -> list[list[dict[str, Any]]]:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {i}: summarise file {i}.py."}] for i in range(n)]


def marked_last(messages: list[Any], mode: str = "") -> list[Any]:
    """The static policy: a marker on the system prompt and on the latest message's last part
    (``prompt_cache_breakpoint`` for an ``openai-breakpoints`` upstream, else ``cache_control``)."""
    key, marker = ("prompt_cache_breakpoint", BREAKPOINT) if mode == OPENAI_BREAKPOINTS else ("cache_control", CC)
    out = [dict(m) for m in messages]
    for m in (out[0], out[-1]):
        content = m["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(p) for p in content]
        parts[-1][key] = marker
        m["content"] = parts
    return out


async def work(client: openai.AsyncOpenAI, ledger: Ledger, messages: list[Any], *, static: bool, parts: int = 1) -> None:
    """Tool rounds until the model answers; each tool result in ``parts`` parts (more than one: a
    long turn, more blocks than a provider looks back over)."""
    while True:
        sent = marked_last(messages, ledger.mode) if static else messages
        reply = await ask(client, ledger, sent, tools=TOOLS)
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return
        for call in reply.tool_calls:
            lines = [{"type": "text", "text": f"{call.id}: line {k} of the result."} for k in range(parts)]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lines if parts > 1 else lines[0]["text"]})


async def agent(
    client: openai.AsyncOpenAI, ledger: Ledger, name: str, *, static: bool = False, long_turn: bool = True
) -> list[Any]:
    """A marker-less (or statically marked) coding agent: two tasks, each a tool round and an
    answer; the second task's tool results come in many parts (a long turn: more blocks than a
    provider looks back over)."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}]
    for task in range(2):
        messages.append({"role": "user", "content": f"{name}, task {task}: check the weather and search the web."})
        await work(client, ledger, messages, static=static, parts=12 if long_turn and task == 1 else 1)
    return messages


async def subagents(client: openai.AsyncOpenAI, ledger: Ledger, n: int, *, static: bool = False, rounds: int = 2) -> None:
    """``n`` subagents handed the same brief after the system prompt, then each its own part of the
    work (a tool round and an answer): in ``rounds`` batches run at once, as an orchestrator
    sends a batch out and the next when it is back."""

    async def one(i: int) -> None:
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": BRIEF},
            {"role": "user", "content": f"You are subagent {i}: do steps {10 * i} to {10 * i + 9}."},
        ]
        await work(client, ledger, messages, static=static)

    size = -(-n // rounds)
    for start in range(0, n, size):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + size))))
