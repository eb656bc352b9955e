"""Responses API: semantic changes are never rewritten; the upstream gets the client's bytes and the break is named.

Each case runs the scripted agent (``tests/responses/agents.py``) through kvwarm for a few
requests, then edits the next request the way a client, a plugin or a user would, and checks
``x-kvwarm-prefix`` / ``x-kvwarm-break``. Break positions are element indices of the
request as kvwarm sees it: ``instructions`` first, then one element per input item (a
``reasoning`` item rides with the item after it).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestServer

from tests.conftest import metric, received
from tests.responses.agents import ResponsesAgent, poster

Body = dict[str, Any]
BREAKS = (
    "content_changed", "system_changed", "tools_changed", "reasoning_changed", "assistant_modified",
    "message_removed", "message_inserted", "duplicate_replay", "truncated_head",
)


async def edited_turn(
    proxy: TestServer, sim: TestServer, edit: Callable[[Body], Body], *, requests: int = 3, reasoning: bool = False
) -> tuple[dict[str, str], dict[str, str], Body]:
    """``requests`` agent requests, then ``edit(next request)``: its prefix header, all headers and the body sent."""
    agent = ResponsesAgent(poster(proxy), reasoning=reasoning)
    await agent.run(requests)
    for turn in agent.turns[1:]:
        assert "break" not in turn.prefix(), turn.prefix()
    body = edit(copy.deepcopy(agent.next_request()))
    response = await poster(proxy)(body, {})
    assert received(sim)[-1].body == orjson.dumps(body), "a semantic change must reach the upstream exactly as sent"
    headers: dict[str, str] = response["_headers"]
    fields = dict(p.split("=", 1) for p in headers["x-kvwarm-prefix"].split("; "))
    assert fields["repaired"] == "0"
    return fields, headers, body


def _items(body: Body, kind: str, role: str | None = None) -> list[int]:
    return [
        i for i, item in enumerate(body["input"])
        if (item.get("type") or "message") == kind and (role is None or item.get("role") == role)
    ]


def breaks(proxy: TestServer) -> dict[str, float]:
    return {r: v for r in BREAKS if (v := metric(proxy, "kvwarm_prefix_breaks_total", reason=r))}


async def test_changed_instructions_are_a_located_system_change(proxy: TestServer, sim: TestServer) -> None:
    def edit(body: Body) -> Body:
        body["instructions"] = body["instructions"].replace("Rule 5:", "Rule 5 (as of 2026-11-23T10:05:13Z):")
        return body

    fields, headers, _ = await edited_turn(proxy, sim, edit)
    assert fields["break"] == "system_changed@0"
    assert fields["matched"].startswith("0/")
    located = headers["x-kvwarm-break"]
    assert located.startswith("system_changed at messages[0] ")
    assert "shape=" in located and "2026" not in located and "dddd-dd-ddTdd:dd:ddZ" in located
    assert breaks(proxy) == {"system_changed": 1}


async def test_changed_user_text_is_content_changed(proxy: TestServer, sim: TestServer) -> None:
    def edit(body: Body) -> Body:
        first = _items(body, "message", "user")[0]
        body["input"][first]["content"] += " Only in src/, please."
        return body

    fields, headers, _ = await edited_turn(proxy, sim, edit)
    assert fields["break"] == "content_changed@1"  # element 0 is the instructions
    assert "x-kvwarm-break" in headers and "src" not in headers["x-kvwarm-break"]
    assert breaks(proxy) == {"content_changed": 1}


async def test_changed_tool_output_is_content_changed(proxy: TestServer, sim: TestServer) -> None:
    def edit(body: Body) -> Body:
        output = _items(body, "function_call_output")[0]
        body["input"][output]["output"] = "[pruned]"
        return body

    fields, _, body = await edited_turn(proxy, sim, edit)
    assert fields["break"] == f"content_changed@{_items(body, 'function_call_output')[0] + 1}"


async def test_dropped_reasoning_item_is_reasoning_changed(proxy: TestServer, sim: TestServer) -> None:
    dropped: list[int] = []

    def edit(body: Body) -> Body:
        reasoning = _items(body, "reasoning")
        assert reasoning, "the upstream reasoned"
        dropped.append(reasoning[0])
        del body["input"][reasoning[0]]
        return body

    fields, _, body = await edited_turn(proxy, sim, edit, reasoning=True)
    # The reasoning item rode with the function call after it, now at the reasoning's position.
    assert body["input"][dropped[0]]["type"] == "function_call"
    assert fields["break"] == f"reasoning_changed@{dropped[0] + 1}"
    assert breaks(proxy) == {"reasoning_changed": 1}


async def test_changed_reasoning_content_is_reasoning_changed(proxy: TestServer, sim: TestServer) -> None:
    def edit(body: Body) -> Body:
        item = body["input"][_items(body, "reasoning")[0]]
        item["encrypted_content"] = item["encrypted_content"][:-8] + "AAAAAAAA"
        return body

    fields, _, _ = await edited_turn(proxy, sim, edit, reasoning=True)
    assert fields["break"].startswith("reasoning_changed@")


async def test_assistant_message_changed_by_the_client_is_assistant_modified(proxy: TestServer, sim: TestServer) -> None:
    def edit(body: Body) -> Body:
        reply = body["input"][_items(body, "message", "assistant")[0]]
        reply["content"][0]["text"] = "[edited by a plugin] " + reply["content"][0]["text"]
        return body

    fields, _, body = await edited_turn(proxy, sim, edit)
    assert fields["break"] == f"assistant_modified@{_items(body, 'message', 'assistant')[0] + 1}"
    assert breaks(proxy) == {"assistant_modified": 1}


async def test_interrupted_reply_kept_in_part_is_assistant_modified(proxy: TestServer, sim: TestServer) -> None:
    def edit(body: Body) -> Body:
        reply = body["input"][_items(body, "message", "assistant")[0]]
        reply["content"][0]["text"] = reply["content"][0]["text"][:20]
        return body

    fields, _, body = await edited_turn(proxy, sim, edit)
    assert fields["break"] == f"assistant_modified@{_items(body, 'message', 'assistant')[0] + 1}"


@pytest.mark.parametrize("change", ["number", "call_id"])
async def test_changed_function_call_is_assistant_modified(proxy: TestServer, sim: TestServer, change: str) -> None:
    def edit(body: Body) -> Body:
        first = _items(body, "function_call")[0]
        call = body["input"][first]
        if change == "number":
            call["arguments"] = call["arguments"].replace(":1", ":1.0")
            assert json.loads(call["arguments"]) == json.loads(call["arguments"].replace(":1.0", ":1"))
        else:
            call["call_id"] = body["input"][first + 1]["call_id"] = "call_regenerated_0"
        return body

    fields, _, body = await edited_turn(proxy, sim, edit)
    assert fields["break"] == f"assistant_modified@{_items(body, 'function_call')[0] + 1}"


async def test_removed_message_is_message_removed(proxy: TestServer, sim: TestServer) -> None:
    removed: list[int] = []

    def edit(body: Body) -> Body:
        reply = _items(body, "message", "assistant")[0]
        removed.append(reply)
        del body["input"][reply]
        return body

    fields, _, _ = await edited_turn(proxy, sim, edit)
    assert fields["break"] == f"message_removed@{removed[0] + 1}"
    assert breaks(proxy) == {"message_removed": 1}


@pytest.mark.parametrize("change", ["added", "description", "removed"])
async def test_changed_tools_are_tools_changed(proxy: TestServer, sim: TestServer, change: str) -> None:
    def edit(body: Body) -> Body:
        if change == "added":
            body["tools"].append({"type": "function", "name": "lint", "parameters": {"type": "object", "properties": {}}})
        elif change == "description":
            body["tools"][1]["description"] += " Faster now."
        else:
            del body["tools"][-1]
        return body

    fields, _, _ = await edited_turn(proxy, sim, edit)
    assert fields["break"] == "tools_changed@tools"
    assert fields["matched"].startswith("0/")
    assert breaks(proxy) == {"tools_changed": 1}


async def test_a_new_user_turn_is_not_a_break(proxy: TestServer, sim: TestServer) -> None:
    def edit(body: Body) -> Body:
        body["input"][-1]["content"] = "Something else entirely."
        return body

    fields, _, _ = await edited_turn(proxy, sim, edit, requests=2)
    assert fields.get("break", "new_branch@").startswith("new_branch@")
    assert breaks(proxy) == {}
