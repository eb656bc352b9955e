"""The pooled upstream client: where a request goes, which headers travel, and error conversion.

One :class:`~proxy.transport.Transport` per app (created in the app's ``cleanup_ctx``; why
not aiohttp's client: see that module), shared by every replica: :class:`Upstream` is the
pool of senders, one :class:`ReplicaSender` per ``upstream.base_url`` (which one a request
takes is :mod:`proxy.routing`'s choice). Transport errors become :class:`~proxy.errors.UpstreamUnreachable` (502) or
:class:`~proxy.errors.UpstreamTimeout` (504) here, once; :func:`never_sent` tells the
router which of them left the replica without a byte of the request (so another replica
may take it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from aiohttp import hdrs
from multidict import CIMultiDict
from yarl import URL

from .config import UpstreamSettings
from .errors import UpstreamTimeout, UpstreamUnreachable
from .transport import (
    ConnectFailed,
    Disconnected,
    Malformed,
    Origin,
    Response,
    Transport,
    TransportError,
)

log = logging.getLogger(__name__)


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
# With upstream.api_key, no client credential travels.
_KEYED_DROP = _REQUEST_DROP | {"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key", "x-goog-api-key"}
# The relay sets the length of what it sends.
_RESPONSE_DROP = HOP_BY_HOP | {hdrs.CONTENT_LENGTH.lower()}
# A gzip or deflate body is decoded here (to observe usage): its encoding no longer applies.
_DECODED_DROP = _RESPONSE_DROP | {hdrs.CONTENT_ENCODING.lower()}


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
    drop = _KEYED_DROP if api_key else _REQUEST_DROP
    if hdrs.CONNECTION in incoming:
        drop = drop | _connection_tokens(incoming)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        if name.lower() not in drop:
            out.add(name, value)
    if api_key:
        out[hdrs.AUTHORIZATION] = f"Bearer {api_key}"
    # Only encodings this side can decode (the body is observed on its way back).
    out[hdrs.ACCEPT_ENCODING] = "gzip, deflate"
    return out


def forward_response_headers(upstream: Mapping[str, str], decoded: bool = True) -> CIMultiDict[str]:
    """The upstream's response headers minus hop-by-hop and length headers, and minus the
    encoding of a body that was ``decoded`` on its way through."""
    drop = _DECODED_DROP if decoded else _RESPONSE_DROP
    if hdrs.CONNECTION in upstream:
        drop = drop | _connection_tokens(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


def never_sent(exc: BaseException) -> bool:
    """``exc`` (raised by :meth:`ReplicaSender.send`) left the upstream without a byte of the
    request: a refused or unreachable address, a connect timeout. Another replica may take it."""
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
        self.senders: tuple[ReplicaSender, ...] = tuple(
            ReplicaSender(transport, settings, url) for url in settings.base_url
        )


class ReplicaSender:
    """Sends requests to one base URL over the app's pooled transport."""

    def __init__(self, transport: Transport, settings: UpstreamSettings, base_url: str) -> None:
        self._transport = transport
        self._settings = settings
        self._base = URL(base_url.rstrip("/"))
        self._pool = transport.pool(Origin.of(self._base))
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

        A pooled connection the upstream closed while idle (llama.cpp and uvicorn-based servers
        such as vLLM close keep-alive connections after 5 s) fails with a disconnect before any
        response byte: the request is sent once more, on a fresh connection.
        """
        target = self.target_for(path, query)
        started = self._transport.loop.time()
        for attempt in range(2):
            try:
                response = await self._transport.request(
                    self._pool, method, target, headers.items(), body, fresh=attempt > 0, within=self._first_byte
                )
            except TimeoutError as exc:
                raise UpstreamTimeout("the upstream did not answer in time") from exc
            except ConnectFailed as exc:
                if isinstance(exc.__cause__, TimeoutError):
                    raise UpstreamTimeout(f"the upstream did not answer in time: {exc}") from exc
                raise UpstreamUnreachable(f"the upstream could not be reached: {exc}") from exc
            except Disconnected as exc:
                if attempt == 0 and exc.before_response:
                    log.debug("upstream closed a pooled connection; retrying once")
                    continue
                raise UpstreamUnreachable(f"the upstream could not be reached: {exc}") from exc
            except (Malformed, ValueError) as exc:
                raise UpstreamUnreachable(f"the upstream could not be reached: {exc}") from exc
            response.deadline = started + self._settings.total_timeout
            return response
        raise AssertionError("unreachable")

    async def read_chunk(self, response: Response) -> bytes:
        """The next body chunk as it arrives (b"" at the end), within the idle timeout."""
        try:
            return await response.read_chunk(self._settings.idle_timeout)
        except TimeoutError as exc:
            raise UpstreamTimeout("the upstream stalled mid-response") from exc
        except TransportError as exc:
            raise UpstreamUnreachable(f"the upstream connection failed mid-response: {exc}") from exc
