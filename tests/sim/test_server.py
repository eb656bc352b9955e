"""The reference upstream over HTTP: shapes, cache accounting, vLLM reply reuse, faults, billing."""

from __future__ import annotations

import asyncio
import base64
import copy
import gzip
import itertools
import json
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient

from proxy.sim.render import get_encoding, render_tokens
from proxy.sim.server import SIM_STATE, Faults, SimConfig, create_sim_app, running_sim
from tests.sim.conftest import (
    SEARCH_TOOL,
    WEATHER_TOOL,
    ClientFactory,
    long_system_prompt,
    make_chat,
    parse_sse,
)

Client = TestClient[Any, Any]
CHAT = "/v1/chat/completions"


async def post_json(client: Client, body: Any, **headers: str) -> dict[str, Any]:
    response = await client.post(CHAT, data=orjson.dumps(body), headers=headers)
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"
    payload: dict[str, Any] = await response.json()
    return payload


async def post_stream(client: Client, body: Any, **headers: str) -> list[Any]:
    response = await client.post(CHAT, data=orjson.dumps({**body, "stream": True}), headers=headers)
    assert response.status == 200, await response.text()
    assert response.content_type == "text/event-stream"
    return parse_sse(await response.read())


def cached(payload: dict[str, Any]) -> int:
    value: int = payload["usage"]["prompt_tokens_details"]["cached_tokens"]
    return value


# -- shapes ---------------------------------------------------------------------------------------


async def test_models(sim_client: ClientFactory) -> None:
    client = await sim_client()
    response = await client.get("/v1/models")
    payload = await response.json()
    assert payload["object"] == "list"
    assert [model["object"] for model in payload["data"]] == ["model"]


async def test_non_streaming_text_reply_shape(sim_client: ClientFactory) -> None:
    client = await sim_client()
    body = make_chat(system="Be brief.")
    payload = await post_json(client, body)
    assert payload["object"] == "chat.completion"
    assert payload["id"].startswith("chatcmpl-")
    assert payload["model"] == "gpt-sim"
    (choice,) = payload["choices"]
    assert choice["finish_reason"] == "stop"
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"].endswith("\n")
    assert message["refusal"] is None and message["annotations"] == []
    usage = payload["usage"]
    assert usage["prompt_tokens"] == len(render_tokens(body["messages"], None))
    assert usage["completion_tokens"] == len(get_encoding().encode_ordinary(message["content"]))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
    assert "openhuman" not in payload


async def test_non_streaming_tool_calls_shape(sim_client: ClientFactory) -> None:
    client = await sim_client()
    body = make_chat(tools=[WEATHER_TOOL, SEARCH_TOOL])
    payload = await post_json(client, body)
    (choice,) = payload["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert calls[0]["function"]["arguments"] == '{"city":"北京 café","days":1,"metric":true}'
    assert payload["usage"]["prompt_tokens"] == len(render_tokens(body["messages"], body["tools"]))

    serial = await post_json(client, {**body, "parallel_tool_calls": False})
    assert len(serial["choices"][0]["message"]["tool_calls"]) == 1


async def test_streaming_text_reply_shape(sim_client: ClientFactory) -> None:
    client = await sim_client()
    body = make_chat()
    whole = await post_json(client, body)
    events = await post_stream(client, body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content_deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(content_deltas) >= 3
    assert "".join(content_deltas) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }


async def test_streaming_usage_chunk_only_when_asked(sim_client: ClientFactory) -> None:
    client = await sim_client()
    body = make_chat(stream_options={"include_usage": True})
    events = await post_stream(client, body)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens"] == len(render_tokens(body["messages"], None))
    assert all(c["usage"] is None for c in events[:-2])  # as OpenAI sends it
    assert events[-3]["choices"][0]["finish_reason"] == "stop"

    plain = await post_stream(client, {**body, "stream_options": {"include_usage": False}})
    assert all(c == "[DONE]" or c["choices"] for c in plain)


async def test_streaming_tool_calls(sim_client: ClientFactory) -> None:
    client = await sim_client()
    events = await post_stream(client, make_chat(tools=[WEATHER_TOOL, SEARCH_TOOL]))
    deltas = [c["choices"][0]["delta"] for c in events[:-1] if c["choices"]]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    headers = [d["tool_calls"][0] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
    assert [(h["index"], h["type"], h["function"]["arguments"]) for h in headers] == [
        (0, "function", ""),
        (1, "function", ""),
    ]
    arguments = ["", ""]
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            arguments[call["index"]] += call["function"]["arguments"]
    assert arguments == [
        '{"city":"北京 café","days":1,"metric":true}',
        '{"query":"北京 café","limit":2.5}',
    ]


async def test_reasoning_and_reply_size_headers(sim_client: ClientFactory) -> None:
    client = await sim_client()
    payload = await post_json(
        client, make_chat(), **{"x-sim-reasoning": "1", "x-sim-reply-tokens": "200"}
    )
    message = payload["choices"][0]["message"]
    assert message["reasoning_content"]
    details = payload["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == len(
        get_encoding().encode_ordinary(message["reasoning_content"])
    )
    assert 200 <= len(get_encoding().encode_ordinary(message["content"])) <= 220


async def test_large_prompt_is_tokenized_off_the_loop_with_the_same_result(
    sim_client: ClientFactory,
) -> None:
    client = await sim_client()
    body = make_chat(system=long_system_prompt(600))  # about 33 kB of JSON
    assert len(orjson.dumps(body)) > 20_000
    payload = await post_json(client, body)
    assert payload["usage"]["prompt_tokens"] == len(render_tokens(body["messages"], None))


# -- prefix cache ---------------------------------------------------------------------------------


async def test_openai_mode_identical_request_is_cached_and_drift_costs(
    sim_client: ClientFactory,
) -> None:
    client = await sim_client()
    long_user = "Please review this. " + "Every line matters here. " * 60
    body = make_chat(long_user, system=long_system_prompt(), tools=[WEATHER_TOOL, SEARCH_TOOL])
    first = await post_json(client, body)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 2000
    assert cached(first) == 0

    second = await post_json(client, body)
    assert cached(second) == (prompt_tokens - 1) // 128 * 128
    assert cached(second) % 128 == 0 and cached(second) >= 1024

    drifted_user = copy.deepcopy(body)
    drifted_user["messages"][-1]["content"] = "Kindly" + long_user[len("Please") :]
    third = await post_json(client, drifted_user)
    assert 1024 <= cached(third) <= cached(second) - 256

    reordered_tools = {**body, "tools": [SEARCH_TOOL, WEATHER_TOOL]}
    assert cached(await post_json(client, reordered_tools)) == 0


async def test_openai_mode_short_prompt_never_cached(sim_client: ClientFactory) -> None:
    client = await sim_client()
    body = make_chat(system="Short.")
    await post_json(client, body)
    assert cached(await post_json(client, body)) == 0


async def test_streamed_usage_reports_cache_hits(sim_client: ClientFactory) -> None:
    client = await sim_client()
    body = make_chat(system=long_system_prompt(), stream_options={"include_usage": True})
    await post_stream(client, body)
    events = await post_stream(client, body)
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024


async def _vllm_turns(client: Client, history_edit: Any) -> tuple[int, int, int]:
    """Turn 1, then turn 2 with the reply echoed through ``history_edit``.

    Returns turn 2's cached tokens, the token count of turn 1's prompt plus the
    exact reply, and the index of the first token where the echoed history
    differs from the exact one.
    """
    for padding in range(64):
        # Pad the question until the exact history ends on a 16-token boundary,
        # so a change in its last tokens is visible in whole blocks.
        await client.post("/sim/reset")
        body = make_chat("What is the weather in Paris?" + " Thanks." * padding, system="Be brief.")
        first = await post_json(client, body)
        reply = first["choices"][0]["message"]
        exact = [*body["messages"], reply]
        exact_tokens = render_tokens(exact, None, add_generation_prompt=False)
        if len(exact_tokens) % 16 > 2:
            continue
        echoed = [*body["messages"], history_edit(copy.deepcopy(reply))]
        echoed_tokens = render_tokens(echoed, None, add_generation_prompt=False)
        second = await post_json(
            client, {**body, "messages": [*echoed, {"role": "user", "content": "And tomorrow?"}]}
        )
        diverge = next(
            (
                i
                for i, (a, b) in enumerate(zip(exact_tokens, echoed_tokens, strict=False))
                if a != b
            ),
            min(len(exact_tokens), len(echoed_tokens)),
        )
        return cached(second), len(exact_tokens), diverge
    raise AssertionError("no padding put the history on a block boundary")


async def test_vllm_echoed_reply_is_cached_and_stripped_newline_is_not(
    sim_client: ClientFactory,
) -> None:
    client = await sim_client(cache_mode="vllm")

    def keep(message: dict[str, Any]) -> dict[str, Any]:
        # Drop the null / empty fields: they render nothing, so this is still an exact echo.
        return {"role": "assistant", "content": message["content"]}

    def strip(message: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": message["content"].rstrip("\n")}

    exact_cached, history_len, _ = await _vllm_turns(client, keep)
    assert exact_cached == history_len // 16 * 16
    stripped_cached, history_len2, diverge = await _vllm_turns(client, strip)
    assert history_len2 == history_len
    assert stripped_cached == diverge // 16 * 16
    assert stripped_cached < exact_cached


async def test_vllm_reserialized_arguments_lose_the_reply(sim_client: ClientFactory) -> None:
    client = await sim_client(cache_mode="vllm")
    body = make_chat(system="Be brief.", tools=[WEATHER_TOOL, SEARCH_TOOL])
    first = await post_json(client, body)
    reply = first["choices"][0]["message"]
    results = [
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
        for call in reply["tool_calls"]
    ]

    async def second_turn(echo: dict[str, Any]) -> int:
        payload = await post_json(client, {**body, "messages": [*body["messages"], echo, *results]})
        return cached(payload)

    exact = await second_turn(reply)
    reserialized = copy.deepcopy(reply)
    for call in reserialized["tool_calls"]:
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]))
    drifted = await second_turn(reserialized)
    prompt_len = first["usage"]["prompt_tokens"]
    assert exact >= (prompt_len + first["usage"]["completion_tokens"]) // 16 * 16
    assert drifted < exact - 16
    assert drifted >= (prompt_len - 1) // 16 * 16  # the prompt itself is still cached


async def test_ttft_grows_with_uncached_tokens(sim_client: ClientFactory) -> None:
    client = await sim_client(ttft_per_uncached_token=0.0004)
    body = make_chat(system=long_system_prompt())
    started = time.perf_counter()
    first = await post_json(client, body)
    cold = time.perf_counter() - started
    uncached = first["usage"]["prompt_tokens"]
    assert cold >= 0.0004 * uncached >= 0.5
    started = time.perf_counter()
    second = await post_json(client, body)
    warm = time.perf_counter() - started
    assert cached(second) > 0
    assert warm < cold - 0.3


async def test_sim_requests_log_and_reset(sim_client: ClientFactory) -> None:
    client = await sim_client()
    body = make_chat(system=long_system_prompt())
    raw = orjson.dumps(body)
    await client.post(CHAT, data=raw, headers={"Authorization": "Bearer sk-1", "X-Custom": "v"})
    await client.post(CHAT, data=b"\xff\xfe not json")
    log = await (await client.get("/sim/requests")).json()
    assert [entry["path"] for entry in log] == [CHAT, CHAT]
    assert log[0]["body"] == raw.decode() and log[0]["body_encoding"] == "utf-8"
    assert log[0]["headers"]["authorization"] == "Bearer sk-1"
    assert log[0]["headers"]["x-custom"] == "v"
    assert base64.b64decode(log[1]["body"]) == b"\xff\xfe not json"
    assert log[1]["body_encoding"] == "base64"
    state = client.server.app[SIM_STATE]
    assert state.requests[0].body == raw and state.requests[-1].method == "POST"

    assert cached(await post_json(client, body)) > 0
    response = await client.post("/sim/reset")
    assert response.status == 200
    assert await (await client.get("/sim/requests")).json() == []
    assert len(state.cache) == 0
    assert cached(await post_json(client, body)) == 0


# -- faults ---------------------------------------------------------------------------------------


async def test_fault_status_with_retry_after(sim_client: ClientFactory) -> None:
    client = await sim_client()
    response = await client.post(
        CHAT, json=make_chat(), headers={"x-sim-fault": "status=503,retry_after=2"}
    )
    assert response.status == 503
    assert response.headers["Retry-After"] == "2"
    error = (await response.json())["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["type"] == "server_error"

    limited = await client.post(CHAT, json=make_chat(), headers={"x-sim-fault": "status=429"})
    assert limited.status == 429
    assert "Retry-After" not in limited.headers
    assert (await limited.json())["error"]["code"] == "rate_limit_exceeded"


async def test_fault_delay_before_headers(sim_client: ClientFactory) -> None:
    client = await sim_client()
    started = time.perf_counter()
    response = await client.post(
        CHAT, json=make_chat(stream=True), headers={"x-sim-fault": "delay=0.3"}
    )
    assert time.perf_counter() - started >= 0.3
    assert response.status == 200
    assert parse_sse(await response.read())[-1] == "[DONE]"


async def test_fault_reset_mid_stream(sim_client: ClientFactory) -> None:
    client = await sim_client()
    response = await client.post(
        CHAT, json=make_chat(stream=True), headers={"x-sim-fault": "reset_after=3"}
    )
    assert response.status == 200
    lines: list[bytes] = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async for line in response.content:
            lines.append(line)
    data = [line for line in lines if line.startswith(b"data: ")]
    assert len(data) == 3
    assert b"[DONE]" not in b"".join(lines)


async def test_fault_reset_non_streaming(sim_client: ClientFactory) -> None:
    client = await sim_client()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post(CHAT, json=make_chat(), headers={"x-sim-fault": "reset_after=0"})
    assert (await client.get("/v1/models")).status == 200  # the server lives on


async def test_fault_stall_between_chunks(sim_client: ClientFactory) -> None:
    client = await sim_client()
    response = await client.post(
        CHAT,
        json=make_chat(stream=True),
        headers={"x-sim-fault": "stall=0.05", "x-sim-reply-tokens": "5"},
    )
    arrivals: list[float] = []
    async for line in response.content:
        if line.startswith(b"data: "):
            arrivals.append(time.perf_counter())
    assert len(arrivals) >= 4
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) >= 0.04


async def test_gzip_compressed_json(sim_client: ClientFactory) -> None:
    client = await sim_client(client_kwargs={"auto_decompress": False})
    response = await client.post(CHAT, json=make_chat(), headers={"x-sim-compress": "gzip"})
    assert response.headers["Content-Encoding"] == "gzip"
    payload = orjson.loads(gzip.decompress(await response.read()))
    assert payload["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"messages": [', "invalid_json"),
        (b'{"messages": [{"role": "user", "content": NaN}]}', "invalid_json"),
        (b'{"model": "m"}', "invalid_request"),
        (b'{"messages": [{"content": "no role"}]}', "invalid_request"),
        (b"[1, 2]", "invalid_request"),
    ],
)
async def test_invalid_requests_get_openai_style_400(
    sim_client: ClientFactory, body: bytes, code: str
) -> None:
    client = await sim_client()
    response = await client.post(CHAT, data=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code


@pytest.mark.parametrize(
    "header",
    [
        {"x-sim-fault": "status=abc"},
        {"x-sim-fault": "status=200"},
        {"x-sim-fault": "explode=1"},
        {"x-sim-fault": "delay"},
        {"x-sim-reply-tokens": "many"},
    ],
)
async def test_invalid_sim_headers_get_400(
    sim_client: ClientFactory, header: dict[str, str]
) -> None:
    client = await sim_client()
    response = await client.post(CHAT, json=make_chat(), headers=header)
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "invalid_sim_header"


def test_fault_header_parsing() -> None:
    assert Faults.parse(None) == Faults()
    assert Faults.parse(
        " status=503 , retry_after=2,delay=1.5, reset_after=4,stall=0.5,"
    ) == Faults(status=503, retry_after="2", delay=1.5, reset_after=4, stall=0.5)


# -- openhuman billing ----------------------------------------------------------------------------


async def test_openhuman_blocks_and_billing(sim_client: ClientFactory) -> None:
    client = await sim_client(
        openhuman=True, price_input=3.0, price_cached_input=0.3, price_output=15.0
    )
    body = make_chat(system=long_system_prompt())
    await post_json(client, body)
    payload = await post_json(client, body)
    usage = payload["usage"]
    prompt, hit, output = usage["prompt_tokens"], cached(payload), usage["completion_tokens"]
    assert hit > 0
    block = payload["openhuman"]
    assert block["usage"] == {
        "input_tokens": prompt,
        "output_tokens": output,
        "cached_input_tokens": hit,
    }
    expected = ((prompt - hit) * 3.0 + hit * 0.3 + output * 15.0) / 1_000_000
    assert block["billing"]["charged_amount_usd"] == pytest.approx(expected, rel=1e-12)

    events = await post_stream(client, {**body, "stream_options": {"include_usage": True}})
    assert events[-2]["openhuman"] == block
    assert all("openhuman" not in c for c in events[:-2])


async def test_openhuman_is_off_by_default_in_streams(sim_client: ClientFactory) -> None:
    client = await sim_client()
    events = await post_stream(client, make_chat(stream_options={"include_usage": True}))
    assert "openhuman" not in events[-2]


# -- configuration and serving --------------------------------------------------------------------


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="cache_mode"):
        SimConfig(cache_mode="gemini")
    with pytest.raises(ValueError, match="chunk_delay"):
        SimConfig(chunk_delay=-1)
    assert create_sim_app(SimConfig(cache_mode="vllm"))[SIM_STATE].cache.block_size == 16
    assert create_sim_app()[SIM_STATE].cache.min_tokens == 1024


async def test_running_sim_serves_on_a_real_port() -> None:
    async with running_sim(SimConfig()) as base_url, aiohttp.ClientSession() as session:
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        async with session.get(base_url + "/models") as response:
            assert response.status == 200


async def test_chunk_delay_spaces_the_stream(sim_client: ClientFactory) -> None:
    client = await sim_client(chunk_delay=0.03)
    started = time.perf_counter()
    events = await post_stream(client, make_chat(), **{"x-sim-reply-tokens": "5"})
    assert time.perf_counter() - started >= 0.03 * (len(events) - 1) * 0.9


async def test_concurrent_requests_are_served(sim_client: ClientFactory) -> None:
    client = await sim_client(ttft_base=0.2)
    started = time.perf_counter()
    payloads = await asyncio.gather(*(post_json(client, make_chat(f"q{i}")) for i in range(5)))
    assert [p["object"] for p in payloads] == ["chat.completion"] * 5
    assert time.perf_counter() - started < 0.9  # the TTFT sleeps overlap
