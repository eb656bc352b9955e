"""Semantic drift is never rewritten: the upstream receives the client's bytes and the break is named."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from tests.agents import SYSTEM, TOOLS
from tests.conftest import ProxyFactory, metric, received

Msgs = list[dict[str, Any]]


async def send(server: TestServer, body: dict[str, Any], key: str = "sk-alice", **headers: str) -> tuple[dict[str, Any], dict[str, str], bytes]:
    raw = orjson.dumps(body)
    async with aiohttp.ClientSession() as s, s.post(
        server.make_url("/v1/chat/completions"), data=raw,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers},
    ) as r:
        assert r.status == 200, await r.text()
        return await r.json(), dict(r.headers), raw


def reply_of(response: dict[str, Any]) -> dict[str, Any]:
    msg = response["choices"][0]["message"]
    return {k: v for k, v in msg.items() if v is not None or k == "content"}


def prefix(headers: dict[str, str]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in headers["x-kvwarm-prefix"].split("; "))


async def two_turns(
    proxy: TestServer, sim: TestServer, first: Msgs, edit: Callable[[Msgs], Msgs],
    tools: list[dict[str, Any]] | None = None, edit_tools: Callable[[Any], Any] | None = None, **headers: str,
) -> tuple[dict[str, str], bytes]:
    """Turn 1 as given; turn 2 = edit(turn 1 + reply + a new user message). Returns turn 2's headers and bytes sent."""
    body: dict[str, Any] = {"model": "kvwarm-sim", "messages": first}
    if tools is not None:
        body["tools"] = tools
    response, _, _ = await send(proxy, body, **headers)
    history = [*copy.deepcopy(first), reply_of(response)]
    if history[-1].get("tool_calls"):
        history += [{"role": "tool", "tool_call_id": c["id"], "content": f"result {i}\n"} for i, c in enumerate(history[-1]["tool_calls"])]
    else:
        history.append({"role": "user", "content": "And then?"})
    body2: dict[str, Any] = {"model": "kvwarm-sim", "messages": edit(copy.deepcopy(history))}
    if tools is not None:
        body2["tools"] = edit_tools(copy.deepcopy(tools)) if edit_tools else tools
    _, headers2, raw2 = await send(proxy, body2, **headers)
    assert received(sim)[-1].body == raw2, "a semantic change must reach the upstream exactly as sent"
    return headers2, raw2


BASE: Msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise the repo."}]


def with_stamp(stamp: str) -> Msgs:
    return [{"role": "system", "content": f"Current time: {stamp}. Session 4f2a.\n{SYSTEM}"}, {"role": "user", "content": "hi"}]


async def test_system_timestamp_is_a_located_system_change(proxy: TestServer, sim: TestServer) -> None:
    def edit(m: Msgs) -> Msgs:
        m[0]["content"] = m[0]["content"].replace("2026-11-22T10:00:00Z", "2026-11-22T10:05:13Z")
        return m

    headers, _ = await two_turns(proxy, sim, with_stamp("2026-11-22T10:00:00Z"), edit)
    assert prefix(headers)["break"] == "system_changed@0"
    assert prefix(headers)["matched"].startswith("0/")
    located = headers["x-kvwarm-break"]
    assert "messages[0]" in located
    assert "dd:dd" in located and "2026" not in located  # the shape, never the text
    assert metric(proxy, "kvwarm_prefix_breaks_total", reason="system_changed") == 1


async def test_pin_patterns_opt_in_restores_the_first_timestamp(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim, repair__pin_patterns={"system": [r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"]})

    def edit(m: Msgs) -> Msgs:
        m[0]["content"] = m[0]["content"].replace("2026-11-22T10:00:00Z", "2026-11-22T10:05:13Z")
        return m

    body: dict[str, Any] = {"model": "kvwarm-sim", "messages": with_stamp("2026-11-22T10:00:00Z")}
    response, _, _ = await send(proxy, body)
    body2 = {"model": "kvwarm-sim", "messages": edit(body["messages"] + [reply_of(response), {"role": "user", "content": "more"}])}
    _, headers, _ = await send(proxy, body2)
    forwarded = orjson.loads(received(sim)[-1].body)
    assert "2026-11-22T10:00:00Z" in forwarded["messages"][0]["content"]
    assert "10:05:13" not in forwarded["messages"][0]["content"]
    assert prefix(headers)["matched"] == "3/4"
    assert "break" not in prefix(headers)


CASES: list[tuple[str, Msgs, Callable[[Msgs], Msgs], str]] = [
    # Extra context added to the turn that was sent, and not saved (catalogue 2).
    ("context_dropped",
     [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [{"type": "text", "text": "[Mon 10:01] cwd=/srv\n\nhi"}]}],
     lambda m: [m[0], {"role": "user", "content": "hi"}, *m[2:]], "content_changed@1"),
    # A plugin or the user changed the assistant's reply.
    ("reply_edited", BASE,
     lambda m: [*m[:2], {**m[2], "content": "[INTERRUPTED] " + m[2]["content"]}, *m[3:]], "assistant_modified@2"),
    # An interrupted stream: the client kept only part of the text.
    ("reply_truncated", BASE,
     lambda m: [*m[:2], {**m[2], "content": m[2]["content"][:20]}, *m[3:]], "assistant_modified@2"),
    # History pruned: the first exchange removed.
    ("pruned", [*BASE, {"role": "assistant", "content": "Done.\n"}, {"role": "user", "content": "Next?"}],
     lambda m: [m[0], *m[3:]], "message_removed@1"),
    # The user prompt appended twice (a retry).
    ("duplicated", BASE, lambda m: [*m[:2], copy.deepcopy(m[1]), *m[2:]], "duplicate_replay@2"),
    # A message inserted in the middle.
    ("inserted", BASE, lambda m: [m[0], {"role": "user", "content": "(note: be brief)"}, *m[1:]], "message_inserted@1"),
    # The head summarised away: the request starts inside the stored chain.
    ("head_truncated", [*BASE, {"role": "assistant", "content": "Sure.\n"}, {"role": "user", "content": "Go on."}],
     lambda m: m[1:], "truncated_head@0"),
    # A tool result rewritten by a hook on every request (catalogue 16) or pruned (catalogue 11).
    ("tool_result_rewritten", [*BASE, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query":"cache"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "src/cache.py:10: def key(x):\n"}],
     lambda m: [*m[:3], {**m[3], "content": "[pruned]"}, *m[4:]], "content_changed@3"),
    ("many_pruned", [*BASE, {"role": "assistant", "content": "A.\n"}, {"role": "user", "content": "B?"},
                     {"role": "assistant", "content": "C.\n"}, {"role": "user", "content": "D?"}],
     lambda m: [m[0], *m[5:]], "message_removed@1"),
]


@pytest.mark.parametrize(("name", "first", "edit", "expected"), CASES, ids=[c[0] for c in CASES])
async def test_semantic_changes_are_reported_not_rewritten(
    proxy: TestServer, sim: TestServer, name: str, first: Msgs, edit: Callable[[Msgs], Msgs], expected: str
) -> None:
    headers, _ = await two_turns(proxy, sim, first, edit)
    assert prefix(headers)["break"] == expected
    assert prefix(headers)["repaired"] == "0"


def _args(m: Msgs, fn: Callable[[dict[str, Any]], None]) -> Msgs:
    for msg in m:
        for call in msg.get("tool_calls") or []:
            fn(call)
    return m


async def test_changed_numbers_in_arguments_are_not_equal(proxy: TestServer, sim: TestServer) -> None:
    def edit(m: Msgs) -> Msgs:
        def redo(call: dict[str, Any]) -> None:
            call["function"]["arguments"] = call["function"]["arguments"].replace(":1", ":1.0").replace(":2.5", ":2.50001")
        return _args(m, redo)

    headers, raw = await two_turns(proxy, sim, BASE, edit, tools=TOOLS)
    assert b"1.0" in raw or b"2.50001" in raw
    assert prefix(headers)["break"].startswith("assistant_modified@2")


async def test_regenerated_tool_call_ids_are_not_rewritten(proxy: TestServer, sim: TestServer) -> None:
    def edit(m: Msgs) -> Msgs:
        ids: dict[str, str] = {}
        for msg in m:
            for call in msg.get("tool_calls") or []:
                ids[call["id"]] = call["id"] = "functions_" + call["function"]["name"] + "_0"
            if msg.get("tool_call_id") in ids:
                msg["tool_call_id"] = ids[msg["tool_call_id"]]
        return m

    headers, _ = await two_turns(proxy, sim, BASE, edit, tools=TOOLS)
    assert prefix(headers)["break"] == "assistant_modified@2"


async def test_reasoning_dropped_is_reported(proxy: TestServer, sim: TestServer) -> None:
    def edit(m: Msgs) -> Msgs:
        m[2].pop("reasoning_content")
        return m

    headers, _ = await two_turns(proxy, sim, BASE, edit, **{"x-sim-reasoning": "1"})
    assert prefix(headers)["break"] == "reasoning_changed@2"


@pytest.mark.parametrize("change", ["added", "description"])
async def test_tool_set_change_is_tools_changed(proxy: TestServer, sim: TestServer, change: str) -> None:
    def edit_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if change == "added":
            return [*tools, {"type": "function", "function": {"name": "lint", "parameters": {"type": "object", "properties": {}}}}]
        tools[1]["function"]["description"] += " Faster now."
        return tools

    headers, _ = await two_turns(proxy, sim, BASE, lambda m: m, tools=TOOLS, edit_tools=edit_tools)
    assert prefix(headers)["break"] == "tools_changed@tools"
    assert prefix(headers)["matched"].startswith("0/")


async def test_a_new_turn_is_not_a_break(proxy: TestServer, sim: TestServer) -> None:
    headers, _ = await two_turns(proxy, sim, BASE, lambda m: m)
    assert "break" not in prefix(headers) or prefix(headers)["break"].startswith("new_branch")
    assert sum(
        metric(proxy, "kvwarm_prefix_breaks_total", reason=r) for r in
        ("content_changed", "system_changed", "tools_changed", "message_inserted", "message_removed", "assistant_modified")
    ) == 0
