"""Builders for pure-core tests: realistic chat requests in one call, and a dict-based NodeReader.

``Session`` drives the production planner (``plan_turn``: match -> repair -> diagnose) and
recorder (``turn_write``) without any I/O, so a test reads like a conversation:
``s.turn(body, reply)``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core.breaks import Break
from proxy.core.match import Match, tenant_root
from proxy.core.plan import TurnPlan, plan_turn, turn_write
from proxy.core.policy import Policy
from proxy.core.record import Reply
from proxy.core.repair import RepairPlan
from proxy.store.base import Node

SECRET = b"test-secret-0123456789"

Msg = dict[str, Any]


# -- messages --------------------------------------------------------------------------------


def system(text: str, **extra: Any) -> Msg:
    return {"role": "system", "content": text, **extra}


def user(text: str, **extra: Any) -> Msg:
    return {"role": "user", "content": text, **extra}


def assistant(text: str | None, *calls: Msg, **extra: Any) -> Msg:
    msg: Msg = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = list(calls)
    msg.update(extra)
    return msg


def call(call_id: str, name: str, arguments: Any, **extra: Any) -> Msg:
    """A tool call; ``arguments`` given as a value is serialized compactly (as a model writes it)."""
    args = (
        arguments
        if isinstance(arguments, str)
        else json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
    )
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": args},
        **extra,
    }


def result(call_id: str, text: str, **extra: Any) -> Msg:
    return {"role": "tool", "tool_call_id": call_id, "content": text, **extra}


def tool_def(name: str, description: str = "", **properties: str) -> Msg:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description or f"The {name} tool.",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": v} for k, v in properties.items()},
                "required": sorted(properties),
            },
        },
    }


WEATHER = tool_def("get_weather", "Current weather for a city.", city="string", days="integer")
SEARCH = tool_def("search", "Search the web.", query="string")
READ = tool_def("read_file", "Read a file from the workspace.", path="string")
TOOLS = [WEATHER, SEARCH, READ]


def make_chat(
    *messages: Msg, tools: Sequence[Msg] | None = None, model: str = "gpt-test", **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [copy.deepcopy(m) for m in messages]}
    if tools is not None:
        body["tools"] = copy.deepcopy(list(tools))
    body.update(extra)
    return body


def agent_history(turns: int = 3, *, parallel: int = 2) -> list[Msg]:
    """A realistic agent transcript: system, then user -> assistant(tool calls) -> tool results -> assistant."""
    msgs: list[Msg] = [system("You are a careful coding agent.\nWork in /repo. Be brief.\n")]
    for t in range(turns):
        msgs.append(user(f"Task {t}: check the weather in 北京 and find file {t}.py"))
        calls = [
            call(f"call_{t}_{j}", "get_weather", {"city": "北京", "days": j + 1})
            for j in range(parallel)
        ]
        msgs.append(assistant(None, *calls))
        msgs.extend(result(f"call_{t}_{j}", f"Sunny, {20 + j}°C\n") for j in range(parallel))
        msgs.append(assistant(f"Done with task {t}.\n"))
    return msgs


# -- a dict-based store ----------------------------------------------------------------------


@dataclass
class DictStore:
    """The read side of a transcript store, in dicts, plus a plain insert-if-absent."""

    nodes: dict[bytes, Node] = field(default_factory=dict)
    kids: dict[bytes, list[Node]] = field(default_factory=dict)
    ids: dict[tuple[bytes, bytes], list[Node]] = field(default_factory=dict)
    lookups: int = 0

    def get(self, key: bytes) -> Node | None:
        self.lookups += 1
        return self.nodes.get(key)

    def children(self, key: bytes) -> Sequence[Node]:
        return list(self.kids.get(key, ()))

    def by_identity(self, tenant: bytes, identity: bytes) -> Sequence[Node]:
        return list(self.ids.get((tenant, identity), ()))

    def insert(self, nodes: Sequence[Node]) -> int:
        added = 0
        for node in nodes:
            if node.key in self.nodes:
                continue
            if node.depth > 0 and node.parent not in self.nodes:
                continue
            self.nodes[node.key] = node
            self.kids.setdefault(node.parent, []).append(node)
            self.ids.setdefault((node.tenant, node.identity), []).append(node)
            added += 1
        return added


def count_tokens(body: bytes) -> int:
    """A stand-in tokenizer: one token per 4 bytes, at least one."""
    return max(1, len(body) // 4)


# -- the pipeline, without I/O ---------------------------------------------------------------


@dataclass
class Turn:
    match: Match
    plan: RepairPlan
    brk: Break | None
    forwarded: dict[str, Any]
    """The body that would go upstream (the repaired one, or the client's)."""
    nodes: list[Node]
    planned: TurnPlan | None = None
    """The production planner's whole plan."""

    @property
    def sent(self) -> bytes:
        return orjson.dumps(self.forwarded)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.plan.repairs]


@dataclass
class Session:
    store: DictStore = field(default_factory=DictStore)
    policy: Policy = field(default_factory=Policy)
    credential: str = "sk-alice"

    @property
    def root(self) -> bytes:
        return tenant_root(SECRET, self.credential)

    def look(self, body: Mapping[str, Any]) -> Turn:
        """Match, repair and diagnose ``body`` without recording anything."""
        before = orjson.dumps(body)
        plan = plan_turn(body, self.root, self.store, self.policy)
        assert orjson.dumps(body) == before, "the caller's body was mutated"
        assert plan.match is not None
        return Turn(plan.match, plan.repair, plan.brk, dict(plan.forwarded), [], plan)

    def turn(
        self, body: Mapping[str, Any], reply: Msg | None = None, *, partial: bool = False
    ) -> Turn:
        """One exchange: look, then record the forwarded elements and the generated reply."""
        t = self.look(body)
        plan = t.planned
        assert plan is not None
        generated = Reply(message=reply, finish_reason="stop", partial=partial, model=None) if reply is not None else None
        record = turn_write(
            plan, generated, None, None, model="", client_gone=False, now=1000.0, count_tokens=count_tokens
        )
        assert record is not None
        t.nodes = list(record.nodes)
        self.store.insert(t.nodes)
        return t
