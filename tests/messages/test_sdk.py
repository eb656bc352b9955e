"""The official ``anthropic`` SDK through kvwarm: warm caches, visible prefixes, usage counted, credentials kept.

Agents keep their history three ways (the SDK's block objects, ``model_dump()`` dicts with their
``None`` fields, ``model_dump(exclude_none=True)`` dicts), stream every other request, and are
compared request by request with the same agent talking to an identical upstream directly.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.transport.http1 import forward_request_headers
from tests.conftest import ProxyFactory, received
from tests.messages.agents import MODEL, MessagesAgent, Turn, post_messages, prefix_of
from tests.messages.conftest import Clients

REQUESTS = 6


@pytest.mark.parametrize("mode", ["anthropic", "vllm"])
@pytest.mark.parametrize("keep", ["objects", "model_dump", "dicts"])
async def test_histories_kept_any_way_stay_warm_and_byte_identical(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients, keep: str, mode: str
) -> None:
    direct_sim, kv_sim = await make_sim(cache_mode=mode), await make_sim(cache_mode=mode)
    kvwarm = await make_proxy(kv_sim)
    options: dict[str, Any] = {"keep": keep, "markers": mode == "anthropic", "parallel": True, "thinking": True}
    direct = await MessagesAgent(clients(direct_sim), **options).run(REQUESTS)
    warm = await MessagesAgent(clients(kvwarm), **options).run(REQUESTS)
    # Nothing to repair: kvwarm forwarded the client's bytes, and the upstream cached as for a direct client.
    assert [r.body for r in received(kv_sim)] == [r.body for r in received(direct_sim)]
    assert [t.cached for t in warm] == [t.cached for t in direct] and warm[-1].cached > 0
    for turn in warm:
        prefix = turn.prefix()
        assert prefix, "every response, streamed or not, carries x-kvwarm-prefix"
        assert "break" not in prefix and prefix["repaired"] == "0", prefix
    for before, turn in itertools.pairwise(warm):
        # Every element the previous request sent, and the reply it got, is matched.
        matched, total = map(int, turn.prefix()["matched"].split("/"))
        assert matched == int(before.prefix()["matched"].split("/")[1]) + 1 and matched < total, turn.prefix()


async def scrape(server: TestServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(server.make_url("/metrics")) as response:
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_count_every_prompt_token_the_upstream_reported(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim = await make_sim(cache_mode="anthropic")
    kvwarm = await make_proxy(sim)
    agent = MessagesAgent(clients(kvwarm), markers=True)
    # The system written for an hour; the conversation, marked at its end, for 5 minutes.
    agent.system = [{"type": "text", "text": agent.system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    turns: list[Turn] = await agent.run(REQUESTS)
    usages = [t.message.usage for t in turns]
    metrics = await scrape(kvwarm)
    model = (("model", MODEL),)

    def total(name: str, labels: tuple[tuple[str, str], ...] = model) -> float:
        return metrics.get((name, labels), 0.0)

    prompt = sum(u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0) for u in usages)
    assert total("kvwarm_prompt_tokens_total") == prompt
    assert total("kvwarm_cache_known_prompt_tokens_total") == prompt
    assert total("kvwarm_cached_prompt_tokens_total") == sum(u.cache_read_input_tokens or 0 for u in usages) > 0
    assert total("kvwarm_completion_tokens_total") == sum(u.output_tokens for u in usages)
    written_5m = sum(u.cache_creation.ephemeral_5m_input_tokens for u in usages if u.cache_creation)
    written_1h = sum(u.cache_creation.ephemeral_1h_input_tokens for u in usages if u.cache_creation)
    assert written_5m > 0 and written_1h > 0
    assert total("kvwarm_cache_write_tokens_total", (("model", MODEL), ("ttl", "5m"))) == written_5m
    assert total("kvwarm_cache_write_tokens_total", (("model", MODEL), ("ttl", "1h"))) == written_1h
    assert sum(u.cache_creation_input_tokens or 0 for u in usages) == written_5m + written_1h


async def test_the_api_key_names_the_tenant_in_either_header(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim = await make_sim(cache_mode="vllm")
    kvwarm = await make_proxy(sim)
    # The anthropic SDK sends its key as ``Authorization: Bearer``; Claude Code as ``x-api-key``.
    agent = MessagesAgent(clients(kvwarm, key="sk-alice"), stream=False)
    await agent.run(2)
    assert received(sim)[-1].headers["authorization"] == "Bearer sk-alice"
    body = agent.next_request()
    # The same key in x-api-key: the same tenant, its conversation matched (the system and every
    # message but the new last one).
    status, headers, _ = await post_messages(kvwarm, body, key="sk-alice")
    assert status == 200 and "authorization" not in received(sim)[-1].headers
    assert prefix_of(headers)["matched"] == f"{len(body['messages'])}/{len(body['messages']) + 1}"
    # Another key: another tenant, nothing of Alice's to match.
    status, headers, _ = await post_messages(kvwarm, body, key="sk-bob")
    assert status == 200 and prefix_of(headers)["matched"].startswith("0/")


async def test_with_an_operator_key_the_upstream_gets_it_in_the_header_of_its_api(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients, openai_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sim = await make_sim()
    kvwarm = await make_proxy(sim, upstream__api_key="sk-operator")
    client = clients(kvwarm, key="sk-ant-client-own")
    await client.beta.messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "Hi"}], betas=["interleaved-thinking-2025-05-14"],
        extra_query={"beta": "true"}, extra_headers={"anthropic-version": "2023-06-01"},  # as Claude Code sends them
    )
    await openai_client(kvwarm, api_key="sk-openai-client-own").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}]
    )
    messages, chat = received(sim)
    # Anthropic's API takes a key in x-api-key; the client's own key goes nowhere.
    assert messages.headers["x-api-key"] == "sk-operator" and "authorization" not in messages.headers
    assert chat.headers["authorization"] == "Bearer sk-operator" and "x-api-key" not in chat.headers
    # The API's own headers and query travel untouched.
    assert messages.path == "/v1/messages?beta=true"
    assert messages.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"
    assert messages.headers["anthropic-version"] == "2023-06-01"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in ("sk-operator", "sk-ant-client-own", "sk-openai-client-own"):
        assert secret not in logged


async def test_without_an_operator_key_the_clients_key_travels(make_sim: Any, make_proxy: ProxyFactory) -> None:
    sim = await make_sim()
    kvwarm = await make_proxy(sim)
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    status, headers, _ = await post_messages(kvwarm, body, key="sk-ant-own")
    assert status == 200 and "x-kvwarm-prefix" in headers
    assert received(sim)[-1].headers["x-api-key"] == "sk-ant-own"


async def test_count_tokens_passes_untouched(make_sim: Any, make_proxy: ProxyFactory, clients: Clients) -> None:
    sim = await make_sim()
    kvwarm = await make_proxy(sim)
    client = clients(kvwarm)
    body = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "How many tokens?"}]}
    counted = await client.messages.count_tokens(**body)
    status, headers, answer = await post_messages(kvwarm, body, path="/v1/messages/count_tokens")
    assert status == 200 and orjson.loads(answer)["input_tokens"] == counted.input_tokens > 0
    assert "x-kvwarm-prefix" not in headers  # not a turn: forwarded, not planned
    assert received(sim)[-1].body == orjson.dumps(body)


@pytest.mark.parametrize(
    ("incoming", "header"),
    [
        ({"anthropic-version": "2023-06-01", "Authorization": "Bearer sk-own"}, "x-api-key"),  # the anthropic SDK
        ({"anthropic-version": "2023-06-01", "X-Api-Key": "sk-own"}, "x-api-key"),  # Claude Code
        ({"X-Api-Key": "sk-own"}, "x-api-key"),
        ({"Authorization": "Bearer sk-own"}, "authorization"),  # OpenAI's APIs
        ({"Authorization": "Bearer sk-own", "X-Api-Key": "sk-other"}, "authorization"),
        ({}, "authorization"),
    ],
)
def test_the_operator_key_goes_in_the_header_the_clients_api_takes(incoming: dict[str, str], header: str) -> None:
    out = forward_request_headers(CIMultiDict(incoming), "sk-operator")
    credentials = {k.lower(): v for k, v in out.items() if k.lower() in ("authorization", "x-api-key")}
    assert credentials == {header: "sk-operator" if header == "x-api-key" else "Bearer sk-operator"}
