"""Transparent forwarding: headers, status, bodies, SSE byte identity and timing, errors."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import ProxyFactory, received

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}


async def post(server: TestServer, path: str, body: bytes, **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.post(server.make_url(path), data=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


async def test_chat_body_reaches_upstream_byte_identical(proxy: TestServer, sim: TestServer) -> None:
    raw = b'{"model": "m",\n "messages": [{"role": "user", "content": "caf\\u00e9"}],   "temperature": 0.70}'
    status, _, body = await post(proxy, "/v1/chat/completions", raw, Authorization="Bearer sk-1")
    assert status == 200
    assert orjson.loads(body)["object"] == "chat.completion"
    assert received(sim)[-1].body == raw


async def test_non_json_body_forwarded_untouched(proxy: TestServer, sim: TestServer) -> None:
    raw = b"this is {not json"
    status, _, body = await post(proxy, "/v1/chat/completions", raw)
    assert received(sim)[-1].body == raw
    assert status == 400  # the upstream decided
    assert "error" in orjson.loads(body)


async def test_get_models_and_query_string(proxy: TestServer, sim: TestServer) -> None:
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url("/v1/models?limit=2&after=x")) as r:
        assert r.status == 200
        data = await r.json()
    assert data["object"] == "list"


class Recorder:
    """A scripted upstream for transport tests: records what it received, replies as told."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.release = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.sse_events = [
            b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}\n\n',
            b": keep-alive comment\n\n",
            b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo\\n"},"finish_reason":null}]}\r\n\r\n',
            b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
            b"data: [DONE]\n\n",
        ]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/v1/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.method, request.path_qs, dict(request.headers), body))
        mode = request.headers.get("x-mode", "json")
        if mode == "sse":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Upstream": "yes"})
            await resp.prepare(request)
            await resp.write(self.sse_events[0])
            await self.release.wait()  # the client must see event 0 before the rest exists
            for event in self.sse_events[1:]:
                await resp.write(event)
            await resp.write_eof()
            return resp
        if mode == "endless":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for _i in range(10_000):
                    await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
                    await asyncio.sleep(0.01)
            except (ConnectionResetError, asyncio.CancelledError):
                self.disconnected.set()
                raise
            return resp
        if mode == "gzip":
            payload = orjson.dumps({"ok": True, "text": "é" * 100})
            return web.Response(body=gzip.compress(payload), headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        return web.json_response(
            {"echo": True},
            status=int(request.headers.get("x-status", "200")),
            headers={"X-Custom": "v", "Retry-After": "7", "Connection": "close, X-Hop", "X-Hop": "drop-me"},
        )


@pytest.fixture
async def recorder(aiohttp_server: Any) -> tuple[Recorder, TestServer]:
    rec = Recorder()
    server = await aiohttp_server(rec.app())
    return rec, server


async def test_headers_pass_through_minus_hop_by_hop(make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]) -> None:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    status, headers, body = await post(
        proxy, "/v1/files?purpose=batch", b"payload",
        Authorization="Bearer sk-client", **{"X-Trace": "t1", "Keep-Alive": "timeout=5", "x-status": "429"},
    )
    method, path_qs, sent, got = rec.requests[-1]
    assert (method, path_qs, got) == ("POST", "/v1/files?purpose=batch", b"payload")
    assert sent["Authorization"] == "Bearer sk-client"
    assert sent["X-Trace"] == "t1"
    assert "Keep-Alive" not in sent
    assert sent["Host"] == f"{upstream.host}:{upstream.port}"
    assert status == 429
    assert headers["Retry-After"] == "7"
    assert headers["X-Custom"] == "v"
    assert "X-Hop" not in headers
    assert orjson.loads(body) == {"echo": True}


async def test_api_key_override(make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]) -> None:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")), upstream__api_key="sk-server")
    await post(proxy, "/v1/models", b"", Authorization="Bearer sk-client")
    assert rec.requests[-1][2]["Authorization"] == "Bearer sk-server"


async def test_sse_relayed_event_by_event_byte_identical(make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]) -> None:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    body = orjson.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": "hi"}]})
    async with aiohttp.ClientSession() as s, s.post(proxy.make_url("/v1/chat/completions"), data=body, headers={"x-mode": "sse"}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["X-Upstream"] == "yes"
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
        # The upstream has not finished (it waits for `release`), yet the first event arrived.
        assert first == rec.sse_events[0]
        rec.release.set()
        rest = await r.read()
    assert first + rest == b"".join(rec.sse_events)
    assert rec.requests[-1][3] == body  # include_usage asked by the client: bytes unchanged


async def test_client_disconnect_cancels_upstream(make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]) -> None:
    rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    async with aiohttp.ClientSession() as s:
        r = await s.post(proxy.make_url("/v1/chat/completions"), data=body, headers={"x-mode": "endless"})
        await r.content.readuntil(b"\n\n")
        r.close()  # drop the connection mid-stream
    await asyncio.wait_for(rec.disconnected.wait(), 10)


async def test_gzip_upstream_is_decoded(make_proxy: ProxyFactory, recorder: tuple[Recorder, TestServer]) -> None:
    _rec, upstream = recorder
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    status, headers, body = await post(proxy, "/v1/anything", b"{}", **{"x-mode": "gzip"})
    assert status == 200
    assert "Content-Encoding" not in headers
    assert orjson.loads(body) == {"ok": True, "text": "é" * 100}


async def test_upstream_unreachable_is_502(make_proxy: ProxyFactory, unused_tcp_port: int) -> None:
    proxy = await make_proxy(f"http://127.0.0.1:{unused_tcp_port}/v1")
    status, _, body = await post(proxy, "/v1/chat/completions", orjson.dumps(CHAT))
    assert status == 502
    error = orjson.loads(body)["error"]
    assert error["code"] == "upstream_unreachable" and error["type"] and error["message"]


async def test_upstream_timeout_is_504(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim, upstream__first_byte_timeout=0.3)
    status, _, body = await post(proxy, "/v1/chat/completions", orjson.dumps(CHAT), **{"x-sim-fault": "delay=3"})
    assert status == 504
    assert orjson.loads(body)["error"]["code"] == "upstream_timeout"


async def test_body_over_limit_is_413_and_never_forwarded(make_proxy: ProxyFactory, sim: TestServer) -> None:
    proxy = await make_proxy(sim, server__max_body_bytes=1000)
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]})
    status, _, body = await post(proxy, "/v1/chat/completions", big)
    assert status == 413
    assert orjson.loads(body)["error"]["code"] == "request_too_large"
    assert received(sim) == []


async def test_upstream_errors_pass_through(proxy: TestServer, sim: TestServer) -> None:
    status, headers, body = await post(proxy, "/v1/chat/completions", orjson.dumps(CHAT), **{"x-sim-fault": "status=429,retry_after=3"})
    assert status == 429
    assert headers["Retry-After"] == "3"
    assert "error" in orjson.loads(body)
    status, _, _ = await post(proxy, "/v1/chat/completions", orjson.dumps(CHAT), **{"x-sim-fault": "status=503"})
    assert status == 503


async def test_health_endpoints(proxy: TestServer) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.make_url("/healthz")) as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(proxy.make_url("/readyz")) as r:
            assert r.status == 200 and (await r.json())["status"] == "ready"


async def test_llamacpp_timings_stop_usage_injection(make_proxy: ProxyFactory, aiohttp_server: Any) -> None:
    """llama.cpp reports timings in every stream; once seen, kvwarm stops adding include_usage."""
    bodies: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        usage = (body.get("stream_options") or {}).get("include_usage")
        timings = {"cache_n": 100, "prompt_n": 20, "prompt_ms": 5.0}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"}}]}\n\n')
        finish: dict[str, Any] = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        if not usage:
            finish["timings"] = timings
        await resp.write(b"data: " + orjson.dumps(finish) + b"\n\n")
        if usage:
            last = {"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 100}}, "timings": timings}
            await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    upstream = await aiohttp_server(app)
    proxy = await make_proxy(str(upstream.make_url("/v1")))
    request = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    seen = []
    for _ in range(2):
        _, _, raw = await post(proxy, "/v1/chat/completions", request)
        seen.append(raw)
    assert bodies[0]["stream_options"] == {"include_usage": True}  # first: kvwarm asks for usage
    assert "stream_options" not in bodies[1]  # then it knows timings will come anyway
    assert b'"timings"' in seen[1] and b'"usage"' not in seen[1]
    assert b'"usage"' not in seen[0]  # the client never sees usage it did not ask for


class KeepAliveCloser:
    """A raw HTTP/1.1 upstream: answers the first request of a connection, then reads the next
    one and hangs up without answering (a crash mid-generation, or a keep-alive close racing
    the request)."""

    def __init__(self, always_close: bool = False) -> None:
        self.always_close = always_close
        self.received = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
                await reader.readexactly(length)
                self.received += 1
                if served >= 1 or self.always_close:
                    break  # hang up without a response
                body = b'{"ok":true}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def test_a_request_the_upstream_read_on_a_reused_connection_and_dropped_is_not_sent_again(
    make_proxy: ProxyFactory, unused_tcp_port: int
) -> None:
    """The upstream may have processed it: a 502, never a second copy
    (tests/reliability/test_no_double_send.py)."""
    upstream = KeepAliveCloser()
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", unused_tcp_port)
    try:
        proxy = await make_proxy(f"http://127.0.0.1:{unused_tcp_port}/v1")
        status, _, body = await post(proxy, "/v1/embeddings", b'{"input":"x"}')
        assert (status, orjson.loads(body)) == (200, {"ok": True})
        status, _, body = await post(proxy, "/v1/embeddings", b'{"input":"x"}')
        assert status == 502 and orjson.loads(body)["error"]["code"] == "upstream_unreachable"
        assert upstream.received == 2  # each request once
    finally:
        server.close()
        await server.wait_closed()


async def test_an_upstream_that_always_hangs_up_is_502_after_one_copy(make_proxy: ProxyFactory, unused_tcp_port: int) -> None:
    upstream = KeepAliveCloser(always_close=True)
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", unused_tcp_port)
    try:
        proxy = await make_proxy(f"http://127.0.0.1:{unused_tcp_port}/v1")
        status, _, body = await post(proxy, "/v1/embeddings", b'{"input":"x"}')
        assert status == 502 and orjson.loads(body)["error"]["code"] == "upstream_unreachable"
        assert upstream.received == 1
    finally:
        server.close()
        await server.wait_closed()
