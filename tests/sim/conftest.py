"""Fixtures of the reference upstream's tests: chat-request factories, a client factory, an SSE parser."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from proxy.sim.server import SimConfig, create_sim_app

ClientFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


def long_system_prompt(sentences: int = 150) -> str:
    """A system prompt of about ``10 * sentences`` tokens (well above OpenAI's 1024-token minimum)."""
    return "".join(
        f"Rule {i}: keep the prefix stable and the cache warm. " for i in range(sentences)
    )


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "number"}},
        },
    },
}


def make_chat(
    user: str = "What is the weather in Paris?",
    *,
    system: str | None = None,
    history: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A realistic chat request in one call."""
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages += history or []
    messages.append({"role": "user", "content": user})
    body: dict[str, Any] = {"model": "gpt-sim", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    body.update(extra)
    return body


def parse_sse(raw: bytes) -> list[Any]:
    """The events of an SSE body: parsed JSON chunks, and the string ``"[DONE]"``."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events: list[Any] = []
    for block in raw.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block[:50]
        data = block[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


@pytest.fixture
def sim_client(aiohttp_client: Any) -> ClientFactory:
    """``await sim_client(cache_mode="vllm", ..., client_kwargs={...})``: a client of a fresh reference upstream."""

    async def make(
        client_kwargs: dict[str, Any] | None = None, **config: Any
    ) -> TestClient[Any, Any]:
        client: TestClient[Any, Any] = await aiohttp_client(
            create_sim_app(SimConfig(**config)), **(client_kwargs or {})
        )
        return client

    return make


# -- the Responses API ----------------------------------------------------------------------------

EXEC_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY, returning output or a session ID.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "cmd": {"type": "string", "description": "Shell command to execute."},
            "workdir": {"type": "string"},
            "yield_time_ms": {"type": "number"},
        },
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
            "timeout_ms": {"type": "number"},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}
WEATHER_FUNCTION: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
        },
        "required": ["city", "days"],
    },
    "strict": False,
}
WEB_SEARCH_TOOL: dict[str, Any] = {"type": "web_search"}


def make_response_request(
    user: str = "List the files, please.",
    *,
    instructions: str | None = None,
    history: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A realistic Responses request in one call: history items, then a user message item."""
    items: list[dict[str, Any]] = list(history or [])
    items.append(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}
    )
    body: dict[str, Any] = {"model": "gpt-sim", "input": items}
    if instructions is not None:
        body["instructions"] = instructions
    if tools is not None:
        body["tools"] = tools
    body.update(extra)
    return body


def parse_response_sse(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Responses SSE body, checking each block is ``event: T`` + ``data: {"type": T}``."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events: list[dict[str, Any]] = []
    for block in raw.split(b"\n\n")[:-1]:
        event_line, data_line = block.split(b"\n")
        assert event_line.startswith(b"event: ") and data_line.startswith(b"data: "), block[:80]
        payload = orjson.loads(data_line[len(b"data: ") :])
        assert payload["type"] == event_line[len(b"event: ") :].decode()
        events.append(payload)
    return events
