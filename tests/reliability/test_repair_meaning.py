"""A repair never changes what the untouched parts of a body mean.

Repaired values are spliced into the client's own bytes: duplicate keys, integers of 2**64
and beyond, odd escapes and unicode outside the repaired values reach the upstream exactly as
the client sent them. Where a repair would touch an object holding a duplicate key, the
request is forwarded unrepaired, byte for byte, and counted.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory, metric, received

SYSTEM = "You are a careful agent. " * 60
CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py","n":1}'}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}]


async def post(server: TestServer, raw: bytes) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(
        server.make_url("/v1/chat/completions"),
        data=raw,
        headers={"Authorization": "Bearer sk-alice", "Content-Type": "application/json"},
    ) as r:
        assert r.status == 200, await r.text()
        data: dict[str, Any] = await r.json()
        data["_headers"] = dict(r.headers)
        return data


def first_turn(**user_extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "read a.py", **user_extra},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "print('hi')"},
        ],
    }


def drifted_args() -> str:
    # The client re-serialized the arguments (Python's json.dumps defaults): same JSON value.
    return json.dumps({"n": 1, "path": "a.py"})


async def test_bytes_outside_the_repaired_values_are_the_clients(sim: TestServer, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sim)
    # Parsers keep the last of duplicate keys: turn 1 held what turn 2's parse will see.
    await post(proxy, orjson.dumps(first_turn(**{"x-note": "B"})))
    # Turn 2, written by hand: a seed beyond 64 bits, a duplicate key in an untouched message,
    # escapes and unicode, and the tool call's arguments re-serialized (the drift to repair).
    call = json.dumps({**CALL, "function": {**CALL["function"], "arguments": drifted_args()}})
    raw = (
        '{"model":"m","seed":18446744073709551616,"temperature":1e-400,'
        f'"tools":{json.dumps(TOOLS)},'
        '"messages":['
        f'{{"role":"system","content":{json.dumps(SYSTEM)}}},'
        '{"role":"user","content":"read a.py","x-note":"A","x-note":"B"},'
        f'{{"role":"assistant","content":null,"tool_calls":[{call}]}},'
        '{"role":"tool","tool_call_id":"call_1","content":"print(\'hi\')"},'
        '{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00 \u5317\u4eac \\/ done"}'
        "]}"
    ).encode()
    response = await post(proxy, raw)
    assert "repaired=1" in response["_headers"]["x-kvwarm-prefix"]
    sent = received(sim)[-1].body
    # The stored argument bytes were restored ...
    assert orjson.dumps(CALL["function"]["arguments"]) in sent
    assert drifted_args().encode() not in json.loads(sent)["messages"][2]["tool_calls"][0]["function"]["arguments"].encode()
    # ... and everything around them is the client's, byte for byte.
    before, _, after = raw.partition(orjson.dumps(drifted_args()))
    assert sent.startswith(before) and sent.endswith(after)
    for exact in (b'"seed":18446744073709551616', b'"temperature":1e-400', b'"x-note":"A","x-note":"B"', b"\\ud83d\\ude00"):
        assert exact in sent
    assert metric(proxy, "kvwarm_repairs_refused_total", reason="duplicate_key") == 0


async def test_a_duplicate_key_where_the_repair_writes_forwards_the_client_bytes(
    sim: TestServer, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(sim)
    await post(proxy, orjson.dumps(first_turn()))
    call = json.dumps({**CALL, "function": {**CALL["function"], "arguments": drifted_args()}})
    # The message to repair holds "content" twice: which one does the upstream read? Unknown,
    # so kvwarm must not rewrite that message at all.
    raw = (
        f'{{"model":"m","tools":{json.dumps(TOOLS)},"messages":['
        f'{{"role":"system","content":{json.dumps(SYSTEM)}}},'
        '{"role":"user","content":"read a.py"},'
        f'{{"role":"assistant","content":"A","content":null,"tool_calls":[{call}]}},'
        '{"role":"tool","tool_call_id":"call_1","content":"print(\'hi\')"},'
        '{"role":"user","content":"next"}]}'
    ).encode()
    response = await post(proxy, raw)
    assert received(sim)[-1].body == raw
    assert "repaired=0" in response["_headers"]["x-kvwarm-prefix"]
    assert metric(proxy, "kvwarm_repairs_refused_total", reason="duplicate_key") == 1


async def test_a_top_level_duplicate_stream_key_gets_no_injected_option(sim: TestServer, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(sim)
    raw = b'{"model":"m","stream":false,"stream":true,"messages":[{"role":"user","content":"hi"}]}'
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"), data=raw, headers={"Content-Type": "application/json"}
    ) as r:
        await r.read()
    # Which "stream" the upstream reads is its own choice: kvwarm adds nothing to such a body.
    assert received(sim)[-1].body == raw
