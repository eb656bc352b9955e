"""The official ``openai`` SDK's ``client.responses.create`` through kvwarm: warm caches, exact relay, usage.

The loops are written the way agents write them, with tools and reasoning kept client-side
(``store: false``, ``include: ["reasoning.encrypted_content"]``), their history kept three
ways: the SDK's output objects themselves, ``model_dump()`` dicts (``status: None``,
``content: None`` on reasoning...) and ``model_dump(exclude_none=True)`` dicts. Each is compared,
request by request, with a loop that keeps the provider's exact JSON talking to an identical
upstream directly.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.sim.steering import REPLY_TOKENS_HEADER
from tests.conftest import ProxyFactory, received
from tests.responses.agents import INSTRUCTIONS, TOOLS, USER_TURNS, render_request
from tests.responses.conftest import Recorder

REQUESTS = 6
MODEL = "kvwarm-sim"
STYLES = ("object", "model_dump", "exclude_none")


@dataclass
class Step:
    prompt: int
    cached: int
    headers: dict[str, str]
    carried: int
    """Elements of the request kvwarm can have stored: the instructions and every item an earlier
    request or response carried (a reasoning item rides with the item after it)."""

    def prefix(self) -> dict[str, str]:
        return dict(p.split("=", 1) for p in self.headers.get("x-kvwarm-prefix", "").split("; ") if "=" in p)


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


def kept(output: list[Any], raw_output: list[dict[str, Any]], style: str) -> list[Any]:
    """The response's output items as the loop keeps them in its history."""
    if style == "object":
        return list(output)
    if style == "model_dump":
        return [o.model_dump() for o in output]
    if style == "exclude_none":
        return [o.model_dump(exclude_none=True) for o in output]
    return copy.deepcopy(raw_output)  # the reference: the provider's JSON, untouched


async def create(client: openai.AsyncOpenAI, items: list[Any], *, stream: bool) -> tuple[Any, list[dict[str, Any]], dict[str, str]]:
    """One turn: (the response object, its output as the provider's JSON, the response headers)."""
    params: dict[str, Any] = {
        "model": MODEL, "instructions": INSTRUCTIONS, "input": items, "tools": TOOLS, "store": False,
        "reasoning": {"effort": "low", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
    }
    if not stream:
        raw = await client.responses.with_raw_response.create(**params)
        return raw.parse(), orjson.loads(raw.content)["output"], dict(raw.headers)
    events = await client.responses.create(**params, stream=True)
    final = None
    async for event in events:
        if event.type == "response.completed":
            final = event.response
    assert final is not None
    return final, [o.model_dump(exclude_none=True) for o in final.output], dict(events.response.headers)


async def sdk_loop(client: openai.AsyncOpenAI, style: str, *, stream: bool, requests: int = REQUESTS) -> list[Step]:
    items: list[Any] = [{"role": "user", "content": USER_TURNS[0]}]
    steps: list[Step] = []
    carried = 0
    for _ in range(requests):
        response, raw_output, headers = await create(client, items, stream=stream)
        usage = response.usage
        assert usage is not None
        steps.append(Step(usage.input_tokens, usage.input_tokens_details.cached_tokens, headers, carried))
        items += kept(response.output, raw_output, style)
        carried = 1 + sum(1 for item in items if _get(item, "type") != "reasoning")
        calls = [o for o in response.output if o.type == "function_call"]
        for call in calls:
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": f"{call.name}: done\n"})
        if not calls:
            users = sum(1 for item in items if _get(item, "role") == "user")
            items.append({"role": "user", "content": USER_TURNS[users % len(USER_TURNS)]})
    return steps


def prompts(sim: TestServer) -> list[list[int]]:
    return [render_request(orjson.loads(r.body)) for r in received(sim)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("style", STYLES)
async def test_sdk_loop_gets_the_cache_of_a_client_that_never_drifts(
    make_sim: Any, make_proxy: ProxyFactory, openai_client: Any, style: str, stream: bool
) -> None:
    ref_sim, kv_sim = await make_sim(cache_mode="vllm"), await make_sim(cache_mode="vllm")
    proxy = await make_proxy(kv_sim)
    reference = await sdk_loop(openai_client(ref_sim), "reference", stream=False)
    through = await sdk_loop(openai_client(proxy), style, stream=stream)

    assert prompts(kv_sim) == prompts(ref_sim)
    assert [s.cached for s in through] == [s.cached for s in reference]
    assert sum(s.cached for s in reference) > 0
    for step in through[1:]:
        fields = step.prefix()
        assert "break" not in fields, fields
        assert fields["matched"].startswith(f"{step.carried}/"), (step.carried, fields)
    if style == "model_dump":
        # model_dump() adds nulls the provider never sent (status, reasoning content): kvwarm saw
        # through them, and the upstream's template renders none of them.
        assert any(b"\"status\":null" in r.body for r in received(kv_sim))


async def metrics_text(server: TestServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as s, s.get(server.make_url("/metrics")) as r:
        assert r.status == 200
        text = await r.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_sum_the_responses_usage_previous_response_id_included(
    sim: TestServer, make_proxy: ProxyFactory, openai_client: Any
) -> None:
    proxy = await make_proxy(sim)
    client = openai_client(proxy)
    steps = await sdk_loop(client, "exclude_none", stream=False, requests=2)
    steps += await sdk_loop(client, "object", stream=True, requests=2)

    # A chained request: the provider holds the prefix, kvwarm forwards it as sent and meters it.
    first = await client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input="Say hi.", store=True)
    chained = await client.responses.with_raw_response.create(
        model=MODEL, instructions=INSTRUCTIONS, previous_response_id=first.id, input="And again."
    )
    forwarded = received(sim)[-1]
    assert orjson.loads(forwarded.body)["previous_response_id"] == first.id
    assert forwarded.body == chained.http_request.content  # the client's bytes, unchanged
    assert "x-kvwarm-prefix" not in chained.headers
    second = chained.parse()
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0

    usages = [(s.prompt, s.cached) for s in steps] + [
        (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) for r in (first, second) if r.usage
    ]
    assert len(usages) == 6
    metrics = await metrics_text(proxy)
    model = (("model", MODEL),)
    assert metrics[("kvwarm_prompt_tokens_total", model)] == sum(p for p, _ in usages)
    assert metrics[("kvwarm_cached_prompt_tokens_total", model)] == sum(c for _, c in usages)
    assert sum(v for (name, _), v in metrics.items() if name == "kvwarm_requests_total") == 6


async def post_raw(server: TestServer, body: dict[str, Any], **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(
        server.make_url("/v1/responses"), data=orjson.dumps(body),
        headers={"Authorization": "Bearer sk-alice", "Content-Type": "application/json", **headers},
    ) as r:
        return r.status, dict(r.headers), await r.read()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_responses_are_relayed_byte_for_byte(
    sim: TestServer, make_proxy: ProxyFactory, recording: Recorder, stream: bool
) -> None:
    hop = await recording(sim)
    proxy = await make_proxy(hop.server)
    body: dict[str, Any] = {
        "model": MODEL, "instructions": INSTRUCTIONS, "input": [{"role": "user", "content": USER_TURNS[0]}],
        "tools": TOOLS, "stream": stream, "store": False, "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
    }
    carried = 0
    for i in range(3):
        status, headers, data = await post_raw(proxy, body)
        assert status == 200
        exchange = hop.exchanges[-1]
        assert exchange.request == orjson.dumps(body)  # kvwarm added nothing (no include_usage for Responses)
        assert data == exchange.response  # and took nothing away
        assert headers["Content-Type"].startswith("text/event-stream" if stream else "application/json")
        fields = dict(p.split("=", 1) for p in headers["x-kvwarm-prefix"].split("; "))
        assert fields["repaired"] == "0" and "break" not in fields
        assert fields["matched"].startswith(f"{carried if i else 0}/")
        if stream:
            assert data.count(b"event: response.completed\n") == 1 and b"[DONE]" not in data
            final = orjson.loads(data.rsplit(b"data: ", 1)[1])["response"]
        else:
            final = orjson.loads(data)
        body["input"] += final["output"]
        carried = 1 + sum(1 for item in body["input"] if item.get("type") != "reasoning")
        calls = [item for item in final["output"] if item["type"] == "function_call"]
        body["input"] += [{"type": "function_call_output", "call_id": c["call_id"], "output": "ok\n"} for c in calls]
        if not calls:
            body["input"].append({"role": "user", "content": "Go on."})


async def read_until(response: aiohttp.ClientResponse, deltas: int) -> str:
    """Read SSE events until ``deltas`` text deltas arrived; the text they carried."""
    texts: list[str] = []
    while len(texts) < deltas:
        line = await asyncio.wait_for(response.content.readline(), 5)
        assert line, "the stream ended early"
        if line.startswith(b"data: "):
            event = orjson.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                texts.append(event["delta"])
    return "".join(texts)


async def wait_for(check: Callable[[], Awaitable[bool]], seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def admin_sessions(proxy: TestServer) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url("/kvwarm/sessions")) as r:
        assert r.status == 200
        data: list[dict[str, Any]] = (await r.json())["data"]
        return data


async def admin_session(proxy: TestServer, session: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url(f"/kvwarm/sessions/{session}")) as r:
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


async def test_a_stream_cut_by_the_client_records_what_was_delivered(make_sim: Any, make_proxy: ProxyFactory) -> None:
    sim = await make_sim(chunk_delay=0.1)
    proxy = await make_proxy(sim)
    first = {"role": "user", "content": USER_TURNS[0]}
    body: dict[str, Any] = {"model": MODEL, "instructions": INSTRUCTIONS, "input": [first], "stream": True, "store": False}
    async with aiohttp.ClientSession() as s:
        response = await s.post(
            proxy.make_url("/v1/responses"), data=orjson.dumps(body),
            headers={"Authorization": "Bearer sk-alice", REPLY_TOKENS_HEADER: "200"},
        )
        delivered = await read_until(response, 4)
        response.close()  # the user pressed Ctrl-C: the connection is gone
    assert delivered and not delivered.endswith("\n")

    async def recorded() -> bool:
        return bool(await admin_sessions(proxy))

    await wait_for(recorded)
    (session,) = await admin_sessions(proxy)
    elements = (await admin_session(proxy, session["id"]))["elements"]
    reply = elements[-1]
    assert reply["generated"] and reply["partial"]
    stored = reply["body"]["content"]
    assert stored == [{"type": "text", "text": delivered}]

    # The client keeps what its user saw, and goes on: that prefix is warm in kvwarm's tree.
    follow = {**body, "stream": False, "input": [
        first,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": delivered}]},
        {"role": "user", "content": "You were cut off; go on."},
    ]}
    status, headers, _ = await post_raw(proxy, follow)
    assert status == 200
    assert headers["x-kvwarm-prefix"] == "matched=3/4; repaired=0"
