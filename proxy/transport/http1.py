"""HTTP/1.1 on the request path, compiled (:mod:`proxy.native`): which headers travel, the
request's head, and the connection's side of the upstream transport.

Every request runs through this module three times: its headers are filtered on the way up
(:func:`forward_request_headers`) and written into a request head (:func:`request_head`); the
response is parsed by ``httptools`` calling back into a :class:`Connection` and buffered in
its :class:`Body`; its headers are filtered on the way down (:func:`forward_response_headers`).
None of it is a coroutine, so all of it is compiled (it runs for every request and every
chunk). Whatever waits is a coroutine in :mod:`proxy.transport.pool`: taking a connection, the
response's headers, a body chunk that has not arrived (:func:`~proxy.transport.pool.read_chunk`).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable, Mapping
from typing import Final, Protocol

import httptools
from aiohttp import hdrs
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = [
    "HIGH_WATER",
    "HOP_BY_HOP",
    "Body",
    "ConnectFailed",
    "Connection",
    "Disconnected",
    "Malformed",
    "ProxyRefused",
    "TransportError",
    "forward_request_headers",
    "forward_response_headers",
    "keep_alive_timeout",
    "request_head",
    "speaks_anthropic",
]

HIGH_WATER: Final = 256 * 1024
"""Decoded bytes buffered for a reader before the socket stops being read (until the reader
takes them: each read takes the whole buffer). A compressed body is decoded at most this much
ahead of its reader: the rest waits encoded (:class:`Decoder`), so a body that inflates a
thousandfold (a decompression bomb) costs no more memory than any other."""

# -- which headers travel ------------------------------------------------------------------------

HOP_BY_HOP: Final = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION,
        "Keep-Alive",
        hdrs.PROXY_AUTHENTICATE,
        hdrs.PROXY_AUTHORIZATION,
        hdrs.TE,
        hdrs.TRAILER,
        hdrs.TRANSFER_ENCODING,
        hdrs.UPGRADE,
    )
)
# Recomputed by the transport for the bytes actually sent.
_REQUEST_DROP: Final = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
# With upstream.api_key, no client credential travels.
_KEYED_DROP: Final = _REQUEST_DROP | {"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key", "x-goog-api-key"}
# The relay sets the length of what it sends.
_RESPONSE_DROP: Final = HOP_BY_HOP | {"content-length"}
# A gzip or deflate body is decoded here (to observe usage): its encoding no longer applies.
_DECODED_DROP: Final = _RESPONSE_DROP | {"content-encoding"}


SERVER_DECODES: Final = frozenset(("gzip", "deflate", "br", "zstd"))
"""Request ``Content-Encoding`` values aiohttp's server decodes before the body is read (the
value whole, as its parser compares it): such a body is forwarded decoded."""


def connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Header names listed in ``Connection`` are hop-by-hop too (RFC 9110 7.6.1), from every
    ``Connection`` field line (RFC 9110 5.3 combines them)."""
    getall = getattr(headers, "getall", None)
    values: list[str] = getall("Connection", []) if getall is not None else [headers.get("Connection", "")]
    return {t.strip().lower() for value in values for t in value.split(",") if t.strip()}


def forward_request_headers(incoming: Mapping[str, str], api_key: str = "") -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop ones, and minus the ``Content-Encoding`` of a body the
    server decoded (:data:`SERVER_DECODES`). With ``api_key`` set, no client credential
    travels upstream (``Authorization``, ``Proxy-Authorization``, ``Cookie``, ``X-Api-Key``,
    ``api-key``, ``x-goog-api-key`` are removed) and ``api_key`` goes in the header the client's
    API takes it in (:func:`speaks_anthropic`: ``x-api-key``; else ``Authorization: Bearer``)."""
    drop = _KEYED_DROP if api_key else _REQUEST_DROP
    if "Connection" in incoming:
        drop = drop | connection_tokens(incoming)
    encoding = incoming.get("Content-Encoding")
    if encoding is not None and encoding.isascii() and encoding.lower() in SERVER_DECODES:
        drop = drop | {"content-encoding"}  # the body forwarded is the decoded one
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        if name.lower() not in drop:
            out.add(name, value)
    if api_key:
        if speaks_anthropic(incoming):
            out["x-api-key"] = api_key
        else:
            out["Authorization"] = f"Bearer {api_key}"
    # Only encodings this side can decode (the body is observed on its way back).
    out["Accept-Encoding"] = "gzip, deflate"
    return out


def speaks_anthropic(incoming: Mapping[str, str]) -> bool:
    """The request is one of Anthropic's API (the Messages API, its ``count_tokens``, ``models``):
    it carries ``anthropic-version``, which Anthropic requires on every request and its SDKs and
    Claude Code always send, or its credential is in ``x-api-key`` alone. Decided by the
    headers, not the path: ``/v1/models`` is both APIs' path, and an Anthropic key is accepted in
    ``x-api-key`` by Anthropic (and by the servers that speak its API), in ``Authorization`` only
    as an OAuth token."""
    return "anthropic-version" in incoming or ("x-api-key" in incoming and "Authorization" not in incoming)


def forward_response_headers(upstream: Mapping[str, str], decoded: bool = True) -> CIMultiDict[str]:
    """The upstream's response headers minus hop-by-hop and length headers, and minus the
    encoding of a body that was ``decoded`` on its way through."""
    drop = _DECODED_DROP if decoded else _RESPONSE_DROP
    if "Connection" in upstream:
        drop = drop | connection_tokens(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


_BODYLESS_METHODS: Final = frozenset(("GET", "HEAD", "DELETE", "OPTIONS", "TRACE", "CONNECT"))


def request_head(method: str, target: str, host: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    """The request line and headers, with ``Host`` and ``Content-Length`` for the bytes sent.
    Raises ValueError when a header or the request line holds a line break."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
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


def keep_alive_timeout(value: str | None) -> float | None:
    """The ``timeout`` parameter of a ``Keep-Alive`` header (``timeout=5, max=100``, as
    llama.cpp's server and Apache send): seconds the server keeps an idle connection."""
    if not value:
        return None
    for part in value.split(","):
        name, _, number = part.partition("=")
        if name.strip().lower() == "timeout":
            try:
                seconds = float(number.strip())
            except ValueError:
                return None
            return seconds if seconds >= 0 else None
    return None


# -- errors --------------------------------------------------------------------------------------


class TransportError(Exception):
    """Base of the transport's errors."""


class ConnectFailed(TransportError):
    """No connection could be opened: the request was never sent."""


class ProxyRefused(ConnectFailed):
    """The egress proxy (:mod:`proxy.transport.egress`) answered ``CONNECT`` (or, for a plain-http
    upstream, the request) with a status other than 2xx: not one byte of the request reached
    the upstream. (Here, beside its base: a plain subclass of a compiled class is called
    through mypyc's glue.)"""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class Disconnected(TransportError):
    """The connection closed before the response was complete."""

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response
        """Not one byte of a response had arrived (a keep-alive connection the server had closed)."""


class Malformed(TransportError):
    """The upstream's response is not valid HTTP/1.1."""


# -- a response's body, as it arrives --------------------------------------------------------------


class Body:
    """One upstream response: status and headers at once, the body read as it arrives
    (:func:`proxy.transport.pool.read_chunk`: :meth:`take` what arrived, else wait for
    :meth:`arrival`). ``release()`` once the body was read to its end returns the connection to
    the pool; ``close()`` (any time) closes it.

    A gzip or deflate body is decoded as it is read, at most :data:`HIGH_WATER` bytes ahead of
    the reader: encoded bytes whose output has no room wait in the :class:`Decoder`, and the
    socket is not read while they do (each read decodes the next piece).

    The connection wakes a waiting reader once a socket read was parsed whole, so a reader
    takes every chunk that one read brought, in one piece. No coroutine here: the module is
    compiled, and waiting is the reader's (docs/ARCHITECTURE.md)."""

    def __init__(self, conn: Connection, status: int, reason: str, headers: CIMultiDict[str], no_body: bool) -> None:
        self._conn: Connection | None = conn
        self.status = status
        self.reason = reason
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(headers)
        length = headers.get("Content-Length")
        self.content_length: int | None = int(length) if length is not None and length.isdigit() else None
        mime = headers.get("Content-Type", "application/octet-stream")
        self.content_type = mime.partition(";")[0].strip().lower()
        encoding = headers.get("Content-Encoding", "")
        self._decoder = _decoder(encoding.strip().lower()) if encoding else None
        self.decoded = self._decoder is not None
        """The body arrives decoded (it was gzip or deflate): its encoding and length no longer apply."""
        framing = headers.get("Transfer-Encoding")
        chunked = framing is not None and "chunked" in framing.lower()
        self._until_eof = not no_body and self.content_length is None and not chunked
        """The body ends when the connection closes (no length, not chunked)."""
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._received = no_body
        """Every byte of the body arrived (a compressed one may not be decoded whole yet)."""
        self._done = no_body
        """Every byte of the body is decoded, in the buffer or taken."""
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        """Done when something arrives for the waiting reader (:meth:`arrival`)."""
        self.deadline = float("inf")
        """The loop time by which the whole body must have arrived (reads wait no later)."""

    # -- the reader's side ----------------------------------------------------------------------

    def arrival(self) -> asyncio.Future[None]:
        """A future done when bytes, the end or an error arrive: the reader then calls
        :meth:`take` again. One reader at a time. Raises :class:`Disconnected` once the
        response was released or closed."""
        conn = self._conn
        if conn is None:
            raise Disconnected("the response was closed", before_response=False)
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError("a read is already waiting for this response")
        self._waiter = waiter = conn.loop.create_future()
        return waiter

    def take(self) -> bytes | None:
        """Every body byte that arrived since the last read, in one piece; ``b""`` at the end;
        None when nothing arrived yet (the caller waits). Raises the response's error. A
        compressed body's next piece is decoded here when its encoded bytes are waiting."""
        buffer = self._buffer
        decoder = self._decoder
        if decoder is not None and not buffer and decoder.backlog:
            self._inflate(decoder)
            if self._received and not decoder.backlog:
                self._finish(decoder)
        chunk: bytes | None = None
        if buffer:
            # One piece (one chunk is not copied): a stream's events come a chunk each, and a
            # reader that relays them writes once per read, not once per event.
            chunk = buffer[0] if len(buffer) == 1 else b"".join(buffer)
            buffer.clear()
            self._buffered = 0
        elif self._error is not None:
            raise self._error
        elif self._done:
            return b""
        conn = self._conn
        if conn is not None and conn.paused and not self.behind:
            conn.resume()  # (also when the waiting bytes decoded to nothing: the rest is on the socket)
        return chunk

    def ready(self) -> bytes | None:
        """What :meth:`take` would return without waiting and without an error: the bytes that
        arrived (or the next decoded piece of those), or ``b""`` at a clean end; None otherwise
        (the caller reads through its sender, which waits within its timeout and converts the
        error)."""
        if self._error is not None and not self._buffer:
            return None
        decoder = self._decoder
        if self._buffer or self._done or (decoder is not None and decoder.backlog):
            try:
                return self.take()
            except TransportError:
                return None  # the next piece did not decode: the sender's read raises it
        return None

    @property
    def complete(self) -> bool:
        """Every byte of the body arrived."""
        return self._done

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool when the body was read
        whole and the upstream keeps it alive; otherwise it is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(self._done and not self._buffer and self._error is None)

    def close(self) -> None:
        """Abandon the response: its connection is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(False)

    # -- the connection's side ------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        if self._received or self._error is not None:
            return  # bytes past the end of this response, or of a broken one (the connection is being dropped)
        decoder = self._decoder
        if decoder is None:  # (the connection wakes the reader once the socket read is parsed whole)
            self._buffer.append(data)
            self._buffered += len(data)
        else:
            decoder.feed(data)
            self._inflate(decoder)

    def _inflate(self, decoder: Decoder) -> None:
        """Decode what fits below :data:`HIGH_WATER`; the rest waits in ``decoder`` for a read.
        An error is set, not woken (:meth:`_fail`): this runs inside a read or a socket read,
        which answers the reader itself."""
        room = HIGH_WATER - self._buffered
        if room <= 0 or self._error is not None:
            return
        try:
            decoded = decoder.decode(room)
        except zlib.error as exc:
            self._error = Malformed(f"the response body could not be decoded: {exc}")
            return
        if decoded:
            self._buffer.append(decoded)
            self._buffered += len(decoded)

    @property
    def behind(self) -> bool:
        """The reader is behind: the socket is not read until it takes what is buffered (and a
        compressed body's waiting bytes are decoded)."""
        decoder = self._decoder
        return self._buffered > HIGH_WATER or (decoder is not None and decoder.backlog)

    def _end(self) -> None:
        """Every byte of the body arrived (its message ended, or the close that delimits it)."""
        self._received = True
        decoder = self._decoder
        if decoder is None:
            self._done = True
        elif not decoder.backlog:
            self._finish(decoder)
        # else: the encoded rest is decoded as the reader takes it (take); it ends there.
        self._wake()  # (at once: the end may come from the connection's close, not a socket read)

    def _finish(self, decoder: Decoder) -> None:
        """Every encoded byte was decoded: the decoder's last bytes, then the end (or the error
        of a stream that does not end)."""
        if self._error is not None:
            return
        try:
            rest = decoder.flush()
        except zlib.error as exc:
            self._error = Malformed(f"the response body could not be decoded: {exc}")
            return
        if rest:
            self._buffer.append(rest)
            self._buffered += len(rest)
        if decoder.cut_short:
            self._error = Malformed("the response body ends mid-stream")
            return
        self._done = True

    def _fail(self, exc: BaseException) -> None:
        """The connection failed: the body's error, unless every byte of it had arrived."""
        if self._error is None and not self._received:
            self._error = exc
        self._wake()

    def _lost(self, exc: BaseException | None) -> None:
        """The connection closed: the end of a body delimited by it, or a broken one."""
        if self._received:
            return
        if self._until_eof and exc is None:
            self._end()
        else:
            detail = f": {exc}" if exc is not None else ""
            self._fail(Disconnected(f"the upstream closed the connection mid-response{detail}", before_response=False))

    def _wake(self) -> None:
        """Wake the waiting reader, if any: something arrived (bytes, the end, an error)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Decoder:
    """gzip or zlib-wrapped deflate, or raw deflate (some servers send it as ``deflate``),
    decoded a bounded piece at a time: what is fed waits, encoded, until :meth:`decode` is asked
    for at most so many bytes (zlib's ``max_length``; the input left over is its
    ``unconsumed_tail``). The inflated body is never held whole, whatever its ratio."""

    def __init__(self, wbits: int) -> None:
        self._wbits = wbits
        self._obj: zlib._Decompress | None = None
        self._head = b""
        """The first byte, until a second one tells a zlib header from raw deflate."""
        self._input: list[bytes] = []
        """Encoded bytes not decoded yet, in order (the last decode's unconsumed tail first)."""
        self._full = False
        """The last decode stopped at its limit: zlib may hold more output without more input."""

    def feed(self, data: bytes) -> None:
        """Encoded bytes, decoded by the next :meth:`decode` calls (a list, not a concatenation:
        a body of many small chunks must not cost a copy of the backlog per chunk)."""
        if data:
            self._input.append(data)

    @property
    def backlog(self) -> bool:
        """Bytes fed are not decoded yet (or their output did not fit the last decode)."""
        return bool(self._input) or self._full

    def decode(self, limit: int) -> bytes:
        """At most ``limit`` (> 0) decoded bytes of what was fed. Raises ``zlib.error``."""
        pieces = self._input
        if not pieces and not self._full:
            return b""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        obj = self._obj
        if obj is None:
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return b""  # too few bytes yet to tell a zlib header from raw deflate
            self._head = b""
            wbits = self._wbits
            if wbits == zlib.MAX_WBITS and not (data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0):
                wbits = -zlib.MAX_WBITS  # no zlib header (RFC 1950 2.2): raw deflate
            obj = self._obj = zlib.decompressobj(wbits)
        decoded = obj.decompress(data, limit)
        tail = obj.unconsumed_tail
        if tail:
            pieces.append(tail)
        self._full = len(decoded) >= limit and not obj.eof
        return decoded

    def flush(self) -> bytes:
        """The last decoded bytes, once every byte fed was decoded (:attr:`backlog` is false)."""
        return b"" if self._obj is None else self._obj.flush()

    @property
    def cut_short(self) -> bool:
        """Bytes arrived but their stream did not end (a truncated body)."""
        return bool(self._head) or (self._obj is not None and not self._obj.eof)


def _decoder(encoding: str) -> Decoder | None:
    if encoding in ("gzip", "x-gzip"):
        return Decoder(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return Decoder(zlib.MAX_WBITS)
    return None  # identity, or one kvwarm does not decode: relayed as it came


# -- one connection --------------------------------------------------------------------------------


class ConnectionPool(Protocol):
    """What a connection needs of its pool (:class:`proxy.transport.pool.Pool`)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def idle(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection:
    """One keep-alive connection, an asyncio protocol: requests written whole, responses parsed
    as they arrive (``httptools`` calls back ``on_*``)."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Body | None = None
        """The response being received (None between requests)."""
        self.waiter: asyncio.Future[Body] | None = None
        """Resolved with the response once its headers arrived."""
        self.no_body = False
        """The request was ``HEAD``: its response has headers only."""
        self.received = False
        """A byte of the current request's response arrived."""
        self.closed = False
        self.paused = False
        self.keep_alive = True
        self.streamed = False
        """The last response came in chunks (a stream): some servers close such a connection
        right after it, unasked (:class:`~proxy.transport.pool.Pool`)."""
        self.kept_for: float | None = None
        """Seconds the server said it keeps the connection open when idle (its ``Keep-Alive:
        timeout=N``), if it said so."""
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._reason = ""
        self.lost: asyncio.Future[None] = self.loop.create_future()
        """Resolved once the connection is closed (``close()`` waits for it)."""

    # -- asyncio's protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses

    def data_received(self, data: bytes) -> None:
        response = self.response
        if (self.waiter is None and response is None) or (response is not None and response._received):
            # Bytes nobody asked for (on an idle connection, or after a complete response): the
            # connection cannot be trusted, the next request would read them as its response.
            self.abort()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._error(Malformed("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._error(Malformed(f"the upstream's response is not valid HTTP/1.1: {exc}"))
        response = self.response
        if response is not None and response._waiter is not None:
            response._wake()  # once per socket read: the reader takes every chunk it brought

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if not self.lost.done():
            self.lost.set_result(None)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            detail = f": {exc}" if exc is not None else ""
            waiter.set_exception(Disconnected(f"the upstream closed the connection{detail}", before_response=not self.received))
        if self.response is not None:
            self.response._lost(exc)

    def pause_writing(self) -> None:  # a request larger than the socket buffer: the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.waiter is None:
            # A response begins after the one asked for was complete, in the same socket read
            # (whole or cut off: either way, read on, the next request would take it for its own).
            self.abort()

    def on_status(self, status: bytes) -> None:
        self._reason += status.decode("latin-1")  # called once per piece of the line read

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            return  # a trailer of the response being received: not a header of the next one
        self._headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        status: int = self.parser.get_status_code()
        if 100 <= status < 200:
            self._headers = CIMultiDict()  # an interim response (100 Continue): the real one follows
            self._reason = ""
            return
        waiter = self.waiter
        if waiter is None:  # a second response to one request: the connection cannot be trusted
            self._error(Malformed("the upstream sent a response nobody asked for"))
            return
        self.keep_alive = bool(self.parser.should_keep_alive())
        self.kept_for = keep_alive_timeout(self._headers.get("Keep-Alive"))
        self.streamed = "chunked" in self._headers.get("Transfer-Encoding", "").lower()
        no_body = self.no_body or status == 204 or status == 304
        response = Body(self, status, self._reason, self._headers, no_body)
        self._headers = CIMultiDict()
        self._reason = ""
        self.response = response
        self.waiter = None
        if not waiter.done():
            waiter.set_result(response)
        if self.no_body:
            self.keep_alive = False  # llhttp would wait for a HEAD response's announced body

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            response._feed(body)
            if not self.paused and response.behind and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and not response._received:
            response._end()

    # -- the pool's side -------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, no_body: bool) -> asyncio.Future[Body]:
        transport = self.transport
        assert transport is not None
        self.no_body = no_body
        self.received = False
        waiter: asyncio.Future[Body] = self.loop.create_future()
        self.waiter = waiter
        try:
            if body:
                transport.writelines((head, body))
            else:
                transport.write(head)
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
