"""The HTTP/1.1 transport to the upstream: pooled keep-alive connections on asyncio protocols.

Why not :class:`aiohttp.ClientSession`: a proxy sends every request it serves, and a
sampling profile of a bare aiohttp pass-through showed the client side alone (URL and
request objects, cookie jar, tracing hooks, payload wrappers, its stream reader) at ~30 %
of the process's CPU per request. kvwarm needs none of it: it forwards bytes it already
holds to a base URL it already parsed. This module is what remains (the style of httpx's
transports and of uvicorn's protocols): one asyncio protocol per connection, responses
parsed by ``httptools`` (llhttp: status line, headers, ``Content-Length``, chunked bodies),
gzip/deflate decoded here, flow control on the socket, a bounded pool. What never waits (the
connection's protocol, the response's buffering, the request head) is compiled, in
:mod:`proxy.transport.http1`; this module keeps what waits: the pool, connecting, sending, and
reading a body chunk that has not arrived (:func:`read_chunk`).

Connections are pooled by origin and :class:`~proxy.transport.egress.Route` (directly, or through which
egress proxy: a ``CONNECT`` tunnel for https origins, absolute-form targets for http ones).

Timers are armed only while something waits (a connection, the response headers, a body
chunk that has not arrived), and one per pool while it holds idle connections (which close
after the route's ``idle_timeout``, or half the ``Keep-Alive: timeout=N`` the server announced,
if that is sooner: :func:`kept_idle`).

**A request is written once.** Nothing here sends a request again once a byte of it was
written: the upstream may have read it whole and begun to generate (RFC 9110 9.2.2, RFC 9112
9.3.1: a client retries on its own only what it knows to be idempotent or unprocessed, and a
POST to a model is neither). What it does is refuse a connection before writing to it. A
pooled connection is taken only when it is open, within its idle timeout, and its socket is
not readable (a zero-timeout poll, as urllib3's ``is_connection_dropped``): the event loop
reads an idle connection all the time, so its socket is readable only when something arrived
since the loop last looked -- the upstream's FIN or RST racing the reuse, or bytes nobody
asked for (rarely a harmless TLS record: then a new connection costs a handshake). A
connection found closed just before the request is written is replaced too. Whatever fails
once the first byte was written fails the request.

Errors (converted to kvwarm's own in :mod:`proxy.transport.client`):

- :class:`ConnectFailed` -- no connection could be opened (refused, no route, DNS, TLS,
  connect timeout, the proxy unreachable), or a new one closed before the request was
  written: not one byte of the request left.
- :class:`ProxyRefused` (a :class:`ConnectFailed`) -- the egress proxy answered ``CONNECT``
  with a status other than 2xx, or answered a plain-http request with 407; ``status`` is its
  status. Not one byte of the request reached the upstream.
- :class:`Disconnected` -- the connection closed after the request was written, before the
  response was complete; ``before_response`` says whether not one byte of a response had
  arrived. Never retried: the upstream may have processed the request.
- :class:`Malformed` -- the upstream's bytes are not HTTP/1.1.
- :class:`TimeoutError` -- a wait took longer than its bound.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import select
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from yarl import URL

from .egress import DIRECT, ProxyRefused, Route, open_tunnel
from .http1 import (
    HIGH_WATER,
    Body,
    ConnectFailed,
    Connection,
    Disconnected,
    Malformed,
    TransportError,
    request_head,
)

__all__ = [
    "DIRECT", "HIGH_WATER", "ConnectFailed", "Disconnected", "Malformed", "Origin", "Pool", "ProxyRefused", "Response",
    "Route", "Transport", "TransportError", "read_chunk",
]

log = logging.getLogger(__name__)

IDLE_CONNECTIONS = 64
"""Idle keep-alive connections kept per origin, beyond which they are closed."""

GRACE = 0.05
"""Seconds a connection must have stayed open after a streamed response before it is reused,
until one of the pool did (:attr:`Pool.proven`): long enough for the close of an upstream that
closes after streams to arrive, so the pool learns it (:meth:`Pool.distrust`) instead of
writing the next request into the closing connection."""

QUICK_CLOSE = 1.0
"""Seconds: an upstream that closes an idle connection this soon after its response closes its
connections after responses (llama.cpp's server does after every stream, though it announces
``Keep-Alive``). Its connections are not reused from then on (:meth:`Pool.distrust`): a request
written into one just as the server closes it would fail, since it is never sent twice."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """Where connections go: ``scheme://host:port``."""

    host: str
    port: int
    tls: bool

    @classmethod
    def of(cls, url: URL) -> Origin:
        """The origin of ``url`` (``http`` or ``https``; the scheme's port when it names none)."""
        tls = url.scheme == "https"
        return cls(host=url.raw_host or "", port=url.port if url.port is not None else (443 if tls else 80), tls=tls)

    @property
    def host_header(self) -> str:
        default = 443 if self.tls else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


Response = Body
"""One upstream response (:class:`~proxy.transport.http1.Body`), its body read with
``await read_chunk(response, within)``."""


class Pool:
    """The connections to one origin on one route (:meth:`Transport.pool`): the idle ones in
    the order they went idle, each with the loop time it did."""

    def __init__(self, transport: Transport, origin: Origin, route: Route = DIRECT) -> None:
        self.transport = transport
        self.origin = origin
        self.route = route
        self.host = origin.host_header
        """The ``Host`` header of every request to the origin."""
        self.loop = transport.loop
        proxy = route.proxy
        self.forwarded = proxy is not None and not origin.tls
        """Requests go to the proxy with absolute-form targets (a plain-http origin behind a proxy)."""
        self.absolute = f"http://{self.host}" if self.forwarded else ""
        """What precedes an origin-form target to make it absolute-form."""
        self.proxy_headers: tuple[tuple[str, str], ...] = (
            (("Proxy-Authorization", proxy.authorization),) if self.forwarded and proxy is not None and proxy.authorization else ()
        )
        self.where = f"{origin.host}:{origin.port}" + (f" through the proxy {proxy.label}" if proxy is not None else "")
        """How errors name the connection's destination (never the proxy's credentials)."""
        self._idle: dict[Connection, tuple[float, float]] = {}
        """The idle connections, least recently used first, each with when it went idle and
        the time it may be reused until."""
        self.reuses = True
        """Connections go back to the pool after a response (until :meth:`distrust`)."""
        self.proven = False
        """A connection of this pool stayed open :data:`GRACE` after a streamed response: from
        then on one is reused however soon after its stream."""
        self._expiry: asyncio.TimerHandle | None = None
        """Closes the idle connections past their timeout; armed while there are some."""
        self.open: set[Connection] = set()

    def take(self) -> tuple[Connection, float] | None:
        """The most recently idle connection that may carry a request: open, within its idle
        timeout, and not readable (see the module's docstring), with the seconds it was idle.
        The others are closed."""
        idle = self._idle
        if not idle:
            return None
        now = self.loop.time()
        for conn, (since, until) in reversed(list(idle.items())):  # the most recently idle first
            if not conn.closed and until > now and not _dropped(conn):
                if conn.streamed and not self.proven:
                    if now - since < GRACE:
                        continue  # too soon to tell whether the upstream is closing it
                    self.proven = True
                del idle[conn]
                return conn, now - since
            del idle[conn]
            if not conn.closed:
                if until > now and now - since < QUICK_CLOSE:
                    self.distrust()  # readable this soon after its response: closed by the upstream
                conn.abort()
                self.forget(conn)
        return None

    def distrust(self) -> None:
        """The upstream closes connections right after its responses: stop reusing them."""
        if self.reuses:
            self.reuses = False
            log.info("%s closes its connections right after responses: a new one per request from now on", self.where)

    def oldest_idle(self) -> Connection | None:
        """The least recently used idle connection, out of the idle ones (to be closed)."""
        for conn in self._idle:
            del self._idle[conn]
            return conn
        return None

    def idle(self, conn: Connection) -> None:
        if not self.reuses or len(self._idle) >= IDLE_CONNECTIONS:
            conn.abort()
            self.forget(conn)
            return
        now = self.loop.time()
        until = now + kept_idle(self.route.idle_timeout, conn.kept_for)
        self._idle[conn] = (now, until)
        if self._expiry is None or until < self._expiry.when():
            if self._expiry is not None:
                self._expiry.cancel()
            self._expiry = self.loop.call_at(until, self._expire)
        self.transport.freed()

    def _expire(self) -> None:
        """Close the idle connections past their time; wake again for the next one to expire."""
        self._expiry = None
        now = self.loop.time()
        for conn, (_, until) in list(self._idle.items()):
            if until <= now:
                del self._idle[conn]
                conn.abort()
                self.forget(conn)
        if self._idle:
            self._expiry = self.loop.call_at(min(until for _, until in self._idle.values()), self._expire)

    def forget(self, conn: Connection) -> None:
        """``conn`` is closed. One still idle was closed by the upstream (kvwarm takes a
        connection out of the pool before closing it)."""
        if conn in self.open:
            self.open.discard(conn)
            self.transport.freed(closed=True)
        idle = self._idle.pop(conn, None)
        if idle is not None and self.loop.time() - idle[0] < QUICK_CLOSE:
            self.distrust()

    def close(self) -> list[asyncio.Future[None]]:
        """Close every connection; the futures resolve as they are closed."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        closing = list(self.open)
        for conn in closing:
            conn.abort()
        self._idle.clear()
        return [conn.lost for conn in closing if conn.transport is not None]


def kept_idle(configured: float, server: float | None) -> float:
    """How long an idle connection may be reused: ``upstream.idle_connection_timeout``, and at
    most half of what the server announced (``Keep-Alive: timeout=N``). Half, not N less a
    moment: the server counts from when it wrote the response, kvwarm from when it read the
    last byte, and on a loaded machine (an engine prefilling on every core) the two clocks
    drift apart by more than a second; a request written into a connection the server is
    closing fails with a 502, since kvwarm never sends a request twice."""
    return configured if server is None else min(configured, server / 2)


def _dropped(conn: Connection) -> bool:
    """An idle connection that is closing or whose socket is readable: at EOF, reset, or
    holding bytes nobody asked for. Either way it cannot carry a request."""
    transport = conn.transport
    if transport is None or transport.is_closing():
        return True
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False  # not a socket (nothing to ask): the event loop's view is all there is
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class Transport:
    """Connections to every origin kvwarm sends to, at most ``limit`` open at once (a request
    beyond waits for one to be freed, within its connect timeout)."""

    def __init__(self, *, limit: int, connect_timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.limit = limit
        self.connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._pools: dict[tuple[Origin, Route], Pool] = {}
        self._open = 0
        self._busy = 0
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    def pool(self, origin: Origin, route: Route = DIRECT) -> Pool:
        """The connections to ``origin`` on ``route``: what :meth:`request` sends on."""
        key = (origin, route)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = Pool(self, origin, route)
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
        seconds after it was sent; connecting has its own bound). Written once at most (see
        the module's docstring). ``fresh``: on a new connection, not an idle one."""
        if pool.forwarded:
            target = pool.absolute + target
            headers = itertools.chain(headers, pool.proxy_headers)
        head = request_head(method, target, pool.host, headers, body)  # refused before a connection is taken
        conn, waiter, idled = await self._send(pool, head, body, method == "HEAD", fresh)
        # A plain timer: asyncio.timeout would add ten Python calls to every request.
        timer = self.loop.call_later(within, _expire_response, waiter)
        try:
            response = await waiter
        except BaseException as exc:
            conn.finished(False)
            if isinstance(exc, Disconnected) and exc.before_response and idled is not None and idled < QUICK_CLOSE:
                pool.distrust()  # it closed the connection it had just answered on: it always will
            raise
        finally:
            timer.cancel()
        if pool.forwarded and response.status == 407:  # the proxy's own answer: it forwarded nothing
            response.close()
            raise ProxyRefused(f"{pool.where}: the proxy answered 407 Proxy Authentication Required", status=407)
        return response

    async def _send(
        self, pool: Pool, head: bytes, body: bytes, no_body: bool, fresh: bool
    ) -> tuple[Connection, asyncio.Future[Body], float | None]:
        """Write the request on a connection: an idle one (:meth:`Pool.take`) or a new one;
        with the seconds it was idle (None: new). A connection found closed before a byte was
        written is replaced when it was pooled; a new one closed that soon means the upstream
        refused it (:class:`ConnectFailed`)."""
        while True:
            taken = None if fresh else pool.take()
            if taken is None:
                conn, idled = await self._connect(pool, fresh)
            else:
                conn, idled = taken
            opened = idled is None
            if not conn.closed:
                try:
                    return conn, conn.send(head, body, no_body), idled
                except Disconnected:
                    pass  # closed under us, and said so before writing (uvloop)
                except BaseException:
                    conn.finished(False)
                    raise
            conn.finished(False)
            if opened:
                raise ConnectFailed(f"{pool.where} closed the new connection before the request was written")

    async def _connect(self, pool: Pool, fresh: bool) -> tuple[Connection, float | None]:
        """A new connection to ``pool``'s origin once fewer than ``limit`` are open (an idle one
        of another origin is closed to make room); an idle one of this origin freed meanwhile
        is taken instead, unless ``fresh``. Returns it and the seconds it was idle (None: new)."""
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
                    await self._wait_for_slot()
                self._open += 1
                conn = Connection(pool)
                pool.open.add(conn)
                try:
                    await self._open_connection(pool, conn)
                except BaseException:
                    conn.abort()
                    pool.forget(conn)
                    raise
                return conn, None
        except TimeoutError as exc:
            raise ConnectFailed(f"no connection to {pool.where} within {self.connect_timeout:g} s") from exc
        except ConnectFailed:
            raise
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {pool.where}: {exc}") from exc

    async def _wait_for_slot(self) -> None:
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

    async def _open_connection(self, pool: Pool, conn: Connection) -> None:
        """Connect ``conn``: to the origin, or to the proxy (for http), or through its tunnel
        (for https: TLS to the origin inside it)."""
        origin, proxy = pool.origin, pool.route.proxy
        protocol = cast(asyncio.Protocol, conn)  # a protocol by its methods (compiled)
        if proxy is None:
            tls = self._tls_for(pool) if origin.tls else None
            await self.loop.create_connection(
                lambda: protocol, origin.host, origin.port, ssl=tls, server_hostname=origin.host if tls is not None else None
            )
        elif not origin.tls:
            await self.loop.create_connection(lambda: protocol, proxy.host, proxy.port)
        else:
            tunnel = await open_tunnel(self.loop, proxy, origin.host, origin.port)
            try:
                secured = await self.loop.start_tls(tunnel, protocol, self._tls_for(pool), server_hostname=origin.host)
            except BaseException:
                tunnel.close()
                raise
            if secured is None:
                raise ConnectFailed(f"TLS to {pool.where} could not start")
            conn.connection_made(secured)  # (start_tls leaves that call to its caller)

    def _tls_for(self, pool: Pool) -> ssl.SSLContext:
        """The route's TLS context, else the transport's (by default, the system's trust)."""
        if pool.route.tls is not None:
            return pool.route.tls
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _any_idle(self) -> Connection | None:
        for pool in self._pools.values():
            conn = pool.oldest_idle()
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


def _expire_response(waiter: asyncio.Future[Body]) -> None:
    """The response's headers did not arrive in time."""
    if not waiter.done():
        waiter.set_exception(TimeoutError())


async def read_chunk(response: Response, within: float) -> bytes:
    """Every body byte that arrived since the last read, in one piece (``b""`` at the end),
    waiting at most ``within`` seconds for them and never past the response's ``deadline``.
    Fails with :class:`Disconnected`, :class:`Malformed` or :class:`TimeoutError`."""
    chunk = response.take()
    if chunk is not None:
        return chunk
    loop = asyncio.get_running_loop()
    async with asyncio.timeout_at(min(loop.time() + within, response.deadline)):
        while (chunk := response.take()) is None:
            await response.arrival()
    return chunk
