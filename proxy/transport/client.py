"""The pooled upstream client: where a request goes, which headers travel, and error conversion.

One :class:`~proxy.transport.pool.Transport` per app (created in the app's ``cleanup_ctx``; why
not aiohttp's client: see that module), shared by every replica: :class:`Upstream` is the
pool of senders, one :class:`ReplicaSender` per ``upstream.base_url`` (which one a request
takes is :mod:`proxy.routing`'s choice), each on the route :mod:`proxy.transport.egress` chose for its
URL (directly or through an egress proxy, the TLS context, the idle timeout). Transport errors
become :class:`~proxy.errors.UpstreamUnreachable` (502) or
:class:`~proxy.errors.UpstreamTimeout` (504) here, once; :func:`never_sent` tells the
router which of them left the replica without a byte of the request (so another replica
may take it).

A request is sent once: a connection that closes after the request was written fails it with
a 502, never a second copy (the upstream may have read it and be generating; see
:mod:`proxy.transport.pool`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from yarl import URL

from ..config import UpstreamSettings
from ..errors import UpstreamTimeout, UpstreamUnreachable
from .egress import Egress
from .http1 import forward_request_headers, forward_response_headers
from .pool import (
    ConnectFailed,
    Disconnected,
    Malformed,
    Origin,
    Response,
    Transport,
    TransportError,
    read_chunk,
)

__all__ = [
    "ReplicaSender", "Upstream", "UpstreamSender", "forward_request_headers", "forward_response_headers", "never_sent",
]

log = logging.getLogger(__name__)


def never_sent(exc: BaseException) -> bool:
    """``exc`` (raised by :meth:`ReplicaSender.send`) left the upstream without a byte of the
    request: a refused or unreachable address, a connect timeout, a proxy that refused the
    tunnel. Another replica may take it."""
    return isinstance(exc.__cause__, ConnectFailed)


class UpstreamSender(Protocol):
    """The seam between the pipeline and the network: one upstream (one replica)."""

    @property
    def base_url(self) -> str: ...

    async def send(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> Response: ...

    async def read_chunk(self, response: Response) -> bytes: ...


class Upstream:
    """The pool of senders: one :class:`ReplicaSender` per ``settings.base_url``, one transport."""

    def __init__(self, transport: Transport, settings: UpstreamSettings) -> None:
        egress = Egress.of(settings)
        self.senders: tuple[ReplicaSender, ...] = tuple(
            ReplicaSender(transport, settings, url, egress) for url in settings.base_url
        )


class ReplicaSender:
    """Sends requests to one base URL over the app's pooled transport."""

    def __init__(self, transport: Transport, settings: UpstreamSettings, base_url: str, egress: Egress | None = None) -> None:
        self._transport = transport
        self._settings = settings
        self._base = URL(base_url.rstrip("/"))
        route = (egress or Egress.of(settings)).route(self._base)
        if route.proxy is not None:
            log.info("upstream %s: through the proxy %s", self._base.origin(), route.proxy.label)
        self._pool = transport.pool(Origin.of(self._base), route)
        self._path = self._base.raw_path.rstrip("/")
        # first_byte_timeout bounds the wait for the response headers only; pauses inside a body
        # are idle_timeout's (read_chunk); total_timeout bounds both, from the request's start.
        self._first_byte = min(settings.first_byte_timeout, settings.total_timeout)

    @property
    def base_url(self) -> str:
        return str(self._base)

    def target_for(self, path: str, query: str) -> str:
        """``/v1/chat/completions`` -> ``<base path>/chat/completions`` (the base carries its own /v1).

        ``query`` is the client's raw (still percent-encoded) query string: forwarded as sent."""
        tail = path[3:] if path.startswith("/v1/") or path == "/v1" else path
        return (self._path + tail or "/") + ("?" + query if query else "")

    def url_for(self, path: str, query: str) -> URL:
        """The whole URL :meth:`send` requests for ``path`` and ``query``."""
        return URL(str(self._base.origin()) + self.target_for(path, query), encoded=True)

    async def send(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> Response:
        """Send and wait for the response headers; the body is read by the caller.

        Sent once: a connection that closes after the request was written (before or during
        the response) is a 502, not a second copy. A pooled connection the upstream closed
        while idle is never written to (the transport checks it first and opens another).
        """
        target = self.target_for(path, query)
        started = self._transport.loop.time()
        try:
            response = await self._transport.request(self._pool, method, target, headers.items(), body, within=self._first_byte)
        except TimeoutError as exc:
            raise UpstreamTimeout("the upstream did not answer in time") from exc
        except ConnectFailed as exc:
            if isinstance(exc.__cause__, TimeoutError):
                raise UpstreamTimeout(f"the upstream did not answer in time: {exc}") from exc
            raise UpstreamUnreachable(f"the upstream could not be reached: {exc}") from exc
        except Disconnected as exc:
            if exc.before_response:
                raise UpstreamUnreachable(
                    f"the upstream closed the connection before answering; the request was not sent again, "
                    f"since the upstream may have processed it ({exc})"
                ) from exc
            raise UpstreamUnreachable(f"the upstream could not be reached: {exc}") from exc
        except (Malformed, ValueError) as exc:
            raise UpstreamUnreachable(f"the upstream could not be reached: {exc}") from exc
        response.deadline = started + self._settings.total_timeout
        return response

    async def read_chunk(self, response: Response) -> bytes:
        """The next body chunk as it arrives (b"" at the end), within the idle timeout."""
        try:
            return await read_chunk(response, self._settings.idle_timeout)
        except TimeoutError as exc:
            raise UpstreamTimeout("the upstream stalled mid-response") from exc
        except TransportError as exc:
            raise UpstreamUnreachable(f"the upstream connection failed mid-response: {exc}") from exc
