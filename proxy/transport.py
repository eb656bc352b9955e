"""The HTTP/1.1 transport to the upstream: pooled keep-alive connections on asyncio protocols.

Why not :class:`aiohttp.ClientSession`: a proxy sends every request it serves, and a
sampling profile of a bare aiohttp pass-through showed the client side alone (URL and
request objects, cookie jar, tracing hooks, payload wrappers, its stream reader) at ~30 %
of the process's CPU per request. kvwarm needs none of it: it forwards bytes it already
holds to a base URL it already parsed. This module is what remains (the style of httpx's
transports and of uvicorn's protocols): one :class:`asyncio.Protocol` per connection,
responses parsed by ``httptools`` (llhttp: status line, headers, ``Content-Length``,
chunked bodies), gzip/deflate decoded here, flow control on the socket, a bounded pool.

Timers are armed only while something waits (a connection, the response headers, a body
chunk that has not arrived): a response read whole from one socket read arms none.

Errors (converted to kvwarm's own in :mod:`proxy.upstream`):

- :class:`ConnectFailed` -- no connection could be opened (refused, no route, DNS, TLS,
  connect timeout): not one byte of the request left.
- :class:`Disconnected` -- the connection closed before the response was complete;
  ``before_response`` says whether not one byte of a response had arrived.
- :class:`Malformed` -- the upstream's bytes are not HTTP/1.1.
- :class:`TimeoutError` -- a wait took longer than its bound.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

__all__ = ["ConnectFailed", "Disconnected", "Malformed", "Origin", "Pool", "Response", "Transport"]

HIGH_WATER = 256 * 1024
"""Decoded bytes buffered for a reader before the socket stops being read (until the reader
takes them: each read takes the whole buffer)."""
IDLE_CONNECTIONS = 64
"""Idle keep-alive connections kept per origin, beyond which they are closed."""


class TransportError(Exception):
    """Base of this module's errors."""


class ConnectFailed(TransportError):
    """No connection could be opened: the request was never sent."""


class Disconnected(TransportError):
    """The connection closed before the response was complete."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response
        """Not one byte of a response had arrived (a keep-alive connection the server had closed)."""


class Malformed(TransportError):
    """The upstream's response is not valid HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where connections go: ``scheme://host:port``."""

    host: str
    port: int
    tls: bool

    @classmethod
    def of(cls, url: URL) -> Origin:
        """The origin of ``url`` (``http`` or ``https``; the scheme's port when it names none)."""
        tls = url.scheme == "https"
        return cls(url.raw_host or "", url.port if url.port is not None else (443 if tls else 80), tls)

    @property
    def host_header(self) -> str:
        default = 443 if self.tls else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class Response:
    """One upstream response: status and headers at once, the body read with :meth:`read_chunk`.

    ``release()`` once the body was read to its end returns the connection to the pool;
    ``close()`` (any time) closes it."""

    __slots__ = (
        "_buffer", "_buffered", "_chunked", "_conn", "_decoder", "_done", "_error", "_no_body",
        "_until_eof", "_waiter", "content_length", "content_type", "deadline", "decoded", "headers",
        "reason", "status",
    )

    def __init__(self, conn: _Connection, status: int, reason: str, headers: CIMultiDict[str], no_body: bool) -> None:
        self._conn: _Connection | None = conn
        self.status = status
        self.reason = reason
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(headers)
        length = headers.get("Content-Length")
        self.content_length: int | None = int(length) if length is not None and length.isdigit() else None
        mime = headers.get("Content-Type", "application/octet-stream")
        self.content_type = mime.partition(";")[0].strip().lower()
        encoding = headers.get("Content-Encoding", "").strip().lower()
        self._decoder = _decoder(encoding)
        self.decoded = self._decoder is not None
        """The body arrives decoded (it was gzip or deflate): its encoding and length no longer apply."""
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        self._no_body = no_body
        self._until_eof = not no_body and self.content_length is None and not self._chunked
        """The body ends when the connection closes (no length, not chunked)."""
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._done = no_body
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.deadline = float("inf")
        """The loop time by which the whole body must have arrived (reads wait no later)."""

    # -- the reader's side ----------------------------------------------------------------------

    async def read_chunk(self, within: float) -> bytes:
        """Every body byte that arrived since the last read (``b""`` at the end); waits at most ``within``
        seconds for them (and never past :attr:`deadline`). Raises :class:`Disconnected`, :class:`Malformed` or :class:`TimeoutError`."""
        while not self._buffer:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait(within)
        # Everything that arrived, in one piece (one chunk is not copied): a stream's events come
        # a chunk each, and a reader that relays them writes once per read, not once per event.
        chunk = b"".join(self._buffer)
        self._buffer.clear()
        self._buffered = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return chunk

    async def _wait(self, within: float) -> None:
        conn = self._conn
        if conn is None:
            raise Disconnected("the response was closed", before_response=False)
        loop = conn.loop
        waiter = self._waiter = loop.create_future()
        timer = loop.call_at(min(loop.time() + within, self.deadline), _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    @property
    def complete(self) -> bool:
        """Every byte of the body arrived."""
        return self._done

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool when the body was read
        whole and the upstream keeps it alive; otherwise it is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(reusable=self._done and not self._buffer and self._error is None)

    def close(self) -> None:
        """Abandon the response: its connection is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(reusable=False)

    # -- the connection's side ------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._done:
            return  # bytes past the end of this response (the connection is being dropped)
        decoder = self._decoder
        kept = data if decoder is None else self._decoded(decoder.decompress, data)
        if kept:  # (a reader woken with nothing would take it for the end)
            self._keep(kept)
            self._wake()

    def _end(self) -> None:
        decoder = self._decoder
        if decoder is not None:
            rest = self._decoded(decoder.flush)
            if rest is None:
                return
            self._keep(rest)
            if decoder.cut_short:
                self._fail(Malformed("the response body ends mid-stream"))
                return
        self._done = True
        self._wake()

    def _decoded(self, step: Callable[..., bytes], *data: bytes) -> bytes | None:
        """``step(*data)`` of the decoder; None (the response failed) when the bytes do not decode."""
        try:
            return step(*data)
        except zlib.error as exc:
            self._fail(Malformed(f"the response body could not be decoded: {exc}"))
            return None

    def _keep(self, data: bytes) -> None:
        if data:
            self._buffer.append(data)
            self._buffered += len(data)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None and not self._done:
            self._error = exc
        self._wake()

    def _lost(self, exc: BaseException | None) -> None:
        """The connection closed: the end of a body delimited by it, or a broken one."""
        if self._done:
            return
        if self._until_eof and exc is None:
            self._end()
        else:
            detail = f": {exc}" if exc is not None else ""
            self._fail(Disconnected(f"the upstream closed the connection mid-response{detail}", before_response=False))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Decoder:
    """gzip or zlib-wrapped deflate, or raw deflate (some servers send it as ``deflate``)."""

    __slots__ = ("_head", "_obj", "_wbits")

    def __init__(self, wbits: int) -> None:
        self._wbits = wbits
        self._obj: zlib._Decompress | None = None
        self._head = b""

    def decompress(self, data: bytes) -> bytes:
        if self._obj is None:
            self._head += data
            if len(self._head) < 2:
                return b""  # too few bytes yet to tell a zlib header from raw deflate
            data, self._head = self._head, b""
            wbits = self._wbits
            if wbits == zlib.MAX_WBITS and not (data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0):
                wbits = -zlib.MAX_WBITS  # no zlib header (RFC 1950 2.2): raw deflate
            self._obj = zlib.decompressobj(wbits)
        return self._obj.decompress(data)

    def flush(self) -> bytes:
        return b"" if self._obj is None else self._obj.flush()

    @property
    def cut_short(self) -> bool:
        """Bytes arrived but their stream did not end (a truncated body)."""
        return bool(self._head) or (self._obj is not None and not self._obj.eof)


def _decoder(encoding: str) -> _Decoder | None:
    if encoding in ("gzip", "x-gzip"):
        return _Decoder(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return _Decoder(zlib.MAX_WBITS)
    return None  # identity, or one kvwarm does not decode: relayed as it came


class _Connection(asyncio.Protocol):
    """One keep-alive connection: requests written whole, responses parsed as they arrive."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        """The response being received (None between requests)."""
        self.waiter: asyncio.Future[Response] | None = None
        """Resolved with the response once its headers arrived."""
        self.no_body = False
        """The request was ``HEAD``: its response has headers only."""
        self.received = False
        """A byte of the current request's response arrived."""
        self.closed = False
        self.paused = False
        self.keep_alive = True
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._reason = ""
        self.lost: asyncio.Future[None] = self.loop.create_future()
        """Resolved once the connection is closed (``close()`` waits for it)."""

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        if self.waiter is None and self.response is None:
            self.abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._error(Malformed("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._error(Malformed(f"the upstream's response is not valid HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if not self.lost.done():
            self.lost.set_result(None)
        if self.waiter is not None and not self.waiter.done():
            detail = f": {exc}" if exc is not None else ""
            self.waiter.set_exception(
                Disconnected(f"the upstream closed the connection{detail}", before_response=not self.received)
            )
        if self.response is not None:
            self.response._lost(exc)

    def pause_writing(self) -> None:  # a request larger than the socket buffer: the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self._reason += status.decode("latin-1")  # called once per piece of the line read

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            return  # a trailer of the response being received: not a header of the next one
        self._headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self._headers = CIMultiDict()  # an interim response (100 Continue): the real one follows
            self._reason = ""
            return
        if self.waiter is None:  # a second response to one request: the connection cannot be trusted
            self._error(Malformed("the upstream sent a response nobody asked for"))
            return
        self.keep_alive = bool(self.parser.should_keep_alive())
        no_body = self.no_body or status in (204, 304)
        response = Response(self, status, self._reason, self._headers, no_body)
        self._headers = CIMultiDict()
        self._reason = ""
        self.response = response
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(response)
        if self.no_body:
            self.keep_alive = False  # llhttp would wait for a HEAD response's announced body

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            response._feed(body)
            if response._buffered > HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and not response._done:
            response._end()

    # -- the pool's side -------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, no_body: bool) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.no_body = no_body
        self.received = False
        waiter = self.waiter = self.loop.create_future()
        try:
            if body:
                self.transport.writelines((head, body))
            else:
                self.transport.write(head)
        except (RuntimeError, OSError) as exc:  # closed under us (uvloop raises, asyncio logs)
            self.waiter = None
            raise Disconnected(f"the connection could not be written: {exc}", before_response=True) from exc
        return waiter

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def finished(self, reusable: bool) -> None:
        """The response's reader is done with this connection."""
        self.response = None
        if self.paused:
            self.resume()
        if reusable and self.keep_alive and not self.closed:
            self.pool.idle(self)
        else:
            self.abort()
            self.pool.forget(self)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _error(self, exc: TransportError) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.response is not None:
            self.response._fail(exc)
        self.abort()


class Pool:
    """The connections to one origin (:meth:`Transport.pool`): the idle ones, most recently used first."""

    def __init__(self, transport: Transport, origin: Origin) -> None:
        self.transport = transport
        self.origin = origin
        self.loop = transport.loop
        self._idle: list[_Connection] = []
        self.open: set[_Connection] = set()

    def take(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    def idle(self, conn: _Connection) -> None:
        if len(self._idle) >= IDLE_CONNECTIONS:
            conn.abort()
            self.forget(conn)
            return
        self._idle.append(conn)
        self.transport.freed()

    def forget(self, conn: _Connection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self.transport.freed(closed=True)
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> list[asyncio.Future[None]]:
        """Close every connection; the futures resolve as they are closed."""
        closing = list(self.open)
        for conn in closing:
            conn.abort()
        self._idle.clear()
        return [conn.lost for conn in closing if conn.transport is not None]


class Transport:
    """Connections to every origin kvwarm sends to, at most ``limit`` open at once (a request
    beyond waits for one to be freed, within its connect timeout)."""

    def __init__(self, *, limit: int, connect_timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.limit = limit
        self.connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._pools: dict[Origin, Pool] = {}
        self._open = 0
        self._busy = 0
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    def pool(self, origin: Origin) -> Pool:
        """The connections to ``origin``: what :meth:`request` sends on."""
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = Pool(self, origin)
        return pool

    async def request(
        self,
        pool: Pool,
        method: str,
        target: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        *,
        fresh: bool = False,
        within: float,
    ) -> Response:
        """Send one request, return its response once its headers arrived (at most ``within``
        seconds after it was sent; connecting has its own bound).
        ``fresh``: on a new connection, not an idle one."""
        head = _head(method, target, pool.origin, headers, body)  # refused before a connection is taken
        conn = None if fresh else pool.take()
        if conn is None:
            conn = await self._connect(pool, fresh)
        timer: asyncio.TimerHandle | None = None
        try:
            waiter = conn.send(head, body, no_body=method == "HEAD")
            timer = self.loop.call_later(within, _expire_response, waiter)
            return await waiter
        except BaseException:
            conn.finished(reusable=False)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _connect(self, pool: Pool, fresh: bool) -> _Connection:
        """A new connection to ``pool``'s origin once fewer than ``limit`` are open (an idle one
        of another origin is closed to make room); an idle one of this origin freed meanwhile
        is taken instead, unless ``fresh``."""
        origin = pool.origin
        try:
            async with asyncio.timeout(self.connect_timeout):
                while True:
                    reused = None if fresh else pool.take()
                    if reused is not None:
                        return reused
                    if self._open < self.limit:
                        break
                    idle = self._any_idle()
                    if idle is not None:
                        idle.abort()
                        idle.pool.forget(idle)
                        continue
                    ticket = self.loop.create_future()
                    self._queue.append(ticket)
                    try:
                        await ticket
                    except BaseException:
                        if ticket.done() and not ticket.cancelled():
                            self.freed()  # granted but not taken: the next in line gets the slot
                        raise
                    finally:
                        if ticket in self._queue:
                            self._queue.remove(ticket)
                self._open += 1
                conn = _Connection(pool)
                pool.open.add(conn)
                try:
                    await self.loop.create_connection(
                        lambda: conn,
                        origin.host,
                        origin.port,
                        ssl=self._ssl_for(origin),
                        server_hostname=origin.host if origin.tls else None,
                    )
                except BaseException:
                    pool.forget(conn)
                    raise
                return conn
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {origin.host}:{origin.port} within {self.connect_timeout:g} s") from exc
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc

    def _ssl_for(self, origin: Origin) -> ssl.SSLContext | None:
        if not origin.tls:
            return None
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _any_idle(self) -> _Connection | None:
        for pool in self._pools.values():
            conn = pool.take()
            if conn is not None:
                return conn
        return None

    def freed(self, closed: bool = False) -> None:
        """A connection closed (``closed``) or went idle: a waiting request may go on."""
        if closed:
            self._open -= 1
        while self._queue:
            ticket = self._queue.popleft()
            if not ticket.done():
                ticket.set_result(None)
                break

    async def close(self) -> None:
        """Close every connection and wait (a second at most) until they are closed."""
        closing = [lost for pool in self._pools.values() for lost in pool.close()]
        if closing:
            await asyncio.wait(closing, timeout=1.0)


def _expire_response(waiter: asyncio.Future[Response]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


_BODYLESS_METHODS = frozenset(("GET", "HEAD", "DELETE", "OPTIONS", "TRACE", "CONNECT"))


def _head(method: str, target: str, origin: Origin, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    """The request line and headers, with ``Host`` and ``Content-Length`` for the bytes sent."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {origin.host_header}\r\n"]
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n")
    if body or method not in _BODYLESS_METHODS:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    head = "".join(lines)
    breaks = len(lines) + 1  # one per line, two in the first (the request line and Host)
    if head.count("\n") != breaks or head.count("\r") != breaks:
        raise ValueError("a request header or the request line holds a line break")
    return head.encode("utf-8", "surrogateescape")
