"""Usage, cost and metrics through the whole proxy: every counter equals what the upstream reported.

Source of truth, independent of kvwarm's own parsing:

* the reference upstream is deterministic (the reply and the cache state are a
  function of the prompts received, in order), so :func:`upstream_reports`
  replays the bodies it received from kvwarm -- in order, with their
  ``x-sim-*`` headers -- to a fresh, identically configured upstream and reads
  the usage of each answer with this file's own JSON / SSE code. kvwarm had
  already asked for stream usage, so every answer carries a usage block, even
  for the streams whose client did not ask for one;
* where the client saw the usage (JSON bodies, streams with ``include_usage``)
  the client's copy must equal the replayed one (which proves the replay);
* scripted upstreams (small aiohttp apps below) report usage shapes fixed here:
  the expected counters are worked out by hand from those blocks;
* costs are computed here from the reported tokens and the price table
  (``proxy/defaults/prices.toml``, read with ``tomllib``); an ``openhuman`` bill is taken
  as the upstream stated it.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import REGISTRY
from tests.agents import Agent, Drift, Post, args_python_dumps, no_drift, varying
from tests.conftest import ProxyFactory, metric, received

SimFactory = Callable[..., Awaitable[TestServer]]

PRICES: dict[str, dict[str, float]] = tomllib.loads(
    (Path(__file__).parents[2] / "proxy" / "defaults" / "prices.toml").read_text()
)["models"]
SIM_MODEL = "kvwarm-sim"
# The reference upstream bills at prices of its own when asked to: different from the table, so a
# billed amount and an estimate can never be confused.
BILLING = {"price_input": 4.0, "price_cached_input": 0.4, "price_output": 16.0}


# -- clients: JSON and SSE, each returning a chat.completion-shaped dict -------------------------

def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body (``data:`` lines; ``[DONE]`` and comments skipped)."""
    chunks = []
    for block in re.split(rb"\r?\n\r?\n", raw):
        data = b"\n".join(line[5:].lstrip(b" ") for line in block.splitlines() if line.startswith(b"data:"))
        if data and data != b"[DONE]":
            chunks.append(orjson.loads(data))
    return chunks


def rebuild(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat.completion from stream chunks: the message from the deltas, the last usage / openhuman block."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: dict[int, dict[str, Any]] = {}
    usage = openhuman = finish = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        openhuman = chunk.get("openhuman") or openhuman
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            for key in ("content", "reasoning_content"):
                if delta.get(key) is not None:
                    message[key] = (message.get(key) or "") + delta[key]
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = call.get("id") or slot["id"]
                slot["type"] = call.get("type") or slot["type"]
                fn = call.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    out: dict[str, Any] = {"object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
    if openhuman is not None:
        out["openhuman"] = openhuman
    return out


async def chat(server: TestServer, body: dict[str, Any], key: str = "sk-usage", **headers: str) -> dict[str, Any]:
    """POST one chat request; the response as a chat.completion dict plus ``_status``, ``_headers``, ``_raw``, ``_chunks``."""
    async with aiohttp.ClientSession() as s, s.post(
        server.make_url("/v1/chat/completions"), data=orjson.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers},
    ) as r:
        raw = await r.read()
        status, response_headers, content_type = r.status, dict(r.headers), r.content_type
    if content_type == "text/event-stream":
        chunks = parse_sse(raw)
        data = rebuild(chunks)
    else:
        chunks, data = [], orjson.loads(raw)
    data.update(_status=status, _headers=response_headers, _raw=raw, _chunks=chunks)
    return data


def poster(server: TestServer, *, stream: bool = False, client_usage: bool = False, key: str = "sk-usage", **headers: str) -> Post:
    """An Agent's ``post``: JSON, or SSE with or without ``stream_options.include_usage``."""
    async def post(body: dict[str, Any]) -> dict[str, Any]:
        body = dict(body)
        if stream:
            body["stream"] = True
            if client_usage:
                body["stream_options"] = {"include_usage": True}
        data = await chat(server, body, key, **headers)
        assert data["_status"] == 200, data["_raw"][:500]
        return data

    return post


# -- the upstream's own reports --------------------------------------------------------------------

async def upstream_reports(sim: TestServer, make_sim: SimFactory, **config: Any) -> list[dict[str, Any]]:
    """What the upstream answered to each request kvwarm forwarded: replayed to a fresh identical upstream."""
    fresh = await make_sim(**config)
    reports = []
    async with aiohttp.ClientSession() as s:
        for req in received(sim):
            headers = {k: v for k, v in req.headers.items() if k.startswith("x-sim-")}
            async with s.post(fresh.make_url(req.path), data=req.body, headers={"Content-Type": "application/json", **headers}) as r:
                raw, status, content_type = await r.read(), r.status, r.content_type
            if status != 200:
                continue
            report = rebuild(parse_sse(raw)) if content_type == "text/event-stream" else orjson.loads(raw)
            assert report["usage"], f"kvwarm forwarded a request without asking for usage: {req.body[:300]!r}"
            reports.append(report)
    return reports


def cached_of(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def estimated_usd(usage: dict[str, Any], model: str = SIM_MODEL) -> float:
    """Hand-computed list price of an OpenAI-shaped usage block."""
    price = PRICES[model]
    prompt, cached, output = usage["prompt_tokens"], cached_of(usage), usage["completion_tokens"]
    return ((prompt - cached) * price["input"] + cached * price["cached_input"] + output * price["output"]) / 1e6


def total(server: TestServer, name: str, **labels: str) -> float:
    """Sum of every sample ``name`` whose labels include ``labels`` (e.g. over all ``kind`` values)."""
    out = 0.0
    for family in server.app[REGISTRY].collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                out += sample.value
    return out


def prefix_header(response: dict[str, Any]) -> dict[str, str]:
    return dict(p.split("=", 1) for p in response["_headers"]["x-kvwarm-prefix"].split("; "))


# -- scripted workloads to the reference upstream ----------------------------------------------------

WORKLOADS: dict[str, dict[str, Any]] = {
    "json": {},
    "json-openhuman-drift": {"openhuman": True, "drift": varying},
    "sse-client-usage-drift-reasoning": {"stream": True, "client_usage": True, "drift": args_python_dumps, "reasoning": True},
    "sse-openhuman-drift": {"stream": True, "openhuman": True, "drift": varying},
    "sse-reasoning": {"stream": True, "reasoning": True},
}
TURNS = 5


@pytest.mark.parametrize("name", list(WORKLOADS))
async def test_counters_equal_the_upstream_reports(make_sim: SimFactory, make_proxy: ProxyFactory, name: str) -> None:
    w = WORKLOADS[name]
    stream, client_usage, openhuman = w.get("stream", False), w.get("client_usage", False), w.get("openhuman", False)
    drift: Drift = w.get("drift", no_drift)
    config: dict[str, Any] = {"openhuman": True, **BILLING} if openhuman else {}
    sim = await make_sim(**config)
    kvwarm = await make_proxy(sim)
    headers = {"x-sim-reasoning": "1"} if w.get("reasoning") else {}
    agent = Agent(poster(kvwarm, stream=stream, client_usage=client_usage, **headers), drift=drift)
    await agent.run(TURNS)

    reports = await upstream_reports(sim, make_sim, **config)
    assert len(reports) == TURNS
    usages = [r["usage"] for r in reports]
    if not stream or client_usage:
        assert [t.response["usage"] for t in agent.turns] == usages, "the client saw other numbers than the upstream reported"
    else:
        assert all(t.response["usage"] is None for t in agent.turns), "a client that did not ask for usage got a usage chunk"

    m = {"model": SIM_MODEL}
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(cached_of(u) for u in usages)
    assert cached > 0, "the workload must exercise the cache"
    assert metric(kvwarm, "kvwarm_requests_total", **m, status="2xx", stream=str(stream).lower()) == TURNS
    assert metric(kvwarm, "kvwarm_prompt_tokens_total", **m) == prompt
    assert metric(kvwarm, "kvwarm_cached_prompt_tokens_total", **m) == cached
    assert metric(kvwarm, "kvwarm_cache_known_prompt_tokens_total", **m) == prompt
    assert metric(kvwarm, "kvwarm_completion_tokens_total", **m) == sum(u["completion_tokens"] for u in usages)
    reasoning = sum(u["completion_tokens_details"]["reasoning_tokens"] for u in usages)
    assert (reasoning > 0) is bool(w.get("reasoning"))
    assert metric(kvwarm, "kvwarm_reasoning_tokens_total", **m) == reasoning
    assert metric(kvwarm, "kvwarm_usage_unknown_cache_total", **m) == 0
    assert metric(kvwarm, "kvwarm_usage_missing_total", **m) == 0
    assert metric(kvwarm, "kvwarm_unpriced_requests_total", **m) == 0
    assert metric(kvwarm, "kvwarm_request_cache_hit_ratio_count", **m) == TURNS
    assert metric(kvwarm, "kvwarm_request_cache_hit_ratio_sum", **m) == pytest.approx(
        sum(cached_of(u) / u["prompt_tokens"] for u in usages)
    )

    estimate = sum(estimated_usd(u) for u in usages)
    if openhuman:
        billed = sum(r["openhuman"]["billing"]["charged_amount_usd"] for r in reports)
        assert billed != pytest.approx(estimate), "the bill must differ from the table for this test to mean anything"
        assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source="billed") == pytest.approx(billed, rel=1e-9)
        assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source="estimated") == 0
    else:
        assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source="estimated") == pytest.approx(estimate, rel=1e-9)
        assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source="billed") == 0

    # Repairs: counted under drift, nothing without; by kind they add up to what the headers said.
    said = sum(int(prefix_header(t.response)["repaired"]) for t in agent.turns)
    repairs = total(kvwarm, "kvwarm_repairs_total")
    rescued = metric(kvwarm, "kvwarm_repair_rescued_tokens_total", **m)
    assert repairs == said
    if drift is no_drift:
        assert repairs == 0 and rescued == 0
    else:
        assert repairs > 0
        assert 0 < rescued <= prompt
    assert total(kvwarm, "kvwarm_prefix_breaks_total") == 0, "new turns are not breaks"
    assert metric(kvwarm, "kvwarm_errors_total", stage="usage") == 0


@pytest.mark.parametrize("openhuman", [False, True], ids=["unbilled", "billed"])
async def test_model_missing_from_price_table_is_unpriced(make_sim: SimFactory, make_proxy: ProxyFactory, openhuman: bool) -> None:
    model = "acme-llm-unlisted"
    assert model not in PRICES
    config: dict[str, Any] = {"openhuman": True, **BILLING} if openhuman else {}
    sim = await make_sim(**config)
    kvwarm = await make_proxy(sim)
    await Agent(poster(kvwarm), model=model).run(3)
    await Agent(poster(kvwarm, stream=True), model=model).run(1)
    reports = await upstream_reports(sim, make_sim, **config)
    assert len(reports) == 4

    m = {"model": model}
    assert metric(kvwarm, "kvwarm_prompt_tokens_total", **m) == sum(r["usage"]["prompt_tokens"] for r in reports)
    assert metric(kvwarm, "kvwarm_cached_prompt_tokens_total", **m) == sum(cached_of(r["usage"]) for r in reports)
    assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source="estimated") == 0
    if openhuman:  # the provider's bill needs no price table
        assert metric(kvwarm, "kvwarm_unpriced_requests_total", **m) == 0
        billed = sum(r["openhuman"]["billing"]["charged_amount_usd"] for r in reports)
        assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source="billed") == pytest.approx(billed, rel=1e-9)
    else:
        assert metric(kvwarm, "kvwarm_unpriced_requests_total", **m) == len(reports)
        assert total(kvwarm, "kvwarm_cost_usd_total") == 0, "an unpriced request must not be costed as zero or anything else"


# -- the stream a client sees --------------------------------------------------------------------

_VOLATILE = [(re.compile(rb'"id":"chatcmpl-[0-9a-f]+"'), b'"id":"ID"'), (re.compile(rb'"created":\d+'), b'"created":0')]


def normalized(raw: bytes) -> bytes:
    """The reference upstream's random completion id and wall-clock ``created`` masked."""
    for pattern, replacement in _VOLATILE:
        raw = pattern.sub(replacement, raw)
    return raw


@pytest.mark.parametrize("openhuman", [False, True], ids=["plain", "openhuman"])
@pytest.mark.parametrize("client_usage", [False, True], ids=["no-usage", "usage"])
async def test_stream_is_what_the_client_would_have_seen(
    make_sim: SimFactory, make_proxy: ProxyFactory, client_usage: bool, openhuman: bool
) -> None:
    """Through kvwarm (which asks for usage either way) vs the same request direct to an identical fresh upstream."""
    config = {"openhuman": openhuman}
    behind, direct = await make_sim(**config), await make_sim(**config)
    kvwarm = await make_proxy(behind)
    via, straight = [], []

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        body = {**body, "stream": True, **({"stream_options": {"include_usage": True}} if client_usage else {})}
        a = await chat(kvwarm, copy.deepcopy(body), **{"x-sim-reasoning": "1"})
        b = await chat(direct, copy.deepcopy(body), **{"x-sim-reasoning": "1"})
        via.append(a)
        straight.append(b)
        return a

    await Agent(post).run(3)
    assert b'"include_usage":true' in received(behind)[0].body
    for a, b in zip(via, straight, strict=True):
        assert a["_status"] == b["_status"] == 200
        assert any(not c["choices"] and c.get("usage") for c in a["_chunks"]) is client_usage
        # Event by event first (a readable diff), then the whole body byte for byte.
        assert normalized(a["_raw"]).split(b"\n\n") == normalized(b["_raw"]).split(b"\n\n")
        assert normalized(a["_raw"]) == normalized(b["_raw"])


# -- usage shapes of other providers, through the whole proxy ---------------------------------------

def _shape_blocks(shape: str, n: int) -> dict[str, Any]:
    """The usage block(s) the scripted upstream reports for its n-th request (numbers vary with n)."""
    if shape == "no_cache_field":
        return {"usage": {"prompt_tokens": 1500 + n, "completion_tokens": 30 + n, "total_tokens": 1530 + 2 * n}}
    if shape == "deepseek":
        hit = 1024 + 64 * n
        return {"usage": {"prompt_tokens": 2000 + n, "completion_tokens": 40 + n, "total_tokens": 2040 + 2 * n,
                          "prompt_cache_hit_tokens": hit, "prompt_cache_miss_tokens": 2000 + n - hit}}
    if shape == "anthropic":
        return {"usage": {"input_tokens": 300 + n, "output_tokens": 50 + n,
                          "cache_read_input_tokens": 2048 + n, "cache_creation_input_tokens": 512 + n}}
    if shape == "openhuman":  # openhuman's block differs from the standard one and wins
        return {"usage": {"prompt_tokens": 999, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}},
                "openhuman": {"usage": {"input_tokens": 1800 + n, "output_tokens": 60 + n, "cached_input_tokens": 1280},
                              "billing": {"charged_amount_usd": 0.0125 + n / 1000, "currency": "USD"}}}
    raise AssertionError(shape)


SHAPE_MODEL = {"no_cache_field": SIM_MODEL, "deepseek": "deepseek-chat", "anthropic": "claude-sonnet-4-5", "openhuman": SIM_MODEL}


def _expected(shape: str, blocks: dict[str, Any]) -> dict[str, Any]:
    """Worked out by hand from each provider's documented meaning of its fields."""
    u = blocks["usage"]
    price = PRICES[SHAPE_MODEL[shape]]
    if shape == "no_cache_field":  # unknown cache: the whole prompt at the input price
        p, o = u["prompt_tokens"], u["completion_tokens"]
        return {"prompt": p, "cached": None, "write": 0, "completion": o, "usd": (p * price["input"] + o * price["output"]) / 1e6, "billed": False}
    if shape == "deepseek":
        p, hit, o = u["prompt_tokens"], u["prompt_cache_hit_tokens"], u["completion_tokens"]
        usd = ((p - hit) * price["input"] + hit * price["cached_input"] + o * price["output"]) / 1e6
        return {"prompt": p, "cached": hit, "write": 0, "completion": o, "usd": usd, "billed": False}
    if shape == "anthropic":  # input_tokens excludes cache reads and writes
        i, r, w, o = u["input_tokens"], u["cache_read_input_tokens"], u["cache_creation_input_tokens"], u["output_tokens"]
        usd = (i * price["input"] + r * price["cached_input"] + w * price["cache_write"] + o * price["output"]) / 1e6
        return {"prompt": i + r + w, "cached": r, "write": w, "completion": o, "usd": usd, "billed": False}
    oh = blocks["openhuman"]
    return {"prompt": oh["usage"]["input_tokens"], "cached": oh["usage"]["cached_input_tokens"], "write": 0,
            "completion": oh["usage"]["output_tokens"], "usd": oh["billing"]["charged_amount_usd"], "billed": True}


class ScriptedUpstream:
    """An OpenAI-compatible upstream reporting one usage shape; streams honour ``include_usage`` like OpenAI."""

    def __init__(self, shape: str) -> None:
        self.shape = shape
        self.bodies: list[dict[str, Any]] = []
        self.reported: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        blocks = _shape_blocks(self.shape, len(self.bodies))
        base = {"id": f"cmpl-{len(self.bodies)}", "created": 1700000000, "model": body["model"]}
        message = {"role": "assistant", "content": f"reply {len(self.bodies)}"}
        if not body.get("stream"):
            self.reported.append(blocks)
            return web.json_response({**base, "object": "chat.completion", **blocks,
                                      "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {**base, "object": "chat.completion.chunk"}
        for delta, finish in (({"role": "assistant", "content": ""}, None), ({"content": message["content"]}, None), ({}, "stop")):
            await response.write(b"data: " + orjson.dumps({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage") is True:
            self.reported.append(blocks)
            await response.write(b"data: " + orjson.dumps({**chunk, "choices": [], **blocks}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.mark.parametrize("mode", ["json", "sse", "sse-client-usage"])
@pytest.mark.parametrize("shape", list(SHAPE_MODEL))
async def test_usage_shapes_are_counted(aiohttp_server: Any, make_proxy: ProxyFactory, shape: str, mode: str) -> None:
    upstream = ScriptedUpstream(shape)
    kvwarm = await make_proxy(await aiohttp_server(upstream.app()))
    model = SHAPE_MODEL[shape]
    n = 3
    for i in range(n):
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": f"question {i}"}]}
        if mode != "json":
            body["stream"] = True
        if mode == "sse-client-usage":
            body["stream_options"] = {"include_usage": True}
        data = await chat(kvwarm, body)
        assert data["_status"] == 200
        assert data["choices"][0]["message"]["content"] == f"reply {i + 1}"
        if mode == "sse":  # kvwarm asked for usage on the client's behalf and kept the answer to itself
            assert upstream.bodies[-1]["stream_options"] == {"include_usage": True}
            assert all(c["choices"] for c in data["_chunks"]) and data["usage"] is None
        else:
            assert data["usage"] == upstream.reported[-1]["usage"]
    assert len(upstream.reported) == n

    expected = [_expected(shape, blocks) for blocks in upstream.reported]
    m = {"model": model}
    prompt = sum(e["prompt"] for e in expected)
    assert metric(kvwarm, "kvwarm_prompt_tokens_total", **m) == prompt
    assert metric(kvwarm, "kvwarm_completion_tokens_total", **m) == sum(e["completion"] for e in expected)
    assert metric(kvwarm, "kvwarm_cache_write_tokens_total", ttl="unknown", **m) == sum(e["write"] for e in expected)
    if shape == "no_cache_field":
        # Unknown, not zero: counted apart, and kept out of the hit-ratio denominator.
        assert metric(kvwarm, "kvwarm_usage_unknown_cache_total", **m) == n
        assert metric(kvwarm, "kvwarm_cache_known_prompt_tokens_total", **m) == 0
        assert metric(kvwarm, "kvwarm_cached_prompt_tokens_total", **m) == 0
        assert metric(kvwarm, "kvwarm_request_cache_hit_ratio_count", **m) == 0
    else:
        assert metric(kvwarm, "kvwarm_usage_unknown_cache_total", **m) == 0
        assert metric(kvwarm, "kvwarm_cache_known_prompt_tokens_total", **m) == prompt
        assert metric(kvwarm, "kvwarm_cached_prompt_tokens_total", **m) == sum(e["cached"] for e in expected)
        assert metric(kvwarm, "kvwarm_request_cache_hit_ratio_count", **m) == n
    source, other = ("billed", "estimated") if expected[0]["billed"] else ("estimated", "billed")
    assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source=source) == pytest.approx(sum(e["usd"] for e in expected), rel=1e-9)
    assert metric(kvwarm, "kvwarm_cost_usd_total", **m, source=other) == 0
    assert metric(kvwarm, "kvwarm_unpriced_requests_total", **m) == 0
    assert metric(kvwarm, "kvwarm_usage_missing_total", **m) == 0


# -- breaks, statuses, errors, the endpoint -----------------------------------------------------------

async def test_prefix_breaks_by_reason(sim: TestServer, make_proxy: ProxyFactory) -> None:
    kvwarm = await make_proxy(sim)
    agent = Agent(poster(kvwarm))
    await agent.run(3)
    assert total(kvwarm, "kvwarm_prefix_breaks_total") == 0

    def edited_user(body: dict[str, Any]) -> None:
        body["messages"][1]["content"] += " Be brief."

    def edited_system(body: dict[str, Any]) -> None:
        body["messages"][0]["content"] = "Today is Tuesday. " + body["messages"][0]["content"]

    def edited_tool(body: dict[str, Any]) -> None:
        body["tools"][2]["function"]["description"] = "Run every test."

    post = poster(kvwarm)
    edits = {"content_changed": edited_user, "system_changed": edited_system, "tools_changed": edited_tool}
    for reason, edit in edits.items():
        body = agent.next_request()
        edit(body)
        response = await post(body)
        assert prefix_header(response)["break"].split("@")[0] == reason
        assert received(sim)[-1].body == orjson.dumps(body), "a semantic change reaches the upstream as sent"
    for reason in edits:
        assert metric(kvwarm, "kvwarm_prefix_breaks_total", reason=reason) == 1
    assert total(kvwarm, "kvwarm_prefix_breaks_total") == len(edits)


async def test_break_over_a_line_end_is_served_and_counted(sim: TestServer, make_proxy: ProxyFactory) -> None:
    """A dated line prepended to the system prompt: the changed span holds a newline."""
    kvwarm = await make_proxy(sim)
    agent = Agent(poster(kvwarm))
    await agent.run(2)
    body = agent.next_request()
    body["messages"][0]["content"] = "Today is Tuesday.\n" + body["messages"][0]["content"]
    data = await chat(kvwarm, body)  # kvwarm must never turn a request that would succeed into a failure
    assert data["_status"] == 200, data["_raw"][:300]
    assert received(sim)[-1].body == orjson.dumps(body)
    assert prefix_header(data)["break"] == "system_changed@0"
    assert metric(kvwarm, "kvwarm_prefix_breaks_total", reason="system_changed") == 1


async def test_requests_by_status_class_and_upstream_errors(
    sim: TestServer, make_proxy: ProxyFactory, closed_port_url: Callable[[], str]
) -> None:
    kvwarm = await make_proxy(sim)
    dead = await make_proxy(closed_port_url())
    plan: list[tuple[TestServer, bool, str | None]] = [
        (kvwarm, False, None), (kvwarm, True, None), (kvwarm, False, None),
        (kvwarm, False, "status=429"), (kvwarm, True, "status=400"),
        (kvwarm, False, "status=503"), (kvwarm, True, "status=500"),
        (dead, False, None), (dead, True, None),
    ]
    seen: dict[tuple[int, str, bool], int] = {}
    for i, (server, stream, fault) in enumerate(plan):
        body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": f"status probe {i}"}], "stream": stream}
        data = await chat(server, body, **({"x-sim-fault": fault} if fault else {}))
        status = data["_status"]
        answered = server is kvwarm  # the upstream answered (the client got the upstream's status)
        if answered:
            assert (status == 200) is (fault is None)
            if fault:
                assert "error" in orjson.loads(data["_raw"])
        else:
            assert status >= 500 and "error" in orjson.loads(data["_raw"])
        key = (id(server), f"{status // 100}xx" if answered else "error", stream)
        seen[key] = seen.get(key, 0) + 1
    assert len(received(sim)) == 7
    for server in (kvwarm, dead):
        for status_class in ("2xx", "4xx", "5xx", "error"):
            for stream in (False, True):
                labels = {"model": SIM_MODEL, "status": status_class, "stream": str(stream).lower()}
                assert metric(server, "kvwarm_requests_total", **labels) == seen.get((id(server), status_class, stream), 0), labels
    # Only an upstream that could not be reached is an upstream error; its 4xx / 5xx answers are relayed.
    assert metric(kvwarm, "kvwarm_errors_total", stage="upstream") == 0
    assert metric(dead, "kvwarm_errors_total", stage="upstream") == 2
    assert metric(kvwarm, "kvwarm_usage_missing_total", model=SIM_MODEL) == 0


async def test_metrics_endpoint_is_served_and_parseable(make_sim: SimFactory, make_proxy: ProxyFactory) -> None:
    sim = await make_sim()
    kvwarm = await make_proxy(sim)
    await Agent(poster(kvwarm), drift=args_python_dumps).run(3)
    await Agent(poster(kvwarm, stream=True)).run(1)
    reports = await upstream_reports(sim, make_sim)

    async with aiohttp.ClientSession() as s, s.get(kvwarm.make_url("/metrics")) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kvwarm_requests", "kvwarm_prompt_tokens", "kvwarm_cached_prompt_tokens", "kvwarm_cost_usd",
                 "kvwarm_repairs", "kvwarm_prefix_breaks", "kvwarm_errors", "kvwarm_request_duration_seconds",
                 "kvwarm_upstream_ttfb_seconds", "kvwarm_inflight_requests", "kvwarm_store_nodes"):
        assert name in families, name
    assert families["kvwarm_requests"].type == "counter"
    assert families["kvwarm_request_duration_seconds"].type == "histogram"
    registry = kvwarm.app[REGISTRY]
    samples = 0
    for family in families.values():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            assert registry.get_sample_value(sample.name, sample.labels) == pytest.approx(sample.value), sample
            samples += 1
    assert samples > 50
    scraped = {s.labels["model"]: s.value for s in families["kvwarm_prompt_tokens"].samples if s.name == "kvwarm_prompt_tokens_total"}
    assert scraped == {SIM_MODEL: sum(r["usage"]["prompt_tokens"] for r in reports)}
    assert next(s.value for s in families["kvwarm_inflight_requests"].samples) == 0
    assert next(s.value for s in families["kvwarm_store_nodes"].samples) > 0
