"""Connections are bounded: at most ``server.max_connections`` open, and headers within ``server.header_timeout``.

kvwarm is started the way ``kvwarm serve`` starts it (:func:`proxy.edge.defences.start_server`, and once
as a real ``kvwarm serve`` process), in front of the reference upstream. Clients are raw
sockets that connect and then send nothing, or half a request head. Today ``kvwarm serve``
accepts every connection and keeps one that sends half a head for 75 s (aiohttp's keep-alive
default), so 200 such clients hold 200 file descriptors.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from proxy.app import create_app
from proxy.edge.defences import CappedSite, start_server
from tests.conftest import proxy_settings, sim_url
from tests.reliability.conftest import (
    exchange,
    free_port,
    get,
    read_response,
    wait_closed_by_server,
)

LIMIT = 8
FLOOD = 200
HEADER_TIMEOUT = 1.0


@pytest.fixture
async def served(sim: TestServer) -> AsyncIterator[tuple[web.AppRunner, CappedSite]]:
    settings = proxy_settings(
        sim_url(sim),
        **{"server.port": 0, "server.max_connections": LIMIT, "server.header_timeout": HEADER_TIMEOUT},
    )
    runner, site = await start_server(create_app(settings, registry=CollectorRegistry()), settings)
    try:
        yield runner, site
    finally:
        await runner.cleanup()


async def test_a_flood_of_idle_connections_holds_at_most_the_limit(served: tuple[web.AppRunner, CappedSite]) -> None:
    runner, site = served
    assert site.cap is not None
    conns = []
    try:
        for _ in range(FLOOD):
            conns.append(await asyncio.open_connection("127.0.0.1", site.port))
        await asyncio.sleep(0.2)
        assert site.cap.open == LIMIT
        assert runner.server is not None and len(runner.server.connections) <= LIMIT
        # The connections over the limit were answered 503 at once and closed.
        refused = [await read_response(reader, 2.0, eof_within=2.0) for reader, _w in conns[LIMIT:]]
        assert {r.status for r in refused} == {503}
        assert all(r.closed and r.error()["code"] == "too_many_connections" for r in refused)
        # One of the held connections is still a working HTTP connection.
        reader, writer = conns[0]
        writer.write(get("/healthz"))
        await writer.drain()
        assert (await read_response(reader, 2.0)).status == 200
    finally:
        for _reader, writer in conns:
            writer.close()
    # Closed connections free their slots: a new client is served.
    for _ in range(50):
        if site.cap.open == 0:
            break
        await asyncio.sleep(0.05)
    assert site.cap.open == 0
    assert (await exchange(site.port, get("/healthz"))).status == 200


async def test_half_sent_headers_are_dropped_after_the_header_timeout(served: tuple[web.AppRunner, CappedSite]) -> None:
    _runner, site = served
    assert site.cap is not None
    conns = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(LIMIT)]
    started = time.monotonic()
    try:
        for _reader, writer in conns:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvwarm\r\nContent-Ty")
        # Full house: a newcomer is refused while the slowloris clients hold every slot.
        assert (await exchange(site.port, get("/healthz"))).status == 503
        closed = await asyncio.gather(*(wait_closed_by_server(reader, HEADER_TIMEOUT + 3.0) for reader, _w in conns))
    finally:
        for _reader, writer in conns:
            writer.close()
    assert all(closed), "a connection that never completes its headers must be closed"
    assert time.monotonic() - started < HEADER_TIMEOUT + 3.0
    await asyncio.sleep(0.1)
    assert site.cap.open == 0
    assert (await exchange(site.port, get("/healthz"))).status == 200


async def test_kvwarm_serve_applies_the_limits(sim: TestServer, tmp_path: Any) -> None:
    """The real command: ``kvwarm serve`` with the limits from the environment."""
    port = free_port()
    env = {
        **os.environ,
        "KVWARM_SERVER_MAX_CONNECTIONS": "3",
        "KVWARM_SERVER_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
        "KVWARM_SERVER_BODY_TIMEOUT": "1",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--port", str(port), "--upstream", sim_url(sim), "--store", "memory",
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(f"http://127.0.0.1:{port}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert proc.returncode is None, "kvwarm serve exited early"
                await asyncio.sleep(0.05)
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for _reader, writer in conns:
            writer.write(b"GET /healthz HTTP/1.1\r\nHo")
            await writer.drain()
        await asyncio.sleep(0.2)
        assert (await exchange(port, get("/healthz"))).status == 503
        closed = await asyncio.gather(*(wait_closed_by_server(reader, HEADER_TIMEOUT + 3.0) for reader, _w in conns))
        assert all(closed)
        await asyncio.sleep(0.2)
        assert (await exchange(port, get("/healthz"))).status == 200
    finally:
        for _reader, writer in conns:
            writer.close()
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0
