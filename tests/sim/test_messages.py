"""The reference upstream's Messages API (Anthropic's), driven by the official ``anthropic`` SDK.

The SDK client validates every body and event strictly against its own models
(``_strict_response_validation``), so a field the SDK needs and the emulator
lacks fails the test. proxy/sim/messages.py says what the endpoint does,
proxy/sim/content_blocks.py how a request renders, proxy/sim/markers.py how
``cache_control`` caches.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.clock import SimClock
from proxy.sim.content_blocks import to_messages
from proxy.sim.messages import render_message_prompt
from proxy.sim.render import render_tokens
from proxy.sim.sealed import seal
from proxy.sim.state import SIM_STATE, SimConfig
from tests.sim.conftest import long_system_prompt

MODEL = "claude-sim"
STABLE = long_system_prompt(150)
EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}
HOUR: dict[str, Any] = {"type": "ephemeral", "ttl": "1h"}
BASH: dict[str, Any] = {
    "name": "Bash",
    "description": "Executes a given bash command and returns its output.",
    "input_schema": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to execute"},
            "timeout": {"type": "number"},
            "description": {"type": "string"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
READ: dict[str, Any] = {
    "name": "Read",
    "description": "Reads a file from the local filesystem.",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}, "limit": {"type": "number"}},
        "required": ["file_path"],
    },
}

Claude = Callable[..., Awaitable[tuple[TestServer, anthropic.AsyncAnthropic]]]


@pytest.fixture
async def claude(
    make_sim: Callable[..., Awaitable[TestServer]],
) -> AsyncIterator[Claude]:
    """``server, client = await claude(cache_mode="anthropic")``: a fresh emulator and a strict
    ``anthropic`` SDK client of it."""
    clients: list[anthropic.AsyncAnthropic] = []

    async def make(**config: Any) -> tuple[TestServer, anthropic.AsyncAnthropic]:
        server = await make_sim(**config)
        client = anthropic.AsyncAnthropic(
            base_url=str(server.make_url("")),
            api_key="sk-ant-test",
            max_retries=0,
            timeout=10,
            _strict_response_validation=True,
        )
        clients.append(client)
        return server, client

    yield make
    for client in clients:
        await client.close()


def system(marker: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    block: dict[str, Any] = {"type": "text", "text": STABLE}
    if marker is not None:
        block["cache_control"] = marker
    return [block]


def user(text: str, marker: dict[str, Any] | None = None) -> dict[str, Any]:
    if marker is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": marker}]}


def ends_at(system_: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> int:
    """Tokens of the prompt up to the end of ``messages`` (a breakpoint on their last block)."""
    if not messages:
        chat = [{"role": "system", "content": system_}]
    else:
        chat = to_messages(system_, messages)
    return len(render_tokens(chat, tools, add_generation_prompt=False))


async def create(client: anthropic.AsyncAnthropic, **body: Any) -> anthropic.types.Message:
    body.setdefault("model", MODEL)
    body.setdefault("max_tokens", 1024)
    return await client.messages.create(**body)


async def count(client: anthropic.AsyncAnthropic, **body: Any) -> int:
    body.setdefault("model", MODEL)
    counted = await client.messages.count_tokens(**body)
    return counted.input_tokens


def usage_of(message: anthropic.types.Message) -> tuple[int, int, int]:
    """``(input_tokens, cache_creation_input_tokens, cache_read_input_tokens)``."""
    usage = message.usage
    assert usage.cache_creation_input_tokens is not None
    assert usage.cache_read_input_tokens is not None
    return usage.input_tokens, usage.cache_creation_input_tokens, usage.cache_read_input_tokens


def dump(message: anthropic.types.Message) -> list[dict[str, Any]]:
    """A reply's content as a client sends it back."""
    return [block.model_dump(exclude_none=True) for block in message.content]


async def post(server: TestServer, path: str, body: Any, **headers: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            server.make_url(path),
            data=body if isinstance(body, bytes) else orjson.dumps(body),
            headers=headers,
        ) as response,
    ):
        return response.status, await response.read()


def parse_events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Messages SSE body, checking each block is ``event: T`` + ``data: {"type": T}``."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events = []
    for block in raw.split(b"\n\n")[:-1]:
        event_line, data_line = block.split(b"\n")
        assert event_line.startswith(b"event: ") and data_line.startswith(b"data: "), block[:80]
        payload = orjson.loads(data_line[len(b"data: ") :])
        assert payload["type"] == event_line[len(b"event: ") :].decode()
        events.append(payload)
    return events


# -- shapes -----------------------------------------------------------------------------------


async def test_a_text_reply_with_anthropic_usage_and_a_request_id(claude: Claude) -> None:
    _, client = await claude()
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=256, messages=[user("Hello?")]
    )
    message = await raw.parse()
    assert raw.headers["request-id"].startswith("req_")
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.cache_creation is not None
    assert message.usage.output_tokens > 0
    prompt = sum(usage_of(message))
    assert prompt == len(render_tokens([{"role": "user", "content": "Hello?"}], None))
    assert prompt == await count(client, messages=[user("Hello?")])


async def test_the_stream_sends_anthropics_event_sequence(claude: Claude) -> None:
    server, _ = await claude()
    body = {
        "model": MODEL,
        "max_tokens": 2048,
        "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [BASH],
        "messages": [user("List the files.")],
    }
    status, raw = await post(server, "/v1/messages", body)
    assert status == 200
    events = parse_events(raw)
    kinds = [event["type"] for event in events]
    deltas = [event["delta"]["type"] for event in events if event["type"] == "content_block_delta"]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("ping") == 1 and kinds.count("content_block_stop") == 2
    assert deltas[-1] == "input_json_delta" and "signature_delta" in deltas
    assert set(deltas[: deltas.index("signature_delta")]) == {"thinking_delta"}
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 1

    blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert blocks[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert (
        blocks[1]["type"] == "tool_use" and blocks[1]["input"] == {} and blocks[1]["name"] == "Bash"
    )
    partial = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 1
    ]
    assert partial[0] == ""
    assert "".join(partial) == '{"command":"echo kvwarm"}'
    final = events[-2]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert set(final["usage"]) == {
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
    }
    assert final["usage"]["output_tokens"] > 1
    assert final["usage"]["input_tokens"] == start["usage"]["input_tokens"]


async def test_a_stream_gives_the_sdk_the_message_the_json_answer_gives(claude: Claude) -> None:
    _, client = await claude(cache_mode="vllm")
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [READ, BASH],
        "messages": [user("Show me the log.")],
    }
    whole = await client.messages.create(**body)
    async with client.messages.stream(**body) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert "message_start" in kinds and "message_stop" in kinds
    assert dump(streamed) == dump(whole)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert sum(usage_of(streamed)) == sum(usage_of(whole))
    assert streamed.usage.output_tokens == whole.usage.output_tokens


async def test_a_tool_use_then_its_result_then_an_answer(claude: Claude) -> None:
    server, client = await claude()
    history: list[dict[str, Any]] = [user("What is in this directory?")]
    first = await create(client, tools=[READ, BASH], messages=history)
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "Bash" and call.input == {"command": "echo kvwarm"}
    history += [
        {"role": "assistant", "content": dump(first)},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "kvwarm\n"}],
        },
    ]
    second = await create(client, tools=[READ, BASH], messages=history)
    assert second.stop_reason == "end_turn"
    assert [block.type for block in second.content] == ["text"]
    assert [r.endpoint for r in server.app[SIM_STATE].requests] == ["messages", "messages"]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "none"}, []),
        ({"type": "auto"}, ["Bash", "Read"]),
        ({"type": "tool", "name": "Read"}, ["Read"]),
        ({"type": "auto", "disable_parallel_tool_use": True}, ["Bash"]),
    ],
)
async def test_tool_choice_steers_the_call(
    claude: Claude, choice: dict[str, Any], expected: list[str]
) -> None:
    server, _ = await claude()
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "tools": [READ, BASH],
        "tool_choice": choice,
        "messages": [user("Go.")],
    }
    status, raw = await post(server, "/v1/messages", body, **{"x-sim-tool-calls": "2"})
    assert status == 200
    content = orjson.loads(raw)["content"]
    assert [block["name"] for block in content if block["type"] == "tool_use"] == expected


async def test_thinking_is_signed_and_its_signature_checked(claude: Claude) -> None:
    _, client = await claude()
    thinking = {"type": "enabled", "budget_tokens": 1024}
    first = await create(client, thinking=thinking, messages=[user("Why?")])
    block = first.content[0]
    assert block.type == "thinking" and block.thinking
    assert block.signature == seal(block.thinking)
    assert first.stop_reason == "end_turn" and first.content[1].type == "text"

    echoed = dump(first)
    follow = [user("Why?"), {"role": "assistant", "content": echoed}, user("And then?")]
    await create(client, thinking=thinking, messages=follow)  # its own signature: accepted

    forged = copy.deepcopy(echoed)
    forged[0]["thinking"] = "I changed my mind."
    follow[1] = {"role": "assistant", "content": forged}
    with pytest.raises(anthropic.BadRequestError) as caught:
        await create(client, thinking=thinking, messages=follow)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"] == {
        "type": "invalid_request_error",
        "message": "messages.1.content.0: Invalid `signature` in `thinking` block",
    }


async def test_beta_query_bearer_key_and_anthropic_headers_are_accepted(claude: Claude) -> None:
    server, _ = await claude()
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "prompt-caching-2024-07-31,extended-cache-ttl-2025-04-11",
    }
    body = {"model": MODEL, "max_tokens": 64, "messages": [user("Hi.")]}
    for auth in ({"x-api-key": "sk-ant-1"}, {"Authorization": "Bearer sk-ant-2"}):
        status, _ = await post(server, "/v1/messages?beta=true", body, **headers, **auth)
        assert status == 200
    status, raw = await post(server, "/v1/messages/count_tokens?beta=true", body, **headers)
    assert status == 200 and orjson.loads(raw)["input_tokens"] > 0
    log = server.app[SIM_STATE].requests
    assert [r.endpoint for r in log] == ["messages", "messages", "messages.count_tokens"]
    assert log[0].path == "/v1/messages?beta=true"
    assert log[0].headers["x-api-key"] == "sk-ant-1"
    assert log[1].headers["authorization"] == "Bearer sk-ant-2"
    assert log[0].headers["anthropic-beta"].startswith("prompt-caching")


# -- rendering ----------------------------------------------------------------------------------


def tokens(**body: Any) -> list[int]:
    """The prompt tokens of a Messages request, as the endpoint renders it (anthropic mode:
    its markers checked too)."""
    body.setdefault("model", MODEL)
    body.setdefault("messages", [user("Hi.")])
    return render_message_prompt(body, SimConfig(cache_mode="anthropic"), True).tokens


USE: dict[str, Any] = {
    "type": "tool_use",
    "id": "toolu_a",
    "name": "Read",
    "input": {"file_path": "a", "limit": 2},
}
RESULT: dict[str, Any] = {"type": "tool_result", "tool_use_id": "toolu_a", "content": "ok"}
TEXT_BLOCK: dict[str, Any] = {"role": "user", "content": [{"type": "text", "text": "Hi."}]}
IMAGE: dict[str, Any] = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
}


def loop(use: dict[str, Any] = USE, result: dict[str, Any] = RESULT) -> list[dict[str, Any]]:
    """A tool loop: a question, the tool use, its result."""
    return [
        user("Read a."),
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]


SAME_TOKENS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "a string and one text block": ({"messages": [user("Hi.")]}, {"messages": [TEXT_BLOCK]}),
    "a system string and one system block": (
        {"system": "Be brief."},
        {"system": [{"type": "text", "text": "Be brief."}]},
    ),
    "cache_control on a text block": (
        {"messages": [user("Hi.", EPHEMERAL)]},
        {"messages": [TEXT_BLOCK]},
    ),
    "cache_control on system, tools and top level": (
        {
            "system": system(HOUR),
            "tools": [{**READ, "cache_control": EPHEMERAL}],
            "cache_control": EPHEMERAL,
        },
        {"system": system(), "tools": [READ]},
    ),
    "cache_control on a tool_result": (
        {"messages": loop(result={**RESULT, "cache_control": EPHEMERAL})},
        {"messages": loop()},
    ),
    "tool ids": (
        {"messages": loop({**USE, "id": "toolu_b"}, {**RESULT, "tool_use_id": "toolu_b"})},
        {"messages": loop()},
    ),
    "a tool_result string and one text block": (
        {"messages": loop(result={**RESULT, "content": [{"type": "text", "text": "ok"}]})},
        {"messages": loop()},
    ),
}
OTHER_TOKENS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tool order": ({"tools": [READ, BASH]}, {"tools": [BASH, READ]}),
    "a tool's key order": (
        {"tools": [READ]},
        {
            "tools": [
                {
                    "description": READ["description"],
                    "name": "Read",
                    "input_schema": READ["input_schema"],
                }
            ]
        },
    ),
    "tool_use input key order": (
        {"messages": loop({**USE, "input": {"limit": 2, "file_path": "a"}})},
        {"messages": loop()},
    ),
    "is_error": ({"messages": loop(result={**RESULT, "is_error": True})}, {"messages": loop()}),
    "an image": (
        {"messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "Hi."}]}]},
        {"messages": [TEXT_BLOCK]},
    ),
}


@pytest.mark.parametrize(("one", "other"), SAME_TOKENS.values(), ids=SAME_TOKENS.keys())
def test_render_the_same(one: dict[str, Any], other: dict[str, Any]) -> None:
    assert tokens(**one) == tokens(**other)


@pytest.mark.parametrize(("one", "other"), OTHER_TOKENS.values(), ids=OTHER_TOKENS.keys())
def test_render_differently(one: dict[str, Any], other: dict[str, Any]) -> None:
    assert tokens(**one) != tokens(**other)


async def test_count_tokens_counts_what_a_message_reports(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    body: dict[str, Any] = {"system": system(EPHEMERAL), "tools": [READ, BASH], "messages": loop()}
    counted = await count(client, **body)
    assert counted == len(tokens(**body))
    message = await create(client, **body)
    assert sum(usage_of(message)) == counted
    assert usage_of(message)[1] > 0  # it wrote, and still adds up


async def test_reordered_tools_miss_the_cache_of_a_local_engine(claude: Claude) -> None:
    _, client = await claude(cache_mode="vllm")
    await create(client, system=system(), tools=[READ, BASH], messages=[user("One?")])
    same = await create(client, system=system(), tools=[READ, BASH], messages=[user("Two?")])
    reordered = await create(client, system=system(), tools=[BASH, READ], messages=[user("Two?")])
    tools_end = len(render_tokens([], [READ, BASH], add_generation_prompt=False))
    assert usage_of(same)[2] > tools_end
    assert usage_of(reordered)[2] < tools_end


async def test_thinking_and_redacted_thinking_render_their_reasoning(claude: Claude) -> None:
    _, client = await claude()
    thought = "Let me look at the files first."

    def turn(block: dict[str, Any]) -> list[dict[str, Any]]:
        answer = [block, {"type": "text", "text": "Done."}]
        return [user("Go."), {"role": "assistant", "content": answer}, user("Next?")]

    signed = {"type": "thinking", "thinking": thought, "signature": seal(thought)}
    redacted = {"type": "redacted_thinking", "data": seal(thought)}
    foreign = {"type": "thinking", "thinking": thought, "signature": "EqQBCkgIARAB"}
    plain = [user("Go."), {"role": "assistant", "content": "Done."}, user("Next?")]
    with_thought = await count(client, messages=turn(signed))
    assert with_thought == await count(client, messages=turn(redacted))
    assert with_thought == await count(client, messages=turn(foreign))
    assert with_thought > await count(client, messages=plain)


# -- caching: the anthropic mode ------------------------------------------------------------------


async def test_a_breakpoint_writes_then_reads_and_usage_adds_up(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    stable = ends_at(system(), [])
    first = await create(client, system=system(EPHEMERAL), messages=[user("One?")])
    total = await count(client, system=system(EPHEMERAL), messages=[user("One?")])
    assert usage_of(first) == (total - stable, stable, 0)
    assert first.usage.cache_creation is not None
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == stable
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == 0
    second = await create(client, system=system(EPHEMERAL), messages=[user("Two?")])
    total = await count(client, system=system(EPHEMERAL), messages=[user("Two?")])
    assert usage_of(second) == (total - stable, 0, stable)


async def test_nothing_is_cached_without_markers(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    for question in ("One?", "One?"):
        message = await create(client, system=system(), messages=[user(question)])
        assert usage_of(message)[1:] == (0, 0)


async def test_an_hour_breakpoint_before_a_five_minute_one_splits_the_write(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    turn = [user(long_system_prompt(120), EPHEMERAL)]
    message = await create(client, system=system(HOUR), messages=turn)
    stable, both = ends_at(system(), []), ends_at(system(), turn)
    assert message.usage.cache_creation is not None
    assert message.usage.cache_creation.ephemeral_1h_input_tokens == stable
    assert message.usage.cache_creation.ephemeral_5m_input_tokens == both - stable
    assert usage_of(message)[1] == both


async def test_more_than_four_breakpoints_are_refused(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    parts = [{"type": "text", "text": f"Part {i}. ", "cache_control": EPHEMERAL} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        await create(client, system=system(), messages=[{"role": "user", "content": parts}])
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"] == {
        "type": "invalid_request_error",
        "message": "A maximum of 4 blocks with cache_control may be provided. Found 5.",
    }
    with pytest.raises(anthropic.BadRequestError, match="Found 5"):
        await count(client, system=system(), messages=[{"role": "user", "content": parts}])
    await create(client, system=system(), messages=[{"role": "user", "content": parts[:4]}])
    with pytest.raises(anthropic.BadRequestError, match="Found 5"):
        four = [{"role": "user", "content": parts[:4]}, user("Last.")]
        await create(client, system=system(), messages=four, cache_control=EPHEMERAL)


async def test_a_malformed_marker_is_refused_with_its_path(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    with pytest.raises(anthropic.BadRequestError, match=r"system\.0\.cache_control\.ttl"):
        await create(
            client, system=system({"type": "ephemeral", "ttl": "10m"}), messages=[user("Hi.")]
        )


@pytest.mark.parametrize(("back", "hits"), [(20, True), (21, False)])
async def test_a_breakpoint_reads_a_prefix_up_to_20_blocks_back(
    claude: Claude, back: int, hits: bool
) -> None:
    _, client = await claude(cache_mode="anthropic")
    await create(client, system=system(EPHEMERAL), messages=[user("Start.")])
    # The written prefix ends at the system block; the breakpoint is `back` blocks after it.
    notes = [{"type": "text", "text": f"Note {i}. "} for i in range(back - 1)]
    notes.append({"type": "text", "text": "Now?", "cache_control": EPHEMERAL})
    message = await create(client, system=system(), messages=[{"role": "user", "content": notes}])
    assert usage_of(message)[2] == (ends_at(system(), []) if hits else 0)


async def test_top_level_cache_control_caches_the_conversation_as_it_grows(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    turn = [user("One?")]
    first = await create(client, system=system(), messages=turn, cache_control=EPHEMERAL)
    assert usage_of(first)[1:] == (ends_at(system(), turn), 0)
    grown = [*turn, {"role": "assistant", "content": dump(first)}, user("Two?")]
    second = await create(client, system=system(), messages=grown, cache_control=EPHEMERAL)
    read = ends_at(system(), turn)
    assert usage_of(second)[1:] == (ends_at(system(), grown) - read, read)


async def test_five_minutes_refreshed_on_each_read_an_hour_when_asked(claude: Claude) -> None:
    clock = SimClock(lambda: 0.0)
    _, client = await claude(cache_mode="anthropic", clock=clock)
    stable = ends_at(system(), [])

    async def read_back(question: str) -> int:
        # The breakpoint is on the question: the system prefix is read a block back.
        return usage_of(
            await create(client, system=system(), messages=[user(question, EPHEMERAL)])
        )[2]

    await create(client, system=system(EPHEMERAL), messages=[user("One?")])
    clock.advance(299)
    assert await read_back("Two?") == stable
    clock.advance(299)  # 598 s after the write, 299 after the read that refreshed it
    assert await read_back("Three?") == stable
    clock.advance(301)
    assert await read_back("Four?") == 0

    await create(client, system=system(HOUR), messages=[user("Five?")])
    clock.advance(3000)
    assert await read_back("Six?") == stable
    clock.advance(3601)
    assert await read_back("Seven?") == 0


async def test_a_marked_tool_result_caches_the_agent_loop(claude: Claude) -> None:
    _, client = await claude(cache_mode="anthropic")
    history: list[dict[str, Any]] = [user("What is here?")]
    first = await create(client, system=system(EPHEMERAL), tools=[BASH], messages=history)
    (call,) = first.content
    assert call.type == "tool_use"
    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": "kvwarm\n",
        "cache_control": EPHEMERAL,
    }
    history += [
        {"role": "assistant", "content": dump(first)},
        {"role": "user", "content": [result]},
    ]
    second = await create(client, system=system(EPHEMERAL), tools=[BASH], messages=history)
    stable = ends_at(system(), [], [BASH])
    assert usage_of(second)[1:] == (ends_at(system(), history, [BASH]) - stable, stable)


# -- caching: the vllm mode (every prefix, as a local engine) ------------------------------------


async def test_the_vllm_mode_caches_every_prefix_and_the_generated_turn(claude: Claude) -> None:
    _, client = await claude(cache_mode="vllm")
    history: list[dict[str, Any]] = [user("What is here?")]
    first = await create(client, system=system(), tools=[BASH], messages=history)
    total = await count(client, system=system(), tools=[BASH], messages=history)
    assert usage_of(first) == (total, 0, 0)
    again = await create(client, system=system(), tools=[BASH], messages=history)
    assert usage_of(again) == (total - (total - 1) // 16 * 16, 0, (total - 1) // 16 * 16)

    (call,) = first.content
    assert call.type == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "kvwarm\n"}
    history += [
        {"role": "assistant", "content": dump(first)},
        {"role": "user", "content": [result]},
    ]
    second = await create(client, system=system(), tools=[BASH], messages=history)
    generated = ends_at(system(), history[:2], [BASH])  # the prompt and the reply, as echoed
    total = await count(client, system=system(), tools=[BASH], messages=history)
    assert usage_of(second) == (total - generated // 16 * 16, 0, generated // 16 * 16)


# -- errors and faults ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "There was an error parsing the body"),
        ({"model": MODEL, "messages": [user("Hi.")]}, "max_tokens: Field required"),
        ({"max_tokens": 9, "messages": [user("Hi.")]}, "model: Field required"),
        ({"model": MODEL, "max_tokens": 9, "messages": []}, "messages: Input should be"),
        (
            {"model": MODEL, "max_tokens": 9, "messages": [{"role": "system", "content": "x"}]},
            "messages.0.role: Input should be 'user' or 'assistant'",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 9,
                "messages": [
                    user("Hi."),
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}],
                    },
                ],
            },
            "messages.1.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_x.",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 9,
                "messages": [
                    user("Hi."),
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "toolu_y", "name": "Bash", "input": {}}
                        ],
                    },
                    user("Well?"),
                ],
            },
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_y.",
        ),
    ],
)
async def test_a_refused_request_gets_an_anthropic_error(
    claude: Claude, body: Any, message: str
) -> None:
    server, _ = await claude()
    status, raw = await post(server, "/v1/messages", body)
    assert status == 400
    error = orjson.loads(raw)
    assert error["type"] == "error" and error["request_id"].startswith("req_")
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(message)


async def test_faults_answer_in_anthropics_shape(claude: Claude) -> None:
    server, client = await claude()
    with pytest.raises(anthropic.InternalServerError) as caught:
        await create(
            client,
            messages=[user("Hi.")],
            extra_headers={"x-sim-fault": "status=529,retry_after=3"},
        )
    assert caught.value.status_code == 529
    assert caught.value.response.headers["retry-after"] == "3"
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.RateLimitError):
        await count(client, messages=[user("Hi.")], extra_headers={"x-sim-fault": "status=429"})
    assert [r.endpoint for r in server.app[SIM_STATE].requests] == [
        "messages",
        "messages.count_tokens",
    ]


async def test_a_stream_cut_short_fails_the_client_and_caches_no_reply(claude: Claude) -> None:
    server, client = await claude(cache_mode="vllm")
    body = {"model": MODEL, "max_tokens": 64, "stream": True, "messages": [user("Hi.")]}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            server.make_url("/v1/messages"),
            data=orjson.dumps(body),
            headers={"x-sim-fault": "reset_after=3"},
        ) as response,
    ):
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    prompt = await count(client, messages=[user("Hi.")])
    assert len(server.app[SIM_STATE].cache) == prompt // 16  # the prompt's blocks, no reply's
