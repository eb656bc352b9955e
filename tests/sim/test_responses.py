"""The reference upstream's Responses API, driven by the official ``openai`` SDK on a real socket.

The SDK client validates every body and event strictly against its own models
(``_strict_response_validation``), so a field the SDK needs and the emulator
lacks fails the test.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from openai.types.responses import Response

from proxy.sim.items import render_response_segments
from proxy.sim.render import encode_segments, render_tokens
from proxy.sim.state import SIM_STATE
from tests.sim.conftest import (
    EXEC_TOOL,
    SHELL_TOOL,
    WEB_SEARCH_TOOL,
    long_system_prompt,
    make_response_request,
    parse_response_sse,
)

Sdk = Callable[..., Awaitable[tuple[TestServer, openai.AsyncOpenAI]]]


@pytest.fixture
def sdk(make_sim: Callable[..., Awaitable[TestServer]], openai_client: Any) -> Sdk:
    """``server, client = await sdk(cache_mode="vllm")``: a fresh emulator and a strict SDK client."""

    async def make(**config: Any) -> tuple[TestServer, openai.AsyncOpenAI]:
        server = await make_sim(**config)
        return server, openai_client(server, _strict_response_validation=True)

    return make


async def post(server: TestServer, body: Any, **headers: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            server.make_url("/v1/responses"),
            data=body if isinstance(body, bytes) else orjson.dumps(body),
            headers=headers,
        ) as response,
    ):
        return response.status, await response.read()


def dump(response: Response) -> list[dict[str, Any]]:
    """A response's output items as a client re-sends them."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def expected_input_tokens(body: dict[str, Any]) -> int:
    items = (
        body["input"]
        if isinstance(body["input"], list)
        else [{"role": "user", "content": body["input"]}]
    )
    segments = render_response_segments(body.get("instructions"), items, body.get("tools") or [])
    return len(encode_segments(segments))


def cached(response: Response) -> int:
    assert response.usage is not None
    return response.usage.input_tokens_details.cached_tokens


# -- shapes ---------------------------------------------------------------------------------------


async def test_text_response_shape(sdk: Sdk) -> None:
    server, client = await sdk()
    body = make_response_request(instructions="Be brief.", metadata={"k": "v"})
    status, raw = await post(server, {**body, "unknown_field": [1]})
    assert status == 200, raw
    payload = orjson.loads(raw)
    strict = Response.model_validate(payload)
    assert strict.id.startswith("resp_") and payload["object"] == "response"
    assert strict.status == "completed" and strict.model == "gpt-sim"
    assert strict.metadata == {"k": "v"} and strict.instructions == "Be brief."
    (message,) = strict.output
    assert message.type == "message" and message.role == "assistant"
    assert strict.output_text.endswith("\n")
    usage = strict.usage
    assert usage is not None
    assert usage.input_tokens == expected_input_tokens(body)
    assert usage.output_tokens == len(encode_segments([strict.output_text]))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert "openhuman" not in payload

    via_sdk = await client.responses.create(**body)
    assert via_sdk.output_text == strict.output_text  # deterministic per prompt
    assert via_sdk.id != strict.id


async def test_string_input_renders_as_one_user_message(sdk: Sdk) -> None:
    _, client = await sdk()
    plain = await client.responses.create(model="m", input="Hello there.")
    parts = await client.responses.create(
        model="m",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there."}]}],
    )
    assert plain.usage and parts.usage
    assert plain.usage.input_tokens == parts.usage.input_tokens
    assert plain.usage.input_tokens == len(
        render_tokens([{"role": "user", "content": "Hello there."}], None)
    )
    assert plain.output_text == parts.output_text


async def test_stream_events_are_typed_ordered_and_complete(sdk: Sdk) -> None:
    server, client = await sdk()
    body = make_response_request(
        tools=[EXEC_TOOL],
        reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content"],
    )
    stream = await client.responses.create(**body, stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    for kind in (
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert kind in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert len([e for e in events if e.type == "response.function_call_arguments.delta"]) > 1
    final = events[-1].response  # type: ignore[union-attr]
    call = final.output[-1]
    assert call.type == "function_call" and call.arguments == deltas == '{"cmd":"echo kvwarm"}'
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0

    status, raw = await post(server, {**body, "stream": True})
    assert status == 200 and b"[DONE]" not in raw
    assert len(parse_response_sse(raw)) == len(events)


async def test_text_stream_deltas_rebuild_the_text(sdk: Sdk) -> None:
    _, client = await sdk()
    body = make_response_request()
    whole = await client.responses.create(**body)
    stream = await client.responses.create(**body, stream=True)
    events = [event async for event in stream]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 3 and "".join(deltas) == whole.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == whole.output_text


async def test_stream_helper_accumulates_the_final_response(sdk: Sdk) -> None:
    _, client = await sdk()
    body = make_response_request(tools=[EXEC_TOOL])
    async with client.responses.stream(**body) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "exec_command"
    whole = await client.responses.create(**body)
    assert whole.output[0].arguments == call.arguments  # type: ignore[union-attr]


# -- the agent loop -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("tools", "name", "arguments"),
    [
        ([WEB_SEARCH_TOOL, SHELL_TOOL, EXEC_TOOL], "exec_command", '{"cmd":"echo kvwarm"}'),
        ([SHELL_TOOL], "shell", '{"command":["echo","kvwarm"]}'),
    ],
)
async def test_agent_loop_one_call_then_a_final_message(
    sdk: Sdk, stream: bool, tools: list[Any], name: str, arguments: str
) -> None:
    _, client = await sdk()
    history: list[Any] = [{"role": "user", "content": "Check the shell works."}]

    async def turn() -> Response:
        if not stream:
            return await client.responses.create(model="m", input=history, tools=tools, store=False)
        async with client.responses.stream(model="m", input=history, tools=tools, store=False) as s:
            return await s.get_final_response()

    first = await turn()
    (call,) = first.output
    assert call.type == "function_call" and (call.name, call.arguments) == (name, arguments)
    assert call.id and call.id.startswith("fc_") and call.status == "completed"
    history += dump(first)
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "kvwarm\n"})
    second = await turn()
    (message,) = second.output
    assert message.type == "message" and second.output_text.endswith("\n")


# -- cached tokens --------------------------------------------------------------------------------


TOOL_OUTPUT = "file-%03d.txt\n"
"""A tool result long enough (hundreds of tokens) that turn 2 has whole blocks after the call."""


async def agent_turns(
    client: openai.AsyncOpenAI, instructions: str
) -> tuple[dict[str, Any], Response]:
    """Turn 1 of an agent, and the turn-2 body that re-sends it with the tool's (long) output."""
    body = make_response_request(
        instructions=instructions, tools=[EXEC_TOOL, WEB_SEARCH_TOOL], store=False
    )
    first = await client.responses.create(**body)
    (call,) = first.output
    assert call.type == "function_call"
    second = copy.deepcopy(body)
    second["input"] += dump(first)
    output = "".join(TOOL_OUTPUT % index for index in range(100))
    second["input"].append(
        {"type": "function_call_output", "call_id": call.call_id, "output": output}
    )
    return second, first


@pytest.mark.parametrize("cache_mode", ["openai", "vllm"])
async def test_identical_prefix_is_cached_and_drift_is_not(sdk: Sdk, cache_mode: str) -> None:
    _, client = await sdk(cache_mode=cache_mode)
    second, first = await agent_turns(client, long_system_prompt())
    assert first.usage is not None
    prompt1 = first.usage.input_tokens
    block = 128 if cache_mode == "openai" else 16
    verbatim = await client.responses.create(**second)
    # Everything turn 1 sent is cached; in vLLM mode its generated call too.
    assert cached(verbatim) >= (prompt1 - 1) // block * block
    if cache_mode == "vllm":
        assert cached(verbatim) > prompt1
    again = await client.responses.create(**second)
    assert again.usage is not None
    assert cached(again) == (again.usage.input_tokens - 1) // block * block > prompt1 + 200

    reordered = {**second, "tools": list(reversed(second["tools"]))}
    assert cached(await client.responses.create(**reordered)) < 64  # the template's fixed header

    reserialized = copy.deepcopy(second)
    call = next(i for i in reserialized["input"] if i["type"] == "function_call")
    call["arguments"] = '{"cmd": "echo kvwarm"}'
    drifted = cached(await client.responses.create(**reserialized))
    assert drifted <= prompt1 + block < cached(again)


@pytest.mark.parametrize("cache_mode", ["openai", "vllm"])
async def test_ids_changing_between_turns_do_not_cost_cache(sdk: Sdk, cache_mode: str) -> None:
    _, client = await sdk(cache_mode=cache_mode)
    second, first = await agent_turns(client, long_system_prompt())
    await client.responses.create(**second)
    verbatim = await client.responses.create(**second)

    renamed = copy.deepcopy(second)
    for index, item in enumerate(renamed["input"]):
        item["id"] = f"msg_regenerated_{index}"
        item.pop("status", None)
    again = await client.responses.create(**renamed)
    assert again.usage and verbatim.usage and first.usage
    assert again.usage.input_tokens == verbatim.usage.input_tokens
    assert cached(again) == cached(verbatim) > first.usage.input_tokens

    edited = copy.deepcopy(second)
    edited["input"][0]["content"][0]["text"] = "List the files, please!"
    assert cached(await client.responses.create(**edited)) < first.usage.input_tokens


async def test_responses_and_chat_share_one_cache(sdk: Sdk) -> None:
    server, client = await sdk()
    instructions = long_system_prompt()
    response = await client.responses.create(model="m", instructions=instructions, input="Hi.")
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": instructions},
            {"role": "user", "content": "Hi."},
        ],
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.make_url("/v1/chat/completions"), json=chat) as r,
    ):
        usage = (await r.json())["usage"]
    assert response.usage and usage["prompt_tokens"] == response.usage.input_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 1024


# -- previous_response_id, store, retrieval -------------------------------------------------------


async def test_previous_response_id_continues_the_stored_conversation(sdk: Sdk) -> None:
    _, client = await sdk(cache_mode="vllm")
    instructions = long_system_prompt(20)
    body = make_response_request(instructions=instructions, tools=[EXEC_TOOL])
    first = await client.responses.create(**body)
    (call,) = first.output
    assert call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "kvwarm\n"}
    chained = await client.responses.create(
        model="m",
        instructions=instructions,
        tools=[EXEC_TOOL],
        previous_response_id=first.id,
        input=[output],
    )
    assert chained.previous_response_id == first.id
    (message,) = chained.output
    assert message.type == "message"
    resent = {**body, "input": [*body["input"], *dump(first), output]}
    assert chained.usage and first.usage
    assert chained.usage.input_tokens == expected_input_tokens(resent)
    assert cached(chained) > first.usage.input_tokens  # the prompt and the generated call

    retrieved = await client.responses.retrieve(first.id)
    assert retrieved.id == first.id and retrieved.output[0].type == "function_call"


async def test_unknown_or_unstored_previous_response_is_refused(sdk: Sdk) -> None:
    _, client = await sdk()
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="m", input="Hi.", previous_response_id="resp_nope")
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.param == "previous_response_id"

    unstored = await client.responses.create(model="m", input="Hi.", store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="Again.", previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_reset_forgets_stored_responses(sdk: Sdk) -> None:
    server, client = await sdk()
    stored = await client.responses.create(model="m", input="Hi.")
    assert (await client.responses.retrieve(stored.id)).id == stored.id
    async with aiohttp.ClientSession() as session:
        await session.post(server.make_url("/sim/reset"))
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="Hi.", previous_response_id=stored.id)
    assert len(server.app[SIM_STATE].requests) == 1  # the log was cleared too


# -- reasoning ------------------------------------------------------------------------------------


async def test_reasoning_items_with_encrypted_content_when_included(sdk: Sdk) -> None:
    _, client = await sdk(cache_mode="vllm")
    body = make_response_request(
        instructions="Be brief.",
        tools=[EXEC_TOOL],
        store=False,
        reasoning={"effort": "medium", "summary": "auto"},
    )
    included = await client.responses.create(**body, include=["reasoning.encrypted_content"])
    reasoning, call = included.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    assert reasoning.encrypted_content and reasoning.id.startswith("rs_")
    assert reasoning.summary and reasoning.summary[0].text.startswith("**")
    assert included.usage and included.usage.output_tokens_details.reasoning_tokens > 0

    hidden = await client.responses.create(**body)
    assert hidden.output[0].type == "reasoning"
    assert hidden.output[0].encrypted_content is None

    # Echoed with its encrypted content, the reasoning is the generated one: fully reused.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "kvwarm\n"}
    echoed = {**body, "input": [*body["input"], *dump(included), output]}
    full = await client.responses.create(**echoed)
    assert cached(full) > included.usage.input_tokens + included.usage.output_tokens - 16
    # Without it, only the summary is left: the reasoning's KV is lost.
    summary_only = {**echoed, "input": [*body["input"], *dump(hidden), output]}
    assert cached(await client.responses.create(**summary_only)) <= included.usage.input_tokens + 16


async def test_reasoning_header_without_a_reasoning_parameter(sdk: Sdk) -> None:
    _, client = await sdk()
    response = await client.responses.create(
        model="m",
        input="Hi.",
        extra_headers={"x-sim-reasoning": "1"},
        include=["reasoning.encrypted_content"],
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].summary == []


# -- steering, faults, bookkeeping ----------------------------------------------------------------


async def test_faults_and_reply_size(sdk: Sdk) -> None:
    server, client = await sdk()
    with pytest.raises(openai.InternalServerError) as caught:
        await client.responses.create(
            model="m", input="Hi.", extra_headers={"x-sim-fault": "status=503"}
        )
    assert caught.value.status_code == 503

    with pytest.raises(openai.APIError):
        stream = await client.responses.create(
            model="m", input="Hi.", stream=True, extra_headers={"x-sim-fault": "reset_after=3"}
        )
        async for _ in stream:
            pass
    assert len(server.app[SIM_STATE].responses) == 0  # a cut stream stores nothing

    short = await client.responses.create(
        model="m", input="Hi.", extra_headers={"x-sim-reply-tokens": "5"}
    )
    long = await client.responses.create(
        model="m", input="Hi.", extra_headers={"x-sim-reply-tokens": "200"}
    )
    assert short.usage and long.usage and long.usage.output_tokens > 5 * short.usage.output_tokens
    status, raw = await post(
        server, {"model": "m", "input": "Hi."}, **{"x-sim-reply-tokens": "many"}
    )
    assert status == 400 and b"x-sim-reply-tokens" in raw


async def test_delay_and_stall_faults(sdk: Sdk) -> None:
    server, _ = await sdk()
    body = {"model": "m", "input": "Hi.", "stream": True}
    started = time.monotonic()
    status, raw = await post(server, body, **{"x-sim-fault": "delay=0.2"})
    assert status == 200 and time.monotonic() - started >= 0.2
    started = time.monotonic()
    status, raw = await post(
        server, body, **{"x-sim-fault": "stall=0.02", "x-sim-reply-tokens": "5"}
    )
    events = parse_response_sse(raw)
    assert status == 200 and events[-1]["type"] == "response.completed"
    assert time.monotonic() - started >= 0.02 * (len(events) - 1)


async def test_item_references_resolve_to_stored_items(sdk: Sdk) -> None:
    _, client = await sdk(cache_mode="vllm")
    body = make_response_request(tools=[EXEC_TOOL], instructions=long_system_prompt(20))
    first = await client.responses.create(**body)
    (call,) = first.output
    assert call.type == "function_call" and call.id
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "kvwarm\n"}
    by_reference = await client.responses.create(
        **{**body, "input": [*body["input"], {"type": "item_reference", "id": call.id}, output]}
    )
    by_value = await client.responses.create(
        **{**body, "input": [*body["input"], *dump(first), output]}
    )
    assert by_reference.usage and by_value.usage
    assert by_reference.usage.input_tokens == by_value.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(
            model="m", input=[{"type": "item_reference", "id": "fc_unknown"}]
        )


async def test_time_to_first_token_grows_with_uncached_tokens(sdk: Sdk) -> None:
    per_token = 0.0003
    _, client = await sdk(ttft_per_uncached_token=per_token)
    body = make_response_request(instructions=long_system_prompt(200))
    started = time.monotonic()
    first = await client.responses.create(**body)
    cold = time.monotonic() - started
    assert first.usage is not None
    uncached_cost = per_token * first.usage.input_tokens  # about 0.6 s
    assert cold >= uncached_cost * 0.95
    started = time.monotonic()
    second = await client.responses.create(**body)
    warm = time.monotonic() - started
    assert cached(second) > 0.9 * first.usage.input_tokens
    assert warm < cold - uncached_cost / 2


async def test_openhuman_blocks_when_configured(sdk: Sdk) -> None:
    server, _ = await sdk(openhuman=True)
    body = make_response_request()
    status, raw = await post(server, body)
    assert status == 200
    payload = orjson.loads(raw)
    usage = payload["usage"]
    assert payload["openhuman"]["usage"] == {
        "input_tokens": usage["input_tokens"],
        "output_tokens": usage["output_tokens"],
        "cached_input_tokens": 0,
    }
    assert payload["openhuman"]["billing"]["charged_amount_usd"] > 0
    status, raw = await post(server, {**body, "stream": True})
    assert status == 200
    completed = parse_response_sse(raw)[-1]
    assert completed["type"] == "response.completed"
    assert completed["response"]["openhuman"]["usage"]["input_tokens"] == usage["input_tokens"]


async def test_request_log_names_each_endpoint(sdk: Sdk) -> None:
    server, client = await sdk()
    await client.responses.create(model="m", input="Hi.")
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}])
    async with (
        aiohttp.ClientSession() as session,
        session.get(server.make_url("/sim/requests")) as r,
    ):
        entries = await r.json()
    assert [(e["endpoint"], e["path"]) for e in entries] == [
        ("responses", "/v1/responses"),
        ("chat.completions", "/v1/chat/completions"),
    ]
    assert orjson.loads(entries[0]["body"])["input"] == "Hi."


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "model": "m",
                "input": [{"type": "function_call_output", "call_id": "c", "output": "x"}],
            },
            "input",
        ),
        (
            {
                "model": "m",
                "input": "Hi.",
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tools[0].name",
        ),
        ({"model": "m", "input": 3}, "input"),
    ],
)
async def test_refused_requests_are_openai_shaped(sdk: Sdk, body: Any, param: str) -> None:
    server, _ = await sdk()
    status, raw = await post(server, body)
    assert status == 400
    error = orjson.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    status, raw = await post(server, b"{not json")
    assert status == 400 and orjson.loads(raw)["error"]["code"] == "invalid_json"


async def test_big_bodies_render_off_the_loop_identically(sdk: Sdk) -> None:
    _, client = await sdk()
    small = await client.responses.create(model="m", input="Hi.", instructions="x " * 100)
    big_text = "A long tool result line.\n" * 2000
    big = await client.responses.create(model="m", input=big_text, instructions="x " * 100)
    assert small.usage and big.usage
    assert big.usage.input_tokens == expected_input_tokens(
        {"input": big_text, "instructions": "x " * 100}
    )
