"""kvwarm in front of a real engine speaking Anthropic's Messages API: llama.cpp's ``/v1/messages``.

llama-server turns a Messages request into chat messages for its template (tools in the order
sent) and reports Anthropic's usage (``input_tokens`` beside ``cache_read_input_tokens``), its
slot's KV the only cache. An agent whose tools arrive in another order every turn, as a client
iterating a map sends them, reuses through kvwarm what the same agent without drift reuses.
Skipped unless ``make engine`` has built the engine.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import ProxyFactory
from tests.engine.engine import engine_available, reset_slot, run_engine
from tests.engine.workload import QUESTIONS, SYSTEM

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not engine_available(), reason="engine not built: run `make engine`"),
    pytest.mark.timeout(600),  # llama-server may take 120 s to start; prefill runs on the CPU
]
TURNS = 4
TOOLS: list[dict[str, Any]] = [
    {"name": name, "description": f"{name.replace('_', ' ').capitalize()} in the repository.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                      "required": ["path"]}}
    for name in ("read_file", "search", "write_file", "run_tests", "list_dir")
]


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with run_engine() as base_url:
        yield base_url


@dataclass
class Run:
    cached: list[int] = field(default_factory=list)
    prefixes: list[str] = field(default_factory=list)


def tools_for(turn: int, drift: bool) -> list[dict[str, Any]]:
    tools = copy.deepcopy(TOOLS)
    if drift and turn:
        random.Random(turn).shuffle(tools)
        if tools == TOOLS:
            tools.reverse()
    return tools


async def run_agent(base_url: str, *, drift: bool) -> Run:
    """``TURNS`` requests of one conversation (greedy decoding: the same prompt, the same reply)."""
    run = Run()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where is the cache key computed?"}]
    async with aiohttp.ClientSession() as session:
        for turn in range(TURNS):
            body = {"model": "smollm2", "max_tokens": 24, "temperature": 0, "system": SYSTEM,
                    "tools": tools_for(turn, drift), "messages": messages}
            headers = {"x-api-key": "sk-engine", "anthropic-version": "2023-06-01", "content-type": "application/json"}
            async with session.post(f"{base_url}/messages", data=orjson.dumps(body), headers=headers) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
                run.prefixes.append(response.headers.get("x-kvwarm-prefix", ""))
            run.cached.append(answer["usage"].get("cache_read_input_tokens") or 0)
            messages = [*messages, {"role": "assistant", "content": answer["content"]},
                        {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]
    return run


async def test_tools_reordered_gets_its_ideal_cache_through_kvwarm(engine: str, make_proxy: ProxyFactory) -> None:
    reset_slot(engine)
    ideal = await run_agent(engine, drift=False)
    reset_slot(engine)
    direct = await run_agent(engine, drift=True)
    reset_slot(engine)
    proxy = await make_proxy(engine)
    warm = await run_agent(str(proxy.make_url("/v1")), drift=True)
    assert sum(ideal.cached) > 0
    assert sum(direct.cached) < 0.6 * sum(ideal.cached), "the drift must cost the engine its cache when sent directly"
    assert sum(warm.cached) >= 0.99 * sum(ideal.cached)
    for prefix in warm.prefixes[1:]:
        assert "break" not in prefix and "repaired=0" not in prefix, prefix
