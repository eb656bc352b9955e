"""Routing fixtures: a pool of reference upstreams as replicas, kvwarm in front, and who served what."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import PIPELINE
from proxy.routing import Router
from proxy.sim.server import SimConfig, create_sim_app
from tests.agents import SYSTEM, USER_TURNS, Agent, Drift, no_drift
from tests.conftest import ProxyFactory, received, sim_url

PoolFactory = Callable[..., Awaitable[list[TestServer]]]
PooledFactory = Callable[..., Awaitable[TestServer]]
SESSION = re.compile(rb"Session (\d+):")


@pytest.fixture
async def make_pool(aiohttp_server: Any) -> PoolFactory:
    """``make_pool(n, **sim_config)``: ``n`` reference upstreams (the replicas)."""

    async def make(n: int, **config: Any) -> list[TestServer]:
        return [await aiohttp_server(create_sim_app(SimConfig(**config))) for _ in range(n)]

    return make


@pytest.fixture
def make_pooled(make_proxy: ProxyFactory) -> PooledFactory:
    """``make_pooled(replicas, **settings)``: kvwarm over the replicas (TestServers or URLs)."""

    async def make(replicas: Sequence[TestServer | str], **overrides: Any) -> TestServer:
        urls = [r if isinstance(r, str) else sim_url(r) for r in replicas]
        return await make_proxy(urls[0], upstream__base_url=urls, **overrides)

    return make


def router_of(kvwarm: TestServer) -> Router:
    return kvwarm.app[PIPELINE].router


def system_prompt(k: int) -> str:
    return f"Project {k}: " + SYSTEM


def session_agent(i: int, post: Any, *, prompt: int = 0, drift: Drift = no_drift) -> Agent:
    """Agent ``i``: its own first message ``Session i: ...`` (the marker), system prompt ``prompt``."""
    return Agent(post, drift=drift, system=system_prompt(prompt), user_turns=[f"Session {i}: {USER_TURNS[0]}", *USER_TURNS[1:]])


def served(replicas: Sequence[TestServer]) -> dict[int, list[int]]:
    """Session number -> the replica index of each of its requests (per replica, in arrival order)."""
    out: dict[int, list[int]] = {}
    for index, replica in enumerate(replicas):
        for r in received(replica):
            found = SESSION.search(r.body)
            if found:
                out.setdefault(int(found.group(1)), []).append(index)
    return out


def turns_at(replicas: Sequence[TestServer], header: str = "x-test-turn") -> dict[tuple[int, int], int]:
    """(session, turn) -> replica index, from a ``x-test-turn`` header the client sent."""
    out: dict[tuple[int, int], int] = {}
    for index, replica in enumerate(replicas):
        for r in received(replica):
            found = SESSION.search(r.body)
            if found and header in r.headers:
                out[(int(found.group(1)), int(r.headers[header]))] = index
    return out
