"""The pooled upstream client on real sockets: where requests go, that nothing is sent twice,
timeouts, error conversion, and which headers travel in each direction."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from yarl import URL

from proxy.config import UpstreamSettings
from proxy.errors import UpstreamTimeout, UpstreamUnreachable
from proxy.request.relay import Relay
from proxy.transport.client import (
    ReplicaSender,
    Upstream,
    forward_request_headers,
    forward_response_headers,
    never_sent,
)
from proxy.transport.pool import ConnectFailed, Disconnected, Transport
from proxy.wire.base import Untouched
from tests.conftest import ProxyFactory

WAIT = 5.0


def upstream_sender(transport: Transport, base_url: str, **settings: Any) -> ReplicaSender:
    """The real sender of requests to one ``base_url`` (a pool of one replica)."""
    return Upstream(transport, UpstreamSettings(base_url=(base_url,), **settings)).senders[0]


MakeUpstream = Callable[..., Any]


@pytest.fixture
async def make_upstream() -> AsyncIterator[MakeUpstream]:
    """``make_upstream(base_url, **settings)``: an upstream sender on its own pooled transport."""
    transports: list[Transport] = []

    def make(base_url: str, limit: int = 16, **settings: Any) -> ReplicaSender:
        transport = Transport(limit=limit, connect_timeout=settings.get("connect_timeout", 10.0))
        transports.append(transport)
        return upstream_sender(transport, base_url, **settings)

    yield make
    for transport in transports:
        await transport.close()


async def serve(aiohttp_server: Any, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> TestServer:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    server: TestServer = await aiohttp_server(app)
    return server


# -- where a request goes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "path", "query", "want"),
    [
        ("http://127.0.0.1:9/v1", "/v1/chat/completions", "", "http://127.0.0.1:9/v1/chat/completions"),
        ("http://127.0.0.1:9/v1/", "/v1/chat/completions", "", "http://127.0.0.1:9/v1/chat/completions"),
        ("https://openrouter.ai/api/v1", "/v1/models", "", "https://openrouter.ai/api/v1/models"),
        ("http://127.0.0.1:9/v1", "/v1", "", "http://127.0.0.1:9/v1"),
        ("http://127.0.0.1:9/v1", "/v1/models", "limit=2&after=x", "http://127.0.0.1:9/v1/models?limit=2&after=x"),
        ("http://10.0.0.1:8000", "/v1/embeddings", "", "http://10.0.0.1:8000/embeddings"),
        ("http://127.0.0.1:9/openai/v1", "/v1/files/file-abc/content", "", "http://127.0.0.1:9/openai/v1/files/file-abc/content"),
    ],
)
async def test_url_for_maps_the_v1_tail_onto_the_base(
    make_upstream: MakeUpstream, base: str, path: str, query: str, want: str
) -> None:
    assert str(make_upstream(base).url_for(path, query)) == want


async def test_send_reaches_the_mapped_url_with_method_query_and_body(
    aiohttp_server: Any, make_upstream: MakeUpstream
) -> None:
    seen: list[tuple[str, str, bytes]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.path_qs, await request.read()))
        return web.json_response({"ok": True}, status=201)

    server = await serve(aiohttp_server, handler)
    upstream = make_upstream(str(server.make_url("/api/v1")))
    response = await upstream.send("PUT", "/v1/things/7", "a=1&b=two", {"Content-Type": "text/plain"}, b"payload")
    try:
        assert response.status == 201
        assert await upstream.read_chunk(response) == b'{"ok": true}'
        assert await upstream.read_chunk(response) == b""
    finally:
        response.release()
    assert seen == [("PUT", "/api/v1/things/7?a=1&b=two", b"payload")]


@pytest.mark.parametrize(
    ("query", "meaning"),
    [
        ("limit=2&after=file-abc", {"limit": "2", "after": "file-abc"}),
        ("q=caf%C3%A9&sp=a+b", {"q": "café", "sp": "a b"}),
        pytest.param("name=a%26b%3Dc&tag=x%2By", {"name": "a&b=c", "tag": "x+y"}, id="encoded-reserved"),
    ],
)
async def test_a_query_reaches_the_upstream_with_its_meaning(
    aiohttp_server: Any, make_proxy: ProxyFactory, query: str, meaning: dict[str, str]
) -> None:
    seen: list[dict[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(dict(request.query))
        return web.json_response({"ok": True})

    server = await serve(aiohttp_server, handler)
    proxy = await make_proxy(str(server.make_url("/v1")))
    async with aiohttp.ClientSession() as client:
        url = URL(f"{proxy.make_url('/v1/files')}?{query}", encoded=True)
        async with client.get(url) as r:
            assert r.status == 200, await r.text()
    assert seen == [meaning]


# -- pooled connections: sent once --------------------------------------------------------


class KeepAliveCloser:
    """A raw HTTP/1.1 upstream: answers the first request of each connection, then reads the next
    one and hangs up without answering (an idle keep-alive close racing a reused connection)."""

    def __init__(self, always_close: bool = False) -> None:
        self.always_close = always_close
        self.received = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                    0,
                )
                await reader.readexactly(length)
                self.received += 1
                if served >= 1 or self.always_close:
                    break  # hang up without a response
                body = b'{"ok":true}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Any], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handle: Any) -> str:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_a_reused_connection_the_upstream_read_from_and_closed_is_unreachable_and_not_retried(
    raw_server: Callable[[Any], Awaitable[str]], make_upstream: MakeUpstream
) -> None:
    """The upstream read the second request (on the reused connection) and hung up: it may
    have processed it, so it is not sent again (tests/reliability/test_no_double_send.py)."""
    closer = KeepAliveCloser()
    upstream = make_upstream(await raw_server(closer.handle))
    response = await upstream.send("POST", "/v1/embeddings", "", {}, b'{"input":"x"}')
    assert await upstream.read_chunk(response) == b'{"ok":true}'
    assert await upstream.read_chunk(response) == b""
    response.release()  # back to the pool: the second request reuses this connection
    with pytest.raises(UpstreamUnreachable) as caught:
        await upstream.send("POST", "/v1/embeddings", "", {}, b'{"input":"x"}')
    assert isinstance(caught.value.__cause__, Disconnected) and caught.value.__cause__.before_response
    assert not never_sent(caught.value)
    assert (closer.received, closer.connections) == (2, 1)


async def test_an_upstream_that_always_hangs_up_is_unreachable_after_one_copy(
    raw_server: Callable[[Any], Awaitable[str]], make_upstream: MakeUpstream
) -> None:
    closer = KeepAliveCloser(always_close=True)
    upstream = make_upstream(await raw_server(closer.handle))
    with pytest.raises(UpstreamUnreachable) as caught:
        await upstream.send("POST", "/v1/embeddings", "", {}, b'{"input":"x"}')
    assert isinstance(caught.value.__cause__, Disconnected)
    assert caught.value.__cause__.before_response
    assert caught.value.status == 502
    assert (closer.received, closer.connections) == (1, 1)


async def test_a_refused_connection_is_unreachable(
    unused_tcp_port: int, make_upstream: MakeUpstream
) -> None:
    upstream = make_upstream(f"http://127.0.0.1:{unused_tcp_port}/v1")
    with pytest.raises(UpstreamUnreachable) as caught:
        await upstream.send("GET", "/v1/models", "", {}, b"")
    assert isinstance(caught.value.__cause__, ConnectFailed)
    assert never_sent(caught.value)
    assert caught.value.status == 502


async def test_no_free_upstream_connection_within_connect_timeout_is_a_timeout_never_sent(
    aiohttp_server: Any, make_upstream: MakeUpstream
) -> None:
    """Every pooled connection busy beyond ``connect_timeout``: a 504, and (not one byte left)
    another replica may take the request."""
    server = await serve(aiohttp_server, _ok)
    upstream = make_upstream(str(server.make_url("/v1")), limit=1, connect_timeout=0.2)
    busy = await upstream.send("GET", "/v1/models", "", {}, b"")  # holds the only connection
    try:
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout) as caught:
            await upstream.send("GET", "/v1/models", "", {}, b"")
        assert 0.15 < time.monotonic() - started < 3
        assert caught.value.status == 504 and never_sent(caught.value)
    finally:
        busy.close()


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


# -- timeouts ---------------------------------------------------------------------------------


@pytest.fixture
async def released() -> AsyncIterator[asyncio.Event]:
    """Set at teardown: lets scripted upstream handlers that wait on it finish."""
    event = asyncio.Event()
    yield event
    event.set()


async def test_no_response_headers_within_first_byte_timeout_is_a_timeout(
    aiohttp_server: Any, make_upstream: MakeUpstream, released: asyncio.Event
) -> None:
    async def handler(request: web.Request) -> web.Response:
        await released.wait()
        return web.Response(text="late")

    server = await serve(aiohttp_server, handler)
    upstream = make_upstream(str(server.make_url("/v1")), first_byte_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout) as caught:
        await upstream.send("POST", "/v1/chat/completions", "", {}, b"{}")
    assert 0.25 < time.monotonic() - started < 3
    assert caught.value.status == 504


def stalling(stall: float, released: asyncio.Event) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An upstream that sends one event, says nothing for ``stall`` seconds, then another."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        try:
            await asyncio.wait_for(released.wait(), stall)
        except TimeoutError:
            pass
        await response.write(b"data: two\n\n")
        await response.write_eof()
        return response

    return handler


async def test_a_stall_mid_body_beyond_idle_timeout_is_a_timeout_from_read_chunk(
    aiohttp_server: Any, make_upstream: MakeUpstream, released: asyncio.Event
) -> None:
    server = await serve(aiohttp_server, stalling(WAIT, released))
    upstream = make_upstream(str(server.make_url("/v1")), first_byte_timeout=WAIT, idle_timeout=0.3)
    response = await upstream.send("POST", "/v1/chat/completions", "", {}, b"{}")
    try:
        assert await upstream.read_chunk(response) == b"data: one\n\n"
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await upstream.read_chunk(response)
        assert 0.25 < time.monotonic() - started < 3
    finally:
        response.close()


async def test_a_pause_mid_body_shorter_than_idle_timeout_is_no_timeout(
    aiohttp_server: Any, make_upstream: MakeUpstream, released: asyncio.Event
) -> None:
    server = await serve(aiohttp_server, stalling(0.5, released))
    upstream = make_upstream(str(server.make_url("/v1")), first_byte_timeout=WAIT, idle_timeout=2.0)
    response = await upstream.send("POST", "/v1/chat/completions", "", {}, b"{}")
    try:
        assert await upstream.read_chunk(response) == b"data: one\n\n"
        assert await upstream.read_chunk(response) == b"data: two\n\n"
        assert await upstream.read_chunk(response) == b""
    finally:
        response.release()


async def test_first_byte_timeout_does_not_bound_pauses_mid_body(
    aiohttp_server: Any, make_upstream: MakeUpstream, released: asyncio.Event
) -> None:
    server = await serve(aiohttp_server, stalling(0.8, released))
    upstream = make_upstream(str(server.make_url("/v1")), first_byte_timeout=0.3, idle_timeout=3.0)
    response = await upstream.send("POST", "/v1/chat/completions", "", {}, b"{}")
    try:
        assert await upstream.read_chunk(response) == b"data: one\n\n"
        assert await upstream.read_chunk(response) == b"data: two\n\n"
    finally:
        response.close()


async def test_a_connection_lost_mid_body_is_unreachable_from_read_chunk(
    raw_server: Callable[[Any], Awaitable[str]], make_upstream: MakeUpstream
) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\nhalf")
        await writer.drain()
        writer.transport.abort()

    upstream = make_upstream(await raw_server(cut))
    response = await upstream.send("GET", "/v1/models", "", {}, b"")
    try:
        assert await upstream.read_chunk(response) == b"half"
        with pytest.raises(UpstreamUnreachable) as caught:
            await upstream.read_chunk(response)
        assert isinstance(caught.value.__cause__, Disconnected)
        assert not caught.value.__cause__.before_response
    finally:
        response.close()


# -- headers ----------------------------------------------------------------------------------


UPSTREAM_RESPONSE_HEADERS = [
    ("Content-Type", "application/json"),
    ("Connection", "keep-alive, X-Hop-Resp"),
    ("X-Hop-Resp", "secret"),
    ("Keep-Alive", "timeout=5"),
    ("Proxy-Authenticate", "Basic realm=upstream"),
    ("Trailer", "X-Checksum"),
    ("X-Keep-Resp", "kept"),
    ("Set-Cookie", "a=1"),
    ("Set-Cookie", "b=2"),
    ("Retry-After", "7"),
]


async def hop_app(
    aiohttp_server: Any, make_upstream: MakeUpstream, api_key: str = ""
) -> tuple[TestServer, TestServer, list[CIMultiDict[str]]]:
    """An upstream that records request headers and answers with hop-by-hop ones, behind a
    proxy-side app that forwards with :func:`forward_request_headers` and relays back."""
    seen: list[CIMultiDict[str]] = []

    async def upstream_handler(request: web.Request) -> web.Response:
        seen.append(CIMultiDict(request.headers))
        return web.Response(body=b'{"ok":true}', headers=CIMultiDict(UPSTREAM_RESPONSE_HEADERS))

    server = await serve(aiohttp_server, upstream_handler)
    upstream = make_upstream(str(server.make_url("/v1")), api_key=api_key)

    async def proxy_handler(request: web.Request) -> web.StreamResponse:
        headers = forward_request_headers(request.headers, api_key)
        response = await upstream.send(request.method, request.path, request.query_string, headers, await request.read())
        relay = Relay(request, response, upstream, {}, Untouched())
        await relay.run()
        return await relay.end()

    app = web.Application()
    app.router.add_route("*", "/v1/{tail:.*}", proxy_handler)
    proxy: TestServer = await aiohttp_server(app)
    return proxy, server, seen


async def test_hop_by_hop_headers_are_dropped_both_ways_and_host_rewritten(
    aiohttp_server: Any, make_upstream: MakeUpstream
) -> None:
    proxy, upstream, seen = await hop_app(aiohttp_server, make_upstream)
    sent = CIMultiDict(
        [
            ("Host", "kvwarm.example"),
            ("Connection", "keep-alive, X-Hop-Req"),
            ("X-Hop-Req", "secret"),
            ("Keep-Alive", "timeout=5"),
            ("TE", "trailers"),
            ("Trailer", "X-Checksum"),
            ("Proxy-Authorization", "Basic cHJveHk6cHc="),
            ("Accept-Encoding", "br, zstd"),
            ("Authorization", "Bearer sk-client"),
            ("X-Keep-Req", "kept"),
            ("X-Multi", "1"),
            ("X-Multi", "2"),
        ]
    )
    async with aiohttp.ClientSession() as client, client.post(proxy.make_url("/v1/chat/completions"), data=b"{}", headers=sent) as r:
        assert r.status == 200
        body = await r.read()
        got = r.headers
    (forwarded,) = seen
    for name in ("Connection", "X-Hop-Req", "Keep-Alive", "TE", "Trailer", "Proxy-Authorization"):
        assert name not in forwarded, name
    assert forwarded.getall("Host") == [f"{upstream.host}:{upstream.port}"]
    assert forwarded["Accept-Encoding"] == "gzip, deflate"  # only what kvwarm can decode
    assert forwarded["Authorization"] == "Bearer sk-client"  # no api_key: the client's own credential
    assert forwarded["X-Keep-Req"] == "kept"
    assert forwarded.getall("X-Multi") == ["1", "2"]
    assert forwarded["Content-Length"] == "2"

    assert body == b'{"ok":true}'
    for name in ("X-Hop-Resp", "Keep-Alive", "Proxy-Authenticate", "Trailer"):
        assert name not in got, name
    assert "X-Hop-Resp" not in got.get("Connection", "")
    assert got["X-Keep-Resp"] == "kept" and got["Retry-After"] == "7"
    assert got.getall("Set-Cookie") == ["a=1", "b=2"]
    assert got["Content-Length"] == str(len(body))


async def test_with_an_api_key_no_client_credential_travels(aiohttp_server: Any, make_upstream: MakeUpstream) -> None:
    proxy, _, seen = await hop_app(aiohttp_server, make_upstream, api_key="sk-server")
    sent = {
        "Authorization": "Bearer sk-client",
        "Proxy-Authorization": "Basic cHJveHk6cHc=",
        "Cookie": "session=client",
        "X-Api-Key": "client-anthropic",
        "API-Key": "client-azure",
        "x-goog-api-key": "client-google",
        "X-Keep-Req": "kept",
    }
    async with aiohttp.ClientSession() as client, client.post(proxy.make_url("/v1/chat/completions"), data=b"{}", headers=sent) as r:
        assert r.status == 200
    (forwarded,) = seen
    assert forwarded.getall("Authorization") == ["Bearer sk-server"]
    for name in ("Proxy-Authorization", "Cookie", "X-Api-Key", "api-key", "x-goog-api-key"):
        assert name not in forwarded, name
    assert not any("client" in value for value in forwarded.values())
    assert forwarded["X-Keep-Req"] == "kept"


def test_every_hop_by_hop_name_is_dropped_from_requests_and_responses() -> None:
    hop = ["Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer", "Transfer-Encoding", "Upgrade"]
    headers = CIMultiDict([(name, "x") for name in hop] + [("X-End", "e")])
    headers["Connection"] = "Upgrade, X-Named"
    headers["X-Named"] = "n"
    out_request = forward_request_headers(headers)
    out_response = forward_response_headers(headers)
    assert list(out_request.keys()) == ["X-End", "Accept-Encoding"]
    assert list(out_response.keys()) == ["X-End"]


def test_request_drops_host_and_length_and_response_drops_length_and_encoding() -> None:
    headers = CIMultiDict(
        [("Host", "h"), ("Content-Length", "9"), ("Content-Encoding", "gzip"), ("Accept-Encoding", "br"), ("X-A", "a")]
    )
    assert dict(forward_request_headers(headers)) == {
        # (the server decoded the gzip body: it travels decoded, without its encoding)
        "X-A": "a",
        "Accept-Encoding": "gzip, deflate",
    }
    assert dict(forward_response_headers(headers)) == {"Host": "h", "Accept-Encoding": "br", "X-A": "a"}


@pytest.mark.parametrize("encoding", ["compress", "gzip, br", "x-gzip", "identity"])
def test_a_request_encoding_the_server_does_not_decode_travels_with_the_body(encoding: str) -> None:
    """aiohttp decodes a request body only for a ``Content-Encoding`` of exactly one of gzip,
    deflate, br or zstd: any other body is forwarded as the client encoded it, with its encoding."""
    headers = CIMultiDict([("Content-Encoding", encoding), ("X-A", "a")])
    assert forward_request_headers(headers)["Content-Encoding"] == encoding
    assert "Content-Encoding" not in forward_request_headers(CIMultiDict([("Content-Encoding", "GZip")]))


def test_names_in_every_connection_field_line_are_hop_by_hop() -> None:
    headers = CIMultiDict([("Connection", "keep-alive"), ("Connection", "X-Secret"), ("X-Secret", "s"), ("X-A", "a")])
    assert "X-Secret" not in forward_request_headers(headers)
    assert "X-Secret" not in forward_response_headers(headers)
