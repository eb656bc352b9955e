"""Semantic changes of a Messages history are never rewritten: forwarded as sent, with their break reason.

Safe drift (``test_drift.py``) is restored; everything else the client changed is what its model
should see: an edited text, a dropped or changed thinking block (opaque, signed), a changed tool
input. kvwarm forwards such a request byte for byte and names the break in ``x-kvwarm-prefix``.
A ``tool_use`` input compares as the JSON its text says, not as orjson parses it: integers beyond
64 bits and repeated keys are seen as sent.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory, metric, received
from tests.messages.agents import MODEL, MessagesAgent, post_messages, prefix_of, rendered
from tests.messages.conftest import Clients


async def request_after(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients, turns: int, **options: Any
) -> tuple[TestServer, TestServer, MessagesAgent, dict[str, Any]]:
    """The emulator (vLLM mode), kvwarm in front of it, an agent that ran ``turns`` unstreamed
    turns through them, and its next request."""
    sim = await make_sim(cache_mode="vllm")
    kvwarm = await make_proxy(sim)
    agent = MessagesAgent(clients(kvwarm), stream=False, **options)
    await agent.run(turns)
    return sim, kvwarm, agent, agent.next_request()


async def send_as_is(kvwarm: TestServer, sim: TestServer, body: dict[str, Any]) -> dict[str, str]:
    """Post ``body``; check the upstream received exactly its bytes; the prefix header as a dict."""
    status, headers, answer = await post_messages(kvwarm, body)
    assert status == 200, answer
    assert received(sim)[-1].body == orjson.dumps(body)
    return prefix_of(headers)


async def test_an_edited_user_text_breaks_and_is_forwarded_as_sent(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim, kvwarm, _, body = await request_after(make_sim, make_proxy, clients, 3)
    body["messages"][0]["content"] = body["messages"][0]["content"].replace("cache key", "cache KEY")
    prefix = await send_as_is(kvwarm, sim, body)
    assert prefix["break"] == "content_changed@1"  # view element 1: the first message (0 is the system)
    assert prefix["repaired"] == "0"


async def test_a_dropped_thinking_block_breaks_and_is_not_re_added(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim, kvwarm, _, body = await request_after(make_sim, make_proxy, clients, 2, thinking=True)
    first = body["messages"][1]
    assert [b["type"] for b in first["content"]] == ["thinking", "tool_use"]
    first["content"] = first["content"][1:]
    prefix = await send_as_is(kvwarm, sim, body)
    assert prefix["break"] == "reasoning_changed@2"
    assert prefix["repaired"] == "0"
    assert metric(kvwarm, "kvwarm_prefix_breaks_total", reason="reasoning_changed") == 1


async def test_a_changed_signature_breaks_and_is_not_restored(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim, kvwarm, _, body = await request_after(make_sim, make_proxy, clients, 2, thinking=True)
    body["messages"][1]["content"][0]["signature"] = "c2lnbmVkIGVsc2V3aGVyZQ=="  # a foreign one: accepted
    prefix = await send_as_is(kvwarm, sim, body)
    assert prefix["break"] == "reasoning_changed@2"


async def test_thinking_blocks_echoed_as_generated_match(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim = await make_sim(cache_mode="vllm")
    kvwarm = await make_proxy(sim)
    agent = MessagesAgent(clients(kvwarm), thinking=True, keep="objects")
    for turn in await agent.run(4):
        assert "break" not in turn.prefix() and turn.prefix()["repaired"] == "0", turn.prefix()
    # The replies (thinking, signature, tool use; streamed and not) were recorded as generated.
    assert agent.turns[-1].prefix()["matched"] == f"{len(agent.turns[-1].request['messages'])}/" + str(
        len(agent.turns[-1].request["messages"]) + 1
    )


async def test_a_changed_tool_input_is_the_clients_to_make(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim, kvwarm, _, body = await request_after(make_sim, make_proxy, clients, 3)
    use = body["messages"][1]["content"][0]
    assert use["type"] == "tool_use"
    use["input"] = {**use["input"], "encoding": "latin-1"}
    prefix = await send_as_is(kvwarm, sim, body)
    assert prefix["break"] == "assistant_modified@2"


def history(value: str, other: str = '"b":2') -> bytes:
    """A conversation whose assistant turn calls a tool with the input ``{"n":value,other}``, as the
    client's own bytes (orjson cannot write a 30-digit integer, nor a repeated key)."""
    tool = {"name": "lookup", "description": "Look a number up.", "input_schema": {"type": "object"}}
    head = orjson.dumps({"model": MODEL, "max_tokens": 64, "system": "Numbers.", "tools": [tool]})[:-1]
    messages = (
        b'[{"role":"user","content":"Look up the number."},'
        b'{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"lookup","input":{"n":'
        + value.encode() + b"," + other.encode() + b'}}]},'
        b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"found"}]}]'
    )
    return head + b',"messages":' + messages + b"}"


async def test_inputs_compare_as_their_text_says(make_sim: Any, make_proxy: ProxyFactory) -> None:
    sim = await make_sim(cache_mode="vllm")
    kvwarm = await make_proxy(sim)
    big = "123456789012345678901234567890"
    first = history(big)
    assert (await post_messages(kvwarm, first))[0] == 200
    # The same input, its keys in another order and spaced: the same meaning, restored as first sent.
    status, headers, _ = await post_messages(kvwarm, history(big).replace(b'{"n":' + big.encode() + b',"b":2}', b'{"b": 2, "n": ' + big.encode() + b"}"))
    assert status == 200
    # A repair would rewrite a value holding an integer orjson cannot keep: refused, sent as is.
    assert prefix_of(headers)["repaired"] == "0"
    assert metric(kvwarm, "kvwarm_repairs_refused_total", reason="unsafe_number") == 1
    # Another 30-digit integer, the same double: another input.
    other = big[:-1] + "1"
    assert orjson.loads(other) == orjson.loads(big)
    status, headers, _ = await post_messages(kvwarm, history(other))
    assert status == 200 and received(sim)[-1].body == history(other)
    assert prefix_of(headers)["matched"] == "2/4"  # the system and the user message, not the call
    # A repeated key is not the input without it, whichever value a parser keeps.
    status, headers, _ = await post_messages(kvwarm, history(big, '"b":2,"b":2'))
    assert status == 200 and prefix_of(headers)["matched"] == "2/4"


async def test_a_pretty_printing_client_needs_no_repair(
    make_sim: Any, make_proxy: ProxyFactory, clients: Clients
) -> None:
    sim, kvwarm, agent, body = await request_after(make_sim, make_proxy, clients, 3)
    inputs = [b["input"] for m in body["messages"] if m["role"] == "assistant" for b in m["content"] if b["type"] == "tool_use"]
    assert any(not json.dumps(value).isascii() or "\\u" in json.dumps(value) for value in inputs)  # non-ASCII to escape
    pretty = json.dumps(body, indent=1).encode()  # spaced, every non-ASCII character escaped
    status, headers, _ = await post_messages(kvwarm, pretty)
    assert status == 200 and received(sim)[-1].body == pretty
    prefix = prefix_of(headers)
    # Its tool inputs, spaced and escaped, mean (and render) what the compact ones the upstream generated do.
    assert prefix["repaired"] == "0" and "break" not in prefix
    assert prefix["matched"].split("/")[0] == str(1 + agent.sent)
    assert rendered(orjson.loads(pretty)) == rendered(body)
