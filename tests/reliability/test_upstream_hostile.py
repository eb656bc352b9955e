"""kvwarm in front of a hostile or broken upstream, end to end: a raw upstream on loopback
writes exactly the bytes each test scripts (``tests.proxy.test_transport.RawUpstream``), and
clients speak to a whole kvwarm app.

- Bytes left on a connection after a complete response (the start of a second, smuggled
  response) make the connection unusable: the next request, maybe another tenant's, goes on a
  new connection and gets its own response, never the smuggled status or headers.
- A compressed body that inflates enormously (a decompression bomb) is decoded as the client
  reads it, a bounded piece at a time: kvwarm never holds the inflated body.
- A body the upstream cuts short is the upstream's failure, counted as such
  (``kvwarm_errors_total{stage="upstream"}``) with one WARNING line, never as an error of
  kvwarm's own (``stage="usage"``, an ERROR with a traceback).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import tracemalloc
import zlib
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.request.relay import EVENT_LIMIT, WHOLE_BODY_LIMIT
from proxy.transport.pool import GRACE, HIGH_WATER, Malformed, Transport, read_chunk
from tests.conftest import ProxyFactory, metric
from tests.proxy.test_transport import (
    RawUpstream,
    Request,
    Serve,
    answer,
    chunked,
    fetch,
    make_transport,
    message,
    send,
    serve,
    transport,
    until,
)

__all__ = ["make_transport", "serve", "transport"]  # the raw upstream's and the transport's fixtures

WAIT = 5.0
"""Bound on any single wait: a hang fails the test, never blocks the suite."""
MODEL = "hostile-model"


def url(upstream: RawUpstream) -> str:
    return f"http://127.0.0.1:{upstream.origin.port}/v1"


def completion(text: str) -> bytes:
    """A chat completion's JSON body whose reply is ``text``."""
    return orjson.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }
    )


def chat(content: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}


def no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing was logged at ERROR (kvwarm's own failures are; the upstream's are not)."""
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def upstream_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The WARNING lines about the upstream, each checked to carry no traceback."""
    records = [r for r in caplog.records if r.levelno == logging.WARNING and "upstream" in r.getMessage()]
    for record in records:
        assert record.exc_info is None and not record.exc_text, record.getMessage()
    return records


# -- A. a response smuggled after a complete one -------------------------------------------


SMUGGLED = b"HTTP/1.1 401 Unauthorized\r\nX-Smuggled: yes\r\nX-Swallow: "
"""The start of a second response, cut off mid-header: read on, the next response's status line
would be that header's value and its headers and body the smuggled response's."""


@pytest.mark.parametrize("split", [False, True], ids=["same-write", "a-write-later"])
async def test_bytes_after_a_complete_response_are_never_read_as_the_next_response(
    serve: Serve, make_proxy: ProxyFactory, openai_client: Any, split: bool
) -> None:
    """Alice's answer comes with the start of a 401 behind it; Bob's request, next on the pool,
    gets his own answer on a new connection."""

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = message(completion(f"answer {len(upstream.requests)}"), "Content-Type: application/json")
        if request.connection > 1:
            writer.write(answer)
        elif not split:
            writer.write(answer + SMUGGLED)
        else:  # a read of its own: the connection is idle by then, or its response not yet released
            writer.write(answer)
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(SMUGGLED)

    upstream = await serve(reply)
    kvwarm = await make_proxy(url(upstream))
    alice = openai_client(kvwarm, api_key="sk-alice")
    bob = openai_client(kvwarm, api_key="sk-bob")
    first = await asyncio.wait_for(alice.chat.completions.with_raw_response.create(**chat("alice asks")), WAIT)
    assert first.http_response.status_code == 200
    assert first.parse().choices[0].message.content == "answer 1"
    if split:
        await upstream.until_eofs(1)  # the smuggled bytes arrived (and kvwarm hung up) before Bob's request
    second = await asyncio.wait_for(bob.chat.completions.with_raw_response.create(**chat("bob asks")), WAIT)
    assert second.http_response.status_code == 200
    assert "x-smuggled" not in second.http_response.headers
    assert second.parse().choices[0].message.content == "answer 2"
    # The second request arrived on a new connection: the first one was closed, not pooled.
    assert [r.connection for r in upstream.requests] == [1, 2]


@pytest.mark.parametrize("late", [SMUGGLED, b"\r\n"], ids=["a-response", "a-blank-line"])
async def test_bytes_after_a_complete_response_not_yet_released_close_its_connection(
    serve: Serve, transport: Transport, late: bytes
) -> None:
    """The body was read whole but the reader still holds the response when more bytes come
    (even a blank line, which starts no response): the connection is closed at once, so the
    release cannot pool it."""

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(message(b"answer %d" % request.connection))
        if request.connection == 1:
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(late)

    upstream = await serve(reply)
    response = await send(transport, upstream)
    conn = response._conn
    assert conn is not None
    assert await read_chunk(response, WAIT) == b"answer 1"
    assert response.complete
    await until(lambda: conn.closed)
    assert await read_chunk(response, WAIT) == b""  # the response itself stays whole
    response.release()
    assert (await fetch(transport, upstream))[1] == b"answer 2"
    assert upstream.accepted == 2


# -- B. a decompression bomb ----------------------------------------------------------------


BOMB_INFLATED = 256 * 1024 * 1024
"""What the bomb inflates to: zeros, about a thousandth of it compressed."""
MiB = 1024 * 1024


@functools.cache
def gzip_bomb(inflated: int = BOMB_INFLATED) -> bytes:
    """``inflated`` zero bytes, gzip-compressed a MiB at a time (never held inflated here)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MiB)
    parts = [compressor.compress(zeros) for _ in range(inflated // MiB)]
    parts.append(compressor.flush())
    return b"".join(parts)


async def read_zeros(response: aiohttp.ClientResponse) -> int:
    """How many bytes the body has, every one of them checked to be zero, without keeping it."""
    size = 0
    async for piece in response.content.iter_any():
        assert piece.count(0) == len(piece), "a byte that is not zero"
        size += len(piece)
    return size


@pytest.mark.parametrize("framing", ["content-length", "small-chunks"])
async def test_a_compressed_body_is_decoded_a_bounded_piece_per_read(serve: Serve, transport: Transport, framing: str) -> None:
    """Each read gets at most HIGH_WATER decoded bytes, the rest waits encoded, and the socket
    is not read while it does; the body read whole, its connection serves the next request."""
    bomb = gzip_bomb(64 * MiB)
    if framing == "content-length":
        first = message(bomb, "Content-Encoding: gzip")
    else:  # many chunks: the bytes waiting to be decoded are kept as a list, never re-joined per chunk
        pieces = (bomb[i : i + 512] for i in range(0, len(bomb), 512))
        first = message(chunked(*pieces), "Content-Encoding: gzip", "Transfer-Encoding: chunked", length=False)
    upstream = await serve(answer(first, message(b"next")))
    response = await send(transport, upstream)
    conn = response._conn
    assert conn is not None
    await until(lambda: conn.paused)  # nobody read yet: the decoded buffer is full, the socket paused
    size = 0
    while chunk := await read_chunk(response, WAIT):
        assert len(chunk) <= HIGH_WATER and chunk.count(0) == len(chunk)
        assert response._buffered <= HIGH_WATER  # nothing decoded ahead beyond the next piece
        size += len(chunk)
    response.release()
    assert size == 64 * MiB
    if framing == "small-chunks":
        await asyncio.sleep(GRACE * 2)  # a stream's connection is reused once it outlived the grace
    assert (await fetch(transport, upstream))[1] == b"next"
    assert upstream.accepted == 1


async def test_a_read_that_decodes_nothing_reads_the_socket_again(serve: Serve, transport: Transport) -> None:
    """The waiting encoded bytes are used up without another decoded byte (the last read's
    output filled it exactly) while the body's last bytes (the gzip trailer) are still to come:
    the socket is read again, never left paused with the reader waiting."""
    whole = message(gzip_bomb(8 * MiB), "Content-Encoding: gzip")

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(whole[:-8])
        await writer.drain()
        await asyncio.sleep(0.05)  # the reader decodes every piece meanwhile
        writer.write(whole[-8:])

    upstream = await serve(reply)
    response = await send(transport, upstream)
    size = 0
    while chunk := await read_chunk(response, WAIT):
        size += len(chunk)
    response.release()
    assert size == 8 * MiB and response.complete


async def test_a_compressed_body_cut_short_fails_after_what_it_decoded(serve: Serve, transport: Transport) -> None:
    """The whole (truncated) encoded body arrived before most of it was decoded: the reader gets
    every byte it holds, then the error, not a clean end."""
    upstream = await serve(answer(message(gzip_bomb(8 * MiB)[:-20], "Content-Encoding: gzip")))
    response = await send(transport, upstream)
    size = 0
    with pytest.raises(Malformed):
        while chunk := await read_chunk(response, WAIT):
            size += len(chunk)
    response.release()
    assert 0 < size <= 8 * MiB and not response.complete
    await upstream.until_eofs(1)  # closed, not pooled


@pytest.mark.parametrize(
    ("method", "path", "limit"),
    [("POST", "/v1/chat/completions", 64 * MiB), ("GET", "/v1/models", 16 * MiB)],
    ids=["observed-chat", "passthrough"],
)
async def test_a_decompression_bomb_is_relayed_whole_in_bounded_memory(
    serve: Serve, make_proxy: ProxyFactory, method: str, path: str, limit: int
) -> None:
    """The client gets every inflated byte; the peak of what the process allocated meanwhile
    (kvwarm, the upstream and the client share it) stays far below the inflated size. The
    observed path keeps up to 32 MiB of a plain body for its usage (``wire.base.BODY_LIMIT``)."""
    upstream = await serve(answer(message(gzip_bomb(), "Content-Type: application/json", "Content-Encoding: gzip")))
    kvwarm = await make_proxy(url(upstream))
    body = orjson.dumps(chat("inflate me")) if method == "POST" else None
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        tracemalloc.start()
        try:
            request = client.request(method, kvwarm.make_url(path), data=body, headers={"Content-Type": "application/json"})
            async with request as r:
                assert r.status == 200 and "Content-Encoding" not in r.headers
                size = await asyncio.wait_for(read_zeros(r), 4 * WAIT)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert size == BOMB_INFLATED
    assert peak < limit, f"{peak / MiB:.1f} MiB allocated at the peak"


async def test_an_event_stream_bomb_of_one_endless_event_ends_as_the_upstreams_failure(
    serve: Serve, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """An event is relayed whole, so an event stream that never ends an event would be held whole:
    past EVENT_LIMIT the stream ends as the upstream's failure, within bounded memory."""
    head = ("Content-Type: text/event-stream", "Content-Encoding: gzip")
    upstream = await serve(answer(message(gzip_bomb(), *head)))
    kvwarm = await make_proxy(url(upstream))
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        tracemalloc.start()
        try:
            async with client.post(kvwarm.make_url("/v1/chat/completions"), json=chat("inflate me", stream=True)) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), 4 * WAIT)  # broken: no event ever ended
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < EVENT_LIMIT + 32 * MiB, f"{peak / MiB:.1f} MiB allocated at the peak"
    assert metric(kvwarm, "kvwarm_errors_total", stage="upstream") == 1
    assert metric(kvwarm, "kvwarm_errors_total", stage="usage") == 0
    no_errors_logged(caplog)


# -- C. a body the upstream cuts short ----------------------------------------------------


@pytest.mark.parametrize(
    ("path", "size"),
    [("/v1/chat/completions", 2_000), ("/v1/chat/completions", 3 * WHOLE_BODY_LIMIT), ("/v1/responses", 3 * WHOLE_BODY_LIMIT)],
    ids=["read-whole", "streamed", "responses-streamed"],
)
async def test_a_json_body_cut_short_is_the_upstreams_failure(
    serve: Serve, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture, path: str, size: int
) -> None:
    body = completion("x" * size)  # (cut, no answer of either API is read)
    request = chat("cut me") if path.endswith("completions") else {"model": MODEL, "input": "cut me"}

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(message(body, "Content-Type: application/json")[: -len(body) // 2])
        return False  # then close the connection: half the announced body never comes

    upstream = await serve(reply)
    kvwarm = await make_proxy(url(upstream))
    caplog.set_level(logging.DEBUG)
    async with aiohttp.ClientSession() as client:
        async with client.post(kvwarm.make_url(path), json=request) as r:
            if size <= WHOLE_BODY_LIMIT:  # read whole before a byte is sent: the client gets an error
                assert r.status == 502
                assert "error" in orjson.loads(await asyncio.wait_for(r.read(), WAIT))
            else:  # streamed: the client sees its response break, not a clean end
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), WAIT)
    assert metric(kvwarm, "kvwarm_errors_total", stage="usage") == 0
    assert metric(kvwarm, "kvwarm_errors_total", stage="upstream") == 1
    # The request's status: an error when the client got kvwarm's 502, else the upstream's.
    status = "error" if size <= WHOLE_BODY_LIMIT else "2xx"
    assert metric(kvwarm, "kvwarm_requests_total", model=MODEL, status=status, stream="false") == 1
    no_errors_logged(caplog)
    assert len(upstream_warnings(caplog)) == 1


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def delta(text: str) -> dict[str, Any]:
    """A chat stream's chunk adding ``text`` to the reply."""
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}


async def test_an_event_stream_cut_mid_event_is_the_upstreams_failure(
    serve: Serve, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    events = sse(delta("Hello")) + sse(delta(" world"))
    cut = sse(delta(" and more"))

    async def reply(request: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = message(b"", "Content-Type: text/event-stream", "Transfer-Encoding: chunked", length=False)
        writer.write(head + b"%x\r\n%s\r\n" % (len(events), events) + b"%x\r\n%s" % (len(cut), cut[:25]))
        return False  # closed mid-chunk, mid-event: the stream never ends

    upstream = await serve(reply)
    kvwarm = await make_proxy(url(upstream))
    caplog.set_level(logging.DEBUG)
    async with aiohttp.ClientSession() as client:
        async with client.post(kvwarm.make_url("/v1/chat/completions"), json=chat("cut me", stream=True)) as r:
            assert r.status == 200
            got = await asyncio.wait_for(r.content.readexactly(len(events)), WAIT)
            assert got == events
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(r.read(), WAIT)
    assert metric(kvwarm, "kvwarm_errors_total", stage="usage") == 0
    assert metric(kvwarm, "kvwarm_errors_total", stage="upstream") == 1
    no_errors_logged(caplog)
    assert len(upstream_warnings(caplog)) == 1
