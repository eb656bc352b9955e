"""Realistic chat request bodies for the benchmarks: tool-using agent conversations of a given size.

A conversation is what a coding agent re-sends every turn: a system prompt, the tools
array, then rounds of ``user`` -> ``assistant`` (one or two tool calls with JSON
arguments) -> ``tool`` results (file contents, search hits) -> ``assistant`` text.
The tool results carry most of the bytes, as in real agents; their size is chosen so
the whole body lands near ``target_bytes``. Everything is deterministic (seeded), so
every target of a benchmark receives byte-identical requests.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import orjson

from tests.agents import SYSTEM, TOOLS

Message = dict[str, Any]

MODEL = "kvwarm-sim"

SHORT_SYSTEM = (
    "You are a careful coding agent working in a repository. Keep changes small, "
    "name files precisely, run the tests after every edit and explain what you did."
)

_WORDS = (
    "cache key prefix token stream chunk request session node store match repair tool call "
    "result file line test case value index error retry budget config upstream client"
).split()


def _code_text(rng: random.Random, size: int) -> str:
    """About ``size`` characters of source-like text (what ``read_file`` returns)."""
    lines: list[str] = []
    total = 0
    while total < size:
        a, b = rng.sample(_WORDS, 2)
        line = f"    def {a}_{b}_{rng.randrange(1000)}(self, {b}: int = {rng.randrange(100)}) -> str:  # {rng.choice(_WORDS)}"
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines)[:size]


def _call(rng: random.Random, call_id: str) -> dict[str, Any]:
    name = rng.choice(("read_file", "search", "run_tests"))
    if name == "read_file":
        args: dict[str, Any] = {"path": f"src/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py", "start_line": rng.randrange(1, 400)}
    elif name == "search":
        args = {"query": f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}", "regex": rng.random() < 0.3, "max_results": 20}
    else:
        args = {"selector": f"tests/test_{rng.choice(_WORDS)}.py", "timeout": 120.5}
    # The compact form a provider generates (what the agent echoes back unchanged).
    arguments = json.dumps(args, separators=(",", ":"))
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def conversation(n_messages: int, target_bytes: int, *, seed: int = 0, system: str = SYSTEM) -> list[Message]:
    """``n_messages`` messages (system first) whose JSON totals about ``target_bytes``."""
    rng = random.Random(seed)
    out: list[Message] = [{"role": "system", "content": system}]
    user_turn = 0
    call_no = 0
    # First pass with empty tool results; then their size is set to hit the target.
    tool_slots: list[Message] = []
    while len(out) < n_messages:
        if user_turn == 0 or rng.random() < 0.25:
            out.append({"role": "user", "content": f"Turn {user_turn}: find where the {rng.choice(_WORDS)} is handled and fix the {rng.choice(_WORDS)} bug."})
            user_turn += 1
            continue
        calls = [_call(rng, f"call_{seed}_{call_no + k}") for k in range(1 + (rng.random() < 0.4))]
        call_no += len(calls)
        out.append({"role": "assistant", "content": None, "tool_calls": calls})
        for call in calls:
            if len(out) >= n_messages:
                break
            result: Message = {"role": "tool", "tool_call_id": call["id"], "content": ""}
            out.append(result)
            tool_slots.append(result)
        if len(out) < n_messages and rng.random() < 0.3:
            out.append({"role": "assistant", "content": f"I read the {rng.choice(_WORDS)} code; next I will check the {rng.choice(_WORDS)}."})
    out = out[:n_messages]
    base = len(orjson.dumps({"model": MODEL, "messages": out, "tools": TOOLS}))
    slots = [m for m in tool_slots if any(m is o for o in out)]
    if slots and target_bytes > base:
        each = (target_bytes - base) // len(slots)
        for m in slots:
            m["content"] = _code_text(rng, max(each, 20))
    for m in slots:
        if not m["content"]:
            m["content"] = "ok"
    # A conversation ending on an assistant tool call would be answered by tool results,
    # not by the model: end on a message the model can answer.
    if out[-1]["role"] == "assistant":
        out[-1] = {"role": "user", "content": "Continue."}
    return out


def chat_body(messages: list[Message], *, stream: bool = False, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": copy.deepcopy(TOOLS if tools is None else tools)}
    if stream:
        body["stream"] = True
    return body


def small_body(*, stream: bool = False) -> bytes:
    """A ~2 KB request: short system prompt, a few tool-call rounds."""
    return orjson.dumps(chat_body(conversation(8, 2048, seed=1, system=SHORT_SYSTEM), stream=stream))


def large_body() -> bytes:
    """A ~500 KB request: ~240 messages, most of the bytes in tool results."""
    return orjson.dumps(chat_body(conversation(240, 500_000, seed=2)))
