"""kvwarm's HTTP/1.1 client (``proxy.transport.pool``) on real sockets, against a raw upstream that
writes exactly the bytes each test scripts: how response bodies are framed and decoded, which
connections are reused (and for how long idle), the pool limit, flow control, malformed responses, timeouts, the
request head it writes, and closing."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import logging
import os
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import pytest
import trustme
from aiohttp import web

from proxy.transport.http1 import keep_alive_timeout
from proxy.transport.pool import (
    GRACE,
    HIGH_WATER,
    ConnectFailed,
    Disconnected,
    Malformed,
    Origin,
    Response,
    Route,
    Transport,
    kept_idle,
    read_chunk,
)

WAIT = 1.0
"""Bound on any single wait that should succeed: a hang fails the test, never blocks the suite."""
SHORT = 0.2
"""The timeout under test where one is."""
SOCKET_READ = 256 * 1024
"""The most asyncio's selector transports read from a socket in one ``data_received``
(``_SelectorSocketTransport.max_size``)."""


# -- a scripted upstream --------------------------------------------------------------------


@dataclass
class Request:
    """One request as the upstream read it off the wire."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    connection: int
    """Which accepted connection (1-based) it came on."""
    nth: int
    """Its place (1-based) among the requests on that connection."""

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        assert len(values) <= 1, f"{name} sent {len(values)} times"
        return values[0] if values else None


Reply = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool | None]]
"""Writes the response to one request; returns False to close the connection after it."""


class RawUpstream:
    """An HTTP/1.1 server on asyncio streams: reads requests (``Content-Length`` bodies), lets
    ``reply`` write the exact response bytes, and counts connections as they come and go."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.requests: list[Request] = []
        self.accepted = 0
        self.open = 0
        self.peak = 0
        """The most connections open at once."""
        self.eofs = 0
        """Connections the client closed (EOF or reset seen while reading)."""
        self.hung_up = asyncio.Event()
        """Set at each EOF counted in ``eofs``."""
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def origin(self) -> Origin:
        assert self.server is not None
        return Origin(host="127.0.0.1", port=self.server.sockets[0].getsockname()[1], tls=False)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.accepted += 1
        number, nth = self.accepted, 0
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self._count_eof()
                    break
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if line)]
                length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
                nth += 1
                request = Request(method, target, headers, await reader.readexactly(length), number, nth)
                self.requests.append(request)
                keep = await self.reply(request, reader, writer)
                if reader.at_eof():  # the reply waited for the client to hang up
                    self._count_eof()
                    break
                if keep is False:
                    break
                await writer.drain()
        except ConnectionError:
            self._count_eof()
        finally:
            self.open -= 1
            writer.close()
            with suppress(ConnectionError):
                await writer.wait_closed()

    def _count_eof(self) -> None:
        self.eofs += 1
        self.hung_up.set()

    async def until_eofs(self, count: int) -> None:
        """Wait (at most WAIT) until the client closed ``count`` connections."""
        async with asyncio.timeout(WAIT):
            while self.eofs < count:
                self.hung_up.clear()
                await self.hung_up.wait()


Serve = Callable[[Reply], Awaitable[RawUpstream]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(reply)``: a started :class:`RawUpstream` on 127.0.0.1."""
    upstreams: list[RawUpstream] = []

    async def start(reply: Reply) -> RawUpstream:
        upstream = RawUpstream(reply)
        upstream.server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
        upstreams.append(upstream)
        return upstream

    yield start
    for upstream in upstreams:
        assert upstream.server is not None
        upstream.server.close()
        await upstream.server.wait_closed()
        if upstream.tasks:  # a handler still stalled on purpose ends here
            _, pending = await asyncio.wait(upstream.tasks, timeout=WAIT)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


MakeTransport = Callable[..., Transport]


@pytest.fixture
async def make_transport(serve: Serve) -> AsyncIterator[MakeTransport]:
    """``make_transport(limit=8, connect_timeout=WAIT)``; each is closed before the upstreams
    (this fixture depends on ``serve`` so that it is torn down first)."""
    transports: list[Transport] = []

    def make(limit: int = 8, connect_timeout: float = WAIT) -> Transport:
        transport = Transport(limit=limit, connect_timeout=connect_timeout)
        transports.append(transport)
        return transport

    yield make
    for transport in transports:
        await transport.close()


@pytest.fixture
async def transport(make_transport: MakeTransport) -> Transport:
    return make_transport()


def message(
    body: bytes = b"",
    *headers: str,
    status: str = "200 OK",
    version: str = "HTTP/1.1",
    length: bool = True,
) -> bytes:
    """A response's exact bytes; ``length`` adds ``Content-Length`` for ``body``."""
    lines = [f"{version} {status}", *headers]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8") + body


def chunked(*chunks: bytes) -> bytes:
    """A chunked body of ``chunks``, then the last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def answer(*responses: bytes, close: bool = False) -> Reply:
    """Write ``responses[n-1]`` to a connection's n-th request (the last one beyond);
    ``close``: close the connection after each."""

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(responses[min(request.nth, len(responses)) - 1])
        return not close

    return reply


async def write_in_pieces(writer: asyncio.StreamWriter, data: bytes, size: int) -> None:
    """``data`` in writes of ``size`` bytes, a millisecond apart (so that the client reads
    them one by one: on loopback each is readable at once)."""
    for at in range(0, len(data), size):
        if at:
            await asyncio.sleep(0.001)
        writer.write(data[at : at + size])
        await writer.drain()


async def hang(reader: asyncio.StreamReader) -> None:
    """Answer nothing more until the client closes the connection."""
    while await reader.read(65536):
        pass


async def until(condition: Callable[[], bool]) -> None:
    """Wait (at most WAIT) until ``condition()`` holds."""
    for _ in range(int(WAIT / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise TimeoutError("the condition never held")


async def read_all(response: Response, within: float = WAIT) -> bytes:
    parts = []
    while chunk := await read_chunk(response, within):
        parts.append(chunk)
    return b"".join(parts)


async def next_on_a_new_connection(transport: Transport, upstream: RawUpstream, body: bytes) -> None:
    """The client closed its (only) connection, and the next exchange opens a second one."""
    await upstream.until_eofs(1)
    assert (await fetch(transport, upstream))[1] == body
    assert upstream.accepted == 2


async def body_is_malformed(transport: Transport, upstream: RawUpstream) -> None:
    """A request to ``upstream`` whose response body reads as :class:`Malformed`."""
    response = await send(transport, upstream)
    try:
        with pytest.raises(Malformed):
            await read_all(response)
    finally:
        response.release()


async def send(
    transport: Transport,
    upstream: RawUpstream,
    method: str = "GET",
    target: str = "/v1/x",
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    *,
    fresh: bool = False,
    within: float = WAIT,
) -> Response:
    """``transport.request`` to ``upstream``'s pool."""
    return await transport.request(transport.pool(upstream.origin), method, target, headers, body, fresh=fresh, within=within)


async def fetch(
    transport: Transport, upstream: RawUpstream, method: str = "GET", headers: Iterable[tuple[str, str]] = (), body: bytes = b""
) -> tuple[Response, bytes]:
    """One whole exchange: the response (released) and its body."""
    response = await send(transport, upstream, method, "/v1/x", headers, body)
    try:
        return response, await read_all(response)
    finally:
        response.release()


# -- framing ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [5, 700_000], ids=["small", "many-reads"])
async def test_a_content_length_body_is_read_whole_and_its_connection_reused(
    serve: Serve, transport: Transport, size: int
) -> None:
    body = os.urandom(size)
    upstream = await serve(answer(message(body, "Content-Type: Application/Octet-Stream; x=1")))
    response, got = await fetch(transport, upstream)
    assert got == body
    assert (response.status, response.reason, response.content_length) == (200, "OK", size)
    assert response.content_type == "application/octet-stream"
    assert response.complete and not response.decoded
    _, again = await fetch(transport, upstream)
    assert again == body
    assert upstream.accepted == 1


CHUNKED_WITH_EXTENSIONS = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
    b"5;name=value\r\nhello\r\n"
    b"1;flag;quoted=\"a b\"\r\n \r\n"
    b"6\r\nworld!\r\n"
    b"0;last=1\r\nX-Checksum: abc\r\nX-Other: o\r\n\r\n"
)


@pytest.mark.parametrize("piece", [len(CHUNKED_WITH_EXTENSIONS), 1, 7], ids=["one-write", "byte-by-byte", "7-bytes"])
async def test_a_chunked_body_with_extensions_and_trailers_is_read_whole(
    serve: Serve, transport: Transport, piece: int
) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await write_in_pieces(writer, CHUNKED_WITH_EXTENSIONS if request.nth == 1 else message(b"next"), piece)

    upstream = await serve(reply)
    response, body = await fetch(transport, upstream)
    assert body == b"hello world!"
    assert response.complete and response.content_length is None
    assert "X-Checksum" not in response.headers  # trailers are not response headers
    await asyncio.sleep(GRACE * 2)  # a stream's connection is reused once it outlived the grace
    _, second = await fetch(transport, upstream)
    assert second == b"next"
    assert upstream.accepted == 1


async def test_a_waiting_read_takes_every_chunk_one_socket_read_brought(serve: Serve, transport: Transport) -> None:
    """A reader already waiting is answered once the socket read is parsed whole, not at its
    first chunk: the events of one read reach the relay (and its client) in one write."""
    events = [b"data: {\"token\": %d}\n\n" % i for i in range(12)]
    go = asyncio.Event()

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(message(b"", "Transfer-Encoding: chunked", length=False))
        await writer.drain()
        await go.wait()
        writer.write(chunked(*events)[:-5])  # twelve chunks in one write (one socket read here)
        await writer.drain()
        await go.wait()
        writer.write(b"0\r\n\r\n")

    upstream = await serve(reply)
    response = await send(transport, upstream, target="/v1/stream")
    reading = asyncio.ensure_future(read_chunk(response, WAIT))
    await asyncio.sleep(0.05)
    assert not reading.done()  # nothing arrived: the read waits
    go.set()
    assert await reading == b"".join(events)
    assert await read_all(response) == b""
    response.release()


async def test_a_read_cancelled_while_waiting_leaves_the_next_read_its_own_timeout(serve: Serve, transport: Transport) -> None:
    """A cancelled read and a new one in the same loop iteration: the new one still times out on
    its own bound (the old read's timer is not its), a second read at once is refused, and the
    body still arrives whole afterwards."""
    finish = asyncio.Event()

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(message(b"", "Transfer-Encoding: chunked", length=False) + chunked(b"early")[:-5])
        await writer.drain()
        await finish.wait()
        writer.write(chunked(b"late"))

    upstream = await serve(reply)
    response = await send(transport, upstream, target="/v1/slow")
    assert await read_chunk(response, WAIT) == b"early"
    first = asyncio.ensure_future(read_chunk(response, 5.0))
    await asyncio.sleep(0)
    first.cancel()
    second = asyncio.ensure_future(read_chunk(response, SHORT))  # in the same loop iteration
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        await read_chunk(response, SHORT)  # one read at a time
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(second, WAIT)
    assert first.cancelled()
    assert time.monotonic() - started < WAIT
    finish.set()
    assert await read_all(response) == b"late"
    response.release()


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
async def test_a_read_takes_every_byte_that_arrived_since_the_last_one(serve: Serve, transport: Transport, framing: str) -> None:
    # A model streams an event a chunk; a reader that fell behind gets them in one read (and
    # the relay writes them to its client in one write), in order, the next read the rest.
    events = [b"data: {\"token\": %d}\n\n" % i for i in range(50)]
    more = asyncio.Event()

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if framing == "chunked":
            head, first, rest = message(b"", "Transfer-Encoding: chunked", length=False), chunked(*events[:40])[:-5], chunked(*events[40:])
        else:
            body = b"".join(events)
            head, first, rest = message(body)[: -len(body)], body[: len(b"".join(events[:40]))], b"".join(events[40:])
        writer.write(head)
        for at in range(0, len(first), 97):  # in many small writes, as a stream arrives
            writer.write(first[at : at + 97])
            await writer.drain()
            await asyncio.sleep(0)
        await more.wait()
        writer.write(rest)

    upstream = await serve(reply)
    response = await send(transport, upstream, target="/v1/stream")
    await until(lambda: response._buffered == len(b"".join(events[:40])))
    assert await read_chunk(response, WAIT) == b"".join(events[:40])
    assert response._buffered == 0
    more.set()
    assert await read_all(response) == b"".join(events[40:])
    response.release()


async def test_trailers_do_not_leak_into_the_next_response_on_the_connection(serve: Serve, transport: Transport) -> None:
    upstream = await serve(answer(CHUNKED_WITH_EXTENSIONS, message(b"next", "X-Next: 1")))
    await fetch(transport, upstream)
    await asyncio.sleep(GRACE * 2)  # a stream's connection is reused once it outlived the grace
    second, _ = await fetch(transport, upstream)
    assert upstream.accepted == 1
    assert sorted(second.headers) == ["Content-Length", "X-Next"]


@pytest.mark.parametrize("piece", [0, 3], ids=["one-write", "3-bytes"])
@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0"])
async def test_a_body_delimited_by_close_is_complete_when_the_server_closes(
    serve: Serve, transport: Transport, piece: int, version: str
) -> None:
    body = b"no length, not chunked: the close ends me"
    raw = message(body, "Content-Type: text/plain", version=version, length=False)

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await write_in_pieces(writer, raw, piece or len(raw))
        return False

    upstream = await serve(reply)
    response, got = await fetch(transport, upstream)
    assert got == body
    assert response.complete and response.content_length is None
    _, again = await fetch(transport, upstream)
    assert again == body
    assert upstream.accepted == 2


async def test_an_empty_content_length_body_ends_at_once_and_its_connection_is_reused(
    serve: Serve, transport: Transport
) -> None:
    upstream = await serve(answer(message(b"", status="201 Created")))
    response = await send(transport, upstream, "POST", "/v1/x", (), b"{}")
    assert response.complete  # before any read
    assert await read_chunk(response, WAIT) == b""
    response.release()
    _, body = await fetch(transport, upstream)
    assert body == b""
    assert upstream.accepted == 1


@pytest.mark.parametrize(
    "head",
    [
        message(status="204 No Content", length=False),
        message(b"", "ETag: \"v1\"", "Content-Length: 42", status="304 Not Modified", length=False),
        message(b"", "ETag: \"v1\"", status="304 Not Modified", length=False),
    ],
    ids=["204", "304-with-length", "304"],
)
async def test_204_and_304_have_no_body_and_keep_the_connection(serve: Serve, transport: Transport, head: bytes) -> None:
    upstream = await serve(answer(head, message(b"after")))
    response = await send(transport, upstream)
    assert response.status in (204, 304)
    assert response.complete
    assert await asyncio.wait_for(read_chunk(response, 5.0), SHORT) == b""
    response.release()
    _, body = await fetch(transport, upstream)
    assert body == b"after"
    assert upstream.accepted == 1


# -- HEAD ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("head", "length"),
    [(message(b"", "Content-Length: 1234", length=False), 1234), (message(b"", "Transfer-Encoding: chunked", length=False), None)],
    ids=["content-length", "chunked"],
)
async def test_a_head_response_has_no_body_and_the_next_request_goes_on_a_new_connection(
    serve: Serve, transport: Transport, head: bytes, length: int | None
) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(head if request.method == "HEAD" else message(b"got"))

    upstream = await serve(reply)
    response = await send(transport, upstream, "HEAD")
    assert response.status == 200 and response.complete
    assert response.content_length == length  # the announced length, of a body that does not come
    assert await asyncio.wait_for(read_chunk(response, 5.0), SHORT) == b""
    response.release()
    await upstream.until_eofs(1)  # the HEAD connection is closed, not pooled
    _, body = await fetch(transport, upstream)
    assert body == b"got"
    assert upstream.accepted == 2


# -- interim responses --------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "interim-first"])
@pytest.mark.parametrize(
    "interim",
    [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\nX-Interim: 1\r\n\r\n"],
    ids=["100", "103"],
)
async def test_an_interim_response_is_skipped(serve: Serve, transport: Transport, split: bool, interim: bytes) -> None:
    final = message(b"real", "X-Final: yes", status="201 Created")

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if request.nth > 1:
            writer.write(message(b"second"))
        elif split:
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(final)
        else:
            writer.write(interim + final)

    upstream = await serve(reply)
    response, body = await fetch(transport, upstream, "POST", [("Expect", "100-continue")], b"{}")
    assert (response.status, response.reason, body) == (201, "Created", b"real")
    assert sorted(response.headers) == ["Content-Length", "X-Final"]
    _, second = await fetch(transport, upstream)
    assert second == b"second"
    assert upstream.accepted == 1


# -- content decoding ---------------------------------------------------------------------

ORIGINAL = b'{"id":"chatcmpl-1","choices":[{"message":{"content":"' + b"".join(b"warm cache %d, " % n for n in range(300)) + b'"}}]}'
"""4.7 kB that compress to some 750 bytes: many writes, many chunks."""


def _deflate_raw(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


ENCODED = {
    "gzip": ("gzip", gzip.compress(ORIGINAL)),
    "x-gzip": ("x-gzip", gzip.compress(ORIGINAL)),
    "deflate-zlib": ("deflate", zlib.compress(ORIGINAL)),
    "deflate-raw": ("deflate", _deflate_raw(ORIGINAL)),
}


def framed(body: bytes, framing: str, *headers: str) -> tuple[bytes, bool]:
    """``body`` framed by ``framing``, and whether the server closes after it."""
    if framing == "content-length":
        return message(body, *headers), False
    if framing == "chunked-1-byte":
        return message(chunked(*(body[i : i + 1] for i in range(len(body)))), *headers, "Transfer-Encoding: chunked", length=False), False
    return message(body, *headers, length=False), True


@pytest.mark.parametrize(
    ("framing", "piece"),
    [("content-length", 0), ("content-length", 16), ("chunked-1-byte", 0), ("close-delimited", 0), ("close-delimited", 16)],
    ids=["content-length", "content-length-16-byte-writes", "chunked-1-byte", "close-delimited", "close-delimited-16-byte-writes"],
)
@pytest.mark.parametrize("name", ["gzip", "x-gzip", "deflate-zlib"])
async def test_an_encoded_body_is_decoded(serve: Serve, transport: Transport, name: str, piece: int, framing: str) -> None:
    encoding, body = ENCODED[name]
    raw, close = framed(body, framing, f"Content-Encoding: {encoding}")

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await write_in_pieces(writer, raw, piece or len(raw))
        return not close

    upstream = await serve(reply)
    response, got = await fetch(transport, upstream)
    assert response.decoded and response.complete
    assert got == ORIGINAL
    assert response.headers["Content-Encoding"] == encoding  # the header stays: the caller drops it


@pytest.mark.parametrize("framing", ["content-length", "close-delimited"])
async def test_a_raw_deflate_body_is_decoded(serve: Serve, transport: Transport, framing: str) -> None:
    encoding, body = ENCODED["deflate-raw"]
    raw, close = framed(body, framing, f"Content-Encoding: {encoding}")
    upstream = await serve(answer(raw, close=close))
    response, got = await fetch(transport, upstream)
    assert response.decoded and got == ORIGINAL


async def test_a_raw_deflate_body_arriving_a_byte_at_a_time_is_decoded(serve: Serve, transport: Transport) -> None:
    raw, _ = framed(ENCODED["deflate-raw"][1], "chunked-1-byte", "Content-Encoding: deflate")
    upstream = await serve(answer(raw))
    response, got = await fetch(transport, upstream)
    assert response.decoded and got == ORIGINAL


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_an_empty_encoded_body_is_empty(serve: Serve, transport: Transport, encoding: str) -> None:
    upstream = await serve(answer(message(b"", f"Content-Encoding: {encoding}")))
    response, got = await fetch(transport, upstream)
    assert response.decoded and response.complete
    assert got == b""


async def test_an_unknown_encoding_passes_through_undecoded(serve: Serve, transport: Transport) -> None:
    opaque = b"\x1b\x07\x00\xf8\x25\x40\x02" + os.urandom(64)  # bytes as br would send them
    upstream = await serve(answer(message(opaque, "Content-Encoding: br")))
    response, got = await fetch(transport, upstream)
    assert not response.decoded
    assert got == opaque
    assert response.content_length == len(opaque)


@pytest.mark.parametrize(
    "body",
    [
        b"this is not gzip at all",
        gzip.compress(ORIGINAL)[:-8] + b"\x00\x00\x00\x00" + gzip.compress(ORIGINAL)[-4:],  # the CRC-32 zeroed
        gzip.compress(ORIGINAL)[:30] + b"\xff" * 40 + gzip.compress(ORIGINAL)[70:],  # the deflate stream mangled
    ],
    ids=["garbage", "bad-crc", "mangled"],
)
@pytest.mark.parametrize("piece", [0, 16], ids=["one-write", "16-byte-writes"])
async def test_a_corrupt_gzip_body_is_malformed_from_read_chunk(
    serve: Serve, transport: Transport, body: bytes, piece: int
) -> None:
    raw = message(body, "Content-Encoding: gzip")

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await write_in_pieces(writer, raw, piece or len(raw))

    upstream = await serve(reply)
    await body_is_malformed(transport, upstream)
    await upstream.until_eofs(1)  # the connection is dropped


# -- keep-alive ---------------------------------------------------------------------------


async def test_sequential_requests_share_one_connection(serve: Serve, transport: Transport) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(message(f"answer {request.nth}".encode()))

    upstream = await serve(reply)
    bodies = [(await fetch(transport, upstream))[1] for _ in range(5)]
    assert bodies == [f"answer {n}".encode() for n in range(1, 6)]
    assert [(r.connection, r.nth) for r in upstream.requests] == [(1, n) for n in range(1, 6)]
    assert upstream.accepted == 1


@pytest.mark.parametrize(
    "first",
    [message(b"bye", "Connection: close"), message(b"bye", version="HTTP/1.0"), message(b"bye", "Connection: keep-alive, close")],
    ids=["connection-close", "http-1.0", "close-among-tokens"],
)
async def test_a_response_saying_close_is_not_reused(serve: Serve, transport: Transport, first: bytes) -> None:
    # The server keeps its side open: only the client's choice makes the second connection.
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(first if request.connection == 1 else message(b"fresh"))

    upstream = await serve(reply)
    assert (await fetch(transport, upstream))[1] == b"bye"
    await next_on_a_new_connection(transport, upstream, b"fresh")


async def test_an_http_1_0_keep_alive_response_is_reused(serve: Serve, transport: Transport) -> None:
    upstream = await serve(answer(message(b"old", "Connection: keep-alive", version="HTTP/1.0")))
    for _ in range(2):
        assert (await fetch(transport, upstream))[1] == b"old"
    assert upstream.accepted == 1


@pytest.mark.parametrize("arrived", [False, True], ids=["body-still-coming", "body-arrived-unread"])
async def test_a_response_released_before_its_body_was_read_closes_its_connection(
    serve: Serve, transport: Transport, arrived: bool
) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool | None:
        if request.nth > 1 or request.connection > 1:
            writer.write(message(b"fresh"))
            return None
        whole = message(b"first half|second half")
        writer.write(whole[: -len(b"second half")])
        await writer.drain()
        if arrived:
            writer.write(whole[-len(b"second half") :])
            return None
        await hang(reader)
        return False

    upstream = await serve(reply)
    response = await send(transport, upstream)
    if arrived:  # every byte is in, and none was read
        await until(lambda: response.complete)
        assert response._buffered == len(b"first half|second half")
    else:
        assert await read_chunk(response, WAIT) == b"first half|"
        assert not response.complete
    response.release()
    await next_on_a_new_connection(transport, upstream, b"fresh")


async def test_response_close_closes_its_connection(serve: Serve, transport: Transport) -> None:
    upstream = await serve(answer(message(b"whole")))
    response = await send(transport, upstream)
    assert await read_all(response) == b"whole"
    response.close()
    await next_on_a_new_connection(transport, upstream, b"whole")


async def test_an_idle_connection_is_closed_after_the_idle_timeout(serve: Serve, transport: Transport) -> None:
    """Idle past its route's ``idle_timeout``, a connection is closed by kvwarm itself (no
    request needed to notice), and the next request opens a new one."""
    upstream = await serve(answer(message(b"ok")))
    pool = transport.pool(upstream.origin, Route(idle_timeout=SHORT))
    response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
    assert await read_all(response) == b"ok"
    response.release()
    assert len(pool.open) == 1 and upstream.eofs == 0
    await upstream.until_eofs(1)  # the timer closed it
    assert not pool.open
    response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
    assert await read_all(response) == b"ok"
    response.release()
    assert upstream.accepted == 2


async def test_an_expired_idle_connection_is_never_reused_even_before_its_timer_ran(serve: Serve, transport: Transport) -> None:
    """The event loop was busy past the idle timeout (its timer has not run): the connection
    is still not taken."""
    upstream = await serve(answer(message(b"ok")))
    pool = transport.pool(upstream.origin, Route(idle_timeout=SHORT))
    for _ in range(2):
        response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
        assert await read_all(response) == b"ok"
        response.release()
        time.sleep(SHORT * 1.5)  # noqa: ASYNC251 - blocks the loop on purpose: no timer runs
    assert upstream.accepted == 2
    await upstream.until_eofs(2)


@pytest.mark.parametrize(
    ("announced", "reused"),
    [(f"timeout={SHORT * 2:g}, max=100", False), ("max=100", True), ("timeout=oops", True), (f"timeout={WAIT * 20:g}", True)],
    ids=["half-the-server's", "no-timeout", "malformed", "longer-than-ours"],
)
async def test_a_server_announcing_its_keep_alive_timeout_is_left_at_half_of_it(
    serve: Serve, transport: Transport, announced: str, reused: bool
) -> None:
    """llama.cpp's server says ``Keep-Alive: timeout=5``: its clock starts when it wrote the
    response, kvwarm's when it read it, so kvwarm reuses such a connection for at most half of
    that (never sending a request twice, it must not write into one the server is closing)."""
    upstream = await serve(answer(message(b"ok", f"Keep-Alive: {announced}")))
    pool = transport.pool(upstream.origin, Route(idle_timeout=WAIT))
    response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
    assert await read_all(response) == b"ok"
    response.release()
    await asyncio.sleep(SHORT * 1.5)  # past half the announced timeout, within ours
    response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
    assert await read_all(response) == b"ok"
    response.release()
    assert upstream.accepted == (1 if reused else 2)


async def test_an_upstream_that_closes_after_each_response_gets_a_new_connection_per_request(
    serve: Serve, transport: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp's server closes the connection right after a streamed response, though it
    announced ``Keep-Alive``. Once the pool saw an idle connection closed that soon, it stops
    reusing them: reused, the next request could be written just as the server closes it, and
    kvwarm never sends a request twice."""

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(message(b"ok", "Keep-Alive: timeout=5, max=100"))
        await writer.drain()
        await asyncio.sleep(SHORT / 4)  # then closes, unasked
        return False

    caplog.set_level(logging.INFO, logger="proxy.transport.pool")
    upstream = await serve(reply)
    pool = transport.pool(upstream.origin, Route(idle_timeout=WAIT))
    for _ in range(4):
        response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
        assert await read_all(response) == b"ok"
        response.release()
        await asyncio.sleep(SHORT)  # the close arrives while the connection is idle
    assert not pool.reuses and upstream.accepted == 4
    assert [r.connection for r in upstream.requests] == [1, 2, 3, 4]
    assert sum("closes its connections right after responses" in r.getMessage() for r in caplog.records) == 1


async def test_a_request_lost_to_such_a_close_is_the_last_one_lost(serve: Serve, transport: Transport) -> None:
    """The next request came before the close: it was written into the closing connection and
    fails (never sent twice), and from then on every request gets a connection of its own."""

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(message(b"ok"))
        await writer.drain()
        await asyncio.sleep(SHORT / 2)  # then closes, unasked, whatever arrived meanwhile
        return False

    upstream = await serve(reply)
    pool = transport.pool(upstream.origin, Route(idle_timeout=WAIT))
    outcomes = []
    for _ in range(5):  # each request right after the previous response
        try:
            response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
        except Disconnected:
            outcomes.append("lost")
            continue
        assert await read_all(response) == b"ok"
        response.release()
        outcomes.append("ok")
    assert outcomes == ["ok", "lost", "ok", "ok", "ok"] and not pool.reuses


async def test_a_stream_that_the_upstream_closes_after_loses_no_request(serve: Serve, transport: Transport) -> None:
    """llama.cpp's server closes the connection right after a stream ends, a moment later. The
    next request, right after the stream, takes a new connection (the stream's is reused only
    once it outlived the grace), and the close teaches the pool to stop reusing."""
    stream = message(b"5\r\nhello\r\n0\r\n\r\n", "Transfer-Encoding: chunked", length=False)

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(stream)
        await writer.drain()
        await asyncio.sleep(SHORT / 2)  # then closes, unasked, whatever arrived meanwhile
        return False

    upstream = await serve(reply)
    pool = transport.pool(upstream.origin, Route(idle_timeout=WAIT))
    for _ in range(4):  # each request right after the previous stream
        response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
        assert await read_all(response) == b"hello"
        response.release()
    assert upstream.accepted == 4
    await asyncio.sleep(SHORT)
    assert not pool.reuses


async def test_a_stream_connection_that_outlives_the_grace_proves_the_pool(serve: Serve, transport: Transport) -> None:
    stream = message(b"5\r\nhello\r\n0\r\n\r\n", "Transfer-Encoding: chunked", length=False)
    upstream = await serve(answer(stream))
    pool = transport.pool(upstream.origin, Route(idle_timeout=WAIT))
    for pause in (0.0, GRACE * 2, 0.0, 0.0):
        await asyncio.sleep(pause)
        response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
        assert await read_all(response) == b"hello"
        response.release()
    # the stream's connection outlived the grace before the second request: from then on it
    # is reused however soon after a stream
    assert pool.proven and pool.reuses
    assert [r.connection for r in upstream.requests] == [1, 1, 1, 1]


async def test_an_upstream_that_keeps_connections_keeps_being_reused(serve: Serve, transport: Transport) -> None:
    upstream = await serve(answer(message(b"ok", "Keep-Alive: timeout=5, max=100")))
    pool = transport.pool(upstream.origin, Route(idle_timeout=WAIT))
    for _ in range(3):
        response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
        assert await read_all(response) == b"ok"
        response.release()
        await asyncio.sleep(SHORT)
    assert pool.reuses and upstream.accepted == 1


def test_keep_alive_timeout_is_read_from_the_header() -> None:
    assert keep_alive_timeout("timeout=5, max=100") == 5.0
    assert keep_alive_timeout("max=100, Timeout = 2.5") == 2.5
    assert keep_alive_timeout("max=100") is None
    assert keep_alive_timeout("timeout=-1") is None
    assert keep_alive_timeout(None) is None
    assert kept_idle(4.0, 5.0) == 2.5 and kept_idle(4.0, None) == 4.0 and kept_idle(4.0, 60.0) == 4.0


async def test_idle_connections_within_the_timeout_are_reused_most_recent_first(serve: Serve, transport: Transport) -> None:
    upstream = await serve(answer(message(b"ok")))
    pool = transport.pool(upstream.origin, Route(idle_timeout=WAIT))
    first = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
    second = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
    for response in (first, second):
        assert await read_all(response) == b"ok"
        response.release()
    response = await transport.request(pool, "GET", "/v1/x", [], b"", within=WAIT)
    response.release()
    assert [r.connection for r in upstream.requests] == [1, 2, 2]


# -- the pool limit -----------------------------------------------------------------------


async def test_the_pool_limit_bounds_open_connections_and_every_request_completes(
    serve: Serve, make_transport: MakeTransport
) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.03)  # slow enough that the five overlap
        writer.write(message(request.body.upper()))

    upstream = await serve(reply)
    transport = make_transport(limit=2)
    bodies = await asyncio.gather(*(fetch(transport, upstream, "POST", body=b"req %d" % n) for n in range(5)))
    assert sorted(body for _, body in bodies) == [b"REQ %d" % n for n in range(5)]
    assert upstream.peak == 2
    assert upstream.accepted == 2


async def test_a_request_waiting_for_a_slot_beyond_connect_timeout_fails_to_connect(
    serve: Serve, make_transport: MakeTransport
) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(message(b"0123456789")[:-5])  # the body half sent: the connection stays busy
        await writer.drain()
        await hang(reader)
        return False

    upstream = await serve(reply)
    transport = make_transport(limit=1, connect_timeout=SHORT)
    busy = await send(transport, upstream)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ConnectFailed) as caught:
        async with asyncio.timeout(WAIT):
            await send(transport, upstream, target="/v1/y")
    waited = loop.time() - started
    busy.close()
    assert isinstance(caught.value.__cause__, TimeoutError)
    assert SHORT * 0.9 <= waited < WAIT / 2
    assert upstream.accepted == 1


async def test_a_freed_slot_lets_a_waiting_request_go_on(serve: Serve, make_transport: MakeTransport) -> None:
    upstream = await serve(answer(message(b"ok")))
    transport = make_transport(limit=1, connect_timeout=WAIT)
    first = await send(transport, upstream)
    waiting = asyncio.ensure_future(fetch(transport, upstream))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # no slot while the first holds the only connection
    assert await read_all(first) == b"ok"
    first.release()
    assert (await asyncio.wait_for(waiting, WAIT))[1] == b"ok"
    assert upstream.accepted == 1


async def test_a_slot_granted_to_a_cancelled_request_goes_to_the_next_one(serve: Serve, make_transport: MakeTransport) -> None:
    upstream = await serve(answer(message(b"ok")))
    transport = make_transport(limit=1, connect_timeout=0.5)
    first = await send(transport, upstream)
    assert await read_all(first) == b"ok"
    cancelled = asyncio.ensure_future(fetch(transport, upstream))
    await asyncio.sleep(0.02)
    waiting = asyncio.ensure_future(fetch(transport, upstream))
    await asyncio.sleep(0.02)  # both wait for the one slot, in that order
    first.release()  # grants the slot to the first in line ...
    cancelled.cancel()  # ... which gives up before it could take it (a client went away)
    assert (await asyncio.wait_for(waiting, SHORT))[1] == b"ok"
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert upstream.accepted == 1


# -- flow control -------------------------------------------------------------------------

LARGE = 8 * 1024 * 1024


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_slow_reader_pauses_the_socket_and_gets_every_byte(serve: Serve, transport: Transport, framing: str) -> None:
    payload = os.urandom(LARGE)

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if framing == "content-length":
            writer.write(message(payload))
        else:
            step = 100_000
            writer.write(message(chunked(*(payload[i : i + step] for i in range(0, LARGE, step))), "Transfer-Encoding: chunked", length=False))

    upstream = await serve(reply)
    response = await send(transport, upstream, target="/v1/big")
    conn = response._conn
    assert conn is not None
    await until(lambda: conn.paused)  # a reader that fell behind
    stalled = response._buffered
    await asyncio.sleep(0.05)
    assert response._buffered == stalled  # paused: nothing more was read off the socket

    digest = hashlib.sha256()
    peak = largest = reads = 0
    resumed = False
    while True:
        peak = max(peak, response._buffered)
        chunk = await read_chunk(response, WAIT)
        if not chunk:
            break
        digest.update(chunk)
        largest = max(largest, len(chunk))
        reads += 1
        resumed = resumed or not conn.paused
        if reads % 8 == 0:
            await asyncio.sleep(0.002)  # slow: the buffer fills again between reads
    response.release()
    assert digest.digest() == hashlib.sha256(payload).digest()
    assert HIGH_WATER < peak <= HIGH_WATER + SOCKET_READ
    assert largest <= HIGH_WATER + SOCKET_READ  # a read takes the buffer, no more
    assert resumed
    assert upstream.accepted == 1


# -- malformed responses ------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [b"SSH-2.0-OpenSSH_9.6\r\n", b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", b"\x00\x01\x02\x03\r\n\r\n"],
    ids=["not-http", "bad-status", "bad-header", "binary"],
)
async def test_garbage_instead_of_a_status_line_is_malformed(serve: Serve, transport: Transport, garbage: bytes) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(garbage if request.connection == 1 else message(b"sane"))

    upstream = await serve(reply)
    with pytest.raises(Malformed):
        await send(transport, upstream)
    await next_on_a_new_connection(transport, upstream, b"sane")  # the connection is dropped


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "bad-size-later"])
async def test_a_bad_chunk_size_mid_body_is_malformed_from_read_chunk(serve: Serve, transport: Transport, split: bool) -> None:
    head = message(b"", "Transfer-Encoding: chunked", length=False) + b"5\r\nhello\r\n"
    bad = b"zz\r\nworld\r\n0\r\n\r\n"

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not split:
            writer.write(head + bad)
            return
        writer.write(head)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(bad)

    upstream = await serve(reply)
    response = await send(transport, upstream)
    assert await read_chunk(response, WAIT) == b"hello"
    with pytest.raises(Malformed):
        await read_chunk(response, WAIT)
    assert not response.complete
    response.release()
    await upstream.until_eofs(1)


@pytest.mark.parametrize(
    "unsolicited", [b"junk", message(b"stale")], ids=["garbage", "a-whole-response"]
)
async def test_bytes_on_an_idle_connection_drop_it(serve: Serve, transport: Transport, unsolicited: bytes) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(message(b"answer %d" % request.connection))
        if request.connection == 1:
            await writer.drain()
            await asyncio.sleep(0.03)  # the client released the connection meanwhile
            writer.write(unsolicited)

    upstream = await serve(reply)
    assert (await fetch(transport, upstream))[1] == b"answer 1"
    await next_on_a_new_connection(transport, upstream, b"answer 2")  # the client hung up on the unsolicited bytes


async def test_a_second_response_to_one_request_drops_the_connection_and_not_the_first(serve: Serve, transport: Transport) -> None:
    """An upstream that answers one request twice in one write: the first response arrives
    whole and alone (the second one's body never joins it), and the connection is not reused."""

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(message(b"first %d" % request.connection) + message(b"SECOND"))

    upstream = await serve(reply)
    response = await send(transport, upstream)
    assert await read_all(response) == b"first 1"
    response.release()
    await next_on_a_new_connection(transport, upstream, b"first 2")


async def test_a_close_mid_headers_is_a_disconnect_after_the_response_began(serve: Serve, transport: Transport) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
        return False

    upstream = await serve(reply)
    with pytest.raises(Disconnected) as caught:
        await send(transport, upstream)
    assert caught.value.before_response is False


async def test_a_reason_split_across_reads_is_kept_whole(serve: Serve, transport: Transport) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await write_in_pieces(writer, message(b"x", status="200 Everything Fine"), 16)

    upstream = await serve(reply)
    response, _ = await fetch(transport, upstream)
    assert response.reason == "Everything Fine"


async def test_a_truncated_gzip_body_is_malformed(serve: Serve, transport: Transport) -> None:
    upstream = await serve(answer(message(gzip.compress(ORIGINAL)[:-20], "Content-Encoding: gzip")))
    await body_is_malformed(transport, upstream)


# -- timeouts -----------------------------------------------------------------------------


async def test_within_bounds_the_wait_for_response_headers(serve: Serve, transport: Transport) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n")  # a status line, then nothing
        await writer.drain()
        await hang(reader)
        return False

    upstream = await serve(reply)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(WAIT):  # a bound of the test's own, which the assert below tells apart
            await send(transport, upstream, within=SHORT)
    assert SHORT * 0.9 <= loop.time() - started < WAIT / 2
    await upstream.until_eofs(1)  # the connection is given up, not pooled


@pytest.mark.parametrize("arrived", [0, 5], ids=["no-body-yet", "part-of-body"])
async def test_the_deadline_bounds_read_chunk_even_when_within_is_longer(
    serve: Serve, transport: Transport, arrived: int
) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(message(b"0123456789")[: -10 + arrived])
        await writer.drain()
        await hang(reader)
        return False

    upstream = await serve(reply)
    response = await send(transport, upstream)
    loop = asyncio.get_running_loop()
    response.deadline = loop.time() + SHORT
    try:
        if arrived:
            assert await read_chunk(response, 5.0) == b"01234"
        started = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(WAIT):  # a bound of the test's own, which the assert below tells apart
                await read_chunk(response, 5.0)
        assert loop.time() - started < WAIT / 2
        assert loop.time() >= response.deadline - 0.01
    finally:
        response.close()


# -- headers -----------------------------------------------------------------------------


@pytest.mark.parametrize("piece", [0, 3], ids=["one-write", "3-bytes"])
async def test_repeated_response_headers_are_all_kept_in_order(serve: Serve, transport: Transport, piece: int) -> None:
    raw = message(b"{}", "Set-Cookie: a=1", "X-Mid: m", "set-cookie: b=2", "X-Note: café", "SET-COOKIE: c=3")

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await write_in_pieces(writer, raw, piece or len(raw))

    upstream = await serve(reply)
    response, _ = await fetch(transport, upstream)
    assert response.headers.getall("Set-Cookie") == ["a=1", "b=2", "c=3"]
    assert list(response.headers.items()) == [
        ("Set-Cookie", "a=1"), ("X-Mid", "m"), ("set-cookie", "b=2"), ("X-Note", "café"), ("SET-COOKIE", "c=3"), ("Content-Length", "2"),
    ]


@pytest.mark.parametrize(
    ("name", "value"),
    [("X-Evil", "a\r\nInjected: 1"), ("X-Evil", "a\nInjected: 1"), ("X-Evil", "a\rb"), ("X-Evil\r\nInjected", "1")],
    ids=["crlf-in-value", "lf-in-value", "cr-in-value", "crlf-in-name"],
)
async def test_a_line_break_in_a_request_header_is_refused_before_anything_is_sent(
    serve: Serve, transport: Transport, name: str, value: str
) -> None:
    upstream = await serve(answer(message(b"ok")))
    with pytest.raises(ValueError, match="line break"):
        await send(transport, upstream, "POST", "/v1/x", [("X-Fine", "1"), (name, value)], b"{}")
    await asyncio.sleep(0.05)  # what was sent would have arrived by now
    assert upstream.requests == []


async def test_a_refused_request_head_gives_its_pool_slot_back(serve: Serve, make_transport: MakeTransport) -> None:
    upstream = await serve(answer(message(b"ok")))
    transport = make_transport(limit=1, connect_timeout=SHORT)
    with pytest.raises(ValueError):
        await send(transport, upstream, headers=[("X-Evil", "a\r\nb: c")])
    async with asyncio.timeout(WAIT):
        assert (await fetch(transport, upstream))[1] == b"ok"


async def test_the_host_header_names_the_origin_with_its_port(serve: Serve, transport: Transport) -> None:
    upstream = await serve(answer(message(b"ok")))
    await fetch(transport, upstream)
    assert upstream.requests[0].header("Host") == f"127.0.0.1:{upstream.origin.port}"


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        (Origin(host="api.example.com", port=80, tls=False), "api.example.com"),
        (Origin(host="api.example.com", port=443, tls=True), "api.example.com"),
        (Origin(host="api.example.com", port=443, tls=False), "api.example.com:443"),
        (Origin(host="api.example.com", port=80, tls=True), "api.example.com:80"),
        (Origin(host="10.0.0.1", port=8000, tls=False), "10.0.0.1:8000"),
        (Origin(host="::1", port=8080, tls=False), "[::1]:8080"),
        (Origin(host="::1", port=80, tls=False), "[::1]"),
        (Origin(host="2001:db8::5", port=443, tls=True), "[2001:db8::5]"),
    ],
)
def test_host_header_omits_only_the_default_port_and_brackets_ipv6(origin: Origin, host: str) -> None:
    assert origin.host_header == host


@pytest.mark.parametrize(
    ("method", "body", "length"),
    [("POST", b"", "0"), ("POST", b'{"a":1}', "7"), ("PUT", b"", "0"), ("GET", b"", None), ("DELETE", b"", None), ("GET", b"q", "1")],
)
async def test_content_length_is_sent_for_the_bytes_of_a_body(
    serve: Serve, transport: Transport, method: str, body: bytes, length: str | None
) -> None:
    upstream = await serve(answer(message(b"ok")))
    await fetch(transport, upstream, method, [("Content-Type", "application/json")], body)
    seen = upstream.requests[0]
    assert (seen.method, seen.target, seen.header("Content-Length"), seen.body) == (method, "/v1/x", length, body)
    assert seen.header("Content-Type") == "application/json"


# -- closing -----------------------------------------------------------------------------


async def test_close_closes_idle_and_busy_connections_within_a_second(serve: Serve, make_transport: MakeTransport) -> None:
    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool | None:
        if request.target == "/idle":
            writer.write(message(b"done"))
            return None
        writer.write(message(b"0123456789")[:-5])  # busy: half a body, then nothing
        await writer.drain()
        await hang(reader)
        return False

    upstream = await serve(reply)
    transport = make_transport()
    idle = await send(transport, upstream, target="/idle")
    assert await read_all(idle) == b"done"
    busy = await send(transport, upstream, target="/busy", fresh=True)
    idle.release()
    assert await read_chunk(busy, WAIT) == b"01234"
    reading = asyncio.ensure_future(read_chunk(busy, 5.0))  # a reader waiting for the rest
    await asyncio.sleep(0.01)
    assert (upstream.accepted, upstream.eofs) == (2, 0)

    loop = asyncio.get_running_loop()
    started = loop.time()
    await transport.close()
    assert loop.time() - started < WAIT / 2
    await upstream.until_eofs(2)
    with pytest.raises(Disconnected):  # woken at once, not at its 5 s
        await asyncio.wait_for(reading, SHORT)
    busy.release()


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture
def tls_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
async def tls_upstream(aiohttp_server: Any, tls_ca: trustme.CA) -> Any:
    """An aiohttp server on https://localhost:PORT with a certificate of ``tls_ca``."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "body": (await request.read()).decode()})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.issue_cert("localhost").configure_cert(context)
    return await aiohttp_server(app, ssl=context, host="localhost")


async def test_https_upstream_is_verified_and_kept_alive(tls_upstream: Any, tls_ca: trustme.CA) -> None:
    """A provider is https: the certificate is checked against the trusted CAs for the host
    name, and the connection is reused like a plain one."""
    client = ssl.create_default_context()
    tls_ca.configure_trust(client)
    transport = Transport(limit=4, connect_timeout=WAIT, ssl_context=client)
    try:
        pool = transport.pool(Origin(host="localhost", port=tls_upstream.port, tls=True))
        for n in range(3):
            response = await transport.request(pool, "POST", "/v1/chat", [], b"hello %d" % n, within=WAIT)
            assert response.status == 200
            assert await read_all(response) == b'{"path": "/v1/chat", "body": "hello %d"}' % n
            response.release()
        assert len(pool.open) == 1
    finally:
        await transport.close()


async def test_an_untrusted_certificate_is_refused_by_default(tls_upstream: Any) -> None:
    """Without ``ssl_context`` (as kvwarm runs) the system's CAs are trusted, and a certificate
    they did not sign never sees the request."""
    transport = Transport(limit=4, connect_timeout=WAIT)
    try:
        with pytest.raises(ConnectFailed) as caught:
            await transport.request(transport.pool(Origin(host="localhost", port=tls_upstream.port, tls=True)), "GET", "/v1/models", [], b"", within=WAIT)
        assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)
    finally:
        await transport.close()
