"""Real client loops with the official openai SDK, as agents write them, with tools, streaming and not.

Three loop styles, each compared turn by turn with a loop that keeps the
provider's exact JSON (the never-drifting reference) talking to an identical
upstream directly:

- ``model_dump``: appends ``choices[0].message.model_dump()`` (refusal/annotations/audio/... = None);
- ``object``: appends the ``ChatCompletionMessage`` object itself (the SDK serializes it);
- ``json_dumps``: rebuilds the assistant message with arguments re-serialized by ``json.dumps``.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.render import render_tokens
from tests.agents import SYSTEM, TOOLS, USER_TURNS
from tests.conftest import ProxyFactory, received

TURNS = 5


async def sdk_loop(client: openai.AsyncOpenAI, style: str, stream: bool) -> list[int]:
    """Run an agent loop; returns the cached_tokens of each turn."""
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
    cached: list[int] = []
    for turn in range(TURNS):
        if stream:
            message, usage = await streamed(client, messages)
        else:
            completion = await client.chat.completions.create(model="kvwarm-sim", messages=messages, tools=TOOLS)
            message, usage = completion.choices[0].message, completion.usage
        assert usage is not None
        cached.append(usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0)
        if style == "model_dump":
            messages.append(message.model_dump())
        elif style == "object":
            messages.append(message)
        elif style == "json_dumps":
            entry: dict[str, Any] = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": json.dumps(json.loads(c.function.arguments))}}
                    for c in message.tool_calls
                ]
            messages.append(entry)
        else:  # reference: the provider's exact JSON, nothing dropped or added
            messages.append(message.model_dump(exclude_none=True) | {"content": message.content})
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": f"{c.function.name}: done\n"} for c in message.tool_calls]
        else:
            messages.append({"role": "user", "content": USER_TURNS[(turn + 1) % len(USER_TURNS)]})
    return cached


async def streamed(client: openai.AsyncOpenAI, messages: list[Any]) -> tuple[Any, Any]:
    """Accumulate a streamed reply the way agent loops do."""
    from openai.types.chat import ChatCompletionMessage

    stream = await client.chat.completions.create(
        model="kvwarm-sim", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = d.id or call["id"]
                if d.function:
                    call["function"]["name"] += d.function.name or ""
                    call["function"]["arguments"] += d.function.arguments or ""
    message = ChatCompletionMessage(
        role="assistant", content="".join(content) or None, tool_calls=[calls[i] for i in sorted(calls)] or None
    )
    return message, usage


def prompts(sim: TestServer) -> list[list[int]]:
    return [render_tokens(b["messages"], b.get("tools")) for b in (orjson.loads(r.body) for r in received(sim))]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("style", ["model_dump", "object", "json_dumps"])
async def test_sdk_loop_gets_the_cache_of_a_client_that_never_drifts(
    make_sim: Any, make_proxy: ProxyFactory, openai_client: Any, style: str, stream: bool
) -> None:
    ref_sim, kv_sim = await make_sim(cache_mode="vllm"), await make_sim(cache_mode="vllm")
    proxy = await make_proxy(kv_sim)
    reference = await sdk_loop(openai_client(ref_sim), "reference", stream)
    through = await sdk_loop(openai_client(proxy), style, stream)
    assert prompts(kv_sim) == prompts(ref_sim)
    assert through == reference
    assert sum(reference) > 0
