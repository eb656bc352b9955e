"""Deterministic replies: tool calls from schemas, text that ends with a newline, stream deltas."""

from __future__ import annotations

import json
import re
from typing import Any

from proxy.sim.render import count_tokens
from proxy.sim.replies import Reply, make_reply, reply_deltas, sample_arguments
from tests.sim.conftest import SEARCH_TOOL, WEATHER_TOOL, make_chat

SEED = b"seed-1"


def assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Rebuild the assistant message from deltas, as a client does."""
    message: dict[str, Any] = {"content": None, "reasoning_content": None, "tool_calls": []}
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            if delta.get(key) is not None:
                message[key] = (message[key] or "") + delta[key]
        for call in delta.get("tool_calls", []):
            calls = message["tool_calls"]
            if call["index"] == len(calls):
                calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return message


def test_user_turn_with_tools_gets_two_parallel_calls() -> None:
    reply = make_reply(make_chat(tools=[WEATHER_TOOL, SEARCH_TOOL]), SEED)
    assert reply.finish_reason == "tool_calls"
    assert reply.content is None
    assert [call.name for call in reply.tool_calls] == ["get_weather", "search"]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in reply.tool_calls)
    assert reply.tool_calls[0].id != reply.tool_calls[1].id
    assert reply.tool_calls[0].arguments == '{"city":"北京 café","days":1,"metric":true}'
    assert reply.tool_calls[1].arguments == '{"query":"北京 café","limit":2.5}'
    message = reply.message()
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": reply.tool_calls[0].arguments,
    }
    assert message["refusal"] is None and message["annotations"] == []


def test_one_call_when_one_tool_or_not_parallel_or_forced() -> None:
    assert len(make_reply(make_chat(tools=[WEATHER_TOOL]), SEED).tool_calls) == 1
    serial = make_chat(tools=[WEATHER_TOOL, SEARCH_TOOL], parallel_tool_calls=False)
    assert [c.name for c in make_reply(serial, SEED).tool_calls] == ["get_weather"]
    forced = make_chat(
        tools=[WEATHER_TOOL, SEARCH_TOOL],
        tool_choice={"type": "function", "function": {"name": "search"}},
    )
    assert [c.name for c in make_reply(forced, SEED).tool_calls] == ["search"]


def test_text_reply_when_no_tools_or_after_tool_results_or_tool_choice_none() -> None:
    after_tool = make_chat(tools=[WEATHER_TOOL])
    after_tool["messages"].append({"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    for request in (
        make_chat(),
        make_chat(tools=[]),
        after_tool,
        make_chat(tools=[WEATHER_TOOL], tool_choice="none"),
    ):
        reply = make_reply(request, SEED)
        assert reply.tool_calls == ()
        assert reply.finish_reason == "stop"
        assert reply.content is not None and reply.content.endswith(".\n")


def test_replies_are_deterministic_per_seed() -> None:
    request = make_chat(tools=[WEATHER_TOOL, SEARCH_TOOL])
    assert make_reply(request, SEED) == make_reply(request, SEED)
    assert (
        make_reply(request, SEED).tool_calls[0].id != make_reply(request, b"other").tool_calls[0].id
    )
    texts = {make_reply(make_chat(), b"seed-%d" % i, reply_tokens=60).content for i in range(5)}
    assert len(texts) > 1


def test_text_reply_size_follows_reply_tokens() -> None:
    for wanted in (5, 40, 300):
        content = make_reply(make_chat(), SEED, reply_tokens=wanted).content
        assert content is not None
        assert wanted <= count_tokens(content) <= wanted + 20


def test_reasoning_is_added_on_request() -> None:
    assert make_reply(make_chat(), SEED).reasoning_content is None
    reply = make_reply(make_chat(), SEED, reasoning=True)
    assert reply.reasoning_content
    assert reply.message()["reasoning_content"] == reply.reasoning_content


def test_sample_arguments_follow_schema_order_and_types() -> None:
    schema = {
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "tags": {"type": "array", "items": {"type": "integer"}},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "maybe": {"type": ["null", "boolean"]},
            "fixed": {"const": "v1"},
        },
    }
    arguments = sample_arguments(schema)
    assert list(arguments) == ["unit", "tags", "where", "maybe", "fixed"]
    assert arguments == {
        "unit": "celsius",
        "tags": [1],
        "where": {"lat": 2.5},
        "maybe": True,
        "fixed": "v1",
    }
    assert sample_arguments(None) == {}


def test_deltas_rebuild_the_text_reply_exactly() -> None:
    reply = make_reply(make_chat(), SEED, reply_tokens=80, reasoning=True)
    deltas = reply_deltas(reply)
    assert deltas[0] == {"role": "assistant", "content": "", "refusal": None}
    assert len([d for d in deltas if "content" in d]) > 5
    rebuilt = assemble(deltas)
    assert rebuilt["content"] == reply.content
    assert rebuilt["reasoning_content"] == reply.reasoning_content


def test_deltas_rebuild_tool_calls_exactly() -> None:
    reply = make_reply(make_chat(tools=[WEATHER_TOOL, SEARCH_TOOL]), SEED)
    deltas = reply_deltas(reply, argument_chars=5)
    assert deltas[0]["content"] is None
    firsts = [d["tool_calls"][0] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
    assert firsts == [
        {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
        for i, c in enumerate(reply.tool_calls)
    ]
    rebuilt = assemble(deltas)["tool_calls"]
    assert [(c["id"], c["name"], c["arguments"]) for c in rebuilt] == [
        (c.id, c.name, c.arguments) for c in reply.tool_calls
    ]
    assert all(json.loads(c["arguments"]) for c in rebuilt)
    assert len(deltas) > 1 + 2 + 4  # role, two call headers, several argument fragments


def test_message_of_a_text_reply_has_no_tool_calls() -> None:
    reply = Reply(content="Hi.\n", reasoning_content=None, tool_calls=(), finish_reason="stop")
    assert reply.message() == {
        "role": "assistant",
        "content": "Hi.\n",
        "refusal": None,
        "annotations": [],
    }
