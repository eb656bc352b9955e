"""A body that does not arrive in full within ``server.body_timeout`` gets 408 and its connection closed.

Slowloris: many real clients over raw sockets promise 5000 bytes and send 4. Today every such
connection is held as long as the client likes (the handler waits in ``request.read()``
forever). Each must be answered 408, OpenAI-shaped, and closed by the server within the
timeout plus a little, and nothing reaches the upstream.
"""

from __future__ import annotations

import asyncio
import gzip
import time

import pytest
from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory
from tests.reliability.conftest import Recorder, exchange, exchange_in_parts, pieces, read_response

CLIENTS = 60
BODY_TIMEOUT = 1.0
SLACK = 4.0


def slow_head(promised: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvwarm\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sk-slow\r\nContent-Length: " + str(promised).encode() + b"\r\n\r\n"
    )


async def test_slow_bodies_get_408_and_their_connections_closed(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")), server__body_timeout=BODY_TIMEOUT)
    conns = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(CLIENTS)]
    started = time.monotonic()
    try:
        for _reader, writer in conns:
            writer.write(slow_head(5000) + b'{"mo')
        await asyncio.gather(*(writer.drain() for _r, writer in conns))
        # The clients never send the rest; every connection must come back answered and closed.
        responses = await asyncio.gather(
            *(read_response(reader, BODY_TIMEOUT + SLACK, eof_within=SLACK) for reader, _w in conns)
        )
    finally:
        for _reader, writer in conns:
            writer.close()
    elapsed = time.monotonic() - started
    assert [r.status for r in responses] == [408] * CLIENTS
    assert all(r.error()["code"] == "request_timeout" for r in responses)
    assert all(r.headers.get("connection", "").lower() == "close" for r in responses)
    assert all(r.closed for r in responses), "the server must close a connection whose body stalled"
    assert elapsed < BODY_TIMEOUT + SLACK
    assert rec.paths == []


async def test_a_body_that_arrives_slowly_but_in_time_is_served(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    """The control: the timeout bounds the whole body, it does not refuse slow-but-finished ones."""
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")), server__body_timeout=2.0)
    body = b'{"model":"m","messages":[{"role":"user","content":"hello"}]}'
    response = await exchange_in_parts(proxy.port, [slow_head(len(body)), *pieces(body, 20)], pause=0.1)
    assert response.status == 200, response
    assert rec.paths == ["/v1/chat/completions"]


async def test_a_body_that_does_not_decompress_is_a_json_400(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    """The client's broken ``Content-Encoding`` is its error, answered in JSON (today: a plain-text 500
    with a traceback in the log)."""
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    response = await exchange(
        proxy.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvwarm\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: 10\r\n\r\nnot-gzip!!",
    )
    assert response.status == 400, response
    assert response.error()["code"] == "invalid_body"
    assert rec.paths == []


async def test_a_chunked_body_broken_midway_is_bounded_by_the_body_timeout(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    """aiohttp does not wake a reader when a chunk header is broken after the body began: only the
    body timeout ends that wait (today: never)."""
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")), server__body_timeout=BODY_TIMEOUT)
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvwarm\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\n{\"mod\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.3)  # kvwarm is reading the body now
        writer.write(b"zz-not-a-chunk-size\r\n\r\n")
        await writer.drain()
        response = await read_response(reader, BODY_TIMEOUT + SLACK)
    finally:
        writer.close()
    assert response.status == 408, response
    assert response.error()["code"] == "request_timeout"
    assert rec.paths == []


def chunked(body: bytes, piece: int) -> bytes:
    """``body`` in chunked framing, ``piece`` bytes a chunk."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + piece]), body[i : i + piece]) for i in range(0, len(body), piece))
    return out + b"0\r\n\r\n"


CHUNKED_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvwarm\r\nContent-Type: application/json\r\n"
    b"Authorization: Bearer sk-chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def test_a_chunked_body_over_the_limit_is_413_and_never_forwarded(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    """No ``Content-Length`` to refuse it by: the limit holds while the pieces arrive."""
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")), server__max_body_bytes=1000)
    body = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 3000 + b'"}]}'
    response = await exchange_in_parts(proxy.port, [CHUNKED_HEAD, *pieces(chunked(body, 256), 700)], pause=0.02)
    assert response.status == 413, response
    assert response.error()["code"] == "request_too_large"
    assert rec.paths == []


@pytest.mark.parametrize(("piece", "pause"), [(10_000, 0.0), (97, 0.0), (97, 0.01)])
async def test_a_body_is_forwarded_as_it_arrived_in_one_piece_or_many(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer], piece: int, pause: float
) -> None:
    """The body kvwarm reads (in one piece with the headers, in chunks already there, or in chunks
    still arriving) is the body forwarded, byte for byte."""
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    body = b'{"model":"m","messages":[{"role":"user","content":"' + bytes(range(65, 91)) * 150 + b'"}]}'
    framed = CHUNKED_HEAD + chunked(body, piece)
    # Without a pause, in one write: the body arrives with the headers, whatever its chunking.
    response = await exchange_in_parts(proxy.port, pieces(framed, piece) if pause else [framed], pause=pause)
    assert response.status == 200, response
    assert rec.bodies == [body]


async def test_a_compressed_body_is_forwarded_decoded_without_its_encoding(
    make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]
) -> None:
    """The server decodes a gzip body before kvwarm reads it: the bytes forwarded are the decoded
    ones, so ``Content-Encoding`` must not travel with them (the upstream would try to decode them again)."""
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    body = b'{"model":"m","messages":[{"role":"user","content":"compressed"}]}'
    packed = gzip.compress(body)
    response = await exchange(
        proxy.port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvwarm\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: " + str(len(packed)).encode() + b"\r\n\r\n" + packed,
    )
    assert response.status == 200, response
    assert rec.bodies == [body]
    assert "content-encoding" not in {k.lower() for k in rec.headers[0]}
