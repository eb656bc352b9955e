"""The capture upstream's helpers that the client tests lean on: the turn comparison and the script."""

from __future__ import annotations

import json

from tests.clients.capture import (
    COMMAND_MARKER,
    command_call,
    compare_turns,
    scripted_output,
    sse_events,
)

_FIRST = b'{"model":"m","input":[{"type":"message","role":"user","content":"a [b] \\"c]\\""}],"store":false}'


def test_compare_turns_finds_a_byte_identical_resend() -> None:
    second = (
        b'{"model":"m","input":[{"type":"message","role":"user","content":"a [b] \\"c]\\""},'
        b'{"type":"function_call_output","call_id":"c1","output":"ok"}],"store":false}'
    )
    assert compare_turns(_FIRST, second) == {
        "changed_fields": [],
        "first_items": 1,
        "second_items": 2,
        "items_equal": True,
        "items_bytes_prefix": True,
        "new_item_types": ["function_call_output"],
    }


def test_compare_turns_tells_a_reserialized_resend_and_changed_fields() -> None:
    # Same item, keys in another order: equal as JSON, not as bytes.
    second = (
        b'{"model":"m","input":[{"role":"user","type":"message","content":"a [b] \\"c]\\""},'
        b'{"type":"function_call_output","call_id":"c1","output":"ok"}],"store":true}'
    )
    result = compare_turns(_FIRST, second)
    assert result["items_equal"] is True
    assert result["items_bytes_prefix"] is False
    assert result["changed_fields"] == ["store"]


def test_the_script_calls_the_command_tool_then_answers() -> None:
    tools = [
        {"type": "function", "name": "write_stdin", "parameters": {"properties": {"session_id": {"type": "number"}}}},
        {"type": "function", "name": "exec_command", "parameters": {"properties": {"cmd": {"type": "string"}}}},
    ]
    assert command_call(tools) == ("exec_command", json.dumps({"cmd": f"echo {COMMAND_MARKER}"}))
    weather = {"type": "function", "name": "get_weather",
               "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"]}}
    assert command_call([weather]) == ("get_weather", json.dumps({"city": "Paris"}))
    first = scripted_output({"input": [{"role": "user", "content": "hi"}], "tools": tools}, 1)
    assert [item["type"] for item in first] == ["function_call"]
    after = scripted_output({"input": [first[0], {"type": "function_call_output", "call_id": "call_1", "output": "x"}],
                             "tools": tools}, 2)
    assert [item["type"] for item in after] == ["message"]

    events = sse_events("resp_1", "m", first)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"] == first
