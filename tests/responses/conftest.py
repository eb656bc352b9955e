"""Fixtures of the Responses API end-to-end tests: the real clients' fixtures, and a recording hop.

``recording(server)`` starts a plain pass-through to ``server`` that keeps the bytes of every
request and response crossing it (streams relayed chunk by chunk, as they arrive) and the
response headers. Between kvwarm and the reference upstream it shows what the upstream sent;
between a real client and kvwarm, what kvwarm answered (its ``x-kvwarm-prefix``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer

from tests.clients.conftest import agents_sdk, codex_bin  # noqa: F401 - fixtures of the real clients

_FORWARDED = ("authorization", "content-type", "accept")


@dataclass
class Exchange:
    """One request through the recording hop."""

    path: str
    request: bytes
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    """The response's headers (``x-kvwarm-*`` when the hop stands in front of kvwarm)."""
    response: bytes = b""


@dataclass
class Recording:
    server: TestServer
    exchanges: list[Exchange] = field(default_factory=list)


Recorder = Callable[[TestServer], Awaitable[Recording]]


@pytest.fixture
async def recording(aiohttp_server: Any) -> Recorder:
    async def start(upstream: TestServer) -> Recording:
        exchanges: list[Exchange] = []

        async def handle(request: web.Request) -> web.StreamResponse:
            exchange = Exchange(request.path, await request.read())
            exchanges.append(exchange)
            headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED or k.lower().startswith("x-sim-")}
            async with aiohttp.ClientSession(auto_decompress=False) as session, session.request(
                request.method, upstream.make_url(request.path_qs), data=exchange.request, headers=headers
            ) as answer:
                out = web.StreamResponse(
                    status=answer.status, headers={hdrs.CONTENT_TYPE: answer.headers.get(hdrs.CONTENT_TYPE, "")}
                )
                exchange.status = answer.status
                exchange.headers = {k.lower(): v for k, v in answer.headers.items()}
                await out.prepare(request)
                async for chunk in answer.content.iter_any():
                    exchange.response += chunk
                    await out.write(chunk)
                await out.write_eof()
                return out

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        server: TestServer = await aiohttp_server(app)
        return Recording(server, exchanges)

    return start
