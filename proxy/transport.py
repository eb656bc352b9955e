"""The HTTP/1.1 transport to the upstream: pooled keep-alive connections on asyncio protocols.

Why not :class:`aiohttp.ClientSession`: a proxy sends every request it serves, and a
sampling profile of a bare aiohttp pass-through showed the client side alone (URL and
request objects, cookie jar, tracing hooks, payload wrappers, its stream reader) at ~30 %
of the process's CPU per request. kvwarm needs none of it: it forwards bytes it already
holds to a base URL it already parsed. This module is what remains (the style of httpx's
transports and of uvicorn's protocols): one asyncio protocol per connection, responses
parsed by ``httptools`` (llhttp: status line, headers, ``Content-Length``, chunked bodies),
gzip/deflate decoded here, flow control on the socket, a bounded pool. All but the coroutines
(the connection's protocol, the response and its reads, the request head) is compiled, in
:mod:`proxy.http1`; this module keeps the pool, connecting and sending, which wait.

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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from yarl import URL

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
    "HIGH_WATER", "ConnectFailed", "Disconnected", "Malformed", "Origin", "Pool", "Response", "Transport",
    "TransportError",
]

IDLE_CONNECTIONS = 64
"""Idle keep-alive connections kept per origin, beyond which they are closed."""


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


Response = Body
"""One upstream response (:class:`~proxy.http1.Body`): ``await response.read_chunk(within)``."""


class Pool:
    """The connections to one origin (:meth:`Transport.pool`): the idle ones, most recently used first."""

    def __init__(self, transport: Transport, origin: Origin) -> None:
        self.transport = transport
        self.origin = origin
        self.host = origin.host_header
        """The ``Host`` header of every request to the origin."""
        self.loop = transport.loop
        self._idle: list[Connection] = []
        self.open: set[Connection] = set()

    def take(self) -> Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    def idle(self, conn: Connection) -> None:
        if len(self._idle) >= IDLE_CONNECTIONS:
            conn.abort()
            self.forget(conn)
            return
        self._idle.append(conn)
        self.transport.freed()

    def forget(self, conn: Connection) -> None:
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
        head = request_head(method, target, pool.host, headers, body)  # refused before a connection is taken
        conn = None if fresh else pool.take()
        if conn is None:
            conn = await self._connect(pool, fresh)
        timer: asyncio.TimerHandle | None = None
        try:
            waiter = conn.send(head, body, method == "HEAD")
            timer = self.loop.call_later(within, _expire_response, waiter)
            return await waiter
        except BaseException:
            conn.finished(False)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _connect(self, pool: Pool, fresh: bool) -> Connection:
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
                conn = Connection(pool)
                pool.open.add(conn)
                try:
                    await self.loop.create_connection(
                        lambda: cast(asyncio.Protocol, conn),  # a protocol by its methods (compiled)
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

    def _any_idle(self) -> Connection | None:
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


def _expire_response(waiter: asyncio.Future[Body]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
