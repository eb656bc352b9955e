"""The HTTP edge's defences against hostile clients: paths, slow bodies, connection floods, log noise.

Every limit here holds before a request reaches a handler. Where kvwarm answers, the
answer is an OpenAI-shaped error (:mod:`proxy.errors`), never a plain-text 500; a
request aiohttp cannot even parse is answered by aiohttp itself (a plain-text 400):

* **Paths** (:func:`check_path`): kvwarm forwards ``/v1/<tail>`` to
  ``<upstream.base_url>/<tail>`` built from the *decoded* path, so the decoded path
  may hold only characters that mean the same encoded or not: RFC 3986 path
  characters without ``%``. Refused with 400 ``invalid_path``: ``.`` / ``..``
  segments (also spelled ``%2e``), a ``%`` left after decoding once (double
  encoding such as ``%252e%252e``: the upstream would decode it again), encoded
  separators ``%2f`` / ``%5c`` (they would be forwarded as real ones), backslashes,
  NUL and other control characters, spaces, ``?`` / ``#`` and non-ASCII.
* **Bodies** (:func:`read_body`): at most ``server.max_body_bytes`` (413), in full
  within ``server.body_timeout`` seconds (408, and the connection is closed). The app's
  middleware (``proxy.app.edge_middleware``) reads every body this way before any
  handler runs; a handler's own ``request.read()`` then returns the same bytes at once.
* **Headers**: aiohttp has no header-read deadline of its own. Its keep-alive
  timeout starts when a connection opens and again when a response ends, and closes
  the connection if no complete request head arrived by then: :func:`runner_options`
  sets it to ``server.header_timeout``.
* **Connections** (:class:`CappedSite`): at most ``server.max_connections`` open
  client connections, counted from accept to close. One more is answered 503
  ``too_many_connections`` and closed within a second (at most :data:`MAX_LINGERING`
  such refusals are open at once; beyond that they are closed at once). So client
  sockets hold at most ``max_connections + MAX_LINGERING`` descriptors (asyncio has no
  way to pause accepting; the kernel's backlog holds what is not accepted yet). A
  semaphore around handlers would not bound descriptors: idle and half-sent
  connections hold one without a handler running.
* **Logs** (:class:`MalformedRequestFilter`): a request aiohttp cannot parse (an
  oversized header or request line, a bad method or URL) is answered 400 by aiohttp
  and logged as one WARNING line naming the client and the error class, never as an
  ERROR with a traceback, and never with the offending bytes (they may hold a key).
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import time
from typing import Any, cast

from aiohttp import web
from aiohttp.http import HttpProcessingError

from ..config import ServerSettings, Settings
from ..errors import (
    BadPath,
    BodyMalformed,
    BodyTimeout,
    BodyTooLarge,
    TooManyConnections,
    error_body,
)

log = logging.getLogger(__name__)

__all__ = [
    "ConnectionCap",
    "CappedSite",
    "MalformedRequestFilter",
    "body_arrived",
    "check_path",
    "ensure_fd_limit",
    "quiet_malformed_requests",
    "read_body",
    "runner_options",
    "send_and_close",
    "shown_path",
    "start_server",
]

_PATH_CHARS = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]*")
"""RFC 3986 ``pchar`` and ``/``, without percent-encoding: the same bytes encoded or decoded."""
_ENCODED_SEPARATOR = re.compile(r"%(?:2[fF]|5[cC])")
_SHOWN_PATH = 200
FD_RESERVE = 64
"""File descriptors besides client and upstream connections: listeners, the store, logs, libraries."""
REFUSAL_LOG_INTERVAL = 60.0
REFUSAL_LINGER = 1.0
"""Seconds a refused connection stays open for the client to read its 503."""
MAX_LINGERING = 64
"""Refused connections lingering at once: the descriptors besides ``server.max_connections``."""


# -- paths ---------------------------------------------------------------------------------------


def check_path(raw_path: str, path: str) -> None:
    """Refuse a request path that could reach outside ``/v1/`` under the upstream base, or would not
    reach the upstream as the client meant it. ``raw_path`` as received, ``path`` decoded once."""
    if _ENCODED_SEPARATOR.search(raw_path.partition("?")[0]):
        raise BadPath("encoded '/' or '\\' in the request path: send the separator itself, or none")
    if not _PATH_CHARS.fullmatch(path):
        if "%" in path:
            raise BadPath("percent-encoding left after decoding the request path (double encoding)")
        raise BadPath(
            "the request path holds a character kvwarm does not forward (control characters, "
            "backslashes, spaces, '?', '#' or non-ASCII, once decoded)"
        )
    if "." in path and any(segment in (".", "..") for segment in path.split("/")):
        raise BadPath("'.' or '..' segments in the request path")


# -- bodies --------------------------------------------------------------------------------------


async def read_body(request: web.Request, settings: ServerSettings) -> bytes:
    """The request body, at most ``settings.max_body_bytes``, arrived within ``settings.body_timeout``.

    Raises :class:`BodyTooLarge` (413), :class:`BodyTimeout` (408, the connection is then closed)
    or :class:`BodyMalformed` (400: the client's chunked or compressed framing is broken). aiohttp
    keeps what it read, so calling it again (or ``request.read()``) returns the same bytes.
    """
    body = body_arrived(request, settings)
    if body is not None:
        return body
    limit = settings.max_body_bytes
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(settings.body_timeout):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError as exc:
        raise BodyTimeout(f"the request body did not arrive within {settings.body_timeout:g} seconds") from exc
    except web.RequestPayloadError as exc:
        raise _malformed(exc) from exc
    return _kept(request, b"".join(chunks), limit)


def body_arrived(request: web.Request, settings: ServerSettings) -> bytes | None:
    """The body when it needs no wait (it was read already, or all of it arrived with the
    headers, as a small one does); None: :func:`read_body` waits for it. Raises as that does."""
    limit = settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body of {request.content_length} bytes exceeds the {limit}-byte limit")
    if request._read_bytes is not None:
        return request._read_bytes
    content = request.content
    if not content.is_eof():
        return None
    try:
        body = content.read_nowait()
    except web.RequestPayloadError as exc:
        raise _malformed(exc) from exc
    return _kept(request, body, limit)


def _kept(request: web.Request, body: bytes, limit: int) -> bytes:
    """``body``, kept where ``request.read()`` (and ``json()``, ``text()``) finds it. Read here
    rather than by ``request.read()``, which copies every body twice (into a bytearray, then
    into bytes): one that arrived in one piece is not copied at all, another once."""
    if len(body) > limit:
        raise _too_large(limit)
    request._read_bytes = body
    return body


def _too_large(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body exceeds the {limit}-byte limit")


def _malformed(exc: web.RequestPayloadError) -> BodyMalformed:
    return BodyMalformed(f"the request body could not be read: {type(exc.__cause__ or exc).__name__}")


async def send_and_close(request: web.Request, response: web.StreamResponse) -> None:
    """Send ``response`` now and close the connection behind it, without aiohttp's lingering read
    of an unfinished body (up to 10 s more for a client that stopped sending)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()


def shown_path(request: web.BaseRequest) -> str:
    """The request path for a log line: as received (percent-encoded, so no raw control characters
    can forge a log line), without the query (it may hold a key), cut short."""
    raw = request.raw_path.partition("?")[0]
    return raw if len(raw) <= _SHOWN_PATH else raw[:_SHOWN_PATH] + "..."


# -- connections ---------------------------------------------------------------------------------


_REFUSAL_BODY = error_body(
    "kvwarm has too many open connections (server.max_connections); retry shortly",
    TooManyConnections.error_type,
    TooManyConnections.code,
)
_REFUSAL = (
    f"HTTP/1.1 {TooManyConnections.status} Service Unavailable\r\n"
    "Content-Type: application/json\r\n"
    f"Content-Length: {len(_REFUSAL_BODY)}\r\n"
    "Connection: close\r\n"
    "Retry-After: 1\r\n"
    "\r\n"
).encode() + _REFUSAL_BODY


class ConnectionCap:
    """A protocol factory around aiohttp's: at most ``limit`` connections open at once.

    A connection counts from the moment it is accepted (the factory call) until its
    ``connection_lost``, so a burst accepted in one loop iteration cannot overshoot.
    """

    def __init__(self, inner: Any, limit: int) -> None:
        self._inner = inner
        self.limit = limit
        self.open = 0
        """Connections open now."""
        self.refused = 0
        """Connections refused since start."""
        self.lingering = 0
        """Refused connections still open, reading what the client sent before it saw the 503."""
        self._refused_unlogged = 0
        self._logged_at = float("-inf")

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open >= self.limit:
            self._note_refusal()
            return _Refusal(self)
        protocol: asyncio.Protocol = self._inner()
        self.open += 1
        return _Counted(protocol, self)

    def release(self) -> None:
        self.open -= 1

    def _note_refusal(self) -> None:
        self.refused += 1
        self._refused_unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL:
            log.warning(
                "refused %d connection(s): %d open, the server.max_connections limit",
                self._refused_unlogged, self.open,
            )
            self._logged_at, self._refused_unlogged = now, 0


class _Counted(asyncio.Protocol):
    """aiohttp's request handler, with the cap's count released when the connection ends."""

    __slots__ = ("_cap", "_inner", "_released")

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self._released = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._released:
            self._released = True
            self._cap.release()
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _Refusal(asyncio.Protocol):
    """Answers 503 at once, then closes when the client does or after :data:`REFUSAL_LINGER` seconds.

    Closing a socket that holds unread input makes the kernel send a reset, which can destroy
    the 503 before the client reads it: so the refusal reads (and drops) what arrives, for a
    moment. At most :data:`MAX_LINGERING` refusals linger at once; beyond that, close at once.
    """

    def __init__(self, cap: ConnectionCap) -> None:
        self._cap = cap
        self._counted = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not isinstance: uvloop's transports do not subclass asyncio's.
        transport = cast(asyncio.Transport, transport)
        transport.write(_REFUSAL)
        if self._cap.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return
        self._cap.lingering += 1
        self._counted = True
        transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER, transport.close)

    def data_received(self, data: bytes) -> None:
        return None

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._counted:
            self._counted = False
            self._cap.lingering -= 1


class CappedSite(web.BaseSite):
    """A TCP site whose connections pass through a :class:`ConnectionCap`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int, backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self.cap: ConnectionCap | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port once started (``port=0`` picks a free one)."""
        if self._server is not None:
            sockets = getattr(self._server, "sockets", None)
            if sockets:
                return int(sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self.cap = ConnectionCap(server, self._max_connections)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.cap, self._host, self._port, backlog=self._backlog)


def runner_options(settings: ServerSettings) -> dict[str, Any]:
    """``web.AppRunner`` keyword arguments: the header deadline (aiohttp's keep-alive timeout)."""
    return {
        "keepalive_timeout": settings.header_timeout,
        "shutdown_timeout": settings.shutdown_timeout,
        "handler_cancellation": True,
        "access_log": None,
    }


async def start_server(app: web.Application, settings: Settings, *, handle_signals: bool = False) -> tuple[web.AppRunner, CappedSite]:
    """Start ``app`` on ``server.host:port`` behind every guard; the caller awaits ``runner.cleanup()``."""
    ensure_fd_limit(settings.server.max_connections + settings.upstream.max_connections + FD_RESERVE)
    runner = web.AppRunner(app, handle_signals=handle_signals, **runner_options(settings.server))
    await runner.setup()
    try:
        site = CappedSite(
            runner, settings.server.host, settings.server.port, max_connections=settings.server.max_connections
        )
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site


def ensure_fd_limit(needed: int) -> None:
    """Raise the soft open-file limit to ``needed`` (up to the hard limit); warn when it stays short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft < needed:
        log.warning(
            "the open-file limit (%d) is below server.max_connections + upstream.max_connections + %d = %d: "
            "under load, accepting connections may fail; lower the limits or raise ulimit -n",
            soft, FD_RESERVE, needed,
        )


# -- logs ----------------------------------------------------------------------------------------


class MalformedRequestFilter(logging.Filter):
    """Turns aiohttp's ERROR-with-traceback for an unparsable request into one WARNING line.

    aiohttp answers such a request 400 itself (``RequestHandler.handle_error``) and logs it with
    ``logger.exception`` on ``aiohttp.server``. The line names the client and the error class only:
    the parser's message quotes the offending bytes, which may be a credential.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "refused a malformed request from %s: %s (%d)"
            record.args = (remote, type(exc).__name__, exc.code)
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            record.exc_info, record.exc_text = None, None
        return True


def quiet_malformed_requests(logger: logging.Logger | None = None) -> MalformedRequestFilter:
    """Install (once) :class:`MalformedRequestFilter` on ``aiohttp.server``; returns the installed filter."""
    target = logger if logger is not None else logging.getLogger("aiohttp.server")
    for existing in target.filters:
        if isinstance(existing, MalformedRequestFilter):
            return existing
    installed = MalformedRequestFilter()
    target.addFilter(installed)
    return installed
