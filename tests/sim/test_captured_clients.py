"""Real clients' Responses requests (captured in ``tests/fixtures/responses``), replayed byte for byte.

The Codex CLI and the openai-agents SDK each sent a session's requests to a
capture upstream; here the same bytes go to the reference upstream: its script
must drive each client through one tool call and a final message, every event
must parse as the SDK's typed events, and a turn must find the previous turn
cached — also when every client-made id changes, as it does between two Codex
sessions.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "responses"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
MakeSim = Callable[..., Awaitable[TestServer]]


def fixture(name: str) -> bytes:
    path = FIXTURES / f"{name}.raw.json"
    if not path.is_file():
        pytest.skip(f"{path} is missing (captured by tests/clients/capture.py)")
    return path.read_bytes()


async def send(server: TestServer, body: bytes) -> Response:
    """POST the exact bytes; the final response, every streamed event validated by the SDK's models."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            server.make_url("/v1/responses"),
            data=body,
            headers={"content-type": "application/json"},
        ) as reply,
    ):
        raw = await reply.read()
        assert reply.status == 200, raw[:500]
    if not raw.startswith(b"event: "):
        return Response.model_validate(orjson.loads(raw))
    events = [
        EVENTS.validate_python(orjson.loads(block.split(b"\ndata: ", 1)[1]))
        for block in raw.split(b"\n\n")[:-1]
    ]
    assert events[-1].type == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final: Response = events[-1].response
    return final


def cached(response: Response) -> int:
    assert response.usage is not None
    return response.usage.input_tokens_details.cached_tokens


def with_new_ids(body: bytes) -> bytes:
    """The same request as another session of the client would send it: every item id regenerated."""
    request = orjson.loads(body)
    for item in request["input"]:
        if "id" in item:
            item["id"] = item["id"].split("_", 1)[0] + "_" + str(uuid.uuid4())
    return orjson.dumps(request)


@pytest.mark.parametrize("cache_mode", ["openai", "vllm"])
async def test_codex_session_one_exec_command_then_a_message(
    make_sim: MakeSim, cache_mode: str
) -> None:
    server = await make_sim(cache_mode=cache_mode)
    first = await send(server, fixture("codex_turn1"))
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content  # include asked for it
    assert reasoning.summary  # reasoning.summary = "auto"
    assert call.type == "function_call"
    assert (call.name, call.arguments) == ("exec_command", '{"cmd":"echo kvwarm"}')

    second = await send(server, fixture("codex_turn2"))
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert first.usage is not None
    block = 128 if cache_mode == "openai" else 16
    assert cached(second) >= (first.usage.input_tokens - 1) // block * block

    # Another Codex session: identical content, every id different. Ids never render.
    other = await send(server, with_new_ids(fixture("codex_turn2")))
    assert cached(other) >= cached(second)
    assert other.usage is not None and second.usage is not None
    assert other.usage.input_tokens == second.usage.input_tokens


async def test_codex_code_mode_runs_its_exec_tool(make_sim: MakeSim) -> None:
    server = await make_sim()
    first = await send(server, fixture("codex_codemode_turn1"))
    call = first.output[-1]
    assert call.type == "custom_tool_call" and call.name == "exec"
    assert "echo kvwarm" in call.input
    second = await send(server, fixture("codex_codemode_turn2"))
    assert second.output[-1].type == "message"
    assert first.usage is not None
    assert cached(second) >= (first.usage.input_tokens - 1) // 128 * 128


async def test_openai_agents_session(make_sim: MakeSim) -> None:
    server = await make_sim(cache_mode="vllm")
    first = await send(server, fixture("agents_turn1"))
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert list(orjson.loads(call.arguments)) == ["city"]
    second = await send(server, fixture("agents_turn2"))
    assert [item.type for item in second.output] == ["message"]
    third = await send(server, fixture("agents_turn3"))  # a new user turn: the tool again
    assert [item.type for item in third.output] == ["function_call"]
    assert second.usage is not None
    assert cached(third) >= (second.usage.input_tokens - 1) // 16 * 16
