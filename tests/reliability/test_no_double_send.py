"""kvwarm never sends a generation twice.

RFC 9110 9.2.2 and RFC 9112 9.3.1: a client may repeat a request on its own only when it
knows the request is idempotent or knows it was not processed. A ``POST`` to a model is not
idempotent (a second copy is a second generation, billed), and once a byte of it was written
kvwarm cannot know it was not processed. So an upstream that reads a request and hangs up,
cuts it mid-body or resets the connection gets it once and the client a 502; the only
connection kvwarm gives up on before writing is a pooled one the upstream closed while it
was idle, and then the request goes, once, on another.

Upstreams are real servers on loopback (asyncio streams, and a blocking server in a thread
where the event loop must not see the close before kvwarm writes); clients reach a whole
kvwarm app, except in the idle race, which must hit the sender at an exact moment.
"""

from __future__ import annotations

import asyncio
import io
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.config import UpstreamSettings
from proxy.transport.client import Upstream
from proxy.transport.pool import Transport
from tests.conftest import ProxyFactory

WAIT = 5.0
"""Bound on any single wait: a hang fails the test, never blocks the suite."""


def chat(content: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
)
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)


Script = Callable[[int, bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
"""``script(n, head, reader, writer)`` plays the ``n``-th request of a connection (from 1),
once its head was read; it returns False to hang up."""


class ScriptedUpstream:
    """An upstream on asyncio streams that plays a :data:`Script`, and counts what arrived."""

    def __init__(self, script: Script | None) -> None:
        self.script = script
        """None: reset every connection at once, before reading it."""
        self.accepted = 0
        self.heads: list[bytes] = []
        """Every request head that arrived (one per copy of a request sent)."""
        self.bodies: list[bytes] = []
        """The bodies read whole."""
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.script is None:
            reset(writer)
            return
        try:
            for n in range(1, 100):
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                if not await self.script(n, head, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def read_body(self, head: bytes, reader: asyncio.StreamReader) -> bytes:
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        self.bodies.append(body)
        return body


@pytest.fixture
async def upstream_of() -> AsyncIterator[Callable[..., Awaitable[ScriptedUpstream]]]:
    started: list[ScriptedUpstream] = []

    async def start(script: Script | None) -> ScriptedUpstream:
        upstream = ScriptedUpstream(script)
        upstream.server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        assert upstream.server is not None
        upstream.server.close()
        await upstream.server.wait_closed()


async def post(server: Any, body: bytes) -> tuple[int, dict[str, Any]]:
    """One chat request through kvwarm, by a client that never retries."""
    async with aiohttp.ClientSession() as client, client.post(
        server.make_url("/v1/chat/completions"), data=io.BytesIO(body), headers={"Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=WAIT),
    ) as response:
        return response.status, orjson.loads(await response.read())


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST): SO_LINGER on, zero seconds."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# -- the upstream hangs up after the request was written -------------------------------------------


@pytest.mark.parametrize("connection", ["new", "pooled"])
async def test_an_upstream_that_reads_the_request_and_closes_gets_it_once(
    upstream_of: Callable[..., Awaitable[ScriptedUpstream]], make_proxy: ProxyFactory, connection: str
) -> None:
    """The upstream read the whole request, then closed without a byte of response (it may
    have crashed mid-generation): a 502, and no second copy on a new connection."""
    skip = 1 if connection == "pooled" else 0  # requests answered before the one that is dropped

    async def script(n: int, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await upstream.read_body(head, reader)
        if n <= skip:
            writer.write(ANSWER)
            await writer.drain()
            return True
        return False

    upstream = await upstream_of(script)
    kvwarm = await make_proxy(upstream.url)
    if skip:
        assert (await post(kvwarm, chat("warm up")))[0] == 200
    status, error = await post(kvwarm, chat("write a poem"))
    assert upstream.bodies.count(chat("write a poem")) == 1
    assert (upstream.accepted, len(upstream.heads)) == (1, 1 + skip)
    assert status == 502 and error["error"]["code"] == "upstream_unreachable"
    assert "not sent again" in error["error"]["message"]


async def test_an_upstream_that_closes_mid_body_gets_at_most_one_copy(
    upstream_of: Callable[..., Awaitable[ScriptedUpstream]], make_proxy: ProxyFactory
) -> None:
    async def script(n: int, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await reader.readexactly(1000)  # a piece of the body, then hang up with the rest unread
        return False

    upstream = await upstream_of(script)
    kvwarm = await make_proxy(upstream.url)
    status, error = await post(kvwarm, chat("x" * (4 * 1024 * 1024)))
    assert status == 502 and error["error"]["code"] == "upstream_unreachable"
    assert (upstream.accepted, len(upstream.heads)) == (1, 1)


async def test_an_upstream_that_resets_before_reading_is_a_502_and_never_a_second_connection(
    upstream_of: Callable[..., Awaitable[ScriptedUpstream]], make_proxy: ProxyFactory
) -> None:
    upstream = await upstream_of(None)
    kvwarm = await make_proxy(upstream.url)
    status, error = await post(kvwarm, chat("write a poem"))
    assert status == 502 and error["error"]["code"] == "upstream_unreachable"
    assert upstream.accepted == 1


# -- the idle race: a pooled connection closed while idle --------------------------------------------


class ThreadedUpstream:
    """A blocking HTTP/1.1 server in a thread. The first connection answers one request, then
    waits for :attr:`hang_up` and closes (FIN) or resets (RST) while idle; later connections
    answer every request. Its sockets live outside the event loop, so the loop learns of the
    close only when it next polls: kvwarm can be made to take the connection before that."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.bodies: list[bytes] = []
        self.connections = 0
        self.hang_up = threading.Event()
        self.hung_up = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        with suppress(OSError):
            while not self.stopping:
                conn, _ = self.listener.accept()
                self.connections += 1
                threading.Thread(target=self.connection, args=(conn, self.connections), daemon=True).start()

    def connection(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(WAIT)
        with conn, suppress(OSError):
            stream = conn.makefile("rb")
            while self.request(stream):
                conn.sendall(ANSWER)
                if number == 1:
                    self.hang_up.wait(WAIT)
                    if self.how == "reset":
                        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
            stream.close()
        if number == 1:
            self.hung_up.set()

    def request(self, stream: Any) -> bool:
        length = None
        while line := stream.readline():
            if line == b"\r\n":
                self.bodies.append(stream.read(length or 0))
                return True
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return False

    def stop(self) -> None:
        self.stopping = True
        self.hang_up.set()
        self.listener.close()


async def idle_race(how: str) -> None:
    """The upstream closes the idle keep-alive connection, and kvwarm sends the next request
    before its event loop has seen that: the connection is found closed (readable) before a
    byte is written, the request goes once, on a new connection, and succeeds."""
    server = ThreadedUpstream(how)
    transport = Transport(limit=8, connect_timeout=WAIT)
    try:
        sender = Upstream(transport, UpstreamSettings(base_url=(f"http://127.0.0.1:{server.port}/v1",))).senders[0]
        first = await sender.send("POST", "/v1/chat/completions", "", {}, chat("one"))
        while await sender.read_chunk(first):
            pass
        first.release()  # idle in the pool now

        server.hang_up.set()
        assert server.hung_up.wait(WAIT)  # (blocks the event loop: it has not seen the close)
        time.sleep(0.05)  # noqa: ASYNC251 - the FIN / RST crosses loopback while the loop stays blind

        second = await sender.send("POST", "/v1/chat/completions", "", {}, chat("two"))
        assert second.status == 200
        while await sender.read_chunk(second):
            pass
        second.release()
        assert server.bodies == [chat("one"), chat("two")]
        assert server.connections == 2
    finally:
        await transport.close()
        server.stop()


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_pooled_connection_closed_while_idle_is_replaced_before_anything_is_written(how: str) -> None:
    await idle_race(how)


@pytest.mark.parametrize("how", ["close", "reset"])
def test_the_idle_race_on_uvloop(how: str) -> None:
    """The same on uvloop (``kvwarm serve``'s loop), whose transports hand out their socket too."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(idle_race(how))


async def test_an_upstream_closing_idle_connections_never_fails_a_request(
    upstream_of: Callable[..., Awaitable[ScriptedUpstream]], make_proxy: ProxyFactory
) -> None:
    """An upstream that closes each connection soon after answering (a short keep-alive
    timeout): every request succeeds, each sent once."""

    async def script(n: int, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await upstream.read_body(head, reader)
        writer.write(ANSWER)  # (keep-alive announced: the close comes while the connection is idle)
        await writer.drain()
        await asyncio.sleep(0.01)
        return False

    upstream = await upstream_of(script)
    kvwarm = await make_proxy(upstream.url)
    for n in range(4):
        assert (await post(kvwarm, chat(f"turn {n}")))[0] == 200
        await asyncio.sleep(0.05)
    assert upstream.bodies == [chat(f"turn {n}") for n in range(4)]
