"""openai-agents (its default model: the Responses API) against Responses API upstreams, no kvwarm.

Against the scripted capture upstream: what the library sends (one function
tool, the call and its output, every request re-sending the previous one's
items byte for byte). Against the reference upstream: a run with a tool call,
non-streaming and streaming, checked on both sides.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from tests.clients.agents import INSTRUCTIONS, THROWAWAY_KEY, run_agent, weather_report
from tests.clients.capture import FINAL_TEXT, CaptureState, compare_turns
from tests.clients.conftest import Upstream

QUESTION = "What is the weather in Paris?"


def _one(items: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [item for item in items if item.get("type") == kind]
    assert len(found) == 1, f"expected one {kind} item, got {[i.get('type') for i in items]}"
    return found[0]


@pytest.mark.usefixtures("agents_sdk")
async def test_agents_send_one_tool_and_resend_their_items_byte_identically(
    capture: tuple[str, CaptureState],
) -> None:
    url, state = capture
    run = await run_agent(url, [QUESTION, "And in Oslo?"])

    assert run.outputs == [FINAL_TEXT, FINAL_TEXT]
    assert run.tool_calls == [{"city": "Paris"}]
    posts = state.responses()
    assert len(posts) == 3  # the call, its answer, the second user turn
    bodies = [p.json() for p in posts]
    first = bodies[0]
    assert first["instructions"] == INSTRUCTIONS
    assert [t["name"] for t in first["tools"]] == ["get_weather"]
    assert "stream" not in first
    assert posts[0].headers.get("authorization") == f"Bearer {THROWAWAY_KEY}"

    new_items = bodies[1]["input"][len(first["input"]):]
    call, output = _one(new_items, "function_call"), _one(new_items, "function_call_output")
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert output == {"call_id": call["call_id"], "output": weather_report("Paris"), "type": "function_call_output"}

    for earlier, later in itertools.pairwise(posts):
        comparison = compare_turns(earlier.body, later.body)
        assert comparison["changed_fields"] == [] and comparison["items_bytes_prefix"], comparison


@pytest.mark.usefixtures("agents_sdk")
@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
async def test_agents_complete_a_tool_run_against_the_reference_upstream(
    sim_upstream: Upstream, stream: bool
) -> None:
    run = await run_agent(sim_upstream.base_url, [QUESTION], stream=stream)

    entries = [e for e in await sim_upstream.received() if e["path"] == "/v1/responses"]
    assert len(entries) == 2
    turn1, turn2 = (json.loads(e["body"]) for e in entries)
    assert turn1.get("stream", False) is stream
    assert turn2["input"][: len(turn1["input"])] == turn1["input"]

    new_items = turn2["input"][len(turn1["input"]):]
    call, output = _one(new_items, "function_call"), _one(new_items, "function_call_output")
    assert call["name"] == "get_weather"
    arguments = json.loads(call["arguments"])
    assert run.tool_calls == [arguments]
    assert output["call_id"] == call["call_id"]
    assert output["output"] == weather_report(arguments["city"])

    # The final output is the upstream's closing message, which the next turn would re-send.
    final = run.history[-1]
    assert (final["type"], final["role"]) == ("message", "assistant")
    assert run.outputs == ["".join(part["text"] for part in final["content"])]
    assert run.outputs[0].strip()
