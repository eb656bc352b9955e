"""Provider diagnostics end to end: the official openai SDK through kvwarm to the reference upstream
in ``openai-breakpoints`` mode (proxy/sim/diagnostics.py), with ``upstream.provider_diagnostics``.

kvwarm names each turn's previous response as ``prompt_cache_options.comparison_response_id``;
the upstream's verdict is counted apart from kvwarm's own break: a hit is no miss, an expired
prefix (the upstream's clock moved past its TTL) is the provider's miss, a drift the client made
is kvwarm's break, and a request setting the client changed is the client's miss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx2
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.sim.markers import OPENAI_BREAKPOINTS
from tests.conftest import ProxyFactory, metric, received
from tests.sim.conftest import long_system_prompt

ClientFactory = Callable[..., openai.AsyncOpenAI]

MODEL = "sim-cache"
BRIEF = long_system_prompt(160)
"""About 2000 tokens: a prefix the upstream caches (1024 tokens at least)."""
TTL = 30 * 60


class Session:
    """A Responses API conversation the way Codex sends it: the whole history every turn."""

    def __init__(self, client: openai.AsyncOpenAI) -> None:
        self.client = client
        self.items: list[Any] = [{"type": "message", "role": "developer", "content": BRIEF}]
        self.responses: list[Any] = []

    async def turn(self, text: str, **extra: Any) -> Any:
        self.items.append({"type": "message", "role": "user", "content": text})
        response = await self.client.responses.create(model=extra.pop("model", MODEL), input=self.items, store=False, **extra)
        if extra.get("stream"):
            events = [event async for event in response]
            response = events[-1].response
        self.items.extend(item.model_dump(exclude_none=True) for item in response.output)
        self.responses.append(response)
        return response


def sent(sim: TestServer) -> list[dict[str, Any]]:
    """The bodies the upstream received, parsed."""
    return [orjson.loads(r.body) for r in received(sim)]


def compared_with(body: dict[str, Any]) -> str | None:
    return (body.get("prompt_cache_options") or {}).get("comparison_response_id")


def diagnoses(proxy: TestServer) -> dict[str, float]:
    return {v: metric(proxy, "kvwarm_provider_cache_diagnoses_total", verdict=v) for v in ("hit", "client_miss", "provider_miss", "unknown")}


async def get(server: TestServer, path: str) -> Any:
    """A GET from loopback (the operator's view): parsed JSON, or the page's text."""
    async with aiohttp.ClientSession() as session, session.get(server.make_url(path)) as r:
        assert r.status == 200
        return await r.json() if r.content_type == "application/json" else await r.text()


async def advance(sim: TestServer, seconds: float) -> None:
    async with aiohttp.ClientSession() as session, session.post(sim.make_url("/sim/clock"), json={"advance": seconds}) as r:
        assert r.status == 200


@pytest.fixture
async def routes(make_sim: Any, make_proxy: ProxyFactory) -> tuple[TestServer, TestServer]:
    """The upstream in openai-breakpoints mode, and kvwarm in front of it asking for diagnostics."""
    sim = await make_sim(cache_mode=OPENAI_BREAKPOINTS)
    return sim, await make_proxy(sim, upstream__provider_diagnostics=True)


@pytest.mark.timeout(60)
async def test_a_hit_is_no_miss_and_an_expired_prefix_is_the_providers(
    routes: tuple[TestServer, TestServer], openai_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    sim, proxy = routes
    session = Session(openai_client(proxy))
    first = await session.turn("Task one: list the files.")
    second = await session.turn("Now read the first one.", stream=True)
    bodies = sent(sim)
    assert "prompt_cache_options" not in bodies[0]  # nothing to compare with yet
    assert compared_with(bodies[1]) == first.id
    assert second.prompt_cache_diagnostics.type == "cache_hit"  # the client sees the upstream's own answer
    assert diagnoses(proxy) == {"hit": 1, "client_miss": 0, "provider_miss": 0, "unknown": 0}

    await advance(sim, TTL + 60)
    caplog.set_level(logging.INFO, logger="proxy.request.pipeline")
    third = await session.turn("And the second one.")
    assert compared_with(sent(sim)[2]) == second.id
    assert third.usage.input_tokens_details.cached_tokens == 0
    assert diagnoses(proxy) == {"hit": 1, "client_miss": 0, "provider_miss": 1, "unknown": 0}
    assert metric(proxy, "kvwarm_provider_cache_misses_total", side="provider", reason="expired") == 1
    assert sum(metric(proxy, "kvwarm_prefix_breaks_total", reason=r) for r in ("content_changed", "system_changed")) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("responses "))
    assert "break=- provider=provider:expired" in line
    # The live page: the provider's misses by side, beside kvwarm's own breaks.
    overview = await get(proxy, "/kvwarm/api/overview")
    assert (overview["totals"]["provider_side_misses"], overview["totals"]["client_side_misses"]) == (1, 0)
    page = await get(proxy, "/kvwarm/")
    assert "Misses the provider diagnosed" in page
    assert "0 client-side: the request changed" in page and "of 2 responses the provider diagnosed" in page


@pytest.mark.timeout(60)
async def test_a_client_drift_is_kvwarms_break_and_a_changed_setting_the_clients_miss(
    routes: tuple[TestServer, TestServer], openai_client: ClientFactory
) -> None:
    sim, proxy = routes
    session = Session(openai_client(proxy))
    first = await session.turn("Task one: list the files.")
    await session.turn("Now read the first one.")
    # The client rewrites its second message (no formatting drift: a change kvwarm must not undo).
    session.items[3] = {"type": "message", "role": "user", "content": "Now read the LAST one."}
    raw = await session.client.responses.with_raw_response.create(model=MODEL, input=[*session.items, {"role": "user", "content": "Go on."}], store=False)
    assert raw.headers["x-kvwarm-break"].startswith("content_changed at messages[3]")
    # Compared with the last response whose reply is still in the request's matched prefix: the
    # upstream read all it wrote. The miss is the client's, as kvwarm's break says; none is the provider's.
    assert compared_with(sent(sim)[2]) == first.id
    assert raw.parse().prompt_cache_diagnostics.type == "cache_hit"
    assert metric(proxy, "kvwarm_prefix_breaks_total", reason="content_changed") == 1
    assert diagnoses(proxy)["provider_miss"] == 0

    # A setting kvwarm does not see changed: the upstream names it.
    other = Session(openai_client(proxy))
    await other.turn("Task two: count the lines.")
    changed = await other.turn("Per file, please.", model="sim-cache-large")
    assert changed.prompt_cache_diagnostics.type == "cache_miss"
    assert metric(proxy, "kvwarm_provider_cache_misses_total", side="client", reason="model_changed") == 1
    assert diagnoses(proxy) == {"hit": 2, "client_miss": 1, "provider_miss": 0, "unknown": 0}


@pytest.mark.timeout(60)
async def test_the_clients_own_comparison_and_previous_response_id(
    routes: tuple[TestServer, TestServer], openai_client: ClientFactory
) -> None:
    sim, proxy = routes
    session = Session(openai_client(proxy))
    first = await session.turn("Task one: list the files.")
    await session.turn("Now read the first one.")
    await session.turn("And the second.", prompt_cache_options={"comparison_response_id": first.id, "ttl": "12h"})
    assert sent(sim)[2]["prompt_cache_options"] == {"comparison_response_id": first.id, "ttl": "12h"}  # never replaced
    client = openai_client(proxy)
    stored = await client.responses.create(model=MODEL, input=[{"role": "developer", "content": BRIEF}, {"role": "user", "content": "Hi."}])
    follow = await client.responses.create(model=MODEL, previous_response_id=stored.id, input="And then?")
    assert compared_with(sent(sim)[-1]) == stored.id
    assert follow.prompt_cache_diagnostics.type == "cache_hit"
    assert diagnoses(proxy)["hit"] == 3  # the client's own comparison is counted too


@pytest.mark.timeout(60)
async def test_off_the_upstream_gets_the_clients_bytes(
    make_sim: Any, make_proxy: ProxyFactory, openai_client: ClientFactory
) -> None:
    sim = await make_sim(cache_mode=OPENAI_BREAKPOINTS)
    proxy = await make_proxy(sim)  # upstream.provider_diagnostics is off by default
    bodies: list[bytes] = []

    async def keep(request: httpx2.Request) -> None:
        bodies.append(request.content)

    async with httpx2.AsyncClient(event_hooks={"request": [keep]}) as http:
        session = Session(openai_client(proxy, http_client=http))
        for text in ("Task one: list the files.", "Now read the first one.", "And the second."):
            await session.turn(text)
    assert [r.body for r in received(sim)] == bodies
    assert all(b"prompt_cache_options" not in body for body in bodies)
    assert sum(diagnoses(proxy).values()) == 0


@pytest.mark.timeout(60)
async def test_a_comparison_that_fails_fails_open(
    routes: tuple[TestServer, TestServer], openai_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvwarm's own error while naming the comparison: counted, and the request goes without it."""
    sim, proxy = routes

    def broken(api: str, raw: bytes, body: Any, response_id: str) -> bytes:
        raise RuntimeError("boom")

    monkeypatch.setattr("proxy.request.turn.asked", broken)
    session = Session(openai_client(proxy))
    await session.turn("Task one: list the files.")
    second = await session.turn("Now read the first one.")
    assert second.prompt_cache_diagnostics is None
    assert "prompt_cache_options" not in sent(sim)[1]
    assert metric(proxy, "kvwarm_errors_total", stage="diagnostics") == 1
