"""kvwarm under hostile input: shared pieces.

Clients here speak HTTP over raw sockets: an HTTP client library may normalize a path,
complete a body or retry, which is exactly what these tests must not do. Upstreams are
real servers that record what reached them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer


@dataclass
class Recorder:
    """An upstream that records every request (raw path, headers, body as read) and answers a small JSON."""

    paths: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(request.raw_path)
        self.headers.append(dict(request.headers))
        self.bodies.append(await request.read())
        return web.json_response({"object": "list", "data": []})


@pytest.fixture
async def recorder(aiohttp_server: Any) -> tuple[Recorder, TestServer]:
    rec = Recorder()
    server: TestServer = await aiohttp_server(rec.app())
    return rec, server


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool
    """The server closed the connection after this response (only looked at when asked)."""

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error object of a JSON error body (fails the test otherwise)."""
        assert self.headers.get("content-type", "").startswith("application/json"), self
        payload = orjson.loads(self.body)
        assert set(payload) == {"error"} and {"message", "type", "code"} <= set(payload["error"]), payload
        error: dict[str, Any] = payload["error"]
        return error


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def read_response(reader: asyncio.StreamReader, within: float = 5.0, *, eof_within: float = 0.0) -> RawResponse:
    """One response (Content-Length framed, as kvwarm's errors are) within ``within`` seconds.
    ``eof_within`` > 0: then wait that long for the server to close the connection (``closed``)."""
    async with asyncio.timeout(within):
        head = await reader.readuntil(b"\r\n\r\n")
        status, headers = parse_head(head[:-4])
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    closed = eof_within > 0 and await wait_closed_by_server(reader, eof_within)
    return RawResponse(status, headers, body, closed)


async def exchange(port: int, request: bytes, within: float = 5.0, *, eof_within: float = 0.0) -> RawResponse:
    """Send ``request`` as is on a new connection and read one response."""
    return await exchange_in_parts(port, [request], within, eof_within=eof_within)


async def exchange_in_parts(
    port: int, parts: Sequence[bytes], within: float = 5.0, *, pause: float = 0.0, eof_within: float = 0.0
) -> RawResponse:
    """Send ``parts`` on a new connection, a write each, ``pause`` seconds after each (a request
    whose body arrives in pieces), and read one response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)
        return await read_response(reader, within, eof_within=eof_within)
    finally:
        writer.close()


def pieces(data: bytes, size: int) -> list[bytes]:
    """``data`` cut into pieces of ``size`` bytes (the last one shorter)."""
    return [data[i : i + size] for i in range(0, len(data), size)]


def get(target: str, *, host: str = "kvwarm", extra: str = "") -> bytes:
    """A GET request line for ``target`` exactly as given (no normalization, no encoding)."""
    return f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode("latin-1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    """True when the server closes the connection (EOF or reset) within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
            return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
