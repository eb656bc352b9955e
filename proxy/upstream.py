"""The pooled upstream client: where a request goes, which headers travel, and error conversion.

One :class:`aiohttp.ClientSession` per app (created in the app's ``cleanup_ctx``), shared
by every replica: :class:`Upstream` is the pool of senders, one :class:`ReplicaSender`
per ``upstream.base_url`` (which one a request takes is :mod:`proxy.routing`'s choice).
Library errors become :class:`~proxy.errors.UpstreamUnreachable` (502) or
:class:`~proxy.errors.UpstreamTimeout` (504) here, once; :func:`never_sent` tells the
router which of them left the replica without a byte of the request (so another replica
may take it).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Mapping
from typing import Protocol

import aiohttp
from aiohttp import hdrs
from multidict import CIMultiDict
from yarl import URL

from .config import UpstreamSettings
from .errors import UpstreamTimeout, UpstreamUnreachable

log = logging.getLogger(__name__)

_STALE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


def _stale_connection(exc: aiohttp.ClientError) -> bool:
    """A disconnect that means "this connection was dead", not "the upstream is unreachable"."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError) and exc.errno in _STALE_ERRNOS


HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION,
        "Keep-Alive",
        hdrs.PROXY_AUTHENTICATE,
        hdrs.PROXY_AUTHORIZATION,
        hdrs.TE,
        "Trailer",
        hdrs.TRAILER,
        hdrs.TRANSFER_ENCODING,
        hdrs.UPGRADE,
    )
)
# Recomputed by aiohttp for the bytes actually sent.
_REQUEST_DROP = HOP_BY_HOP | {hdrs.HOST.lower(), hdrs.CONTENT_LENGTH.lower(), hdrs.ACCEPT_ENCODING.lower()}
# The upstream body is decoded here (to observe usage), so its encoding and length no longer apply.
_RESPONSE_DROP = HOP_BY_HOP | {hdrs.CONTENT_LENGTH.lower(), hdrs.CONTENT_ENCODING.lower()}


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Header names listed in ``Connection`` are hop-by-hop too (RFC 9110 7.6.1), from every
    ``Connection`` field line (RFC 9110 5.3 combines them)."""
    getall = getattr(headers, "getall", None)
    values: list[str] = getall(hdrs.CONNECTION, []) if getall is not None else [headers.get(hdrs.CONNECTION, "")]
    return {t.strip().lower() for value in values for t in value.split(",") if t.strip()}


def forward_request_headers(incoming: Mapping[str, str], api_key: str = "") -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop ones. With ``api_key`` set, no client credential
    travels upstream (``Authorization``, ``Proxy-Authorization``, ``Cookie``, ``X-Api-Key``,
    ``api-key``, ``x-goog-api-key`` are removed) and ``Authorization`` carries ``api_key``."""
    drop = _REQUEST_DROP | _connection_tokens(incoming)
    if api_key:
        drop |= {"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key", "x-goog-api-key"}
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        if name.lower() not in drop:
            out.add(name, value)
    if api_key:
        out[hdrs.AUTHORIZATION] = f"Bearer {api_key}"
    # Only encodings this side can decode (the body is observed on its way back).
    out[hdrs.ACCEPT_ENCODING] = "gzip, deflate"
    return out


def forward_response_headers(upstream: Mapping[str, str]) -> CIMultiDict[str]:
    """The upstream's response headers minus hop-by-hop, length and encoding headers."""
    drop = _RESPONSE_DROP | _connection_tokens(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


_NEVER_SENT: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,
    getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ClientConnectorError),  # aiohttp >= 3.10
)
"""Failures to open a connection: not one byte of the request reached the upstream."""


def never_sent(exc: BaseException) -> bool:
    """``exc`` (raised by :meth:`ReplicaSender.send`) left the upstream without a byte of the
    request: a refused or unreachable address, a connect timeout. Another replica may take it."""
    return isinstance(exc.__cause__, _NEVER_SENT)


class UpstreamSender(Protocol):
    """The seam between the pipeline and the network: one upstream (one replica)."""

    @property
    def base_url(self) -> str: ...

    async def send(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> aiohttp.ClientResponse: ...

    async def read_chunk(self, response: aiohttp.ClientResponse) -> bytes: ...


class Upstream:
    """The pool of senders: one :class:`ReplicaSender` per ``settings.base_url``, one session."""

    def __init__(self, session: aiohttp.ClientSession, settings: UpstreamSettings) -> None:
        self.senders: tuple[ReplicaSender, ...] = tuple(
            ReplicaSender(session, settings, url) for url in settings.base_url
        )


class ReplicaSender:
    """Sends requests to one base URL over the app's pooled session."""

    def __init__(self, session: aiohttp.ClientSession, settings: UpstreamSettings, base_url: str) -> None:
        self._session = session
        self._settings = settings
        self._base = URL(base_url.rstrip("/"))
        # first_byte_timeout bounds the wait for the response headers only (see send); pauses
        # inside a body are idle_timeout's (read_chunk).
        self._timeout = aiohttp.ClientTimeout(total=settings.total_timeout, sock_connect=settings.connect_timeout)

    @property
    def base_url(self) -> str:
        return str(self._base)

    def url_for(self, path: str, query: str) -> URL:
        """``/v1/chat/completions`` -> ``<base_url>/chat/completions`` (the base carries its own /v1).

        ``query`` is the client's raw (still percent-encoded) query string: forwarded as sent."""
        tail = path[3:] if path.startswith("/v1/") or path == "/v1" else path
        return URL(str(self._base) + tail + ("?" + query if query else ""), encoded=True)

    async def send(
        self, method: str, path: str, query: str, headers: Mapping[str, str], body: bytes
    ) -> aiohttp.ClientResponse:
        """Send and wait for the response headers; the body is read by the caller.

        A pooled connection the upstream closed while idle (llama.cpp and uvicorn-based servers
        such as vLLM close keep-alive connections after 5 s) fails with a disconnect before any
        response byte: the request is sent once more, on a fresh connection.
        """
        url = self.url_for(path, query)
        for attempt in range(2):
            try:
                async with asyncio.timeout(self._settings.first_byte_timeout):
                    return await self._session.request(
                        method,
                        url,
                        headers=headers,
                        data=body if body else None,
                        timeout=self._timeout,
                        allow_redirects=False,
                        auto_decompress=True,
                    )
            except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
                raise UpstreamTimeout(f"the upstream did not answer in time: {exc}") from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 0 and _stale_connection(exc):
                    log.debug("upstream closed a pooled connection (%s); retrying once", type(exc).__name__)
                    continue
                raise UpstreamUnreachable(f"the upstream could not be reached: {type(exc).__name__}") from exc
            except aiohttp.ClientError as exc:
                raise UpstreamUnreachable(f"the upstream could not be reached: {type(exc).__name__}") from exc
        raise AssertionError("unreachable")

    async def read_chunk(self, response: aiohttp.ClientResponse) -> bytes:
        """The next body chunk as it arrives (b"" at the end), within the idle timeout."""
        try:
            async with asyncio.timeout(self._settings.idle_timeout):
                return await response.content.readany()
        except TimeoutError as exc:
            raise UpstreamTimeout("the upstream stalled mid-response") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"the upstream connection failed mid-response: {type(exc).__name__}") from exc
