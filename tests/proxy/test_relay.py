"""The relay on real sockets: a scripted upstream, a proxy-side app whose handler runs a
:class:`Relay` as the pipeline does (``finish``, the turn's record, between :meth:`Relay.run`
and :meth:`Relay.end`), and an aiohttp client. What the client receives, when, and what
``finish`` and the observer saw."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config import ServerSettings
from proxy.core.sse import SSEEvent
from proxy.core.usage import Usage
from proxy.edge.defences import runner_options
from proxy.errors import UpstreamTimeout, UpstreamUnreachable
from proxy.request.relay import WHOLE_BODY_LIMIT, Relay, RelayOutcome
from proxy.transport.client import forward_request_headers
from proxy.transport.pool import Transport
from proxy.wire.base import HIDE, KEEP, Replace, Verdict
from tests.proxy.test_upstream_client import upstream_sender

WAIT = 5.0
"""Upper bound on any single wait in these tests: a hang fails, it never blocks the suite."""
QUIET = 0.3
"""How long "nothing arrives" is watched for."""


def event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


class RecordingObserver:
    """A real observer: hides and replaces events by their data, hashes plain bodies as they pass."""

    usage: Usage | None = None

    def __init__(self, hide: tuple[str, ...] = (), replace: dict[str, bytes] | None = None) -> None:
        self.hide = hide
        self.replace = replace or {}
        self.events: list[SSEEvent] = []
        self.body_hash = hashlib.sha256()
        self.body_bytes = 0
        self.body_calls = 0
        self.largest_chunk = 0

    def on_event(self, event: SSEEvent) -> Verdict:
        self.events.append(event)
        if event.data in self.hide:
            return HIDE
        if event.data in self.replace:
            return Replace(raw=self.replace[event.data])
        return KEEP

    def is_terminal(self, event: SSEEvent) -> bool:
        return event.data == "[DONE]"

    def on_body(self, chunk: bytes) -> None:
        # Hashed, not kept: the test itself holds no copy of what passed through.
        self.body_hash.update(chunk)
        self.body_bytes += len(chunk)
        self.body_calls += 1
        self.largest_chunk = max(self.largest_chunk, len(chunk))

    def end(self, *, client_gone: bool) -> None:
        return None


@dataclass
class Harness:
    """kvwarm's edge in miniature: the real :class:`Upstream` and :class:`Relay` behind a route."""

    url: str
    observer: RecordingObserver
    gate: asyncio.Event
    """``finish`` waits for this (set by default)."""
    finish_started: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    handler_done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: RelayOutcome | None = None
    finish_calls: int = 0
    raised: BaseException | None = None
    order: list[str] = field(default_factory=list)

    async def finish(self, outcome: RelayOutcome) -> None:
        self.finish_calls += 1
        self.outcome = outcome
        self.order.append("finish started")
        self.finish_started.set()
        await self.gate.wait()
        self.order.append("finish done")
        self.finished.set()


Start = Callable[..., Awaitable[Harness]]


@pytest.fixture
async def start_relay() -> AsyncIterator[Start]:
    """``await start_relay(upstream_base_url, ...)``: a proxy-side server relaying to that upstream.

    It runs with kvwarm's own runner options (handler cancellation on, as in ``kvwarm serve``)
    unless ``handler_cancellation=False`` is passed.
    """
    runners: list[web.AppRunner] = []
    transports: list[Transport] = []

    async def start(
        base_url: str,
        *,
        observer: RecordingObserver | None = None,
        gate_open: bool = True,
        handler_cancellation: bool | None = None,
        **upstream_settings: Any,
    ) -> Harness:
        transport = Transport(limit=16, connect_timeout=10.0)
        transports.append(transport)
        upstream = upstream_sender(transport, base_url, **upstream_settings)
        gate = asyncio.Event()
        if gate_open:
            gate.set()
        h = Harness(url="", observer=observer or RecordingObserver(), gate=gate)

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                body = await request.read()
                response = await upstream.send(
                    request.method, request.path, request.query_string, forward_request_headers(request.headers), body
                )
                relay = Relay(request, response, upstream, {"x-relayed": "yes"}, h.observer)
                try:
                    outcome = await relay.run()
                except asyncio.CancelledError:  # the client left: what it was delivered is recorded
                    if relay.outcome.client_gone:
                        await asyncio.shield(h.finish(relay.outcome))
                    raise
                await h.finish(outcome)
                return await relay.end()
            except BaseException as exc:
                h.raised = exc
                raise
            finally:
                h.handler_done.set()

        app = web.Application()
        app.router.add_route("*", "/v1/{tail:.*}", handle)
        options = runner_options(ServerSettings())
        if handler_cancellation is not None:
            options["handler_cancellation"] = handler_cancellation
        options["shutdown_timeout"] = 1.0
        runner = web.AppRunner(app, **options)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        h.url = f"http://127.0.0.1:{port}"
        return h

    yield start
    for runner in runners:
        await runner.cleanup()
    for transport in transports:
        await transport.close()


def upstream_url(server: TestServer) -> str:
    return str(server.make_url("/v1"))


async def serve(aiohttp_server: Any, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> TestServer:
    app = web.Application()
    app.router.add_route("*", "/v1/{tail:.*}", handler)
    server: TestServer = await aiohttp_server(app)
    return server


async def read_until_quiet(response: aiohttp.ClientResponse, done: asyncio.Event) -> bytes:
    """Everything that arrives until nothing more comes for QUIET seconds after ``done`` is set."""
    got = bytearray()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            chunk = await asyncio.wait_for(response.content.readany(), QUIET)
        except TimeoutError:
            if done.is_set():
                return bytes(got)
            continue
        if not chunk:
            return bytes(got)
        got += chunk
    raise AssertionError("the response neither ended nor went quiet")


# -- raw upstreams, for what aiohttp's server will not do: break a response halfway -------------


class RawUpstream:
    """An HTTP/1.1 upstream on a plain socket: ``script(writer)`` writes the whole response."""

    def __init__(self, script: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> None:
        self.script = script
        self.connections = 0
        self.closed_by_peer = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
            )
            await reader.readexactly(length)
            await self.script(writer)
            # Hold the connection until the proxy closes it (or the test ends).
            await asyncio.wait_for(reader.read(), WAIT)
            self.closed_by_peer.set()
        except ConnectionError:
            self.closed_by_peer.set()  # a write found the connection closed by the proxy
        except (asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
async def raw_upstreams() -> AsyncIterator[list[RawUpstream]]:
    made: list[RawUpstream] = []
    yield made
    for upstream in made:
        await upstream.stop()


# -- SSE ------------------------------------------------------------------------------------


async def test_events_are_written_as_they_arrive(aiohttp_server: Any, start_relay: Start) -> None:
    release = asyncio.Event()
    events = [event('{"n":0}'), b": comment\n\n", event('{"n":1}'), event('{"n":2}'), event("[DONE]")]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-From-Upstream": "1"})
        await resp.prepare(request)
        await resp.write(events[0])
        await asyncio.wait_for(release.wait(), WAIT)  # nothing more exists until the client saw event 0
        for e in events[1:]:
            await resp.write(e)
        await resp.write_eof()
        return resp

    upstream = await serve(aiohttp_server, handler)
    h = await start_relay(upstream_url(upstream))
    async with aiohttp.ClientSession() as client, client.post(f"{h.url}/v1/chat/completions", data=b"{}") as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert (r.headers["X-From-Upstream"], r.headers["x-relayed"]) == ("1", "yes")
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), WAIT)
        assert first == events[0]
        assert not h.finish_started.is_set()
        release.set()
        rest = await asyncio.wait_for(r.read(), WAIT)
    assert first + rest == b"".join(events)
    assert [e.raw for e in h.observer.events] == events
    assert h.outcome == RelayOutcome(complete=True)
    assert h.finish_calls == 1


async def test_hide_drops_exactly_that_event_and_replace_substitutes_its_bytes(
    aiohttp_server: Any, start_relay: Start
) -> None:
    events = [event("a"), event("hide-me"), event("replace-me"), event("b"), event("hide-me-too"), event("[DONE]")]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:  # one write per event, and then all of them in one chunk below
            await resp.write(e)
        return resp

    upstream = await serve(aiohttp_server, handler)
    observer = RecordingObserver(hide=("hide-me", "hide-me-too"), replace={"replace-me": b"data: replaced!\r\n\r\n"})
    h = await start_relay(upstream_url(upstream), observer=observer)
    async with aiohttp.ClientSession() as client, client.post(f"{h.url}/v1/chat/completions", data=b"{}") as r:
        got = await asyncio.wait_for(r.read(), WAIT)
    assert got == event("a") + b"data: replaced!\r\n\r\n" + event("b") + event("[DONE]")
    assert [e.raw for e in observer.events] == events  # the observer saw every event, hidden ones too


async def test_terminal_event_reaches_the_client_only_after_finish(aiohttp_server: Any, start_relay: Start) -> None:
    body = event("one") + event("two") + event("[DONE]")

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(body)  # the terminal event arrives in the same chunk as the others
        await resp.write_eof()
        return resp

    upstream = await serve(aiohttp_server, handler)
    h = await start_relay(upstream_url(upstream), gate_open=False)
    async with aiohttp.ClientSession() as client, client.post(f"{h.url}/v1/chat/completions", data=b"{}") as r:
        before = await read_until_quiet(r, h.finish_started)
        assert before == event("one") + event("two")
        assert h.finish_started.is_set() and not h.finished.is_set()
        assert not r.content.at_eof()
        h.gate.set()
        after = await asyncio.wait_for(r.read(), WAIT)
    assert after == event("[DONE]")
    assert h.order == ["finish started", "finish done"]
    assert h.outcome is not None and h.outcome.complete


async def test_a_client_that_leaves_mid_stream_closes_the_upstream_connection(
    raw_upstreams: list[RawUpstream], start_relay: Start
) -> None:
    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for i in range(2000):
            writer.write(chunk(event(f'{{"n":{i}}}')))
            await writer.drain()
            await asyncio.sleep(0.005)

    upstream = RawUpstream(endless)
    raw_upstreams.append(upstream)
    h = await start_relay(await upstream.start())
    async with aiohttp.ClientSession() as client:
        r = await client.post(f"{h.url}/v1/chat/completions", data=b"{}")
        assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), WAIT) == event('{"n":0}')
        r.close()  # drop the connection mid-stream
    await asyncio.wait_for(h.handler_done.wait(), WAIT)
    # The upstream saw its connection closed by the proxy: cancelled, not left streaming or pooled.
    await asyncio.wait_for(upstream.closed_by_peer.wait(), WAIT)
    assert upstream.connections == 1




@pytest.mark.parametrize(
    "handler_cancellation",
    [False, True],
    ids=["no-cancellation", "serve-options"],
)
async def test_a_client_that_leaves_mid_stream_is_reported_as_gone(
    raw_upstreams: list[RawUpstream], start_relay: Start, handler_cancellation: bool
) -> None:
    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD)
        for i in range(2000):
            writer.write(chunk(event(f'{{"n":{i}}}')))
            await writer.drain()
            await asyncio.sleep(0.005)

    upstream = RawUpstream(endless)
    raw_upstreams.append(upstream)
    h = await start_relay(await upstream.start(), handler_cancellation=handler_cancellation)
    async with aiohttp.ClientSession() as client:
        r = await client.post(f"{h.url}/v1/chat/completions", data=b"{}")
        await asyncio.wait_for(r.content.readuntil(b"\n\n"), WAIT)
        r.close()
    await asyncio.wait_for(h.handler_done.wait(), WAIT)
    assert h.finish_calls == 1, f"finish was not called (the handler ended with {h.raised!r})"
    assert h.outcome is not None
    assert h.outcome.client_gone and not h.outcome.complete and h.outcome.upstream_error is None
    await asyncio.wait_for(upstream.closed_by_peer.wait(), WAIT)


@pytest.mark.parametrize("failure", ["hangup", "stall"])
async def test_an_upstream_failure_mid_stream_breaks_the_clients_response(
    raw_upstreams: list[RawUpstream], start_relay: Start, failure: str
) -> None:
    async def breaks(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(event("one")) + chunk(event("two")[:7]))  # half of event two
        await writer.drain()
        if failure == "hangup":
            writer.transport.abort()
        # "stall": say nothing more; the proxy's idle timeout ends it

    upstream = RawUpstream(breaks)
    raw_upstreams.append(upstream)
    h = await start_relay(await upstream.start(), idle_timeout=0.3, first_byte_timeout=WAIT)
    async with aiohttp.ClientSession() as client, client.post(f"{h.url}/v1/chat/completions", data=b"{}") as r:
        assert await asyncio.wait_for(r.content.readuntil(b"\n\n"), WAIT) == event("one")
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(r.read(), WAIT)  # broken, not a clean end
    assert h.outcome is not None
    expected = UpstreamUnreachable if failure == "hangup" else UpstreamTimeout
    assert isinstance(h.outcome.upstream_error, expected)
    assert not h.outcome.complete and not h.outcome.client_gone
    if failure == "stall":
        await asyncio.wait_for(upstream.closed_by_peer.wait(), WAIT)  # the stalled connection is closed


# -- plain bodies ---------------------------------------------------------------------------


async def test_a_small_plain_body_is_one_response_sent_after_finish(aiohttp_server: Any, start_relay: Start) -> None:
    payload = b'{"object":"chat.completion","text":"' + b"x" * (WHOLE_BODY_LIMIT - 100) + b'"}'

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, content_type="application/json", headers={"X-Up": "1"})

    upstream = await serve(aiohttp_server, handler)
    h = await start_relay(upstream_url(upstream), gate_open=False)
    got_headers = asyncio.Event()
    async with aiohttp.ClientSession() as client:

        async def fetch() -> tuple[aiohttp.ClientResponse, bytes]:
            async with client.post(f"{h.url}/v1/chat/completions", data=b"{}") as r:
                got_headers.set()
                return r, await r.read()

        task = asyncio.create_task(fetch())
        await asyncio.wait_for(h.finish_started.wait(), WAIT)
        await asyncio.sleep(QUIET)
        assert not got_headers.is_set()  # not a byte before finish completed
        assert h.observer.body_calls == 1 and h.observer.body_bytes == len(payload)
        h.gate.set()
        r, body = await asyncio.wait_for(task, WAIT)
    assert body == payload
    assert r.headers["Content-Length"] == str(len(payload))
    assert "Transfer-Encoding" not in r.headers
    assert (r.headers["X-Up"], r.headers["x-relayed"]) == ("1", "yes")
    assert h.observer.body_hash.digest() == hashlib.sha256(payload).digest()
    assert h.outcome == RelayOutcome(complete=True)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_large_body_is_streamed_and_its_last_chunk_held_until_finish(
    aiohttp_server: Any, start_relay: Start, framing: str
) -> None:
    size = 5 * 1024 * 1024
    piece = 64 * 1024
    payload = bytes(range(256)) * (size // 256)
    release = asyncio.Event()
    sent = 0

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        if framing == "content-length":
            resp.content_length = size
        await resp.prepare(request)
        for offset in range(0, size, piece):
            if offset == 4 * piece:
                await asyncio.wait_for(release.wait(), WAIT)  # the rest exists only once the client read
            await resp.write(payload[offset : offset + piece])
            sent = offset + piece
        await resp.write_eof()
        return resp

    upstream = await serve(aiohttp_server, handler)
    h = await start_relay(upstream_url(upstream), gate_open=False)
    digest = hashlib.sha256()
    async with aiohttp.ClientSession() as client, client.post(f"{h.url}/v1/files", data=b"{}") as r:
        assert "Content-Length" not in r.headers  # streamed, not read whole
        first = await asyncio.wait_for(r.content.readany(), WAIT)
        assert first and sent < size  # bytes reached the client before the upstream sent them all
        assert not release.is_set()
        digest.update(first)
        release.set()
        before = await read_until_quiet(r, h.finish_started)
        digest.update(before)
        received = len(first) + len(before)
        assert h.finish_started.is_set() and not h.finished.is_set()
        assert 0 < received < size  # the last chunk is held back while finish runs
        h.gate.set()
        tail = await asyncio.wait_for(r.read(), WAIT)
        assert tail
        digest.update(tail)
    assert received + len(tail) == size
    assert digest.digest() == hashlib.sha256(payload).digest()
    # The observer saw every byte once, in order, in pieces (never the whole body at once).
    assert h.observer.body_bytes == size
    assert h.observer.body_hash.digest() == hashlib.sha256(payload).digest()
    assert h.observer.body_calls > 4
    assert h.observer.largest_chunk <= WHOLE_BODY_LIMIT
    assert h.outcome == RelayOutcome(complete=True)


@pytest.mark.parametrize("size", [300, 3 * 1024 * 1024], ids=["small", "large"])
async def test_a_gzip_compressed_body_is_decoded(aiohttp_server: Any, start_relay: Start, size: int) -> None:
    payload = (b'{"object":"list","data":"' + b"caf\xc3\xa9 " * size)[: size - 2] + b'"}'
    compressed = gzip.compress(payload)

    async def handler(request: web.Request) -> web.StreamResponse:
        assert "gzip" in request.headers["Accept-Encoding"]
        return web.Response(body=compressed, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    upstream = await serve(aiohttp_server, handler)
    h = await start_relay(upstream_url(upstream))
    async with aiohttp.ClientSession(auto_decompress=False) as client, client.get(f"{h.url}/v1/models") as r:
        body = await asyncio.wait_for(r.read(), WAIT)
        assert "Content-Encoding" not in r.headers
    assert body == payload
    assert h.observer.body_bytes == len(payload)
    assert h.observer.body_hash.digest() == hashlib.sha256(payload).digest()


async def test_a_gzip_compressed_event_stream_is_decoded_event_by_event(aiohttp_server: Any, start_relay: Start) -> None:
    events = [event(f'{{"n":{i}}}') for i in range(50)] + [event("[DONE]")]

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=gzip.compress(b"".join(events)),
            headers={"Content-Encoding": "gzip", "Content-Type": "text/event-stream"},
        )

    upstream = await serve(aiohttp_server, handler)
    h = await start_relay(upstream_url(upstream))
    async with aiohttp.ClientSession(auto_decompress=False) as client, client.post(f"{h.url}/v1/chat/completions") as r:
        body = await asyncio.wait_for(r.read(), WAIT)
        assert "Content-Encoding" not in r.headers
    assert body == b"".join(events)
    assert [e.raw for e in h.observer.events] == events


async def test_a_plain_body_cut_short_is_an_upstream_error_before_any_byte(
    raw_upstreams: list[RawUpstream], start_relay: Start
) -> None:
    async def short(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b"x" * 400)
        await writer.drain()
        writer.transport.abort()

    upstream = RawUpstream(short)
    raw_upstreams.append(upstream)
    h = await start_relay(await upstream.start())
    async with aiohttp.ClientSession() as client, client.post(f"{h.url}/v1/chat/completions", data=b"{}") as r:
        assert r.status == 500  # this harness has no error middleware: the relay raised
        assert b"x" * 400 not in await r.read()
    assert isinstance(h.raised, UpstreamUnreachable)
    assert h.finish_calls == 0
