"""Shared fixtures: the reference upstream and kvwarm on real sockets, and the openai SDK as client."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from proxy.app import REGISTRY, STORE, create_app
from proxy.config import Settings, load_settings
from proxy.sim.server import SIM_STATE, SimConfig, create_sim_app
from tests.store.redis_server import RedisClusterProcesses, RedisServer, binaries_missing

ProxyFactory = Callable[..., Awaitable[TestServer]]


def sim_url(server: TestServer) -> str:
    return str(server.make_url("/v1"))


@pytest.fixture
def closed_port_url() -> Iterator[Callable[[], str]]:
    """``closed_port_url()``: a loopback URL nothing listens on (connections are refused). Its
    port stays bound, not listening, until the test ends, so no server the test starts (a
    kvwarm that would then proxy to itself) can be given it."""
    held: list[socket.socket] = []

    def make() -> str:
        s = socket.socket()
        held.append(s)
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"

    yield make
    for s in held:
        s.close()


@pytest.fixture
async def sim(aiohttp_server: Any) -> TestServer:
    """The reference upstream, OpenAI cache mode."""
    server: TestServer = await aiohttp_server(create_sim_app(SimConfig()))
    return server


@pytest.fixture
async def make_sim(aiohttp_server: Any) -> Callable[..., Awaitable[TestServer]]:
    async def make(**config: Any) -> TestServer:
        server: TestServer = await aiohttp_server(create_sim_app(SimConfig(**config)))
        return server

    return make


def proxy_settings(upstream: str, **overrides: Any) -> Settings:
    base = {"store.backend": "memory", "upstream.base_url": upstream, "log.level": "DEBUG"}
    base.update(overrides)
    return load_settings(None, env={}, overrides=base)


@pytest.fixture
async def make_proxy(aiohttp_server: Any) -> ProxyFactory:
    """Start kvwarm in front of ``upstream`` (a TestServer or URL) with setting overrides."""

    async def make(upstream: TestServer | str, *, store: Any = None, **overrides: Any) -> TestServer:
        url = upstream if isinstance(upstream, str) else sim_url(upstream)
        dotted = {k.replace("__", "."): v for k, v in overrides.items()}
        app = create_app(proxy_settings(url, **dotted), registry=CollectorRegistry(), store=store)
        server: TestServer = await aiohttp_server(app)
        return server

    return make


@pytest.fixture
async def proxy(make_proxy: ProxyFactory, sim: TestServer) -> TestServer:
    return await make_proxy(sim)


def received(sim_server: TestServer) -> list[Any]:
    """The requests the reference upstream received, oldest first."""
    return list(sim_server.app[SIM_STATE].requests)


def metric(server: TestServer, name: str, **labels: str) -> float:
    value = server.app[REGISTRY].get_sample_value(name, labels)
    return 0.0 if value is None else value


def store_of(server: TestServer) -> Any:
    """The app's store: the local store itself (synchronous reads) when it is one."""
    store = server.app[STORE]
    return getattr(store, "local", store)


@pytest.fixture
async def openai_client() -> AsyncIterator[Callable[..., Any]]:
    """``openai_client(server)``: an AsyncOpenAI pointed at a TestServer's /v1."""
    import openai

    clients: list[openai.AsyncOpenAI] = []

    def make(server: TestServer, api_key: str = "sk-test-key", **kwargs: Any) -> openai.AsyncOpenAI:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=api_key, max_retries=0, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def app_of(server: TestServer) -> web.Application:
    return server.app


def poster(
    server: TestServer, key: str = "sk-alice", headers: dict[str, str] | None = None
) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    """An agent's ``post``: one chat request to ``server`` with ``key``; the response JSON with
    its headers under ``"_headers"``. A non-200 status fails the test."""

    async def post(body: dict[str, Any]) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.post(
            server.make_url("/v1/chat/completions"),
            data=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})},
        ) as r:
            assert r.status == 200, await r.text()
            data: dict[str, Any] = await r.json()
            data["_headers"] = dict(r.headers)
            return data

    return post


# -- real Redis servers (one standalone server and one 3-master cluster per test module; skipped,
# with the reason, where redis-server is absent) -------------------------------------------------


def need_redis() -> None:
    why = binaries_missing()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    need_redis()
    procs = RedisClusterProcesses(tmp_path_factory.mktemp("cluster")).start()
    yield procs
    procs.stop()


def pytest_report_header() -> str:
    """Say once, at the top of every run, how the request path runs (compiled, or plain Python
    and why: KVWARM_PURE=1, a stale build, or a machine that cannot compile)."""
    from proxy import build, native

    why = build.unavailable() if native.state() != "compiled" else None
    return f"kvwarm request path: {native.state()}" + (f"; this machine cannot compile: {why}" if why else "")
