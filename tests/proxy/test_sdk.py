"""The official openai SDK through kvwarm gets what it gets from the upstream directly."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from tests.conftest import received

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
     "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


def strip_volatile(dump: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in dump.items() if k not in {"id", "created", "system_fingerprint"}}


async def test_non_streaming_same_as_direct(proxy: TestServer, sim: TestServer, openai_client: Any) -> None:
    direct = await openai_client(sim).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    via = await openai_client(proxy).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert strip_volatile(via.model_dump()) == strip_volatile(direct.model_dump())
    assert via.choices[0].message.content


async def test_tool_calls_same_as_direct(proxy: TestServer, sim: TestServer, openai_client: Any) -> None:
    direct = await openai_client(sim).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS)
    via = await openai_client(proxy).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS)
    calls = via.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert [c.model_dump() for c in calls] == [c.model_dump() for c in direct.choices[0].message.tool_calls]


async def collect(stream: Any) -> tuple[list[dict[str, Any]], str]:
    chunks = [c.model_dump() async for c in stream]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return chunks, text


@pytest.mark.parametrize("include_usage", [False, True])
async def test_streaming_same_as_direct(proxy: TestServer, sim: TestServer, openai_client: Any, include_usage: bool) -> None:
    kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
    direct, direct_text = await collect(await openai_client(sim).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True, **kwargs))
    via, via_text = await collect(await openai_client(proxy).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, stream=True, **kwargs))
    assert via_text == direct_text and via_text.endswith("\n")
    assert [strip_volatile(c) for c in via] == [strip_volatile(c) for c in direct]
    has_usage_chunk = any(c["usage"] for c in via)
    assert has_usage_chunk is include_usage
    # kvwarm asked for usage either way, to measure the cache.
    assert b'"include_usage":true' in received(sim)[-1].body.replace(b" ", b"")


async def test_streaming_tool_calls(proxy: TestServer, sim: TestServer, openai_client: Any) -> None:
    stream = await openai_client(proxy).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS, stream=True)
    args: dict[int, str] = {}
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
    direct = await openai_client(sim).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS)
    assert [args[i] for i in sorted(args)] == [c.function.arguments for c in direct.choices[0].message.tool_calls]


async def test_errors_raise_the_same_sdk_exceptions(proxy: TestServer, sim: TestServer, openai_client: Any) -> None:
    for client in (openai_client(sim), openai_client(proxy)):
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(
                model="gpt-4o-mini", messages=MESSAGES, extra_headers={"x-sim-fault": "status=429,retry_after=1"}
            )
        assert info.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, extra_headers={"x-sim-fault": "status=500"})


async def test_stream_reset_mid_way_surfaces_as_the_same_error(proxy: TestServer, sim: TestServer, openai_client: Any) -> None:
    raised = []
    for client in (openai_client(sim), openai_client(proxy)):
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, stream=True, extra_headers={"x-sim-fault": "reset_after=2"}
        )
        got = 0
        with pytest.raises(Exception) as info:
            async for _ in stream:
                got += 1
        raised.append((type(info.value), got))
    assert raised[0] == raised[1]
    assert raised[1][1] >= 1
