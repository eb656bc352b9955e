"""kvwarm with its keep-alive in front of the reference upstream, both on one clock that the tests
move (``SimClock(lambda: 0.0)``: time passes only when advanced), and agent sessions driven with
the official openai SDK."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from proxy.keepalive import KEEPALIVE, KeepAlive
from proxy.sim.accounting import READ_PRICE, WRITE_PRICE
from proxy.sim.clock import SimClock
from proxy.sim.server import SIM_STATE, SimConfig, create_sim_app
from tests.conftest import proxy_settings, sim_url
from tests.sim.conftest import WEATHER_TOOL, long_system_prompt

MODEL = "sim-keepalive"
SYSTEM = long_system_prompt(200)
"""About 2,800 tokens with the tools: a prefix the upstream caches (1,024 tokens at least)."""
INPUT = SimConfig().price_input
OUTPUT = SimConfig().price_output
USER_AGENT = "kvwarm-keepalive/"


@dataclass
class Pair:
    """The reference upstream and kvwarm in front of it, on one clock."""

    sim: TestServer
    kvwarm: TestServer
    clock: SimClock
    sims: list[TestServer] = field(default_factory=list)
    """Every replica (``sim`` is the first)."""

    @property
    def keeper(self) -> KeepAlive:
        return self.kvwarm.app[KEEPALIVE]

    async def advance(self, seconds: float) -> None:
        """Move both clocks ``seconds`` on, stopping at each moment something of the keep-alive
        falls due to let it run then (as its task would)."""
        end = self.clock() + seconds
        while (due := self.keeper.next_due()) is not None and due <= end:
            self.clock.advance(max(0.0, due - self.clock()))
            await self.keeper.run_due()
        self.clock.advance(end - self.clock())
        await self.keeper.run_due()

    def pings(self, sim: TestServer | None = None) -> list[Any]:
        """The keep-alive pings the upstream (``sim``: that replica) received, oldest first."""
        return [r for r in self._received(sim) if r.headers.get("user-agent", "").startswith(USER_AGENT)]

    def turns(self, sim: TestServer | None = None) -> list[Any]:
        return [r for r in self._received(sim) if not r.headers.get("user-agent", "").startswith(USER_AGENT)]

    def _received(self, sim: TestServer | None) -> list[Any]:
        return [r for server in ([sim] if sim is not None else self.sims) for r in server.app[SIM_STATE].requests]

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """``/metrics`` as a client reads it: (sample name, sorted labels) -> value."""
        async with aiohttp.ClientSession() as s, s.get(self.kvwarm.make_url("/metrics")) as r:
            assert r.status == 200
            text = await r.text()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    async def overview(self) -> dict[str, Any]:
        """``/kvwarm/api/overview``: what the live page shows (``view.text``: its cards' strings)."""
        async with aiohttp.ClientSession() as s, s.get(self.kvwarm.make_url("/kvwarm/api/overview")) as r:
            assert r.status == 200
            data: dict[str, Any] = await r.json()
            return data

    async def sessions(self) -> list[dict[str, Any]]:
        """``/kvwarm/sessions``: what ``kvwarm sessions`` lists."""
        async with aiohttp.ClientSession() as s, s.get(self.kvwarm.make_url("/kvwarm/sessions")) as r:
            assert r.status == 200
            data: list[dict[str, Any]] = (await r.json())["data"]
            return data


PairFactory = Callable[..., Awaitable[Pair]]


def prices_file(tmp_path: Path) -> Path:
    """A price table that prices :data:`MODEL` as the upstream bills it in its breakpoint modes."""
    path = tmp_path / "prices.toml"
    path.write_text(
        f'[models."{MODEL}"]\ninput = {INPUT}\ncached_input = {READ_PRICE * INPUT}\noutput = {OUTPUT}\n'
        f"cache_write_multiplier = {WRITE_PRICE}\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture
async def make_pair(aiohttp_server: Any, tmp_path: Path) -> PairFactory:
    """``await make_pair(mode, **settings)``: a fresh upstream in cache ``mode`` and kvwarm with
    its keep-alive enabled in front of it (``keepalive__budget_usd_per_day=...`` and so on)."""

    async def make(mode: str, *, dialect: str | None = None, replicas: int = 1, **overrides: Any) -> Pair:
        clock = SimClock(lambda: 0.0)
        sims: list[TestServer] = [
            await aiohttp_server(create_sim_app(SimConfig(cache_mode=mode, clock=clock))) for _ in range(replicas)
        ]
        dotted = {
            "upstream.cache_breakpoints": dialect or ("cache_control" if mode == "anthropic" else "openai"),
            "keepalive.enabled": True,
            "metrics.prices_file": str(prices_file(tmp_path)),
            "log.level": "INFO",
            **{k.replace("__", "."): v for k, v in overrides.items()},
        }
        urls = ",".join(sim_url(sim) for sim in sims)
        app = create_app(proxy_settings(urls, **dotted), registry=CollectorRegistry(), clock=clock)
        kvwarm: TestServer = await aiohttp_server(app)
        return Pair(sims[0], kvwarm, clock, sims)

    return make


@dataclass
class Session:
    """A coding agent's session through kvwarm: a task, a tool round per turn, growing history."""

    client: openai.AsyncOpenAI
    name: str
    system: str = SYSTEM
    tools: list[Any] = field(default_factory=lambda: [WEATHER_TOOL])
    messages: list[Any] = field(default_factory=list)
    usages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}, {"role": "user", "content": f"{self.name}: fix the bug."}]

    async def turn(self, **kwargs: Any) -> dict[str, Any]:
        """One request; its reply and the tool's results join the history. Returns its usage."""
        response = await self.client.chat.completions.create(model=MODEL, messages=self.messages, tools=self.tools, **kwargs)
        assert response.usage is not None
        usage = response.usage.model_dump()
        self.usages.append(usage)
        message = response.choices[0].message
        self.messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            self.messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{self.name}: " + "output line. " * 40})
        return usage

    async def streamed_turn(self) -> dict[str, Any]:
        """The same turn as a stream (the usage comes in the last chunk)."""
        stream = await self.client.chat.completions.create(
            model=MODEL, messages=self.messages, tools=self.tools, stream=True, stream_options={"include_usage": True}
        )
        usage: dict[str, Any] = {}
        calls: dict[int, dict[str, Any]] = {}
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                    entry["id"] = call.id or entry["id"]
                    if call.function is not None:
                        entry["function"]["name"] += call.function.name or ""
                        entry["function"]["arguments"] += call.function.arguments or ""
        self.usages.append(usage)
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [calls[i] for i in sorted(calls)]})
        for call in calls.values():
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"{self.name}: " + "output line. " * 40})
        return usage


def cached(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    value: int = details.get("cached_tokens") or 0
    return value


def written(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    value: int = details.get("cache_write_tokens") or 0
    return value


def body_of(request: Any) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(request.body)
    return data


async def learn(pair: Pair, client: openai.AsyncOpenAI, pause: float, sessions: int = 3, *, back: bool = True) -> None:
    """``sessions`` two-turn sessions (``back``: the second turn ``pause`` seconds after the first;
    else none: abandoned, watched past their horizon), so the tenant has a history of pauses."""
    for i in range(sessions):
        session = Session(client, f"warm-up {i}")
        await session.turn()
        if back:
            await pair.advance(pause)
            await session.turn()
        await pair.advance(3 * 3600.0)  # every watch past its horizon: the next session starts clean
        assert not pair.keeper.watches
