"""Cache markers render nothing, and blocks end where the prompt's tokens say (proxy/sim/layout.py)."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from proxy.sim.items import render_response_segments
from proxy.sim.layout import layout
from proxy.sim.render import encode_with_starts, render_segments, render_tokens
from proxy.sim.state import CACHE_MODES
from tests.sim.conftest import WEATHER_TOOL, ClientFactory, long_system_prompt

BREAKPOINT = {"mode": "explicit", "ttl": "12h"}
CONTROL = {"type": "ephemeral", "ttl": "1h"}
MARKERS = {"prompt_cache_breakpoint": BREAKPOINT, "cache_control": CONTROL}


def marked_chat() -> dict[str, Any]:
    """A chat request with both dialects' markers everywhere one may sit."""
    return {
        "model": "gpt-sim",
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief.", **MARKERS}], **MARKERS},
            {"role": "user", "content": [{"type": "text", "text": "Weather?", **MARKERS}, {"type": "image_url", "image_url": {"url": "x"}, **MARKERS}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Checking.", "cache_control": CONTROL}],
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}, **MARKERS}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "Sunny.", **MARKERS}], **MARKERS},
        ],
        "tools": [{**WEATHER_TOOL, **MARKERS}],
        "prompt_cache_options": {"mode": "explicit"},
        "cache_control": CONTROL,
    }


def unmarked(value: Any) -> Any:
    """``value`` without any cache marker or option, at any depth."""
    if isinstance(value, dict):
        dropped = {*MARKERS, "prompt_cache_options"}
        return {key: unmarked(item) for key, item in value.items() if key not in dropped}
    if isinstance(value, list):
        return [unmarked(item) for item in value]
    return value


def test_chat_markers_render_nothing() -> None:
    body = marked_chat()
    plain = unmarked(body)
    assert render_segments(body["messages"], body["tools"]) == render_segments(plain["messages"], plain["tools"])
    assert "cache_control" not in orjson.dumps(render_segments(body["messages"], body["tools"])).decode()


def test_responses_markers_render_nothing() -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief.", **MARKERS}], **MARKERS},
        {"role": "user", "content": [{"type": "input_text", "text": "List.", **MARKERS}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "a", **MARKERS}], **MARKERS},
        {"type": "custom_item", "data": 1, **MARKERS},
    ]
    tools = [{"type": "function", "name": "ls", "parameters": {}, **MARKERS}]
    assert render_response_segments("Hi.", items, tools) == render_response_segments(
        "Hi.", unmarked(items), unmarked(tools)
    )


@pytest.mark.parametrize("mode", CACHE_MODES)
async def test_marked_and_unmarked_requests_have_the_same_prompt_tokens(
    sim_client: ClientFactory, mode: str
) -> None:
    client = await sim_client(cache_mode=mode)
    body = marked_chat()
    # Valid in every mode: no breakpoint on assistant content or a tool; four cache_control
    # blocks (the tool, the system message, the first user part, and the top-level one's).
    assistant, tool_message = body["messages"][2], body["messages"][3]
    assistant["content"][0].pop("cache_control")
    assistant["tool_calls"][0] = unmarked(assistant["tool_calls"][0])
    body["messages"][1]["content"][1].pop("cache_control")
    tool_message.pop("cache_control")
    tool_message["content"][0].pop("cache_control")
    body["tools"][0].pop("prompt_cache_breakpoint")
    counts = []
    for request in (body, unmarked(copy.deepcopy(body))):
        response = await client.post("/v1/chat/completions", data=orjson.dumps(request))
        assert response.status == 200, await response.text()
        counts.append((await response.json())["usage"]["prompt_tokens"])
    assert counts[0] == counts[1] == len(render_tokens(body["messages"], body["tools"]))


def blocks_of(messages: list[Any], tools: list[Any] | None = None) -> Any:
    segments = render_segments(messages, tools)
    tokens, starts = encode_with_starts(segments)
    return layout(messages, tools, segments, tokens, starts), tokens


def test_blocks_are_tools_parts_and_calls_and_a_message_ends_after_its_end_token() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Part one.\n\n"}, {"type": "text", "text": "Part two."}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}] * 2},
    ]
    laid, _ = blocks_of(messages, [WEATHER_TOOL])
    assert [(b.role, b.closes) for b in laid.blocks] == [
        ("tools", True),
        ("system", True),
        ("user", False),
        ("user", True),
        ("assistant", False),
        ("assistant", True),
    ]
    for index, count in ((0, 0), (1, 1), (3, 2), (5, 3)):
        assert laid.offset(index) == len(render_tokens(messages[:count], [WEATHER_TOOL], add_generation_prompt=False))
    assert laid.message_ends() == [laid.offset(i) for i in (0, 1, 3, 5)]


def test_a_block_inside_a_message_ends_at_the_last_token_boundary_within_it() -> None:
    clean = [{"role": "user", "content": [{"type": "text", "text": "Part one.\n\n"}, {"type": "text", "text": "Part two."}]}]
    laid, tokens = blocks_of(clean)
    alone = render_tokens([{"role": "user", "content": "Part one.\n\n"}], None, add_generation_prompt=False)
    assert laid.offset(0) == len(alone) - 2  # the part's own tokens, before <|im_end|>\n
    assert tokens[: laid.offset(0)] == alone[:-2]

    # "wait" + "ing" tokenize as one word: the boundary between the parts falls inside a token.
    merged = [{"role": "user", "content": [{"type": "text", "text": long_system_prompt(1) + "wait"}, {"type": "text", "text": "ing"}]}]
    laid, tokens = blocks_of(merged)
    alone = render_tokens([{"role": "user", "content": long_system_prompt(1) + "wait"}], None, add_generation_prompt=False)
    assert laid.offset(0) == len(alone) - 3  # before "wait": its last token boundary agreeing with the prompt
    assert tokens[: laid.offset(0)] == alone[:-3]
