"""``routing.prompt_cache_key = "session"``: one stable key per conversation, spliced into the
client's bytes, never replacing a client's key, sharded when one key gets hot."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from tests.agents import SAFE_DRIFTS
from tests.conftest import ProxyFactory, received
from tests.demo.run import sdk_post
from tests.routing.conftest import session_agent

KEY = re.compile(rb'^\{"prompt_cache_key":"([0-9a-f]{32}(?:-\d+)?)",')


def keys_of(sim: TestServer) -> list[str | None]:
    out = []
    for r in received(sim):
        found = KEY.match(r.body)
        out.append(found.group(1).decode() if found else None)
    return out


async def post_raw(server: TestServer, path: str, raw: bytes) -> int:
    async with aiohttp.ClientSession() as s, s.post(
        server.make_url(path), data=raw, headers={"Authorization": "Bearer sk-raw", "Content-Type": "application/json"}
    ) as r:
        await r.read()
        return r.status


async def test_each_conversation_gets_one_stable_key(make_proxy: ProxyFactory, sim: TestServer, openai_client: Any) -> None:
    kvwarm = await make_proxy(sim, routing__prompt_cache_key="session")
    client = openai_client(kvwarm)
    drifting = session_agent(0, sdk_post(client), prompt=0, drift=SAFE_DRIFTS["varying"])
    sibling = session_agent(1, sdk_post(client), prompt=0)  # the same system prompt, its own conversation
    other_tenant = session_agent(0, sdk_post(openai_client(kvwarm, api_key="sk-other")), prompt=0)
    for agent in (drifting, sibling, other_tenant):
        await agent.run(3)
    keys = keys_of(sim)
    assert None not in keys
    assert keys[0] == keys[1] == keys[2], "stable over turns, drift included"
    assert keys[3] == keys[4] == keys[5] != keys[0]
    assert keys[6] == keys[7] == keys[8] not in (keys[0], keys[3]), "tenants never share a key"
    # The key is a keyed hash: it contains nothing of what kvwarm stores or the client sent.
    assert all(k is not None and k.encode() not in r.body[40:] for k, r in zip(keys, received(sim), strict=True))


async def test_the_key_is_spliced_into_the_clients_bytes_and_a_clients_own_key_is_kept(
    make_proxy: ProxyFactory, sim: TestServer
) -> None:
    kvwarm = await make_proxy(sim, routing__prompt_cache_key="session")
    raw = b'{ "model" : "m",\n  "messages": [{"role":"user","content":"hello there"}], "temperature":  1.0 }'
    assert await post_raw(kvwarm, "/v1/chat/completions", raw) == 200
    sent = received(sim)[-1].body
    found = KEY.match(sent)
    assert found is not None
    assert sent == b'{"prompt_cache_key":"' + found.group(1) + b'",' + raw[1:]

    own = b'{"model":"m","prompt_cache_key":"mine","messages":[{"role":"user","content":"hello there"}]}'
    assert await post_raw(kvwarm, "/v1/chat/completions", own) == 200
    assert received(sim)[-1].body == own
    explicit_null = b'{"model":"m","prompt_cache_key":null,"messages":[{"role":"user","content":"hello there"}]}'
    assert await post_raw(kvwarm, "/v1/chat/completions", explicit_null) == 200
    assert received(sim)[-1].body == explicit_null

    responses = b'{"model":"m","instructions":"Be brief.","input":"hello there"}'
    assert await post_raw(kvwarm, "/v1/responses", responses) == 200
    sent = received(sim)[-1].body
    assert KEY.match(sent) and sent.endswith(responses[1:])


async def test_a_hot_key_is_sharded_past_its_rate(make_proxy: ProxyFactory, sim: TestServer) -> None:
    kvwarm = await make_proxy(sim, routing__prompt_cache_key="session", routing__prompt_cache_key_rpm=2)
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "the same opening"}]})
    for _ in range(5):  # five forks of one conversation within a minute
        assert await post_raw(kvwarm, "/v1/chat/completions", raw) == 200
    keys = keys_of(sim)
    base = keys[0]
    assert base is not None and len(base) == 32
    assert keys == [base, base, f"{base}-1", f"{base}-1", f"{base}-2"]


async def test_off_by_default(make_proxy: ProxyFactory, sim: TestServer) -> None:
    kvwarm = await make_proxy(sim)
    raw = b'{"model":"m","messages":[{"role":"user","content":"hello there"}]}'
    assert await post_raw(kvwarm, "/v1/chat/completions", raw) == 200
    assert received(sim)[-1].body == raw
